package integration_test

import (
	"bufio"
	"bytes"
	"compress/zlib"
	"crypto/sha256"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// An LLM gateway through real Caddy processes and a real Redis: a fake
// upstream speaking OpenAI's chat completions and Responses API and
// Anthropic's Messages API, JSON and streamed, compressed as the client
// accepts (gzip, deflate, br, zstd) or not; clients that send what the
// official SDKs send (a JSON body with max_tokens, Authorization: Bearer).

// llmCall is what the upstream saw and sent for one request.
type llmCall struct {
	input, output  int64    // the usage it reported
	bodySum        [32]byte // of the request body it received
	wireSum        [32]byte // of the response bytes it wrote (compressed)
	acceptEncoding string
	text           int // bytes of the answer's text it sent
}

// llmUpstream answers by path: /v1/chat/completions, /v1/responses,
// /v1/messages, streamed when the body says "stream": true, compressed in
// the first coding of Accept-Encoding. Its answer is X-Words words (5
// bytes each, 30 by default), the output tokens ceil(bytes/4), the input
// tokens X-Prompt-Tokens (10 by default). X-Cut: <bytes> stops after that
// much text: it waits for the client to go (Caddy cancels the upstream
// request), or with X-Cut-By: upstream drops the connection.
type llmUpstream struct {
	addr  string
	mu    sync.Mutex
	calls map[string]*llmCall // by X-Test-Id
	all   []int64             // every usage reported, in order
}

func startLLMUpstream(t *testing.T) *llmUpstream {
	t.Helper()
	u := &llmUpstream{calls: map[string]*llmCall{}}
	u.addr = serveLoopback(t, http.HandlerFunc(u.serve))
	return u
}

func (u *llmUpstream) call(id string) *llmCall {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.calls[id]
}

func (u *llmUpstream) total() (n int, sum int64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, v := range u.all {
		sum += v
	}
	return len(u.all), sum
}

// wire is the response as it goes out: compressed, hashed, flushed per
// event; or, buffered, sent whole with its Content-Length when closed.
type wire struct {
	w     http.ResponseWriter
	hash  io.Writer
	enc   io.Writer // the compressor, or the hashing writer itself
	flush func() error
	close func() error
	buf   *bytes.Buffer // buffered: the body, sent on end
	sum   io.Writer
}

func newWire(w http.ResponseWriter, coding string, sum io.Writer, buffered bool) *wire {
	out := &wire{w: w, hash: io.MultiWriter(w, sum), sum: sum}
	if buffered {
		out.buf = new(bytes.Buffer)
		out.hash = out.buf
	}
	out.enc, out.flush, out.close = out.hash, func() error { return nil }, func() error { return nil }
	switch coding {
	case "gzip":
		zw := gzip.NewWriter(out.hash)
		out.enc, out.flush, out.close = zw, zw.Flush, zw.Close
	case "deflate":
		zw := zlib.NewWriter(out.hash)
		out.enc, out.flush, out.close = zw, zw.Flush, zw.Close
	case "br":
		bw := brotli.NewWriterLevel(out.hash, 5)
		out.enc, out.flush, out.close = bw, bw.Flush, bw.Close
	case "zstd":
		zw, _ := zstd.NewWriter(out.hash, zstd.WithEncoderConcurrency(1))
		out.enc, out.flush, out.close = zw, zw.Flush, zw.Close
	}
	if coding != "" && coding != "identity" {
		w.Header().Set("Content-Encoding", coding)
	}
	return out
}

// event writes one part and pushes it to the client.
func (o *wire) event(s string) {
	_, _ = io.WriteString(o.enc, s)
	if o.buf == nil {
		_ = o.flush()
		o.w.(http.Flusher).Flush()
	}
}

// end ends the body.
func (o *wire) end() {
	_ = o.close()
	if o.buf != nil {
		o.w.Header().Set("Content-Length", strconv.Itoa(o.buf.Len()))
		_, _ = o.sum.Write(o.buf.Bytes())
		_, _ = o.w.Write(o.buf.Bytes())
	}
}

func jsonString(s string) string { b, _ := json.Marshal(s); return string(b) }

func (u *llmUpstream) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var req struct {
		Stream bool `json:"stream"`
	}
	_ = json.Unmarshal(raw, &req)
	words, _ := strconv.Atoi(r.Header.Get("X-Words"))
	if words == 0 {
		words = 30
	}
	text := strings.Repeat("word ", words)
	input := int64(10)
	if v := r.Header.Get("X-Prompt-Tokens"); v != "" {
		input, _ = strconv.ParseInt(v, 10, 64)
	}
	output := int64(len(text)+3) / 4
	cut, _ := strconv.Atoi(r.Header.Get("X-Cut"))
	coding, _, _ := strings.Cut(r.Header.Get("Accept-Encoding"), ",")
	coding = strings.TrimSpace(coding)
	if r.Header.Get("X-Plain") != "" { // left to Caddy's encode
		coding = "identity"
	}
	sum := sha256.New()
	c := &llmCall{input: input, output: output, bodySum: sha256.Sum256(raw), acceptEncoding: r.Header.Get("Accept-Encoding")}
	defer func() {
		copy(c.wireSum[:], sum.Sum(nil))
		u.mu.Lock()
		u.calls[r.Header.Get("X-Test-Id")] = c
		u.all = append(u.all, input+output)
		u.mu.Unlock()
	}()
	ct := "application/json"
	if req.Stream {
		ct = "text/event-stream"
	}
	w.Header().Set("Content-Type", ct)
	out := newWire(w, coding, sum, !req.Stream) // a JSON body goes with its Content-Length
	// deltas sends the text 20 bytes at a time, each in the event format
	// given, stopping at the cut.
	deltas := func(format string) bool {
		for i := 0; i < len(text); i += 20 {
			if cut > 0 && c.text >= cut {
				out.w.(http.Flusher).Flush()
				if r.Header.Get("X-Cut-By") == "upstream" {
					panic(http.ErrAbortHandler) // drops the connection mid-body
				}
				select { // until Caddy, its client gone, cancels this request
				case <-r.Context().Done():
				case <-time.After(10 * time.Second):
				}
				return false
			}
			part := text[i:min(i+20, len(text))]
			out.event(fmt.Sprintf(format, jsonString(part)))
			c.text += len(part)
		}
		return true
	}
	switch {
	case r.URL.Path == "/v1/chat/completions" && !req.Stream:
		c.text = len(text)
		out.event(fmt.Sprintf(`{"id":"chatcmpl-1","object":"chat.completion","created":1741569952,"model":"gpt-4o-mini","choices":[{"index":0,"message":{"role":"assistant","content":%s,"refusal":null},"finish_reason":"stop"}],"usage":{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}}`,
			jsonString(text), input, output, input+output))
	case r.URL.Path == "/v1/chat/completions":
		chunk := `{"id":"chatcmpl-1","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4o-mini","choices":[%s],"usage":%s}`
		out.event("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}`, "null") + "\n\n")
		if !deltas("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{"content":%s},"finish_reason":null}`, "null") + "\n\n") {
			return
		}
		out.event("data: " + fmt.Sprintf(chunk, `{"index":0,"delta":{},"finish_reason":"stop"}`, "null") + "\n\n")
		if r.Header.Get("X-No-Usage") == "" {
			out.event("data: " + fmt.Sprintf(chunk, "", fmt.Sprintf(`{"prompt_tokens":%d,"completion_tokens":%d,"total_tokens":%d}`, input, output, input+output)) + "\n\n")
		}
		out.event("data: [DONE]\n\n")
	case r.URL.Path == "/v1/responses" && !req.Stream:
		c.text = len(text)
		out.event(fmt.Sprintf(`{"id":"resp_1","object":"response","created_at":1741476542,"status":"completed","model":"gpt-4.1","output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant","content":[{"type":"output_text","text":%s,"annotations":[]}]}],"usage":{"input_tokens":%d,"input_tokens_details":{"cached_tokens":0},"output_tokens":%d,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":%d}}`,
			jsonString(text), input, output, input+output))
	case r.URL.Path == "/v1/responses":
		out.event(`event: response.created` + "\n" + `data: {"type":"response.created","sequence_number":0,"response":{"id":"resp_1","object":"response","status":"in_progress","model":"gpt-4.1","output":[],"usage":null}}` + "\n\n")
		out.event(`event: response.output_item.added` + "\n" + `data: {"type":"response.output_item.added","sequence_number":1,"output_index":0,"item":{"id":"msg_1","type":"message","status":"in_progress","role":"assistant","content":[]}}` + "\n\n")
		if !deltas(`event: response.output_text.delta` + "\n" + `data: {"type":"response.output_text.delta","sequence_number":2,"item_id":"msg_1","output_index":0,"content_index":0,"delta":%s}` + "\n\n") {
			return
		}
		out.event(`event: response.output_text.done` + "\n" + fmt.Sprintf(`data: {"type":"response.output_text.done","sequence_number":3,"item_id":"msg_1","output_index":0,"content_index":0,"text":%s}`, jsonString(text)) + "\n\n")
		out.event(`event: response.completed` + "\n" + fmt.Sprintf(`data: {"type":"response.completed","sequence_number":4,"response":{"id":"resp_1","object":"response","status":"completed","model":"gpt-4.1","output":[{"type":"message","id":"msg_1","role":"assistant","content":[{"type":"output_text","text":%s}]}],"usage":{"input_tokens":%d,"output_tokens":%d,"total_tokens":%d}}}`,
			jsonString(text), input, output, input+output) + "\n\n")
	case r.URL.Path == "/v1/messages" && !req.Stream:
		c.text = len(text)
		out.event(fmt.Sprintf(`{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","content":[{"type":"text","text":%s}],"model":"claude-sonnet-4-5","stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":%d,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":%d}}`,
			jsonString(text), input, output))
	case r.URL.Path == "/v1/messages":
		out.event("event: message_start\n" + fmt.Sprintf(`data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-sonnet-4-5","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":%d,"output_tokens":1}}}`, input) + "\n\n")
		out.event("event: content_block_start\n" + `data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}` + "\n\n")
		out.event("event: ping\n" + `data: {"type": "ping"}` + "\n\n")
		if !deltas("event: content_block_delta\n" + `data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":%s}}` + "\n\n") {
			return
		}
		out.event("event: content_block_stop\n" + `data: {"type":"content_block_stop","index":0}` + "\n\n")
		out.event("event: message_delta\n" + fmt.Sprintf(`data: {"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":%d}}`, output) + "\n\n")
		out.event("event: message_stop\n" + `data: {"type":"message_stop"}` + "\n\n")
	default:
		w.WriteHeader(404)
		return
	}
	out.end()
}

// TestLLMWithEncode: a site whose Caddy compresses (`encode`, which the
// Caddyfile orders inside rate_limit) with a plain upstream: the limiter
// reads the usage from encode's gzip and zstd output.
func TestLLMWithEncode(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	encode := map[string]any{"handler": "encode", "encodings": map[string]any{"gzip": map[string]any{}, "zstd": map[string]any{}}, "prefer": []string{"zstd", "gzip"}}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, llmPolicies(nil)...), encode, proxyTo(up.addr))
	n := 0
	for _, f := range llmFormats {
		for _, coding := range []string{"gzip", "zstd"} {
			n++
			key := "sk-encode-" + strconv.Itoa(n)
			r := llmPost(t, newClient(), in.URL+f.path, key, f.body, "Accept-Encoding", coding, "X-Plain", "1", "X-Test-Id", key, "X-Words", "200")
			call := up.call(key)
			if r.status != 200 || call == nil || r.header.Get("Content-Encoding") != coding {
				t.Fatalf("%s: %d, Content-Encoding %q, want %s from encode", f.name, r.status, r.header.Get("Content-Encoding"), coding)
			}
			if settled := 100000 - bucketTokens(t, in, f.provider, key); settled != call.input+call.output {
				t.Errorf("%s through encode %s: settled %d, the upstream reported %d", f.name, coding, settled, call.input+call.output)
			}
		}
	}
}

