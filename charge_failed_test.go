package ratelimit

import (
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestServeHTTPProviderFailure: a provider's error without usage (a 400
// for a prompt too long, a 429, a 500, a 529) and Caddy's own 502 or 504
// when the provider cannot be reached give the whole reservation back,
// however large the prompt (the 1 MB prompt charged a million
// tokens); an error that reports usage is settled as any; a 200 without
// usage keeps the estimate of what it delivered. The WARN names the
// status.
func TestServeHTTPProviderFailure(t *testing.T) {
	prompt := `{"model":"gpt-4o","max_tokens":50,"messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}]}`
	core, logs := observer.New(zap.WarnLevel)
	for _, tc := range []struct {
		name    string
		body    string
		status  int   // the upstream's; 0: Caddy's own error (err)
		err     error // what the handler chain returns
		answer  string
		charged int64
	}{
		{"400, context too long, a 1 MB prompt", prompt, 400, nil, `{"error":{"message":"This model's maximum context length is 128000 tokens."}}`, 0},
		{"429 from the provider", `{"max_tokens":100,"messages":[{"role":"user","content":"hi"}]}`, 429, nil, `{"error":{"type":"rate_limit_exceeded"}}`, 0},
		{"500", `{"max_tokens":100,"messages":[]}`, 500, nil, `{"error":{}}`, 0},
		{"529 overloaded (Anthropic)", `{"max_tokens":100,"messages":[]}`, 529, nil, `{"type":"error","error":{"type":"overloaded_error"}}`, 0},
		{"Caddy's 502: the provider down", `{"max_tokens":100,"messages":[]}`, 0, caddyhttp.Error(http.StatusBadGateway, errors.New("dial tcp: connection refused")), "", 0},
		{"Caddy's 504: the provider not reached in time", `{"max_tokens":100,"messages":[]}`, 0, caddyhttp.Error(http.StatusGatewayTimeout, &net.OpError{Op: "dial", Err: errors.New("i/o timeout")}), "", 0},
		// A 504 waiting for the answer: the provider may be generating, and
		// billing: the estimate stands (its ceiling, at least the reservation).
		{"Caddy's 504: the answer too slow", `{"max_tokens":100,"messages":[]}`, 0, caddyhttp.Error(http.StatusGatewayTimeout, &net.OpError{Op: "read", Err: errors.New("i/o timeout")}), "", 100},
		{"an error reporting usage is settled", `{"max_tokens":100,"messages":[]}`, 400, nil, `{"error":{},"usage":{"total_tokens":7}}`, 7},
		{"a 200 without usage keeps the estimate", `{"max_tokens":100,"messages":[]}`, 200, nil, `{"choices":[]}`, 100}, // its ceiling: the body holds no prompt text
	} {
		h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm_tokens", Key: "{http.rate_limit.bearer}", Rate: "100000/24h",
			Burst: 2_000_000, Cost: "openai", MaxCost: 2_000_000, Settle: &Settle{From: settleOpenAI}}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		h.logger = zap.New(core)
		x := serveLLMError(t, h, tc.body, func(w http.ResponseWriter, r *http.Request) error {
			if tc.err != nil {
				return tc.err
			}
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(tc.status)
			_, _ = w.Write([]byte(tc.answer))
			return nil
		}, "Authorization", "Bearer sk-failed")
		if got := 2_000_000 - x.remaining; got != tc.charged {
			t.Errorf("%s: charged %d, want %d", tc.name, got, tc.charged)
		}
	}
	var lines []string
	for _, e := range logs.All() {
		lines = append(lines, e.Message)
	}
	all := strings.Join(lines, "\n")
	for _, want := range []string{"answered 400 with no usage: its reservation was given back", "answered 502 with no usage", "answered 200 with no usage: charged the estimate"} {
		if !strings.Contains(all, want) {
			t.Errorf("no WARN says %q; logged:\n%s", want, all)
		}
	}
}
