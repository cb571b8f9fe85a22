package integration_test

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The LLM gateway of docs/after-admission.md driven by the official SDKs
// (npm openai 6.49.0 and @anthropic-ai/sdk 1.16.0, run by
// integration_test/sdk/driver.mjs) against the fake provider of
// sdk_provider_test.go, through a real Caddy and Redis: what an
// application gets, and what the budget is charged, for the cases of
// issue 36. Each test logs its figures before it checks them.

// sdkPolicy is a token policy keyed on the credential, as the docs'
// gateway: reserving from the body (cost openai, at most max), settling
// the usage the response reports.
func sdkPolicy(name, settle string, rate string, burst, maxCost int64, match ...string) map[string]any {
	p := map[string]any{"name": name, "key": "{http.rate_limit.credential}", "rate": rate, "burst": burst,
		"cost": "openai", "max_cost": maxCost, "settle": map[string]any{"from": settle}}
	if len(match) > 0 {
		p["match"] = map[string]any{"path": match}
	}
	return p
}

// sdkLimiter is limiter with a Redis timeout of 1 s (a loaded machine
// must not make a decision fail open) and the key prefix given, no jitter
// unless extra sets one.
func sdkLimiter(redisAddr, prefix string, extra map[string]any, policies ...map[string]any) map[string]any {
	e := map[string]any{"jitter": 0, "redis": map[string]any{"addresses": []string{redisAddr}, "timeout": "1s", "key_prefix": prefix}}
	for k, v := range extra {
		e[k] = v
	}
	return limiter(redisAddr, e, policies...)
}

// sdkBudget is a budget that does not refill during a test: a token every
// 86.4 s.
const sdkBudget = "100000/2400h"

// settledBy is what a fresh key's bucket was charged: burst less what it
// holds, its settle made before its response ended.
func settledBy(t *testing.T, in *instance, policy, identity string, burst int64) int64 {
	t.Helper()
	return burst - bucketTokens(t, in, policy, identity)
}

// byCredential is the provider's calls by the key they carried.
func byCredential(calls []providerCall) map[string]providerCall {
	m := map[string]providerCall{}
	for _, c := range calls {
		auth, _, _ := strings.Cut(c.credential, "|")
		key := strings.TrimPrefix(auth, "Bearer ")
		if key == "" {
			key = strings.Trim(c.credential, "|")
		}
		m[key] = c
	}
	return m
}