// llmFormat is one API and framing, and the request the SDK sends for it.
type llmFormat struct {
	name, path string
	stream     bool
	provider   string // the policy that settles it
	body       string
	prompt     int64 // the estimate of its prompt: the bytes of its strings / 4, rounded up
}

// The prompts' strings: "gpt-4o-mini" "user" "Say hello" (24 bytes: 6
// tokens), "gpt-4.1" "Say hello" (16: 4), "claude-sonnet-4-5" "user" "Say
// hello" (30: 8).
var llmFormats = []llmFormat{
	{"openai chat JSON", "/v1/chat/completions", false, "openai_tokens", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}],"max_tokens":256}`, 6},
	{"openai chat SSE", "/v1/chat/completions", true, "openai_tokens", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}],"max_tokens":256,"stream":true,"stream_options":{"include_usage":true}}`, 6},
	{"openai responses JSON", "/v1/responses", false, "openai_tokens", `{"model":"gpt-4.1","input":"Say hello","max_output_tokens":256}`, 4},
	{"openai responses SSE", "/v1/responses", true, "openai_tokens", `{"model":"gpt-4.1","input":"Say hello","max_output_tokens":256,"stream":true}`, 4},
	{"anthropic JSON", "/v1/messages", false, "anthropic_tokens", `{"model":"claude-sonnet-4-5","max_tokens":256,"messages":[{"role":"user","content":"Say hello"}]}`, 8},
	{"anthropic SSE", "/v1/messages", true, "anthropic_tokens", `{"model":"claude-sonnet-4-5","max_tokens":256,"messages":[{"role":"user","content":"Say hello"}],"stream":true}`, 8},
}

