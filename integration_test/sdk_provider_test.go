package integration_test

import (
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// A fake LLM provider for the official SDKs: OpenAI's chat completions and
// Responses API (and Azure OpenAI's deployment path), Anthropic's Messages
// and count_tokens, JSON and streamed, compressed in each of the codings
// the client accepts in turn (and not at all), reporting usage as the
// providers do, counted from what the request carries:
//
//   - text: letters and spaces at 4 a token, any other byte (digits,
//     punctuation, non-ASCII: code, numbers, CJK) a token of its own, as
//     byte-level tokenizers go for dense text;
//   - what the body does not show: a stored response's whole context for
//     previous_response_id, 1,105 tokens an image (a high-detail
//     1024×1024 one), 2,000 a document;
//   - caching: Anthropic's prompt up to its last cache_control block is
//     written to the cache (cache_creation_input_tokens) the first time and
//     read from it (cache_read_input_tokens) after, and input_tokens is
//     what follows; OpenAI's cached_tokens are the part of a prompt of
//     1,024 tokens or more seen before, by 128, within prompt_tokens;
//   - the answer: X-Output-Tokens tokens (default 30), at most the
//     request's max_tokens, its text "abcd" each (4 bytes a token), times
//     n (choices) when the request sets it;
//   - `background: true` (Responses API): answered at once, queued, usage
//     null; the usage recorded is what it bills later.
//
// X-Cut: <bytes> stops a stream after that much text, and waits for the
// client to go; X-Provider-Status: <4xx or 5xx> answers that error, without
// usage. A streamed chat completion carries its usage only when the request
// asks (stream_options.include_usage), as OpenAI's does: then every chunk
// has "usage": null and a last chunk, with no choices, the usage; otherwise
// no usage at all. Responses name the model served: served's dated
// snapshot of the model asked for, or the model asked for.
type sdkProvider struct {
	addr string
	// served maps a model asked for to the one served (set before use).
	served map[string]string
	mu     sync.Mutex
	// stored are the Responses API's stored responses: their context's tokens.
	stored map[string]int64
	// cached are the prompt prefixes in the providers' caches.
	cached map[[32]byte]bool
	calls  []providerCall
	n      int
}

// providerCall is one answer's usage as the provider reported it.
type providerCall struct {
	path, credential                       string
	input, output, cacheWrite, cacheRead   int64 // Anthropic's fields; OpenAI: input = prompt_tokens
	cached                                 int64 // OpenAI's prompt_tokens_details.cached_tokens
	hidden                                 int64 // of input, what the body did not show
	text                                   int   // bytes of answer text sent
	cut                                    bool  // the stream was cut before its usage
	acceptEncoding, contentEncoding, model string
	// served is the model the answer named; stream: it was streamed, with
	// its usage asked for (askedUsage); org, team, user: the identity
	// headers the gateway passed on (X-Org, X-Team, X-User); at: when the
	// answer was written (recorded).
	served             string
	stream, askedUsage bool
	org, team, user    string
	at                 time.Time
}

// total is the usage as a policy without weights settles it: OpenAI's
// total_tokens; Anthropic's input and output tokens, cache writes as
// input, cache reads not (the defaults of settle anthropic).
func (c providerCall) total() int64 { return c.input + c.cacheWrite + c.output }

func startProvider(t *testing.T) *sdkProvider {
	t.Helper()
	p := &sdkProvider{stored: map[string]int64{}, cached: map[[32]byte]bool{}, served: map[string]string{}}
	p.addr = serveLoopback(t, http.HandlerFunc(p.serve))
	return p
}

// serveLoopback serves h on a free loopback port until the test ends, and
// returns its address.
func serveLoopback(t *testing.T, h http.Handler) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String()
}

// reported is what the provider answered since call from (its index).
func (p *sdkProvider) reported(from int) []providerCall {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]providerCall(nil), p.calls[from:]...)
}

func (p *sdkProvider) count() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.calls)
}