// TestSDKExactSettles: each API and framing through its official SDK,
// compressed as the SDK accepts, is charged exactly the usage the provider
// reported: OpenAI's chat completions (JSON, and a stream with
// include_usage), the Responses API (JSON, stream), Azure OpenAI's
// deployment path (its api-key), Anthropic's Messages (JSON, stream), with
// prompt caching reported (OpenAI's cached_tokens; Anthropic's cache
// writes counted as input and reads not, the defaults).
func TestSDKExactSettles(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	const burst = 1_000_000
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil,
		sdkPolicy("openai_tokens", "openai", sdkBudget, burst, 8000, "/v1/chat/*", "/v1/responses*", "/openai/*"),
		sdkPolicy("anthropic_tokens", "anthropic", sdkBudget, burst, 8000, "/v1/messages*")), proxyTo(prov.addr))
	system := strings.Repeat("You answer in one short sentence. ", 200) // 6,800 bytes of letters: 1,700 tokens
	chat := func(stream bool) map[string]any {
		p := map[string]any{"model": "gpt-4o-mini", "max_tokens": 100, "messages": []any{
			map[string]any{"role": "system", "content": system}, map[string]any{"role": "user", "content": "Say hello"}}}
		if stream {
			p["stream"], p["stream_options"] = true, map[string]any{"include_usage": true}
		}
		return p
	}
	cached := []any{map[string]any{"type": "text", "text": system, "cache_control": map[string]any{"type": "ephemeral"}}}
	messages := func(stream bool) map[string]any {
		return map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 100, "stream": stream, "system": cached,
			"messages": []any{map[string]any{"role": "user", "content": "Say hello"}}}
	}
	responses := func(stream bool) map[string]any {
		return map[string]any{"model": "gpt-4.1", "input": "Say hello", "max_output_tokens": 100, "stream": stream}
	}
	runs := []struct {
		sdk, policy string
		calls       []*sdkCall
	}{
		{"openai", "openai_tokens", []*sdkCall{
			{ID: "chat JSON", Kind: "chat", Params: chat(false)},
			{ID: "chat JSON, cached", Kind: "chat", Params: chat(false)},
			{ID: "chat stream, cached", Kind: "chat", Params: chat(true)},
			{ID: "responses JSON", Kind: "responses", Params: responses(false)},
			{ID: "responses stream", Kind: "responses", Params: responses(true)},
		}},
		{"azure", "openai_tokens", []*sdkCall{{ID: "azure chat JSON", Kind: "chat", Params: chat(false)}}},
		{"anthropic", "anthropic_tokens", []*sdkCall{
			{ID: "messages JSON, cache write", Kind: "messages", Params: messages(false)},
			{ID: "messages JSON, cache read", Kind: "messages", Params: messages(false)},
			{ID: "messages stream, cache read", Kind: "messages", Params: messages(true)},
		}},
	}
	var table []string
	n := 0
	for _, r := range runs {
		for _, c := range r.calls {
			n++
			c.APIKey = fmt.Sprintf("sk-exact-%d", n)
		}
		from := prov.count()
		runSDK(t, sdkPlan{SDK: r.sdk, BaseURL: in.URL + map[string]string{"openai": "/v1"}[r.sdk], Concurrency: 1, Calls: r.calls}, 60*time.Second)
		got := byCredential(prov.reported(from))
		for _, c := range r.calls {
			p, ok := got[c.APIKey]
			if c.done == nil || !c.done.OK || !ok {
				t.Errorf("%s %s: %s (the provider saw it: %v)", r.sdk, c.ID, c.surfaced(), ok)
				continue
			}
			settled := settledBy(t, in, r.policy, c.APIKey, burst)
			table = append(table, fmt.Sprintf("| %s | %s | %s of %q | %d in (%d cached), %d cache write, %d cache read, %d out | %d | %d |",
				r.sdk, c.ID, p.contentEncoding, p.acceptEncoding, p.input, p.cached, p.cacheWrite, p.cacheRead, p.output, p.total(), settled))
			if settled != p.total() {
				t.Errorf("%s %s: settled %d, the provider reported %d", r.sdk, c.ID, settled, p.total())
			}
		}
	}
	t.Logf("settled against reported usage:\n| SDK | call | Content-Encoding | reported | counted | settled |\n|---|---|---|---|---|---|\n%s", strings.Join(table, "\n"))
}