var llmCodings = []string{"identity", "gzip", "deflate", "br", "zstd"}

// llmPolicies are the gateway's: OpenAI's APIs keyed on the bearer token,
// Anthropic's on x-api-key, each reserving from the body (at most 8,000)
// of a budget of 100,000 tokens that does not refill during a test, and
// settling the usage the response reports (weighed as given).
func llmPolicies(weights map[string]any) []map[string]any {
	openai := map[string]any{"from": "openai"}
	anthropic := map[string]any{"from": "anthropic"}
	if weights != nil {
		openai["weights"], anthropic["weights"] = weights, weights
	}
	return []map[string]any{
		{"name": "openai_tokens", "match": map[string]any{"path": []string{"/v1/chat/completions", "/v1/responses"}}, "key": "{http.rate_limit.bearer}",
			"rate": "100000/240h", "cost": "openai", "max_cost": 8000, "settle": openai},
		{"name": "anthropic_tokens", "match": map[string]any{"path": []string{"/v1/messages"}}, "key": "{http.request.header.X-Api-Key}",
			"rate": "100000/240h", "cost": "openai", "max_cost": 8000, "settle": anthropic},
	}
}

// llmResponse is what a client got.
type llmResponse struct {
	status  int
	header  http.Header
	trailer http.Header
	body    []byte
}

