package ratelimit

import (
	"bytes"
	"net/http"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
)

// TestCutEstimate: a response without usage is estimated at one token per
// byte of the prompt, or, for an Anthropic stream past its message_start,
// the input it reported; and the answer at the ceiling the request set
// (which the provider enforces), or without one the text delivered at a
// token a byte; weighed as the usage.
func TestCutEstimate(t *testing.T) {
	dense := requestBody{ok: true, maxTokens: 10, promptBytes: 40000, promptTokens: 10000}
	anthropic := &Settle{From: settleAnthropic}
	openai := &Settle{From: settleOpenAI}
	weighed := &Settle{From: settleAnthropic, Weights: &SettleWeights{Input: ptr(1.0), Output: ptr(5.0), CacheRead: ptr(0.1)}}
	for _, s := range []*Settle{anthropic, openai, weighed} {
		if err := s.check(); err != nil {
			t.Fatal(err)
		}
	}
	started := scanAll("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":40000,\"cache_read_input_tokens\":10011,\"output_tokens\":1}}}\n\n"+
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\""+strings.Repeat("x", 400)+"\"}}\n\n", true, 1<<20)
	cut := scanAll("data: {\"choices\":[{\"delta\":{\"content\":\""+strings.Repeat("x", 40)+"\"}}]}\n\n", true, 1<<20)
	for _, tc := range []struct {
		name  string
		s     *Settle
		body  requestBody
		found *scanFound
		want  int64
	}{
		{"openai, a dense prompt: its bytes, and max_tokens", openai, dense, &cut.found, 40000 + 10},
		{"no ceiling: the text", openai, requestBody{promptBytes: 100}, &cut.found, 100 + 40},
		{"a ceiling above the text", openai, requestBody{ok: true, maxTokens: 1000, promptBytes: 100}, &cut.found, 100 + 1000},
		{"anthropic past message_start: its input, cache reads at their weight", anthropic, dense, &started.found, 40000 + 10},
		{"anthropic weighed", weighed, requestBody{ok: true, maxTokens: 1000, promptBytes: 5}, &started.found, 40000 + 1002 + 5*1000},
		{"anthropic before message_start: the prompt's bytes", anthropic, dense, &cut.found, 40000 + 10},
	} {
		if got := cutEstimate(tc.s, tc.body, tc.found); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
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
	lost := counterValue(h.Policies[0].chargesLost[lostUnreadable])
	x := serveLLM(t, h, `{"model":"m","messages":[{"role":"user","content":"bomb"}],"max_tokens":990}`,
		answering(bomb.Bytes(), "Content-Type", "application/json", "Content-Encoding", "zstd"), "Authorization", "Bearer sk-bomb")
	reserved := int64(990 + tokensOf(int64(len("m")+len("user")+len("bomb"))))
	if charged := 100000 - x.remaining; charged != reserved || counterValue(h.Policies[0].chargesLost[lostUnreadable])-lost != 1 {
		t.Fatalf("a compression bomb: charged %d, want its reservation %d; counted unreadable %v", charged, reserved, counterValue(h.Policies[0].chargesLost[lostUnreadable])-lost)
	}
}
