package ratelimit

import (
	"bytes"
	"context"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/klauspost/compress/zstd"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// llmExchange is one request through a handler to an upstream, as the
// client and the upstream saw it.
type llmExchange struct {
	status    int
	header    http.Header
	body      []byte
	remaining int64 // {http.rate_limit.remaining} once the response is charged
	upstream  []byte
	panicked  any
}

// serveLLM sends a POST with body and the header pairs through h to
// upstream, which is handed the request body as it arrived.
func serveLLM(t *testing.T, h *Handler, body string, upstream func(w http.ResponseWriter, r *http.Request), header ...string) (x llmExchange) {
	t.Helper()
	return serveLLMError(t, h, body, func(w http.ResponseWriter, r *http.Request) error {
		upstream(w, r)
		return nil
	}, header...)
}

// serveLLMError is serveLLM with an upstream that may fail as Caddy's
// reverse_proxy does, returning an error without writing (a 502, a 504).
func serveLLMError(t *testing.T, h *Handler, body string, upstream func(w http.ResponseWriter, r *http.Request) error, header ...string) (x llmExchange) {
	t.Helper()
	r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	repl := caddy.NewReplacer()
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
	r = r.WithContext(ctx)
	w := httptest.NewRecorder()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		x.upstream, _ = io.ReadAll(r.Body)
		r.Body = io.NopCloser(bytes.NewReader(x.upstream)) // for the upstream to read
		return upstream(w, r)
	})
	func() {
		defer func() { x.panicked = recover() }()
		_ = h.ServeHTTP(w, r, next)
	}()
	x.status, x.header, x.body = w.Code, w.Header(), w.Body.Bytes()
	v, _ := repl.GetString("http.rate_limit.remaining")
	x.remaining, _ = strconv.ParseInt(v, 10, 64)
	return x
}

// llmPolicy reserves from the body (cost openai, at most 8,000) of a
// budget of 10,000 tokens that does not refill during a test.
func llmPolicy(settle *Settle) *Policy {
	return &Policy{Name: "llm_tokens", Key: "{http.rate_limit.bearer}", Rate: "10000/24h", Cost: "openai", MaxCost: 8000, Settle: settle}
}

// answering writes a body with the headers.
func answering(body []byte, header ...string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		_, _ = w.Write(body)
	}
}

// TestServeHTTPSettleLLM: `cost openai` reserves max_tokens and the
// prompt's estimate from the body, which reaches the upstream byte for
// byte; `settle openai` and `settle anthropic` settle the usage of JSON
// bodies and streams, compressed or not, weighed or not: the bucket holds
// the budget less the reported usage.
func TestServeHTTPSettleLLM(t *testing.T) {
	w14 := &SettleWeights{Input: ptr(1.0), Output: ptr(4.0)}
	for _, tc := range []struct {
		name   string
		settle *Settle
		ct     string
		body   string
		usage  int64
	}{
		{"openai chat JSON", &Settle{From: settleOpenAI}, "application/json", llmtest.OpenAIChatJSON, 29},
		{"openai chat SSE", &Settle{From: settleOpenAI}, "text/event-stream", llmtest.OpenAIChatSSE, 12},
		{"openai chat SSE, weighed", &Settle{From: settleOpenAI, Weights: w14}, "text/event-stream", llmtest.OpenAIChatSSE, 9 + 4*3},
		{"openai responses JSON", &Settle{From: settleOpenAI}, "application/json", llmtest.OpenAIResponsesJSON, 123},
		{"openai responses SSE", &Settle{From: settleOpenAI}, "text/event-stream", llmtest.OpenAIResponsesSSE, 48},
		{"anthropic JSON", &Settle{From: settleAnthropic}, "application/json", llmtest.AnthropicJSON, 18},
		{"anthropic SSE", &Settle{From: settleAnthropic}, "text/event-stream", llmtest.AnthropicSSE, 40},
		{"anthropic SSE, weighed", &Settle{From: settleAnthropic, Weights: w14}, "text/event-stream", llmtest.AnthropicSSE, 25 + 4*15},
	} {
		for _, coding := range llmtest.Codings {
			h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{llmPolicy(tc.settle)}}, newMemoryStore((&clock{t: 1000 * sec}).now))
			encoded := llmtest.Encode(t, coding, tc.body, 100)
			up := answering(encoded, "Content-Type", tc.ct, "Content-Encoding", coding)
			x := serveLLM(t, h, llmtest.ChatRequest, up, "Authorization", "Bearer sk-1", "Accept-Encoding", "gzip, deflate, br, zstd")
			reserved := int64(50 + 11)
			if tc.settle.Weights != nil {
				reserved = 11 + 4*50
			}
			if x.status != 200 || !bytes.Equal(x.body, encoded) || string(x.upstream) != llmtest.ChatRequest {
				t.Fatalf("%s, %s: %d, the client got the body unchanged %v, the upstream the request's %v", tc.name, coding, x.status, bytes.Equal(x.body, encoded), string(x.upstream) == llmtest.ChatRequest)
			}
			// The RateLimit field went out with the reservation; the bucket
			// holds the usage once settled.
			if r := fields(t, x.header, "RateLimit")["llm_tokens"]["r"]; r != 10000-reserved || x.remaining != 10000-tc.usage {
				t.Errorf("%s, %s: RateLimit r=%d (want the reservation's %d), settled at %d left (want %d, a usage of %d)", tc.name, coding, r, 10000-reserved, x.remaining, 10000-tc.usage, tc.usage)
			}
		}
	}
}

