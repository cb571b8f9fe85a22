package integration_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Every multiplier of the output reserved (issue 45, item 4), through the
// official OpenAI SDK against the fake provider, on the docs' gateway's
// burst (50,000, at most 8,000 a request) refilling too slowly to blur a
// figure (a token every 172.8 s).

// TestSDKOutputMultipliers: 32 concurrent chat calls asking for n = 128
// answers of up to 50 tokens are admitted as far as 128 ceilings each fit
// in the burst (they used 410,016 tokens on a burst of 50,000 in the
// issue); one such stream cut after some 25,000 bytes of text is charged
// at least those, its 128 ceilings (132 in the issue); a Responses call
// with background: true reserves max, or is refused before the provider
// with `unbounded refuse`.
func TestSDKOutputMultipliers(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	tokens := sdkPolicy("openai_tokens", "openai", "50000/2400h", 50000, 8000)
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, tokens), proxyTo(prov.addr))
	chat := func(stream bool) map[string]any {
		p := map[string]any{"model": "gpt-4o-mini", "max_tokens": 50, "n": 128,
			"messages": []any{map[string]any{"role": "user", "content": "Name a colour."}}}
		if stream {
			p["stream"], p["stream_options"] = true, map[string]any{"include_usage": true}
		}
		return p
	}
	var calls []*sdkCall
	for i := range 32 {
		calls = append(calls, &sdkCall{ID: fmt.Sprintf("n128-%d", i), APIKey: "sk-n128", Kind: "chat", Params: chat(false),
			Headers: map[string]any{"X-Output-Tokens": "50"}})
	}
	from := prov.count()
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Concurrency: 32, Calls: calls}, 90*time.Second)
	var used int64
	for _, c := range prov.reported(from) {
		used += c.total()
	}
	t.Logf("32 concurrent calls of n = 128, max_tokens 50: %d admitted, the provider billed %d tokens, on a burst of 50,000", okCount(calls), used)
	if used > 50000 {
		t.Errorf("the provider billed %d tokens to calls admitted on a burst of 50,000", used)
	}

	// The provider stops after 24,000 bytes of text (6,000 tokens of the
	// 6,400), before the usage; the application, having read them, goes.
	cut := &sdkCall{ID: "n128 cut", APIKey: "sk-n128-cut", Kind: "chat", Params: chat(true), AbortAfterText: 24_000,
		Headers: map[string]any{"X-Output-Tokens": "50", "X-Cut": "24000"}}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{cut}}, 60*time.Second)
	charged := 50000 - cutTokens(t, in, "openai_tokens", "sk-n128-cut", 50000-8000)
	t.Logf("a stream of n = 128 cut after %s bytes of text: charged %d tokens", cut.doneText(), charged)
	if charged < 128*50 {
		t.Errorf("a cut stream of n = 128 charged %d, want at least its 128 ceilings (6,400)", charged)
	}

	bg := &sdkCall{ID: "background", APIKey: "sk-background", Kind: "responses", Params: map[string]any{"model": "o3", "input": "Plan the migration.",
		"max_output_tokens": 100, "background": true}, Headers: map[string]any{"X-Output-Tokens": "100"}}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{bg}}, 60*time.Second)
	charged = 50000 - bucketTokens(t, in, "openai_tokens", "sk-background")
	t.Logf("a background Responses call: %s; charged %d tokens", bg.surfaced(), charged)
	if charged != 8000 {
		t.Errorf("a background call charged %d, want max (8,000): its usage comes after its answer", charged)
	}
	strict := sdkPolicy("openai_tokens", "openai", "50000/2400h", 50000, 8000)
	strict["unbounded"] = "refuse"
	refusing := startCaddy(t, sdkLimiter(srv.Addr, "strict:", map[string]any{"error_format": "openai"}, strict), proxyTo(prov.addr))
	from = prov.count()
	bg = &sdkCall{ID: "background refused", APIKey: "sk-background", Kind: "responses", Params: bg.Params}
	runSDK(t, sdkPlan{SDK: "openai", BaseURL: refusing.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{bg}}, 60*time.Second)
	t.Logf("with unbounded refuse: %s; the provider saw %d", bg.surfaced(), prov.count()-from)
	if bg.done == nil || bg.done.Status != 400 || prov.count() != from || !strings.Contains(bg.done.Message, "ceiling") {
		t.Errorf("unbounded refuse: %s, the provider saw %d; want 400 before the provider", bg.surfaced(), prov.count()-from)
	}
}
