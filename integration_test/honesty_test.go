package integration_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Learned usage that does not punish honesty (issue 45, item 5), through
// the official OpenAI SDK against the fake provider.

// TestSDKLearnedHonesty: one honest call whose dense prompt (40,000
// digits) used 40,010 tokens on a reservation of 10,010 leaves its key
// 9,990 tokens of a burst of 50,000; the key's next 8
// small calls (about 55 tokens each) are admitted, as a fresh key's are
// (in the issue, all 8 were refused for 594 s with x-should-retry: false,
// each raised to the 40,010 the key had learned); a call like the dense
// one reserves what like calls used. A denial that waits only for
// reservations in flight never says x-should-retry: false.
func TestSDKLearnedHonesty(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, sdkPolicy("openai_tokens", "openai", sdkBudget, 50000, 50000)), proxyTo(prov.addr))
	dense := func(id, key string) *sdkCall {
		return &sdkCall{ID: id, APIKey: key, Kind: "chat", Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 10,
			"messages": []any{map[string]any{"role": "user", "content": strings.Repeat("7", 40_000)}}}}
	}
	small := func(id, key string) *sdkCall {
		return &sdkCall{ID: id, APIKey: key, Kind: "chat", Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 50,
			"messages": []any{map[string]any{"role": "user", "content": "Say hi"}}}}
	}
	big := dense("honest", "sk-honest")
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{big}}, 60*time.Second)
	left := bucketTokens(t, in, "openai_tokens", "sk-honest")
	var calls []*sdkCall
	for i := range 8 {
		calls = append(calls, small(fmt.Sprintf("small %d", i), "sk-honest"))
	}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Concurrency: 1, Calls: calls}, 60*time.Second)
	var fresh []*sdkCall
	for i := range 8 {
		fresh = append(fresh, small(fmt.Sprintf("fresh %d", i), "sk-fresh"))
	}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Concurrency: 1, Calls: fresh}, 60*time.Second)
	noRetry := 0
	for _, c := range calls {
		for _, h := range c.requests {
			if h.answer.ShouldRetry == "false" {
				noRetry++
			}
		}
	}
	t.Logf("one honest call used %s (its key left with %d of 50,000); its next 8 small calls: %d admitted (%d said x-should-retry: false: %s); a fresh key's 8: %d admitted",
		big.surfaced(), left, okCount(calls), noRetry, calls[len(calls)-1].surfaced(), okCount(fresh))
	if okCount(calls) != 8 || okCount(fresh) != 8 {
		t.Errorf("after one honest large call, %d of 8 small calls admitted (a fresh key: %d of 8)", okCount(calls), okCount(fresh))
	}
	// A call like the dense one reserves what like calls used beyond their
	// estimate: it does not fit in what the key has left.
	again := dense("dense again", "sk-honest")
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{again}}, 60*time.Second)
	t.Logf("a second dense call: %s", again.surfaced())
	if again.done == nil || again.done.OK {
		t.Errorf("a call like the one that used 40,010 was admitted on %d tokens left: like calls learned nothing", left)
	}
	// A burst of small calls in flight at once, their reservations holding
	// the budget: a denial among them waits for their refunds.
	inflight := startCaddy(t, sdkLimiter(srv.Addr, "inflight:", nil, sdkPolicy("openai_tokens", "openai", sdkBudget, 2000, 2000)), proxyTo(prov.addr))
	var wave []*sdkCall
	for i := range 12 {
		c := small(fmt.Sprintf("wave %d", i), "sk-wave")
		c.Params["max_tokens"] = 400
		c.Headers = map[string]any{"X-Output-Tokens": "5"}
		wave = append(wave, c)
	}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: inflight.URL + "/v1", MaxRetries: intp(0), Concurrency: 12, Calls: wave}, 60*time.Second)
	denied, told := 0, 0
	for _, c := range wave {
		for _, h := range c.requests {
			if h.answer.Status == 429 {
				denied++
				if h.answer.ShouldRetry == "false" {
					told++
				}
			}
		}
	}
	t.Logf("12 calls at once reserving 403 each of a burst of 2,000: %d denied, %d of them with x-should-retry: false", denied, told)
	if told != 0 {
		t.Errorf("%d denials waiting for reservations in flight said x-should-retry: false", told)
	}
}