func ptr[T any](v T) *T { return &v }

// TestServeHTTPCutStream: a stream cut before its usage (reverse_proxy
// panics with http.ErrAbortHandler when the client or the upstream cuts
// it) is charged what it delivered, its text at one token a byte (the
// most a byte-level tokenizer makes; internal/llm/cut_estimate.go) and the prompt's
// bytes, and never less than its reservation; a stream
// without a usage event (no include_usage) the same. Each is counted lost
// by its reason, and the upstream that sends no usage is logged once.
func TestServeHTTPCutStream(t *testing.T) {
	text := strings.Repeat("word ", 80) // 400 bytes: 100 tokens
	var stream strings.Builder
	for i := 0; i < len(text); i += 20 {
		stream.WriteString("data: {\"choices\":[{\"delta\":{\"content\":\"" + text[i:i+20] + "\"}}]}\n\n")
	}
	half := stream.String()[:stream.Len()/2]
	halfText := int64(strings.Count(half, "word ") * 5)
	core, logs := observer.New(zap.WarnLevel)
	for _, tc := range []struct {
		name    string
		reserve string // X-Max-Tokens, the header cost
		body    string
		cut     bool
		gone    bool // the client's context is cancelled
		charged int64
		reason  int
	}{
		{"cut by the upstream, a tiny reservation", "1", half, true, false, halfText, lostNoUsage},
		{"cut by the client, a tiny reservation", "1", half, true, true, halfText, lostClientGone},
		{"cut, a reservation above the estimate", "500", half, true, false, 500, lostNoUsage},
		{"no usage event", "1", stream.String(), false, false, 400, lostNoUsage},
		{"no usage event, gzip", "1", stream.String(), false, false, 400, lostNoUsage},
	} {
		h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm_tokens", Key: "{http.rate_limit.bearer}", Rate: "10000/24h",
			Cost: "{http.request.header.X-Max-Tokens}", MaxCost: 8000, Settle: &Settle{From: settleOpenAI}}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		h.logger = zap.New(core)
		body, coding := []byte(tc.body), "identity"
		if strings.HasSuffix(tc.name, "gzip") {
			body, coding = llmtest.Encode(t, "gzip", tc.body, 0), "gzip"
		}
		var cancel context.CancelFunc
		up := func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "text/event-stream")
			w.Header().Set("Content-Encoding", coding)
			_, _ = w.Write(body)
			if tc.gone {
				cancel()
			}
			if tc.cut {
				panic(http.ErrAbortHandler)
			}
		}
		lostBefore := counterValue(h.Policies[0].after.lost[tc.reason])
		x := serveLLMCancel(t, h, up, &cancel, "Authorization", "Bearer sk-cut", "X-Max-Tokens", tc.reserve)
		if tc.cut != (x.panicked == http.ErrAbortHandler) {
			t.Fatalf("%s: panicked %v: the handler must let reverse_proxy's abort go on", tc.name, x.panicked)
		}
		if x.remaining != 10000-tc.charged {
			t.Errorf("%s: %d left, want %d (charged %d)", tc.name, x.remaining, 10000-tc.charged, tc.charged)
		}
		if got := counterValue(h.Policies[0].after.lost[tc.reason]) - lostBefore; got != 1 {
			t.Errorf("%s: %v counted lost as %s, want 1", tc.name, got, lostReasonNames[tc.reason])
		}
		t.Logf("%s: reserved %s, charged %d", tc.name, tc.reserve, tc.charged)
	}
	// One line per policy and reason per minute at most: the first
	// handler's no_usage, the others' first each (every handler is its own
	// config).
	for _, e := range logs.All() {
		if !strings.Contains(e.Message, "no usage") {
			t.Errorf("logged %q", e.Message)
		}
	}
}

