package llm

import (
	"errors"
	"io"
	"net/http"
)

// What an LLM request may use, read from its JSON body before it runs
// (`cost openai`). The body is read up to maxRequestPrefix bytes by the
// tokenizer of usage.go (top-level keys only) and handed on to the upstream
// byte for byte: the prefix read, then the rest, unread.

// maxRequestPrefix is the most of a request body read for its reservation.
const maxRequestPrefix = 64 << 10

// Request is what a request body says it may use.
type Request struct {
	ok bool // the ceiling was read: a JSON body with max_tokens (or a newer name)
	// maxTokens is the ceiling on the tokens of the answer: the largest of
	// max_tokens, max_completion_tokens and max_output_tokens.
	maxTokens int64
	// promptTokens estimates the prompt: the bytes of the body's string
	// values (the messages' text, roles, the model's name, tool
	// definitions) at bytesPerToken a token. For a body longer than the
	// prefix, its Content-Length at the same ratio.
	promptTokens int64
	// promptBytes are those bytes (for a body longer than the prefix, its
	// Content-Length), which a stream cut before its usage is charged at
	// one token each (cut_estimate.go).
	promptBytes int64
	// hides: the body carries input it does not show (a stored
	// conversation, an image, a file, a provider-side tool: see
	// jsonScan.hiddenValue and hiddenType), or is longer than the prefix
	// read, whose rest may, or asks for output the request cannot bound
	// (background): the provider bills what the estimate cannot see, so
	// the request reserves max. So does a body that names two models (the
	// provider reads one of them, maybe the dearer).
	hides bool
	// outputs is how many answers the ceiling bounds each: `n` choices
	// (chat and legacy completions) or `best_of` completions generated,
	// the larger, for each prompt of a `prompt` array; 1 for most.
	outputs int64
	// background: `"background": true` (the Responses API answers at once,
	// usage null, and bills as the work runs).
	background bool
	// model is the model the body names (`model`), decoded; empty when it
	// names none (or one longer than maxModel, or only in the part of the
	// body past the prefix read).
	model      string
	namesModel bool
	truncated  bool
}

// Model is the model the request body names, or empty.
func (rb Request) Model() string { return rb.model }

// NamesModel reports whether the body names a model (a string), readable
// or not (longer than any model's name, a broken escape): Model is then
// empty.
func (rb Request) NamesModel() bool { return rb.namesModel }

// Truncated reports whether the body is longer than the prefix read.
func (rb Request) Truncated() bool { return rb.truncated }

// ReadRequest reads the request body's prefix and puts it back before
// the rest: the upstream gets the body unchanged.
func ReadRequest(r *http.Request) Request {
	if r.Body == nil || r.Body == http.NoBody || r.ContentLength == 0 {
		return Request{}
	}
	if ce := r.Header.Get("Content-Encoding"); ce != "" && parseCoding(ce) != codingIdentity {
		return Request{} // a compressed body is not read: max
	}
	size := maxRequestPrefix + 1 // one more, to know there is more
	if r.ContentLength > 0 && r.ContentLength < int64(size) {
		size = int(r.ContentLength)
	}
	buf := make([]byte, size)
	n, err := io.ReadFull(r.Body, buf)
	buf = buf[:n]
	whole := r.ContentLength == int64(n)
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		err, whole = nil, true // the body ended within the prefix: the rest reads its end again
	}
	r.Body = &prefixedBody{prefix: buf, rest: r.Body, err: err, whole: whole}
	if err != nil {
		return Request{} // the client's body failed: max
	}
	truncated := n > maxRequestPrefix
	if truncated {
		buf = buf[:maxRequestPrefix]
	}
	return scanRequest(buf, truncated, r.ContentLength)
}

// scanRequest reads the ceiling and the prompt's estimate from a body, or
// its prefix when truncated (the body's length then is contentLength, or
// -1 unknown).
func scanRequest(body []byte, truncated bool, contentLength int64) Request {
	var j jsonScan
	var f scanFound
	j.feed(body, &f, textAnywhere)
	var rb Request
	for _, s := range [...]int{slotMaxTokens, slotMaxCompletion, slotMaxOutput} {
		if v, ok := f.get(s); ok && v > 0 {
			rb.maxTokens, rb.ok = max(rb.maxTokens, v), true
		}
	}
	if !truncated && (j.depth != 0 || j.inString) {
		rb.ok = false // not a whole JSON document
	}
	rb.promptTokens, rb.promptBytes = TokensOf(f.strings)+f.tokenIDs, f.strings+f.tokenIDs
	rb.outputs = outputs(&f)
	rb.background = f.background
	rb.hides = f.hides || truncated || f.background || f.models > 1
	rb.model, rb.namesModel, rb.truncated = f.model.String(), f.models > 0, truncated
	if truncated {
		rb.promptBytes = max(contentLength, int64(len(body)))
		if contentLength < 0 {
			rb.ok = false // how much prompt follows is not known
		}
		rb.promptTokens = TokensOf(contentLength)
	}
	return rb
}

// Reservation is what the request reserves under a policy: the ceiling on
// each answer times the answers asked for (outputs) and the prompt's
// estimate, weighed as the policy's settle weighs usage (w), at most
// maxCost; maxCost when the body does not say, or hides input.
func (rb Request) Reservation(w Weights, maxCost int64) int64 {
	if !rb.ok || rb.hides {
		return maxCost
	}
	return min(max(1, w.weigh(rb.promptTokens, rb.ceiling())), maxCost)
}

// ceiling is the most output the request may be billed: its ceiling on an
// answer times the answers it asks for.
func (rb Request) ceiling() int64 { return saturatingMul(rb.maxTokens, max(1, rb.outputs)) }

// Unbounded reports whether the request's output has no ceiling the body
// shows: no max_tokens (or a newer name) that could be read, or
// `"background": true`, whose usage comes after its answer (see the
// module's `unbounded refuse`).
func (rb Request) Unbounded() bool { return !rb.ok || rb.background }

// maxOutputs bounds the answers one request is read as asking for: OpenAI
// allows n up to 128 and best_of up to 20, and a prompt array of up to
// 2,048 prompts; more is capped (the reservation is capped by max anyway).
const maxOutputs = 1 << 20

// outputs is the answers a request asks for, from what its scan found:
// the larger of `n` and `best_of` (at least 1), for each prompt of a
// top-level `prompt` array (one when it is an array of token ids, or not
// an array).
func outputs(f *scanFound) int64 {
	per := int64(1)
	for _, s := range [...]int{slotN, slotBestOf} {
		if v, ok := f.get(s); ok && v > per {
			per = v
		}
	}
	prompts := f.prompts
	if f.idPrompt {
		prompts++ // the array itself is one prompt of token ids
	}
	return min(saturatingMul(per, max(1, prompts)), maxOutputs)
}

// prefixedBody is a request body whose first bytes were read already.
type prefixedBody struct {
	prefix []byte
	rest   io.ReadCloser
	err    error // the body failed while the prefix was read: the same again
	whole  bool  // the prefix is the whole body
}

func (b *prefixedBody) Read(p []byte) (int, error) {
	if len(b.prefix) > 0 {
		n := copy(p, b.prefix)
		b.prefix = b.prefix[n:]
		return n, nil
	}
	if b.err != nil {
		return 0, b.err
	}
	return b.rest.Read(p)
}

func (b *prefixedBody) Close() error { return b.rest.Close() }