// llmPost sends a request as the SDKs do: a JSON body, the key in
// Authorization: Bearer (OpenAI) or x-api-key (Anthropic), the header pairs.
func llmPost(t *testing.T, client *http.Client, url, key, body string, header ...string) llmResponse {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("X-Api-Key", key)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("reading the response: %v", err)
	}
	return llmResponse{resp.StatusCode, resp.Header, resp.Trailer, raw}
}

// bucketTokens reads a bucket from the admin API, as `caddy rate-limit
// inspect` does.
func bucketTokens(t *testing.T, in *instance, policy, identity string) int64 {
	t.Helper()
	status, body := adminCall(t, in, "POST", "/rate_limit/inspect", `{"policy":"`+policy+`","identity":"`+identity+`"}`)
	var b bucketAnswer
	if err := json.Unmarshal([]byte(body), &b); err != nil || status != 200 {
		t.Fatalf("inspect %s %s: %d %s", policy, identity, status, body)
	}
	return b.Tokens
}

// cutTokens waits (at most 2 s) for the bucket of a stream the client cut
// to hold want, and returns what it holds: the charge is made once Caddy
// notices the client went away, which the client, having gone, does not
// wait for (a response the client read to its end was charged before its
// end: bucketTokens at once).
func cutTokens(t *testing.T, in *instance, policy, identity string, want int64) int64 {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		got := bucketTokens(t, in, policy, identity)
		if got == want || time.Now().After(deadline) {
			return got
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func limitOf(t *testing.T, h http.Header, policy string) int64 {
	t.Helper()
	for _, f := range parseFields(t, h, "RateLimit") {
		if f.name == policy {
			return f.params["r"]
		}
	}
	t.Fatalf("no %s in RateLimit %q", policy, h.Values("RateLimit"))
	return 0
}

// TestLLMSettle: for each provider's API, JSON and streamed, plain and in
// each coding, the bucket is charged exactly the usage the upstream
// reported; the client gets the upstream's bytes unchanged and the
// upstream the request's; the RateLimit field shows the reservation (the
// body's max_tokens and the prompt's estimate), and the RateLimit trailer,
// sent on TE: trailers, the settled state.
func TestLLMSettle(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, llmPolicies(nil)...), proxyTo(up.addr))
	weighed := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0, "redis": map[string]any{"addresses": []string{srv.Addr}, "key_prefix": "w:"}},
		llmPolicies(map[string]any{"input": 1, "output": 4})...), proxyTo(up.addr))
	client := newClient()
	const burst = 100000
	var table []string
	n := 0
	for _, f := range llmFormats {
		// "gpt-4o-mini" "user" "Say hello" and the like: the prompt's strings.
		for _, coding := range llmCodings {
			for _, w := range []struct {
				name string
				in   *instance
			}{{"", in}, {"weighed 1:4", weighed}} {
				if w.in == weighed && coding != "gzip" && coding != "identity" {
					continue
				}
				n++
				key, id := fmt.Sprintf("sk-%d", n), strconv.Itoa(n)
				words := 20 + rand.IntN(60)
				r := llmPost(t, client, w.in.URL+f.path, key, f.body, "Accept-Encoding", coding, "TE", "trailers",
					"X-Test-Id", id, "X-Words", strconv.Itoa(words), "X-Prompt-Tokens", strconv.Itoa(5+rand.IntN(20)))
				call := up.call(id)
				if r.status != 200 || call == nil {
					t.Fatalf("%s, %s: %d, the upstream saw it: %v", f.name, coding, r.status, call != nil)
				}
				reported := call.input + call.output
				if w.in == weighed {
					reported = call.input + 4*call.output
				}
				if sha256.Sum256(r.body) != call.wireSum || call.bodySum != sha256.Sum256([]byte(f.body)) {
					t.Errorf("%s, %s: the body changed on the way (response %v, request %v)", f.name, coding, sha256.Sum256(r.body) == call.wireSum, call.bodySum == sha256.Sum256([]byte(f.body)))
				}
				reserved := burst - limitOf(t, r.header, f.provider)
				settled := burst - bucketTokens(t, w.in, f.provider, key)
				trailer := int64(-1)
				if len(r.trailer.Values("RateLimit")) > 0 {
					trailer = burst - limitOf(t, r.trailer, f.provider)
				}
				table = append(table, fmt.Sprintf("| %s%s | %s | %d | %d | %d | %d |", f.name, map[bool]string{true: ", " + w.name}[w.name != ""], coding, reserved, reported, settled, trailer))
				if settled != reported || trailer != reported {
					t.Errorf("%s, %s %s: settled %d, the trailer says %d, the upstream reported %d", f.name, coding, w.name, settled, trailer, reported)
				}
				if w.in == in && reserved != 256+f.prompt {
					t.Errorf("%s, %s: reserved %d, want max_tokens 256 and the prompt's %d", f.name, coding, reserved, f.prompt)
				}
			}
		}
	}
	t.Logf("settled against reported usage (tokens):\n| API | Content-Encoding | reserved | reported | settled | RateLimit trailer |\n|---|---|---|---|---|---|\n%s", strings.Join(table, "\n"))

	// Without TE: trailers, no trailer is declared.
	r := llmPost(t, client, in.URL+"/v1/chat/completions", "sk-plain", llmFormats[1].body, "X-Test-Id", "plain")
	if r.header.Get("Trailer") != "" || len(r.trailer) != 0 {
		t.Errorf("without TE: trailers: Trailer %q, trailers %v", r.header.Get("Trailer"), r.trailer)
	}
}