// serveLLMCancel is serveLLM with a context the upstream can cancel, as a
// client going away does.
func serveLLMCancel(t *testing.T, h *Handler, upstream func(http.ResponseWriter, *http.Request), cancel *context.CancelFunc, header ...string) (x llmExchange) {
	t.Helper()
	r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(llmtest.ChatRequest))
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	repl := caddy.NewReplacer()
	ctx, c := context.WithCancel(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
	*cancel = c
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
	r = r.WithContext(ctx)
	w := httptest.NewRecorder()
	next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		upstream(w, r)
		return nil
	})
	func() {
		defer func() { x.panicked = recover() }()
		_ = h.ServeHTTP(w, r, next)
	}()
	x.status, x.header, x.body = w.Code, w.Header(), w.Body.Bytes()
	v, _ := repl.GetString("http.rate_limit.remaining")
	x.remaining, _ = strconv.ParseInt(v, 10, 64)
	return x
}

// TestLostLogged: a body that cannot be read is counted each time and
// logged once per minute per policy, with why; never per request.
func TestLostLogged(t *testing.T) {
	core, logs := observer.New(zap.WarnLevel)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{llmPolicy(&Settle{From: settleOpenAI})}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	h.logger = zap.New(core)
	corrupt := bytes.Repeat([]byte{0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 0, 0xff, 0xff}, 10)
	for range 20 {
		x := serveLLM(t, h, llmtest.ChatRequest, answering(corrupt, "Content-Type", "application/json", "Content-Encoding", "gzip"), "Authorization", "Bearer sk-2")
		if x.status != 200 || !bytes.Equal(x.body, corrupt) {
			t.Fatalf("%d, body changed %v", x.status, !bytes.Equal(x.body, corrupt))
		}
	}
	if got := counterValue(h.Policies[0].after.lost[lostUnreadable]); got != 20 {
		t.Errorf("%v counted unreadable, want 20", got)
	}
	if logs.Len() != 1 || !strings.Contains(logs.All()[0].Message, "could not be read") {
		t.Fatalf("logged %d lines, want 1: %+v", logs.Len(), logs.All())
	}
	t.Logf("logged once: %s %v", logs.All()[0].Message, logs.All()[0].ContextMap())
	// The reservation stood each time: 61 × 20.
	if x := serveLLM(t, h, `{"max_tokens":1}`, answering(nil), "Authorization", "Bearer sk-2"); x.remaining != 10000-61*20-1 {
		t.Errorf("%d left after 20 unreadable bodies, want %d", x.remaining, 10000-61*20-1)
	}
}

