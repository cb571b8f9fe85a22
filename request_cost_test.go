package ratelimit

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// TestRequestBodyOf: nothing is read twice: a second policy takes the
// first reading, and the upstream reads the body byte for byte.
func TestRequestBodyOf(t *testing.T) {
	rs := &requestState{}
	r := httptest.NewRequest("POST", "/", strings.NewReader(llmtest.ChatRequest))
	first, second := requestBodyOf(r, rs), requestBodyOf(r, rs)
	if first != second || first.Reservation(llm.UnitWeights, 8000) != 50+11 {
		t.Errorf("read twice: %+v, %+v", first, second)
	}
	if got, _ := io.ReadAll(r.Body); !bytes.Equal(got, []byte(llmtest.ChatRequest)) {
		t.Errorf("after two policies, the upstream read %q", got)
	}
}

// TestServeHTTPOutputs: `cost openai` reserves every answer a request asks
// for (n = 128 reserves 128 ceilings: 32 such calls no longer fit in a
// burst of 50,000 at once), and `unbounded refuse` answers 400, before the
// upstream, a request without a ceiling or asking for a background
// response; `unbounded max` (the default) reserves max for them.
func TestServeHTTPOutputs(t *testing.T) {
	newHandler := func(unbounded string) *Handler {
		return testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm_tokens_" + unbounded, Key: "{http.rate_limit.bearer}", Rate: "50000/24h",
			Cost: "openai", MaxCost: 8000, Unbounded: unbounded, Settle: &Settle{From: settleOpenAI}}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	}
	h := newHandler("")
	n128 := `{"model":"gpt-4o-mini","max_tokens":50,"n":128,"messages":[{"role":"user","content":"Hi"}]}`
	admitted := 0
	for range 32 {
		x := serveLLM(t, h, n128, func(w http.ResponseWriter, r *http.Request) {
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write([]byte(`{"choices":[]}`)) // no usage: the reservation stands (its estimate)
		}, "Authorization", "Bearer sk-n128")
		if x.status == 200 {
			admitted++
		}
	}
	if admitted != 50000/(2+128*50) { // 7 of 32: 6,402 tokens each
		t.Errorf("32 calls of n = 128, max_tokens 50: %d admitted, want %d", admitted, 50000/(2+128*50))
	}
	refuse := newHandler(unboundedRefuse)
	for _, body := range []string{
		`{"model":"o3","input":"Think hard","reasoning":{"effort":"high"}}`,
		`{"model":"o3","input":"Think hard","max_output_tokens":100,"background":true}`,
	} {
		reached := false
		x := serveLLM(t, refuse, body, func(w http.ResponseWriter, r *http.Request) { reached = true }, "Authorization", "Bearer sk-unbounded")
		if x.status != 400 || reached || !strings.Contains(string(x.body), "max_tokens") {
			t.Errorf("unbounded refuse, %s: %d (upstream reached %v) %s", body, x.status, reached, x.body)
		}
		x = serveLLM(t, newHandler(unboundedMax), body, func(w http.ResponseWriter, r *http.Request) {}, "Authorization", "Bearer sk-unbounded")
		if x.status != 200 || x.remaining != 50000-8000 {
			t.Errorf("unbounded max, %s: %d, %d left; want 200 and max reserved (42000)", body, x.status, x.remaining)
		}
	}
	if x := serveLLM(t, refuse, n128, func(w http.ResponseWriter, r *http.Request) {}, "Authorization", "Bearer sk-bounded"); x.status != 200 {
		t.Errorf("unbounded refuse, a request with a ceiling: %d", x.status)
	}
}