// TestLLMTrailersHTTP2: over HTTP/2 (h2c), the settled RateLimit comes as
// a trailer too, after a streamed body and after a JSON body that keeps
// its Content-Length.
func TestLLMTrailersHTTP2(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	h2c := func(cfg map[string]any) {
		cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)["protocols"] = []string{"h1", "h2c"}
	}
	in := startCaddyTuned(t, h2c, limiter(srv.Addr, map[string]any{"jitter": 0}, llmPolicies(nil)...), proxyTo(up.addr))
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{Protocols: protocols, DisableCompression: true}}
	for i, f := range []llmFormat{llmFormats[0], llmFormats[3], llmFormats[5]} {
		key := "sk-h2-" + strconv.Itoa(i)
		r := llmPost(t, client, in.URL+f.path, key, f.body, "Accept-Encoding", "gzip", "TE", "trailers", "X-Test-Id", key)
		call := up.call(key)
		if r.status != 200 || call == nil || len(r.trailer.Values("RateLimit")) == 0 {
			t.Fatalf("%s over h2c: %d, trailers %v", f.name, r.status, r.trailer)
		}
		if got := 100000 - limitOf(t, r.trailer, f.provider); got != call.input+call.output {
			t.Errorf("%s over h2c: the trailer says %d used, the upstream reported %d", f.name, got, call.input+call.output)
		}
	}
}

// TestLLMRequestBody: the reservation comes from the body the SDK sends
// (max_tokens and the prompt at 4 bytes a token), and the body reaches the
// upstream byte for byte: small, and larger than the 64 KiB read (then the
// prompt's estimate is its Content-Length); without max_tokens, max.
func TestLLMRequestBody(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, llmPolicies(nil)...), proxyTo(up.addr))
	client := newClient()
	long := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"` + strings.Repeat("a long document ", 12_000) + `"}],"max_tokens":300}`
	for i, tc := range []struct {
		name, body string
		reserved   int64
	}{
		// "gpt-4o-mini" "system" "You are a helpful assistant." "user" "Write a haiku about rate limits.": 81 bytes.
		{"the SDK's chat request", `{"model":"gpt-4o-mini","messages":[{"role":"system","content":"You are a helpful assistant."},{"role":"user","content":"Write a haiku about rate limits."}],"max_tokens":100,"stream":true,"stream_options":{"include_usage":true}}`, 100 + 21},
		{"max_completion_tokens", `{"model":"o3","messages":[{"role":"user","content":"Hi"}],"max_completion_tokens":2000}`, 2000 + 2},
		{"a 192 KB prompt: its length", long, 8000},
		{"without max_tokens", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Hi"}]}`, 8000},
		{"not JSON", `model=gpt-4o-mini&max_tokens=5`, 8000},
	} {
		key := "sk-body-" + strconv.Itoa(i)
		r := llmPost(t, client, in.URL+"/v1/chat/completions", key, tc.body, "X-Test-Id", key)
		call := up.call(key)
		if r.status != 200 || call == nil || call.bodySum != sha256.Sum256([]byte(tc.body)) {
			t.Fatalf("%s: %d, the upstream got the body unchanged: %v", tc.name, r.status, call != nil && call.bodySum == sha256.Sum256([]byte(tc.body)))
		}
		reserved := 100000 - limitOf(t, r.header, "openai_tokens")
		t.Logf("%s (%d bytes): reserved %d", tc.name, len(tc.body), reserved)
		if reserved != tc.reserved {
			t.Errorf("%s: reserved %d, want %d", tc.name, reserved, tc.reserved)
		}
	}
}

