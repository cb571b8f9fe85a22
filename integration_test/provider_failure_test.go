package integration_test

import (
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// A provider's failure costs nothing (issue 45, item 2): providers bill no
// request they refuse or fail, so a tenant is never locked out by their
// errors, and an SDK retrying them sees the provider's error every time.
// The policy is the docs' gateway's: 200,000 tokens an hour, burst 50,000,
// reserving at most 8,000.

// failingProvider answers every request with the status of its
// X-Provider-Status header (default 503) and an error body without usage,
// as providers do; it counts the requests it answered.
func failingProvider(t *testing.T) (addr string, answered *atomic.Int64) {
	t.Helper()
	answered = new(atomic.Int64)
	addr = serveLoopback(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		answered.Add(1)
		status := 503
		if v, err := strconv.Atoi(r.Header.Get("X-Provider-Status")); err == nil {
			status = v
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		fmt.Fprintf(w, `{"error":{"message":"the provider failed (%d)","type":"server_error","param":null,"code":null}}`, status)
	}))
	return addr, answered
}

// docsTokens is the docs' token policy.
func docsTokens() map[string]any {
	return sdkPolicy("openai_tokens", "openai", "200000/1h", 50000, 8000)
}

// TestProviderErrorRefunded: the 1 MB prompt answered 400 (context
// too long) leaves its key's bucket as it was, and the key's next call
// goes through at once (it was charged 1,000,063 tokens, its next call
// told to wait 18,392 s).
func TestProviderErrorRefunded(t *testing.T) {
	srv := testredis.Start(t)
	prov, _ := failingProvider(t)
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, docsTokens()), proxyTo(prov))
	c := newClient()
	post := func(body string, header ...string) (*http.Response, string) {
		req, _ := http.NewRequest("POST", in.URL+"/v1/chat/completions", strings.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk-big-prompt")
		req.Header.Set("Content-Type", "application/json")
		for i := 0; i+1 < len(header); i += 2 {
			req.Header.Set(header[i], header[i+1])
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		return resp, string(raw)
	}
	big := `{"model":"gpt-4o","max_tokens":63,"messages":[{"role":"user","content":"` + strings.Repeat("a", 1_000_000) + `"}]}`
	resp, _ := post(big, "X-Provider-Status", "400")
	charged := 50000 - bucketTokens(t, in, "openai_tokens", "sk-big-prompt")
	next, body := post(`{"model":"gpt-4o","max_tokens":10,"messages":[{"role":"user","content":"hi"}]}`, "X-Provider-Status", "200")
	t.Logf("a 1 MB prompt answered %d: charged %d tokens; the key's next call: %d, Retry-After %q, X-Should-Retry %q (%s)",
		resp.StatusCode, charged, next.StatusCode, next.Header.Get("Retry-After"), next.Header.Get("X-Should-Retry"), strings.TrimSpace(body))
	if resp.StatusCode != 400 {
		t.Fatalf("the provider's 400 came back as %d", resp.StatusCode)
	}
	if charged != 0 {
		t.Errorf("charged %d tokens for a request the provider refused, want 0", charged)
	}
	if next.StatusCode == 429 {
		t.Errorf("the key's next call was denied for its failed one: Retry-After %s", next.Header.Get("Retry-After"))
	}
}

// TestSDKProviderFailure: the official OpenAI SDK calling while the
// provider answers 503 (three attempts: its two retries) is charged
// nothing, every attempt reaches the provider and sees its 503, and the
// application gets the provider's error; the same with Caddy's own 502
// when the provider cannot be reached.
func TestSDKProviderFailure(t *testing.T) {
	srv := testredis.Start(t)
	prov, answered := failingProvider(t)
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, docsTokens()), proxyTo(prov))
	prompt := strings.Repeat("Summarise the incident report below in three lines. ", 1400) // 70 KB
	call := &sdkCall{ID: "during 503", APIKey: "sk-during-outage", Kind: "chat", Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 500,
		"messages": []any{map[string]any{"role": "user", "content": prompt}}}}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", Concurrency: 1, Calls: []*sdkCall{call}}, 60*time.Second)
	charged := 50000 - bucketTokens(t, in, "openai_tokens", "sk-during-outage")
	var statuses []int
	for _, h := range call.requests {
		statuses = append(statuses, h.answer.Status)
	}
	t.Logf("an SDK call during the provider's 503: attempts answered %v, the provider answered %d; charged %d tokens; the application got: %s",
		statuses, answered.Load(), charged, call.surfaced())
	if charged != 0 {
		t.Errorf("charged %d tokens for three failed attempts, want 0", charged)
	}
	if len(statuses) != 3 || answered.Load() != 3 {
		t.Errorf("attempts answered %v, %d reached the provider: want 3, all the provider's", statuses, answered.Load())
	}
	for i, s := range statuses {
		if s != 503 {
			t.Errorf("attempt %d saw %d, want the provider's 503", i+1, s)
		}
	}
	if call.done == nil || call.done.Status != 503 {
		t.Errorf("the application got %s, want the provider's 503", call.surfaced())
	}

	// The provider unreachable: Caddy's own 502, every attempt.
	down := startCaddy(t, sdkLimiter(srv.Addr, "down:", nil, docsTokens()), proxyTo("127.0.0.1:1"))
	call = &sdkCall{ID: "provider down", APIKey: "sk-provider-down", Kind: "chat", Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 500,
		"messages": []any{map[string]any{"role": "user", "content": prompt}}}}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: down.URL + "/v1", Concurrency: 1, Calls: []*sdkCall{call}}, 60*time.Second)
	charged = 50000 - bucketTokens(t, down, "openai_tokens", "sk-provider-down")
	statuses = nil
	for _, h := range call.requests {
		statuses = append(statuses, h.answer.Status)
	}
	t.Logf("an SDK call with the provider unreachable: attempts answered %v; charged %d tokens; the application got: %s", statuses, charged, call.surfaced())
	if charged != 0 || len(statuses) != 3 || statuses[2] != 502 {
		t.Errorf("provider down: charged %d, attempts %v; want 0 and three 502s", charged, statuses)
	}
}