// TestSDKHiddenInput: the attack. 32 concurrent Responses API
// calls continuing a stored conversation (previous_response_id) of
// 100,000 tokens, each reserving ~106 by its body and using 100,100,
// against a burst of 50,000: the first wave is bounded by max (8,000 a
// request: 6 admitted) and its excess is owed in full (not forgiven at
// 2 × burst); once it is paid back (an operator's grant, rather than the
// 5.5 h the rate takes), the key, having learned what it uses, reserves
// the whole burst (1 admitted a wave). A chat call with 4 images and an
// Anthropic call with images and a document reserve max; the conversation
// cut at 90% of its text is charged what its key learned.
func TestSDKHiddenInput(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	prov.stored["resp_big"] = 99_998 // and "Go on", 2 tokens: 100,000 in
	const burst = 50_000
	const slow = "100000/1h" // 27.8 tokens a second
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, sdkPolicy("llm_tokens", "openai", slow, burst, 8000)), proxyTo(prov.addr))
	continued := func(id string) *sdkCall {
		return &sdkCall{ID: id, APIKey: "sk-tenant", Kind: "responses", Headers: map[string]any{"X-Output-Tokens": "100"},
			Params: map[string]any{"model": "gpt-4.1", "previous_response_id": "resp_big", "input": "Go on", "max_output_tokens": 100}}
	}
	full := func() { // the debt paid back: the bucket full again, what the key learned kept
		owed := burst - bucketTokens(t, in, "llm_tokens", "sk-tenant")
		if status, body := adminCall(t, in, "POST", "/rate_limit/grant", fmt.Sprintf(`{"policy":"llm_tokens","identity":"sk-tenant","tokens":%d}`, owed)); status != 200 {
			t.Fatalf("grant: %d %s", status, body)
		}
	}
	// What the bucket may have refilled since began: 27.8 tokens a second,
	// and at least the 100 (3.6 s) these checks allowed when a wave took a
	// second or two, as it does beside two CPU hogs. A slower machine takes
	// longer, and the rate gives back more meanwhile.
	refilledSince := func(began time.Time) int64 {
		return max(100, int64(time.Since(began).Seconds()*100_000/3600)+1)
	}
	var waves []string
	var admitted []int
	for wave := 1; wave <= 3; wave++ {
		if wave > 1 {
			full()
		}
		began := time.Now()
		var calls []*sdkCall
		for i := range 32 {
			calls = append(calls, continued(fmt.Sprintf("w%d-%d", wave, i)))
		}
		from := prov.count()
		runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Concurrency: 32, Calls: calls}, 60*time.Second)
		used := int64(0)
		for _, c := range prov.reported(from) {
			used += c.total()
		}
		ok := okCount(calls)
		// Every settle was made before its response ended.
		tokens := bucketTokens(t, in, "llm_tokens", "sk-tenant")
		admitted = append(admitted, ok)
		waves = append(waves, fmt.Sprintf("| %d | %d of 32 | %d | %d | %d |", wave, ok, used, burst-used, tokens))
		if refilled := refilledSince(began); tokens > burst-used+refilled {
			t.Errorf("wave %d: the bucket holds %d tokens after %d were used: more than %d (+ %d refilled since the wave began), the debt was forgiven", wave, tokens, used, burst-used, refilled)
		}
	}
	t.Logf("32 concurrent calls continuing a conversation (100,100 tokens each) per wave, burst 50,000:\n| wave | admitted | tokens used | burst - used | bucket after (inspect) |\n|---|---|---|---|---|\n%s", strings.Join(waves, "\n"))
	if admitted[0] > burst/8000 {
		t.Errorf("wave 1: %d admitted, want at most %d (max 8,000 each)", admitted[0], burst/8000)
	}
	for i, n := range admitted[1:] {
		if n > 1 {
			t.Errorf("wave %d: %d admitted, want at most 1 (the key learned it uses 100,100: it reserves the burst)", i+2, n)
		}
	}

	// The conversation cut at 90% of its text.
	full()
	began := time.Now()
	cut := continued("cut")
	cut.Params["stream"], cut.AbortAfterText, cut.Headers["X-Cut"] = true, 360, "360"
	run := runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{cut}}, 30*time.Second)
	// The client cut the stream: its charge is made once Caddy notices
	// (bounded: 2 s).
	left := bucketTokens(t, in, "llm_tokens", "sk-tenant")
	for deadline := time.Now().Add(2 * time.Second); left > 100 && time.Now().Before(deadline); left = bucketTokens(t, in, "llm_tokens", "sk-tenant") {
		time.Sleep(20 * time.Millisecond)
	}
	charged := burst - left
	t.Logf("the conversation (100,100 tokens if read) cut after %s of its 400 bytes of text: reserved %d, charged %d (less the refill since)", cut.doneText(), reservedBy(run.calls["cut"], "llm_tokens", burst), charged)
	if charged < burst-refilledSince(began) { // 27.8 tokens a second come back meanwhile
		t.Errorf("the cut conversation: charged %d, want what its key learned, the burst (%d, less %d refilled since)", charged, burst, refilledSince(began))
	}

	// Images and documents: 4 images behind URLs, and an Anthropic call
	// with 2 images and a PDF.
	from := prov.count()
	var images []any
	for range 4 {
		images = append(images, map[string]any{"type": "image_url", "image_url": map[string]any{"url": "https://img.example/x.jpg", "detail": "high"}})
	}
	chat := &sdkCall{ID: "4 images", APIKey: "sk-images", Kind: "chat", Headers: map[string]any{"X-Output-Tokens": "100"}, Params: map[string]any{"model": "gpt-4o",
		"max_tokens": 100, "messages": []any{map[string]any{"role": "user", "content": append([]any{map[string]any{"type": "text", "text": "What are these"}}, images...)}}}}
	run = runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{chat}}, 30*time.Second)
	reserved := reservedBy(run.calls["4 images"], "llm_tokens", burst)
	used := byCredential(prov.reported(from))["sk-images"].total()
	t.Logf("a chat call with 4 images (%d tokens used): reserved %d", used, reserved)
	if reserved < used {
		t.Errorf("a chat call with 4 images: reserved %d, used %d", reserved, used)
	}
	prov2 := startProvider(t)
	in2 := startCaddy(t, sdkLimiter(srv.Addr, "a:", nil,
		sdkPolicy("claude_tokens", "anthropic", slow, burst, 8000)), proxyTo(prov2.addr))
	doc := &sdkCall{ID: "images and a PDF", APIKey: "sk-docs", Kind: "messages", Headers: map[string]any{"X-Output-Tokens": "100"}, Params: map[string]any{"model": "claude-sonnet-4-5",
		"max_tokens": 100, "messages": []any{map[string]any{"role": "user", "content": []any{
			map[string]any{"type": "image", "source": map[string]any{"type": "url", "url": "https://img.example/a.jpg"}},
			map[string]any{"type": "image", "source": map[string]any{"type": "url", "url": "https://img.example/b.jpg"}},
			map[string]any{"type": "document", "source": map[string]any{"type": "url", "url": "https://doc.example/c.pdf"}},
			map[string]any{"type": "text", "text": "Compare them"}}}}}}
	run = runSDK(t, sdkPlan{SDK: "anthropic", BaseURL: in2.URL, MaxRetries: intp(0), Calls: []*sdkCall{doc}}, 30*time.Second)
	reserved = reservedBy(run.calls["images and a PDF"], "claude_tokens", burst)
	if r := prov2.reported(0); len(r) > 0 {
		used = r[0].total()
	}
	t.Logf("an Anthropic call with 2 images and a document (%d tokens used): reserved %d", used, reserved)
	if reserved < used {
		t.Errorf("images and a document: reserved %d, used %d", reserved, used)
	}
}