// cutStream sends a streamed request whose upstream stops after cut bytes
// of text, reads the stream until the text stops coming (decoding it when
// compressed), then goes away. It returns the bytes of text it read.
func cutStream(t *testing.T, url, key, body, coding string, cut int, header ...string) int {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Authorization", "Bearer "+key)
	req.Header.Set("Accept-Encoding", coding)
	req.Header.Set("X-Cut", strconv.Itoa(cut))
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableCompression: true, DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return -resp.StatusCode
	}
	var rd io.Reader = resp.Body
	switch coding {
	case "gzip":
		zr, err := gzip.NewReader(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		rd = zr
	}
	lines := bufio.NewReader(rd)
	text := 0
	for text < cut {
		line, err := lines.ReadString('\n')
		if err != nil {
			t.Fatalf("the stream ended after %d bytes of text: %v", text, err)
		}
		if strings.Contains(line, `"content":"word`) {
			text += 20
		}
	}
	return text // the deferred Close drops the connection: the client is gone
}

// TestLLMCutStream: a stream cut after half its text is charged at least
// what it delivered (the text at a token a byte, the most a byte-level
// tokenizer makes), however small its reservation: cut by the client or by
// the upstream, plain or gzip; each counted in charges_lost_total by its
// reason.
func TestLLMCutStream(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	policy := map[string]any{"name": "llm_tokens", "key": "{http.rate_limit.bearer}", "rate": "100000/240h",
		"cost": "{http.request.header.X-Max-Tokens}", "max_cost": 8000, "settle": map[string]any{"from": "openai"}}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), proxyTo(up.addr))
	body := llmFormats[1].body
	const words, half = 80, 200 // 400 bytes of text, cut after 200: 50 tokens
	for i, tc := range []struct {
		name, coding, by, reason string
	}{
		{"cut by the client", "identity", "client", "client_gone"},
		{"cut by the client, gzip", "gzip", "client", "client_gone"},
		{"cut by the upstream", "identity", "upstream", "no_usage"},
		{"cut by the upstream, gzip", "gzip", "upstream", "no_usage"},
	} {
		key := "sk-cut-" + strconv.Itoa(i)
		before := lostCount(t, in, "llm_tokens", tc.reason)
		if tc.by == "client" {
			if read := cutStream(t, in.URL+"/v1/chat/completions", key, body, tc.coding, half, "X-Max-Tokens", "1", "X-Words", strconv.Itoa(words)); read != half {
				t.Fatalf("%s: read %d bytes of text", tc.name, read)
			}
		} else {
			req, _ := http.NewRequest("POST", in.URL+"/v1/chat/completions", strings.NewReader(body))
			for k, v := range map[string]string{"Authorization": "Bearer " + key, "Accept-Encoding": tc.coding, "X-Cut": strconv.Itoa(half), "X-Cut-By": "upstream", "X-Max-Tokens": "1", "X-Words": strconv.Itoa(words)} {
				req.Header.Set(k, v)
			}
			if resp, err := newClient().Do(req); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
		}
		estimate := int64(half)
		got := 100000 - bucketTokens(t, in, "llm_tokens", key)
		if tc.by == "client" {
			got = 100000 - cutTokens(t, in, "llm_tokens", key, 100000-estimate)
		}
		lost := lostCount(t, in, "llm_tokens", tc.reason) - before
		t.Logf("%s after %d of %d bytes of text: reserved 1, charged %d (the estimate %d); lost{reason=%s} +%v", tc.name, half, words*5, got, estimate, tc.reason, lost)
		if got < estimate {
			t.Errorf("%s: charged %d, less than the %d its %d bytes of text imply", tc.name, got, estimate, half)
		}
		if lost != 1 {
			t.Errorf("%s: charges_lost_total{reason=%q} rose by %v, want 1", tc.name, tc.reason, lost)
		}
	}
}

// lostCount reads caddy_rate_limit_charges_lost_total{policy, reason}.
func lostCount(t *testing.T, in *instance, policy, reason string) float64 {
	t.Helper()
	mfs, _ := scrape(t, in)
	mf := mfs["caddy_rate_limit_charges_lost_total"]
	if mf == nil {
		return 0
	}
	for _, m := range mf.GetMetric() {
		labels := map[string]string{}
		for _, l := range m.GetLabel() {
			labels[l.GetName()] = l.GetValue()
		}
		if labels["policy"] == policy && labels["reason"] == reason {
			return m.GetCounter().GetValue()
		}
	}
	return 0
}