// TestServeHTTPTrailerDeclared: on TE: trailers, a settle known only after
// the body declares the RateLimit trailer (and, over HTTP/1.1, drops the
// upstream's Content-Length so the body is chunked); a response that is
// never written, or a handler with headers off, declares nothing. The
// upstream is asked only for the codings whose usage is read.
func TestServeHTTPTrailerDeclared(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{llmPolicy(&Settle{From: settleOpenAI})}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	var asked []string
	up := func(w http.ResponseWriter, r *http.Request) {
		asked = r.Header.Values("Accept-Encoding")
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(llmtest.OpenAIChatJSON)))
		_, _ = io.WriteString(w, llmtest.OpenAIChatJSON)
	}
	x := serveLLM(t, h, llmtest.ChatRequest, up, "Authorization", "Bearer sk-t", "TE", "trailers", "Accept-Encoding", "compress")
	if x.header.Get("Trailer") != "RateLimit" || x.header.Get("Content-Length") != "" || asked != nil {
		t.Errorf("Trailer %q, Content-Length %q, the upstream asked for %q: want RateLimit declared, no length, no Accept-Encoding", x.header.Get("Trailer"), x.header.Get("Content-Length"), asked)
	}
	// The header map holds the settled RateLimit when the handler returns:
	// what net/http sends as the declared trailer.
	if r := fields(t, x.header, "RateLimit")["llm_tokens"]["r"]; r != 10000-29 {
		t.Errorf("RateLimit at the end %d, want the settled %d", r, 10000-29)
	}
	x = serveLLM(t, h, llmtest.ChatRequest, up, "Authorization", "Bearer sk-t2", "Accept-Encoding", "br;q=1, dcz, gzip")
	if x.header.Get("Trailer") != "" || strings.Join(asked, ",") != "br;q=1, gzip" {
		t.Errorf("without TE: Trailer %q; the upstream asked for %q", x.header.Get("Trailer"), asked)
	}
	off := testHandler(t, &Handler{Jitter: jitterOff(), Headers: "off", Policies: []*Policy{llmPolicy(&Settle{From: settleOpenAI})}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	x = serveLLM(t, off, llmtest.ChatRequest, up, "Authorization", "Bearer sk-t", "TE", "trailers")
	if x.header.Get("Trailer") != "" || x.header.Get("RateLimit") != "" {
		t.Errorf("headers off: Trailer %q, RateLimit %q", x.header.Get("Trailer"), x.header.Get("RateLimit"))
	}
	x = serveLLM(t, off, llmtest.ChatRequest, func(http.ResponseWriter, *http.Request) {}, "Authorization", "Bearer sk-t", "TE", "trailers")
	if x.header.Get("Trailer") != "" || x.header.Get("RateLimit") != "" {
		t.Errorf("headers off, nothing written: Trailer %q, RateLimit %q", x.header.Get("Trailer"), x.header.Get("RateLimit"))
	}
}

// TestServeHTTPDenseCut: a stream of a dense prompt (code, digits, CJK:
// about a token a byte), cut before its usage, is charged at least what
// reading it would have cost (40,010), not its bytes at 4 a token
// (10,022); through the handler, with `cost openai`.
func TestServeHTTPDenseCut(t *testing.T) {
	prompt := strings.Repeat("7", 40000-len("gpt-4o-mini")-len("user"))
	body := `{"model":"gpt-4o-mini","messages":[{"role":"user","content":"` + prompt + `"}],"max_tokens":10,"stream":true,"stream_options":{"include_usage":true}}`
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm_tokens", Key: "{http.rate_limit.bearer}", Rate: "100000/24h",
		Cost: "openai", MaxCost: 50000, Settle: &Settle{From: settleOpenAI}}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	x := serveLLM(t, h, body, func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = w.Write([]byte("data: {\"choices\":[{\"delta\":{\"content\":\"12345678\"}}]}\n\n"))
		panic(http.ErrAbortHandler)
	}, "Authorization", "Bearer sk-dense")
	if charged := 100000 - x.remaining; x.panicked != http.ErrAbortHandler || charged < 40010 {
		t.Fatalf("a dense prompt of 40,000 bytes cut after 8 bytes of answer: charged %d, want at least 40,010 (reading it costs 40,000 + up to 10)", charged)
	}
}

// TestServeHTTPCompressionBomb: a body that decodes to thousands of times
// its size (a compression bomb: the decoder stops) keeps its reservation,
// as the docs say, and is counted unreadable: the text decoded before it
// stopped is not an estimate.
func TestServeHTTPCompressionBomb(t *testing.T) {
	var bomb bytes.Buffer
	zw, _ := zstd.NewWriter(&bomb)
	_, _ = zw.Write([]byte(`{"choices":[{"message":{"content":"`))
	_, _ = zw.Write(bytes.Repeat([]byte("a"), 32<<20))
	_ = zw.Close()
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm_tokens", Key: "{http.rate_limit.bearer}", Rate: "100000/24h",
		Cost: "openai", MaxCost: 1000, Settle: &Settle{From: settleOpenAI}}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	lost := counterValue(h.Policies[0].after.lost[lostUnreadable])
	x := serveLLM(t, h, `{"model":"m","messages":[{"role":"user","content":"bomb"}],"max_tokens":990}`,
		answering(bomb.Bytes(), "Content-Type", "application/json", "Content-Encoding", "zstd"), "Authorization", "Bearer sk-bomb")
	reserved := int64(990 + llm.TokensOf(int64(len("m")+len("user")+len("bomb"))))
	if charged := 100000 - x.remaining; charged != reserved || counterValue(h.Policies[0].after.lost[lostUnreadable])-lost != 1 {
		t.Fatalf("a compression bomb: charged %d, want its reservation %d; counted unreadable %v", charged, reserved, counterValue(h.Policies[0].after.lost[lostUnreadable])-lost)
	}
}