// okCount is how many of the calls returned an answer.
func okCount(calls []*sdkCall) int {
	n := 0
	for _, c := range calls {
		if c.done != nil && c.done.OK {
			n++
		}
	}
	return n
}

// reservedBy is what the call's admitted request reserved: the burst less
// the r the RateLimit field of its answer showed (its bucket was full).
func reservedBy(c *sdkCall, policy string, burst int64) int64 {
	if len(c.requests) == 0 {
		return -1
	}
	for _, m := range strings.Split(c.requests[len(c.requests)-1].answer.RateLimit, ",") {
		if strings.Contains(m, `"`+policy+`"`) {
			for _, param := range strings.Split(m, ";") {
				if v, ok := strings.CutPrefix(strings.TrimSpace(param), "r="); ok {
					r, _ := strconv.ParseInt(v, 10, 64)
					return burst - r
				}
			}
		}
	}
	return -1
}

// TestSDKPromptCaching: an Anthropic system prompt of 10,011 tokens behind
// one cache_control marker, 3 calls: the provider reports it as a cache
// write, then reads. settle anthropic counts the write as input and the
// reads not at all (the provider's input-token rate limits count them so),
// and with weights ... cache_read 1 counts both.
func TestSDKPromptCaching(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	const burst = 1_000_000
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, sdkPolicy("claude_tokens", "anthropic", sdkBudget, burst, 8000)), proxyTo(prov.addr))
	weighed := sdkPolicy("claude_tokens", "anthropic", sdkBudget, burst, 8000)
	weighed["settle"] = map[string]any{"from": "anthropic", "weights": map[string]any{"input": 1, "output": 1, "cache_read": 1}}
	calls := func(key, system string) []*sdkCall {
		var cs []*sdkCall
		for i := range 3 {
			cs = append(cs, &sdkCall{ID: fmt.Sprintf("%s-%d", key, i), APIKey: key, Kind: "messages", Headers: map[string]any{"X-Output-Tokens": "200"},
				Params: map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 200,
					"system":   []any{map[string]any{"type": "text", "text": system, "cache_control": map[string]any{"type": "ephemeral"}}},
					"messages": []any{map[string]any{"role": "user", "content": "Summarise the rules."}}}})
		}
		return cs
	}
	measure := func(in *instance, key, system string) (charged, reported, cacheTokens int64) {
		from := prov.count()
		runSDK(t, sdkPlan{SDK: "anthropic", BaseURL: in.URL, MaxRetries: intp(0), Calls: calls(key, system)}, 60*time.Second)
		for _, c := range prov.reported(from) {
			reported += c.input + c.output
			cacheTokens += c.cacheWrite + c.cacheRead
		}
		return burst - bucketTokens(t, in, "claude_tokens", key), reported, cacheTokens
	}
	charged, inOut, cache := measure(in, "sk-cache", strings.Repeat("abcd", 10011))
	t.Logf("default weights: 3 calls, %d input and output tokens and %d through the cache (10,011 written, then read twice): charged %d", inOut, cache, charged)
	if want := inOut + 10011; charged != want {
		t.Errorf("default weights: charged %d, want %d (input, output and the cache write)", charged, want)
	}
	in2 := startCaddy(t, sdkLimiter(srv.Addr, "w:", nil, weighed), proxyTo(prov.addr))
	charged, inOut, cache = measure(in2, "sk-cache-all", strings.Repeat("efgh", 10011))
	t.Logf("weights input 1 output 1 cache_read 1: 3 calls, %d input and output tokens and %d through the cache: charged %d", inOut, cache, charged)
	if want := inOut + 3*10011; charged != want {
		t.Errorf("cache_read 1: charged %d, want %d", charged, want)
	}
}