// fakeTokens counts text as the fake tokenizer does.
func fakeTokens(s string) int64 {
	letters, other := int64(0), int64(0)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c == ' ' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' {
			letters++
		} else {
			other++
		}
	}
	return (letters+3)/4 + other
}

// promptParts walks a request's content: its text, in order, with the
// cache breakpoints among it, and what it does not show.
type promptParts struct {
	texts      []string
	breakAfter int   // texts up to this index (exclusive) are before the last cache_control; 0 none
	hidden     int64 // tokens of images, documents, stored responses
}

func (pp *promptParts) content(v any) {
	switch c := v.(type) {
	case string:
		pp.texts = append(pp.texts, c)
	case []any:
		for _, part := range c {
			m, _ := part.(map[string]any)
			switch m["type"] {
			case "text", "input_text":
				pp.texts = append(pp.texts, fmt.Sprint(m["text"]))
			case "image_url", "input_image", "image":
				pp.hidden += 1105
			case "document", "input_file", "file":
				pp.hidden += 2000
			}
			if m["cache_control"] != nil {
				pp.breakAfter = len(pp.texts)
			}
		}
	}
}

func (p *sdkProvider) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	if v, err := strconv.Atoi(r.Header.Get("X-Provider-Status")); err == nil && v >= 400 {
		// The provider's error: no usage, as providers answer one.
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(v)
		fmt.Fprintf(w, `{"error":{"message":"the provider failed (%d)","type":"server_error","param":null,"code":null}}`, v)
		return
	}
	var req map[string]any
	if err := json.Unmarshal(raw, &req); err != nil && r.Method == "POST" {
		http.Error(w, `{"error":{"message":"not JSON"}}`, 400)
		return
	}
	stream, _ := req["stream"].(bool)
	ceiling := int64(0)
	for _, k := range []string{"max_tokens", "max_completion_tokens", "max_output_tokens"} {
		if v, ok := req[k].(float64); ok {
			ceiling = max(ceiling, int64(v))
		}
	}
	var pp promptParts
	path := r.URL.Path
	switch {
	case strings.HasSuffix(path, "/chat/completions"):
		for _, m := range asList(req["messages"]) {
			msg, _ := m.(map[string]any)
			pp.texts = append(pp.texts, fmt.Sprint(msg["role"]))
			pp.content(msg["content"])
		}
	case path == "/v1/responses":
		pp.content(req["instructions"])
		if s, ok := req["input"].(string); ok {
			pp.texts = append(pp.texts, s)
		}
		for _, item := range asList(req["input"]) {
			m, _ := item.(map[string]any)
			pp.content(m["content"])
		}
		if id, ok := req["previous_response_id"].(string); ok {
			p.mu.Lock()
			pp.hidden += p.stored[id]
			p.mu.Unlock()
		}
	case strings.HasPrefix(path, "/v1/messages"):
		pp.content(req["system"])
		for _, m := range asList(req["messages"]) {
			msg, _ := m.(map[string]any)
			pp.content(msg["content"])
		}
	default:
		http.Error(w, `{"error":{"message":"no such path"}}`, 404)
		return
	}
	var c providerCall
	c.path, c.model, c.acceptEncoding = path, fmt.Sprint(req["model"]), r.Header.Get("Accept-Encoding")
	c.served = c.model
	if s := p.servedModel(c.model); s != "" {
		c.served = s
	}
	c.stream = stream
	if so, ok := req["stream_options"].(map[string]any); ok {
		c.askedUsage = so["include_usage"] == true
	}
	c.org, c.team, c.user = r.Header.Get("X-Org"), r.Header.Get("X-Team"), r.Header.Get("X-User")
	c.credential = r.Header.Get("Authorization") + "|" + r.Header.Get("X-Api-Key") + "|" + r.Header.Get("Api-Key")
	var all, prefix int64
	for i, s := range pp.texts {
		n := fakeTokens(s)
		all += n
		if i < pp.breakAfter {
			prefix += n
		}
	}
	c.hidden = pp.hidden
	c.input = all + pp.hidden
	p.mu.Lock()
	p.n++
	n := p.n
	id := "resp_" + strconv.Itoa(n)
	if strings.HasPrefix(path, "/v1/messages") && pp.breakAfter > 0 {
		key := sha256.Sum256([]byte(strings.Join(pp.texts[:pp.breakAfter], "\x00")))
		if p.cached[key] {
			c.cacheRead = prefix
		} else {
			c.cacheWrite = prefix
			p.cached[key] = true
		}
		c.input -= prefix
	}
	if strings.HasSuffix(path, "/chat/completions") && all >= 1024 && len(pp.texts) > 2 {
		key := sha256.Sum256([]byte(strings.Join(pp.texts[:len(pp.texts)-1], "\x00")))
		if p.cached[key] {
			for _, s := range pp.texts[:len(pp.texts)-1] {
				c.cached += fakeTokens(s)
			}
			c.cached -= c.cached % 128
		}
		p.cached[key] = true
	}
	p.mu.Unlock()
	out := int64(30)
	if v := r.Header.Get("X-Output-Tokens"); v != "" {
		out, _ = strconv.ParseInt(v, 10, 64)
	}
	if ceiling > 0 {
		out = min(out, ceiling)
	}
	// n choices (chat completions), each of out tokens: one text of all
	// of them, as far as a usage scanner is concerned.
	if n, _ := req["n"].(float64); n > 1 {
		out *= int64(n)
	}
	c.output = out
	if path == "/v1/messages/count_tokens" {
		c.output = 0
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"input_tokens":%d}`, c.input+c.cacheWrite+c.cacheRead)
		p.record(c)
		return
	}
	p.mu.Lock()
	p.stored[id] = c.input + c.cacheWrite + c.cacheRead + out
	p.mu.Unlock()
	if bg, _ := req["background"].(bool); bg && path == "/v1/responses" {
		// Answered at once, queued, its usage null: billed as the work runs.
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":%q,"object":"response","created_at":1741476542,"status":"queued","background":true,"model":%q,"output":[],"usage":null}`, id, c.model)
		p.record(c)
		return
	}
	text := strings.Repeat("abcd", int(out))
	cut, _ := strconv.Atoi(r.Header.Get("X-Cut"))
	// Each of the codings the client accepts in turn, and none.
	codings := []string{"identity"}
	for part := range strings.SplitSeq(r.Header.Get("Accept-Encoding"), ",") {
		if coding, _, _ := strings.Cut(part, ";"); strings.TrimSpace(coding) != "" {
			codings = append(codings, strings.TrimSpace(coding))
		}
	}
	coding := codings[n%len(codings)]
	c.contentEncoding = coding
	ct := "application/json"
	if stream {
		ct = "text/event-stream"
	}
	w.Header().Set("Content-Type", ct)
	w.Header().Set("X-Request-Id", "req_"+strconv.Itoa(n))
	o := newWire(w, coding, io.Discard, !stream)
	defer func() { p.record(c) }()
	deltas := func(format string) bool {
		for i := 0; i < len(text); i += 20 {
			if cut > 0 && c.text >= cut {
				o.w.(http.Flusher).Flush()
				select { // until Caddy, its client gone, cancels this request
				case <-r.Context().Done():
				case <-time.After(10 * time.Second):
				}
				c.cut = true
				return false
			}
			part := text[i:min(i+20, len(text))]
			o.event(fmt.Sprintf(format, jsonString(part)))
			c.text += len(part)
		}
		return true
	}
	in := c.input // OpenAI's prompt_tokens hold the cached ones
	switch {
	case strings.HasSuffix(path, "/chat/completions") && !stream:
		c.text = len(text)
		o.event(fmt.Sprintf(`{"id":"chatcmpl-%s","object":"chat.completion","created":1741569952,"model":%q,"choices":[{"index":0,"message":{"role":"assistant","content":%s,"refusal":null},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d,"audio_tokens":0}}}`,
			id, c.served, jsonString(text), in, out, in+out, c.cached))
	case strings.HasSuffix(path, "/chat/completions"):
		usageNull := "" // each chunk's usage, when the request asks for it
		if c.askedUsage {
			usageNull = `,"usage":null`
		}
		chunk := `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1741569952,"model":` + strconv.Quote(c.served) + `,"choices":[%s]%s}`
		o.event("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}`, usageNull) + "\n\n")
		if !deltas("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{"content":%s},"finish_reason":null}`, usageNull) + "\n\n") {
			return
		}
		o.event("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{},"finish_reason":"stop"}`, usageNull) + "\n\n")
		if c.askedUsage {
			o.event("data: " + fmt.Sprintf(chunk, "", fmt.Sprintf(`,"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d,"prompt_tokens_details":{"cached_tokens":%d}}`, in, out, in+out, c.cached)) + "\n\n")
		}
		o.event("data: [DONE]\n\n")
	case path == "/v1/responses" && !stream:
		c.text = len(text)
		o.event(fmt.Sprintf(`{"id":%q,"object":"response","created_at":1741476542,"status":"completed","model":%q,"output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":%s,"annotations":[]}]}],"usage":{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}}`,
			id, c.served, jsonString(text), in, out, in+out))
	case path == "/v1/responses":
		o.event(`event: response.created` + "\n" + fmt.Sprintf(`data: {"type":"response.created","sequence_number":0,"response":{"id":%q,"object":"response","status":"in_progress","model":%q,"output":[],"usage":null}}`, id, c.served) + "\n\n")
		if !deltas(`event: response.output_text.delta` + "\n" + `data: {"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":%s}` + "\n\n") {
			return
		}
		o.event(`event: response.completed` + "\n" + fmt.Sprintf(`data: {"type":"response.completed","sequence_number":4,"response":{"id":%q,"object":"response","status":"completed","model":%q,"output":[{"type":"message","id":"msg_1","role":"assistant","content":[{"type":"output_text","text":%s}]}],"usage":{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"total_tokens":%d}}}`,
			id, c.served, jsonString(text), in, out, in+out) + "\n\n")
	case !stream: // Anthropic Messages
		c.text = len(text)
		o.event(fmt.Sprintf(`{"id":"msg_%s","type":"message","role":"assistant","content":[{"type":"text","text":%s}],"model":%q,"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":%d}}`,
			id, jsonString(text), c.served, c.input, c.cacheWrite, c.cacheRead, out))
	default:
		o.event("event: message_start\n" + fmt.Sprintf(`data: {"type":"message_start","message":{"id":"msg_%s","type":"message","role":"assistant","content":[],"model":%q,"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":%d,"cache_creation_input_tokens":%d,"cache_read_input_tokens":%d,"output_tokens":1}}}`,
			id, c.served, c.input, c.cacheWrite, c.cacheRead) + "\n\n")
		o.event("event: content_block_start\n" + `data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}` + "\n\n")
		if !deltas("event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":%s}}` + "\n\n") {
			return
		}
		o.event("event: content_block_stop\n" + `data: {"type":"content_block_stop","index":0}` + "\n\n")
		o.event("event: message_delta\n" + fmt.Sprintf(`data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":%d}}`, out) + "\n\n")
		o.event("event: message_stop\n" + `data: {"type":"message_stop"}` + "\n\n")
	}
	o.end()
}

func (p *sdkProvider) record(c providerCall) {
	p.mu.Lock()
	c.at = time.Now()
	p.calls = append(p.calls, c)
	p.mu.Unlock()
}

// servedModel is the model served for one asked for, or "".
func (p *sdkProvider) servedModel(asked string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.served[asked]
}

func asList(v any) []any { l, _ := v.([]any); return l }