// TestLLMCheapEscape: the scenario. On a budget of 2,000 tokens,
// an honest client reserving 125 and reading its streams to their usage
// (125 tokens each) gets 16; a client reserving 2 and cutting every
// stream after half its text, which got 1,000 when a cut stream kept only
// its reservation, now gets no more text for its budget than the honest
// one: each cut stream is charged the half it read, at a token a byte.
func TestLLMCheapEscape(t *testing.T) {
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	policy := map[string]any{"name": "llm_tokens", "key": "{http.rate_limit.bearer}", "rate": "2000/240h", "burst": 2000,
		"cost": "{http.request.header.X-Max-Tokens}", "max_cost": 200, "settle": map[string]any{"from": "openai"}}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), proxyTo(up.addr))
	body := llmFormats[1].body
	const words = 100 // 500 bytes of text: 125 output tokens
	honest, honestText := 0, 0
	for range 100 {
		r := llmPost(t, newClient(), in.URL+"/v1/chat/completions", "sk-honest", body, "X-Max-Tokens", "125", "X-Words", strconv.Itoa(words), "X-Prompt-Tokens", "0")
		if r.status != 200 {
			break
		}
		honest++
		honestText += strings.Count(string(r.body), `"content":"word`) * 20
	}
	for _, coding := range []string{"identity", "gzip"} {
		key := "sk-cutter-" + coding
		cutter, cutterText, charged := 0, 0, int64(0)
		for range 1000 {
			// Half the text: 260 of 500 bytes (13 events of 20), 65 tokens.
			read := cutStream(t, in.URL+"/v1/chat/completions", key, body, coding, words*5/2, "X-Max-Tokens", "2", "X-Words", strconv.Itoa(words))
			if read < 0 {
				break
			}
			cutter++
			cutterText += read
			charged += max(2, int64(read))
			// The next request is decided once this one's charge is made,
			// when Caddy has noticed the cut.
			if got := 2000 - cutTokens(t, in, "llm_tokens", key, 2000-charged); got != charged {
				t.Fatalf("%s: after %d cut streams of %d bytes of text, %d charged, want %d", coding, cutter, read, got, charged)
			}
		}
		t.Logf("honest: %d streams, %d bytes of text; cutting after half (%s): %d streams, %d bytes of text (the issue measured 1,000 when a cut stream kept its reservation)",
			honest, honestText, coding, cutter, cutterText)
		if cutterText > honestText+words*5 {
			t.Errorf("%s: cutting streams got %d bytes of text, the honest client %d", coding, cutterText, honestText)
		}
		if cutter > 2*honest+1 {
			t.Errorf("%s: %d cut streams against %d read whole", coding, cutter, honest)
		}
	}
	if honest != 16 {
		t.Errorf("the honest client got %d streams of 125 tokens from 2,000, want 16", honest)
	}
}

// TestLLMAcrossInstances: 4 instances, 16 concurrent clients sending the
// SDKs' requests (max_tokens 100), the upstream using up to that: the
// usage settled stays within burst + rate × elapsed (+ one reservation),
// for OpenAI's chat stream in gzip, the Responses API's JSON in zstd and
// Anthropic's stream in br.
func TestLLMAcrossInstances(t *testing.T) {
	const run = 2 * time.Second
	srv := testredis.Start(t)
	up := startLLMUpstream(t)
	fleets := 0
	for _, tc := range []struct {
		format llmFormat
		coding string
	}{
		{llmFormat{"openai chat SSE", "/v1/chat/completions", true, "openai_tokens", `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"Say hello"}],"max_tokens":100,"stream":true,"stream_options":{"include_usage":true}}`, 6}, "gzip"},
		{llmFormat{"openai responses JSON", "/v1/responses", false, "openai_tokens", `{"model":"gpt-4.1","input":"Say hello","max_output_tokens":100}`, 4}, "zstd"},
		{llmFormat{"anthropic SSE", "/v1/messages", true, "anthropic_tokens", `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"user","content":"Say hello"}],"stream":true}`, 8}, "br"},
	} {
		t.Run(tc.format.name+", "+tc.coding, func(t *testing.T) {
			fleets++
			var fleet []*instance
			policies := llmPolicies(nil)
			for _, p := range policies {
				p["rate"], p["burst"], p["max_cost"] = "1000/1s", 2000, 200
			}
			redis := map[string]any{"addresses": []string{srv.Addr}, "key_prefix": "llm" + strconv.Itoa(fleets) + ":"}
			for range 4 {
				fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0, "redis": redis}, policies...), proxyTo(up.addr)))
			}
			n0, sum0 := up.total()
			var admitted, denied, admittedTime atomic.Int64 // admittedTime: ns the clients spent in admitted requests
			var wg sync.WaitGroup
			start := time.Now()
			client := newClient()
			for c := range 16 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for i := 0; time.Since(start) < run; i++ {
						// Output up to the 100 asked for (words of 5 bytes: 1.25
						// tokens), the prompt 3 of the 5 to 8 reserved for it.
						req, _ := http.NewRequest("POST", fleet[(c+i)%len(fleet)].URL+tc.format.path, strings.NewReader(tc.format.body))
						for k, v := range map[string]string{"Authorization": "Bearer tenant", "X-Api-Key": "tenant", "Accept-Encoding": tc.coding,
							"X-Words": strconv.Itoa(1 + rand.IntN(80)), "X-Prompt-Tokens": "3"} {
							req.Header.Set(k, v)
						}
						sent := time.Now()
						resp, err := client.Do(req)
						if err != nil {
							t.Error(err)
							return
						}
						_, _ = io.Copy(io.Discard, resp.Body)
						resp.Body.Close()
						if resp.StatusCode == 200 {
							admitted.Add(1)
							admittedTime.Add(int64(time.Since(sent)))
						} else {
							denied.Add(1)
							time.Sleep(10 * time.Millisecond)
						}
					}
				}()
			}
			wg.Wait()
			elapsed := time.Since(start)
			n1, sum1 := up.total()
			settled, budget := float64(sum1-sum0), 2000+1000*elapsed.Seconds()
			busy := float64(admittedTime.Load()) / float64(16*elapsed)
			t.Logf("%d admitted (%d reached the upstream), %d denied, %.0f tokens used of a budget of %.0f (%.2f); the clients' time in admitted requests %.0f%%",
				admitted.Load(), n1-n0, denied.Load(), settled, budget, settled/budget, 100*busy)
			if settled > budget+108 {
				t.Errorf("%.0f tokens used, more than the budget %.0f + one reservation", settled, budget)
			}
			// Reservations not given back would leave the bucket empty: the
			// clients would spend their time denied, and the budget unused.
			// On a machine so busy that each admitted request takes long
			// (its reservation held all that time), the clients spend their
			// time in admitted requests instead: the budget is then limited by
			// what 16 clients can send, not by the refunds.
			if settled < 0.7*budget && busy < 0.7 {
				t.Errorf("%.0f tokens used of %.0f, %d denied, the clients in admitted requests %.0f%% of the time: the refunds did not come back",
					settled, budget, denied.Load(), 100*busy)
			}
		})
	}
}