// TestSDKCredentials: with the docs' key, {http.rate_limit.credential},
// every client has its own bucket however its SDK sends its key
// (Anthropic's TypeScript SDK: Authorization: Bearer; OpenAI's: the same;
// Azure OpenAI's: api-key; Gemini's x-goog-api-key): tenant A's sixth
// request is denied, tenant B's first is not. With the key the docs used
// to give (x-api-key), every Anthropic SDK client is the empty key: the
// policy says so (a WARN, caddy_rate_limit_empty_keys_total), and the
// operator can inspect and reset that bucket.
func TestSDKCredentials(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	perKey := func(key string) map[string]any {
		return map[string]any{"name": "per_key", "key": key, "rate": "5/1h"}
	}
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil, perKey("{http.rate_limit.credential}")), proxyTo(prov.addr))
	msg := func(id, key string) *sdkCall {
		return &sdkCall{ID: id, APIKey: key, Kind: "messages", Params: map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 50,
			"messages": []any{map[string]any{"role": "user", "content": "Hi"}}}}
	}
	tenants := func(in *instance) (aSixth, bFirst *sdkCall) {
		var calls []*sdkCall
		for i := range 6 {
			calls = append(calls, msg(fmt.Sprintf("a%d", i), "sk-ant-tenant-a"))
		}
		calls = append(calls, msg("b0", "sk-ant-tenant-b"))
		run := runSDK(t, sdkPlan{SDK: "anthropic", BaseURL: in.URL, MaxRetries: intp(0), Concurrency: 1, Calls: calls}, 60*time.Second)
		return run.calls["a5"], run.calls["b0"]
	}
	a6, b1 := tenants(in)
	t.Logf("{http.rate_limit.credential}, Anthropic SDK: tenant A's 6th call %s; tenant B's 1st %s", a6.surfaced(), b1.surfaced())
	if a6.done == nil || a6.done.OK || a6.done.Status != 429 || b1.done == nil || !b1.done.OK {
		t.Errorf("tenant A's 6th: %s; tenant B's 1st: %s; want 429 and ok", a6.surfaced(), b1.surfaced())
	}
	oa := runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", MaxRetries: intp(0), Calls: []*sdkCall{{ID: "c", APIKey: "sk-openai-c", Kind: "chat",
		Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 50, "messages": []any{map[string]any{"role": "user", "content": "Hi"}}}}}}, 30*time.Second)
	az := runSDK(t, sdkPlan{SDK: "azure", BaseURL: in.URL, MaxRetries: intp(0), Calls: []*sdkCall{{ID: "d", APIKey: "az-key-d", Kind: "chat",
		Params: map[string]any{"model": "gpt-4o-mini", "max_tokens": 50, "messages": []any{map[string]any{"role": "user", "content": "Hi"}}}}}}, 30*time.Second)
	goog := get(t, in.URL+"/v1beta/models", "X-Goog-Api-Key", "AIza-e")
	for key, want := range map[string]int64{"sk-ant-tenant-a": 0, "sk-ant-tenant-b": 4, "sk-openai-c": 4, "az-key-d": 4, "AIza-e": 4} {
		if got := bucketTokens(t, in, "per_key", key); got != want {
			t.Errorf("credential %s: %d left, want %d (OpenAI %s, Azure %s, Gemini %d)", key, got, want, oa.calls["c"].surfaced(), az.calls["d"].surfaced(), goog.status)
		}
	}

	// The key the docs gave before: x-api-key.
	old := startCaddy(t, sdkLimiter(srv.Addr, "old:", nil,
		perKey("{http.request.header.X-Api-Key}")), proxyTo(prov.addr))
	var calls []*sdkCall
	for i := range 25 {
		calls = append(calls, msg(fmt.Sprintf("x%d", i), fmt.Sprintf("sk-ant-%d", i)))
	}
	run := runSDK(t, sdkPlan{SDK: "anthropic", BaseURL: old.URL, MaxRetries: intp(0), Calls: calls}, 60*time.Second)
	empty := metricValue(t, old, "caddy_rate_limit_empty_keys_total", map[string]string{"policy": "per_key"})
	warned := strings.Count(logText(t, old), "resolved empty")
	t.Logf("keyed on x-api-key: 25 Anthropic SDK clients, each its own key: %d admitted; %v counted empty; %d WARN lines", okCount(calls), empty, warned)
	if okCount(calls) != 5 || empty != 25 || warned != 1 || strings.Contains(logText(t, old), "sk-ant-") {
		t.Errorf("keyed on x-api-key: %d admitted, %v counted empty, %d WARN lines (want 5, 25, 1, without a credential) (%s)", okCount(calls), empty, warned, run.calls["x24"].surfaced())
	}
	status, body := adminCall(t, old, "GET", "/rate_limit/inspect?policy=per_key&empty_key=true", "")
	status2, body2 := adminCall(t, old, "POST", "/rate_limit/reset", `{"policy":"per_key","empty_key":true}`)
	t.Logf("inspect --empty-key: %d %s; reset --empty-key: %d %s", status, body, status2, body2)
	if status != 200 || !strings.Contains(body, `"tokens":0`) || status2 != 200 || !strings.Contains(body2, `"tokens":5`) {
		t.Errorf("the empty key's bucket: inspect %d %s, reset %d %s", status, body, status2, body2)
	}
}

// TestSDKDenseCut: a dense prompt (40,000 digits: 40,000 tokens) whose
// stream the application cuts after its first text, before the usage
// event, through both SDKs: charged at least what reading it costs
// (40,010: the prompt and its max_tokens of 10), not its bytes at 4 a
// token (10,022).
func TestSDKDenseCut(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	const burst = 1_000_000
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil,
		sdkPolicy("openai_tokens", "openai", sdkBudget, burst, 100_000, "/v1/chat/*"),
		sdkPolicy("anthropic_tokens", "anthropic", sdkBudget, burst, 100_000, "/v1/messages*")), proxyTo(prov.addr))
	digits := strings.Repeat("0123456789", 4000)
	cut := func(id, kind, key string, params map[string]any) *sdkCall {
		params["stream"], params["max_tokens"] = true, 10
		return &sdkCall{ID: id, APIKey: key, Kind: kind, AbortAfterText: 8, Headers: map[string]any{"X-Cut": "8", "X-Output-Tokens": "10"}, Params: params}
	}
	for _, tc := range []struct {
		sdk, policy string
		call        *sdkCall
		prompt      int64
	}{
		{"openai", "openai_tokens", cut("chat", "chat", "sk-dense-openai", map[string]any{"model": "gpt-4o-mini",
			"messages": []any{map[string]any{"role": "user", "content": digits[:39999]}}, "stream_options": map[string]any{"include_usage": true}}), 40000},
		{"anthropic", "anthropic_tokens", cut("messages", "messages", "sk-dense-anthropic", map[string]any{"model": "claude-sonnet-4-5",
			"messages": []any{map[string]any{"role": "user", "content": digits}}}), 40000},
	} {
		from := prov.count()
		base := in.URL + "/v1"
		if tc.sdk == "anthropic" {
			base = in.URL
		}
		runSDK(t, sdkPlan{SDK: tc.sdk, BaseURL: base, MaxRetries: intp(0), Calls: []*sdkCall{tc.call}}, 30*time.Second)
		full := tc.prompt + 10
		charged := settledBy(t, in, tc.policy, tc.call.APIKey, burst)
		var p providerCall
		if r := prov.reported(from); len(r) > 0 {
			p = r[0]
		}
		t.Logf("%s: a stream of a %d-token prompt cut after %s bytes of text (%s; the provider cut: %v): charged %d, reading it costs %d",
			tc.sdk, tc.prompt, tc.call.doneText(), tc.call.surfaced(), p.cut, charged, full)
		if charged < full {
			t.Errorf("%s: a dense stream cut before its usage was charged %d, reading it costs %d", tc.sdk, charged, full)
		}
	}
}