// TestLLMUnreadableAndAcceptEncoding: a body the limiter cannot read
// (corrupt gzip) leaves the reservation standing, is counted
// (charges_lost_total{reason="unreadable"}) each time and logged once;
// and the upstream is asked only for the codings whose usage is read.
func TestLLMUnreadableAndAcceptEncoding(t *testing.T) {
	srv := testredis.Start(t)
	var seen atomic.Value
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	corrupt := bytes.Repeat([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0xee}, 20)
	bad := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Store(r.Header.Get("Accept-Encoding"))
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Encoding", "gzip")
		_, _ = w.Write(corrupt)
	})}
	go func() { _ = bad.Serve(l) }()
	defer bad.Close()
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, llmPolicies(nil)...), proxyTo(l.Addr().String()))
	client := newClient()
	for i := range 5 {
		r := llmPost(t, client, in.URL+"/v1/chat/completions", "sk-bad", llmFormats[0].body, "Accept-Encoding", "gzip, compress, dcz;q=0.5, *;q=0.1")
		if r.status != 200 || !bytes.Equal(r.body, corrupt) {
			t.Fatalf("request %d: %d, body unchanged %v", i, r.status, bytes.Equal(r.body, corrupt))
		}
	}
	if got := seen.Load(); got != "gzip" {
		t.Errorf("the upstream was asked for %q, want gzip alone", got)
	}
	// Each response's charge is made, and counted, before its end.
	if got := lostCount(t, in, "openai_tokens", "unreadable"); got != 5 {
		t.Errorf("charges_lost_total{reason=unreadable} %v, want 5", got)
	}
	if got := 100000 - bucketTokens(t, in, "openai_tokens", "sk-bad"); got != 5*(256+6) {
		t.Errorf("%d tokens charged, want the 5 reservations of 262 standing", got)
	}
	var lines []string
	for _, line := range strings.Split(logText(t, in), "\n") {
		if strings.Contains(line, "could not be read") {
			lines = append(lines, line)
		}
	}
	if len(lines) != 1 || strings.Contains(lines[0], "sk-bad") {
		t.Fatalf("%d log lines about the unreadable body, want 1 without the key: %q", len(lines), lines)
	}
	t.Logf("logged once for 5 responses: %s", lines[0])
}

// TestLLMBearerKey: clients writing their one credential differently
// ("Bearer x", "bearer x", "Bearer   x ") share its bucket; another
// credential has its own.
func TestLLMBearerKey(t *testing.T) {
	srv := testredis.Start(t)
	policy := map[string]any{"name": "per_key", "key": "{http.rate_limit.bearer}", "rate": "10/1h"}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), respond())
	for _, auth := range []string{"Bearer sk-x", "bearer sk-x", "BEARER   sk-x ", "Bearer sk-y"} {
		if r := get(t, in.URL+"/", "Authorization", auth); r.status != 200 {
			t.Fatalf("%q: %d", auth, r.status)
		}
	}
	if x, y := bucketTokens(t, in, "per_key", "sk-x"), bucketTokens(t, in, "per_key", "sk-y"); x != 7 || y != 9 {
		t.Fatalf("sk-x has %d left, sk-y %d: want 7 (three ways of writing it, one bucket) and 9", x, y)
	}
}