// doneText is the text the application read, for logs.
func (c *sdkCall) doneText() string {
	if c.done == nil {
		return "?"
	}
	return strconv.Itoa(c.done.Text)
}

// TestSDKRetries: what the SDKs do with the gateway's denials, with their
// default retries (2): a quota's denial (its period's end is hours away)
// surfaces at once, in one HTTP request; 10 SDK clients on one key never
// sleep past maxRetryWait (10 s) inside a call; a cost that can never fit
// (an operator's override below what the requests reserve) is one HTTP
// request per call, not three; and with error_format the SDK shows the
// gateway's error as the provider's rate-limit error.
func TestSDKRetries(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	chatCall := func(id, key string, maxTokens int) *sdkCall {
		return &sdkCall{ID: id, APIKey: key, Kind: "chat", Headers: map[string]any{"X-Output-Tokens": strconv.Itoa(maxTokens)}, Params: map[string]any{"model": "gpt-4o-mini",
			"max_tokens": maxTokens, "messages": []any{map[string]any{"role": "user", "content": "Hi"}}}}
	}
	t.Run("quota", func(t *testing.T) {
		in := startCaddy(t, sdkLimiter(srv.Addr, "q:", nil,
			map[string]any{"name": "daily", "key": "{http.rate_limit.credential}", "quota": "2/day"}), proxyTo(prov.addr))
		calls := []*sdkCall{chatCall("1", "sk-q", 10), chatCall("2", "sk-q", 10), chatCall("3", "sk-q", 10)}
		run := runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", Concurrency: 1, Calls: calls}, 20*time.Second)
		third := run.calls["3"]
		var ra string
		if len(third.requests) > 0 {
			ra = third.requests[0].answer.RetryAfter
		}
		t.Logf("quota 2/day, the 3rd call: %d HTTP requests, longest sleep %v, Retry-After %s s, surfaced: %s", third.httpRequests(), third.longestSleep(run), ra, third.surfaced())
		if third.done == nil || third.httpRequests() != 1 || third.longestSleep(run) > 0 {
			t.Errorf("the 3rd call of a quota of 2: %d HTTP requests, slept %v, surfaced %s; want one request, at once", third.httpRequests(), third.longestSleep(run), third.surfaced())
		}
	})
	t.Run("fleet", func(t *testing.T) {
		// 10 clients at once, each reserving 500 of a burst of 1,000
		// refilled 100 a second: the eighth in line waits 40 s.
		in := startCaddy(t, sdkLimiter(srv.Addr, "f:", map[string]any{"jitter": 0.2},
			sdkPolicy("fleet_tokens", "openai", "100/1s", 1000, 1000)), proxyTo(prov.addr))
		var calls []*sdkCall
		for i := range 10 {
			calls = append(calls, chatCall(strconv.Itoa(i), "sk-fleet", 496)) // 496 + "user" "Hi" (6 bytes: 2): 498, and the model's name
		}
		run := runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", Concurrency: 10, Calls: calls}, 120*time.Second)
		var longestSleep, longestCall time.Duration
		requests, ok, missing := 0, 0, 0
		for _, c := range calls {
			longestSleep = max(longestSleep, c.longestSleep(run))
			requests += c.httpRequests()
			if c.done == nil {
				longestCall = max(longestCall, time.Duration(run.ended*float64(time.Millisecond)))
				continue
			}
			longestCall = max(longestCall, time.Duration(c.done.Ms*float64(time.Millisecond)))
			if c.done.OK {
				ok++
			}
			for _, r := range c.requests {
				if r.answer.Status == 429 && r.answer.RetryAfter != "" && r.answer.RetryAfterMs == "" {
					missing++
				}
			}
		}
		t.Logf("10 SDK clients on one key: %d answered, %d HTTP requests, longest sleep in a call %v, longest call %v (stopped at the deadline: %v)",
			ok, requests, longestSleep.Round(time.Millisecond), longestCall.Round(time.Millisecond), run.stopped)
		if longestSleep > 10*time.Second+500*time.Millisecond || run.stopped || missing > 0 {
			t.Errorf("10 SDK clients: a call slept %v (want at most 10 s), stopped %v, %d 429s without retry-after-ms", longestSleep, run.stopped, missing)
		}
	})
	t.Run("never fits", func(t *testing.T) {
		big := sdkPolicy("big_tokens", "openai", "1000/1s", 1000, 1000)
		delete(big, "max_cost") // max: the burst, 1,000
		in := startCaddy(t, sdkLimiter(srv.Addr, "n:", nil, big), proxyTo(prov.addr))
		if status, body := adminCall(t, in, "POST", "/rate_limit/override", `{"policy":"big_tokens","identity":"sk-big","rate":"1000/1s","burst":100}`); status != 200 {
			t.Fatalf("override: %d %s", status, body)
		}
		var calls []*sdkCall
		for i := range 220 {
			calls = append(calls, chatCall(strconv.Itoa(i), "sk-big", 200))
		}
		start := time.Now()
		runSDK(t, sdkPlan{SDK: "openai", BaseURL: in.URL + "/v1", Concurrency: 22, Calls: calls}, 120*time.Second)
		requests := 0
		for _, c := range calls {
			requests += c.httpRequests()
		}
		t.Logf("220 calls whose cost can never fit (200 of a burst of 100): %d HTTP requests in %v, the first surfaced: %s", requests, time.Since(start).Round(time.Millisecond), calls[0].surfaced())
		if requests != 220 {
			t.Errorf("220 calls that can never fit: %d HTTP requests, want one per call", requests)
		}
	})
	t.Run("error body", func(t *testing.T) {
		var mu sync.Mutex
		seen := map[string]string{}
		for _, tc := range []struct{ sdk, format, base string }{{"openai", "", "/v1"}, {"openai", "openai", "/v1"}, {"anthropic", "anthropic", ""}} {
			extra := map[string]any{}
			if tc.format != "" {
				extra["error_format"] = tc.format
			}
			in := startCaddy(t, sdkLimiter(srv.Addr, "e"+tc.format+":", extra, map[string]any{"name": "one_a_day", "key": "{http.rate_limit.credential}", "rate": "1/24h"}), proxyTo(prov.addr))
			c1, c2 := chatCall("1", "sk-e", 10), chatCall("2", "sk-e", 10)
			if tc.sdk == "anthropic" {
				for _, c := range []*sdkCall{c1, c2} {
					c.Kind = "messages"
				}
			}
			run := runSDK(t, sdkPlan{SDK: tc.sdk, BaseURL: in.URL + tc.base, MaxRetries: intp(0), Concurrency: 1, Calls: []*sdkCall{c1, c2}}, 30*time.Second)
			d := run.calls["2"].done
			mu.Lock()
			seen[tc.sdk+" "+tc.format] = run.calls["2"].surfaced()
			mu.Unlock()
			t.Logf("%s SDK, error_format %q: %s (type %q, code %q)", tc.sdk, tc.format, run.calls["2"].surfaced(), d.typeOf(), d.codeOf())
			switch tc.format {
			case "openai":
				if d == nil || d.Code != "rate_limit_exceeded" || !strings.Contains(d.Message, "one_a_day") || d.Name != "RateLimitError" {
					t.Errorf("openai format: %s", run.calls["2"].surfaced())
				}
			case "anthropic":
				if d == nil || d.Type != "rate_limit_error" || !strings.Contains(d.Message, "one_a_day") || d.Name != "RateLimitError" {
					t.Errorf("anthropic format: %s", run.calls["2"].surfaced())
				}
			}
		}
	})
}

func (e *sdkEvent) typeOf() string {
	if e == nil {
		return ""
	}
	return e.Type
}

func (e *sdkEvent) codeOf() string {
	if e == nil {
		return ""
	}
	return e.Code
}
