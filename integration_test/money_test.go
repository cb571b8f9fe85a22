package integration_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Budgets in money (docs/money.md) driven by the official SDKs against the
// fake provider of sdk_provider_test.go, whose own record of what it
// answered, priced from the same list, is the truth (the ledger): four
// Caddy instances holding an organisation, its teams and users within
// their dollars, streams charged exactly with include_usage, models with
// no price refused, cached tokens at their own price, dated snapshots
// priced as their family.

// moneyModel is a model of the money tests: its name, the dated snapshot
// the provider serves for it, and its prices in USD per million tokens.
// Made up and high, so that a call costs cents: a large model costs 20
// times a small one.
type moneyModel struct {
	name, served                         string
	input, output, cacheWrite, cacheRead float64
}

var moneyModels = []moneyModel{
	{"gpt-4.1", "gpt-4.1-2025-04-14", 1000, 4000, 1000, 250},
	{"gpt-4.1-nano", "gpt-4.1-nano-2025-04-14", 50, 200, 50, 12.5},
	{"claude-sonnet-4-5", "claude-sonnet-4-5-20250929", 1000, 4000, 1250, 100},
	{"claude-haiku-4-5", "claude-haiku-4-5-20251001", 50, 200, 62.5, 5},
}

// moneyPricesJSON is the handler's prices block: the models' lines.
func moneyPricesJSON() map[string]any {
	var lines []any
	for _, m := range moneyModels {
		lines = append(lines, map[string]any{"model": m.name, "input": m.input, "output": m.output, "cache_write": m.cacheWrite, "cache_read": m.cacheRead})
	}
	return map[string]any{"models": lines}
}

// serveSnapshots makes the provider name the dated snapshot of each model
// it serves.
func serveSnapshots(prov *sdkProvider) {
	for _, m := range moneyModels {
		prov.served[m.name] = m.served
	}
}

// pico is a price in USD per million tokens as pico-dollars a token.
func pico(perMillion float64) int64 { return int64(perMillion*1e6 + 0.5) }

// ledgerPico is what the provider's answer cost, priced from the list by
// the model asked for (whose family the model served is), in
// pico-dollars: exact. OpenAI's prompt tokens hold the cached ones, priced
// apart; Anthropic's input is what was neither written to nor read from
// the cache.
func ledgerPico(t *testing.T, c providerCall) int64 {
	t.Helper()
	i := slices.IndexFunc(moneyModels, func(m moneyModel) bool { return m.name == c.model || m.served == c.model })
	if i < 0 {
		t.Fatalf("the provider answered %q, which the test does not price", c.model)
	}
	m := moneyModels[i]
	if strings.HasPrefix(c.path, "/v1/messages") {
		return c.input*pico(m.input) + c.cacheWrite*pico(m.cacheWrite) + c.cacheRead*pico(m.cacheRead) + c.output*pico(m.output)
	}
	return (c.input-c.cached)*pico(m.input) + c.cached*pico(m.cacheRead) + c.output*pico(m.output)
}

// chargedMicros is what the gateway charges for a cost in pico-dollars:
// micro-dollars, rounded up.
func chargedMicros(p int64) int64 { return (p + 999_999) / 1_000_000 }

// moneyPolicy is a money policy of the fleet: rate per 24 h, a burst of
// the rate's N, keyed on key, reserving an LLM request's priced estimate
// (at most max), settling its priced usage.
func moneyPolicy(name, key, usd, settle string, maxUSD float64) map[string]any {
	s := map[string]any{"from": settle}
	if settle == "openai" {
		s["include_usage"] = true
	}
	return map[string]any{"name": name, "key": key, "unit": "usd", "rate": usd + "/24h", "cost": "openai", "max_cost": maxUSD, "settle": s}
}

// moneyRoutes are the routes of a money gateway: OpenAI's APIs and
// Anthropic's each through their own rate_limit handler, holding the same
// policies (one budget each, whichever format it settles), proxied to the
// provider.
func moneyRoutes(redisAddr, provider string, policies func(settle string) []map[string]any) func(map[string]any) {
	limiterFor := func(settle string) map[string]any {
		h := sdkLimiter(redisAddr, "rl:", nil, policies(settle)...)
		h["prices"] = moneyPricesJSON()
		return h
	}
	routes := []any{
		map[string]any{"match": []any{map[string]any{"path": []string{"/v1/chat/*", "/v1/responses*"}}}, "handle": []any{limiterFor("openai"), proxyTo(provider)}},
		map[string]any{"match": []any{map[string]any{"path": []string{"/v1/messages*"}}}, "handle": []any{limiterFor("anthropic"), proxyTo(provider)}},
	}
	return func(cfg map[string]any) {
		cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)["routes"] = routes
	}
}

// level is one budget of the hierarchy: its policy, the identity it keys
// on, and its dollars per 24 h (the burst).
type level struct {
	policy, id string
	usd        float64
}

// TestMoneyFleet: four Caddy instances on one Redis, an organisation ($5),
// two teams ($3 each) and four users ($1.50 each), each a money policy on
// every request (all or nothing), 32 concurrent SDK clients (openai and
// @anthropic-ai/sdk) calling two models priced 1 : 20, streaming and not,
// some with hidden input (images: reserved at max), on every instance.
// The ledger's spend at every level is never above its cap (burst + rate
// × elapsed) at any moment, and the binding cap (the organisation's: its
// users could spend $6) is used to at least 0.9 when demand exceeds it.
// What the gateway charged is the ledger's, call by call rounded up to the
// micro-dollar; the streams the SDK did not ask usage for got none.
func TestMoneyFleet(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	serveSnapshots(prov)
	const maxUSD = 1.40 // the most a request reserves: an image on the large model costs $1.27
	policies := func(settle string) []map[string]any {
		return []map[string]any{
			moneyPolicy("org", "{http.request.header.X-Org}", "5", settle, maxUSD),
			moneyPolicy("team", "{http.request.header.X-Org}/{http.request.header.X-Team}", "3", settle, maxUSD),
			moneyPolicy("user", "{http.request.header.X-Org}/{http.request.header.X-User}", "1.5", settle, maxUSD),
		}
	}
	tune := moneyRoutes(srv.Addr, prov.addr, policies)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddyTuned(t, tune, respond()))
	}
	users := []struct{ user, team string }{{"ann", "search"}, {"bob", "search"}, {"cat", "ads"}, {"dan", "ads"}}
	levels := []level{{"org", "acme", 5}}
	for _, team := range []string{"search", "ads"} {
		levels = append(levels, level{"team", "acme/" + team, 3})
	}
	for _, u := range users {
		levels = append(levels, level{"user", "acme/" + u.user, 1.5})
	}

	// The calls: for each user, large-model calls first (JSON, streamed
	// without asking for usage as the SDK does by default, streamed
	// asking, an image), then small-model ones, which fill what the large
	// ones leave; both SDKs, every instance in turn.
	prompt := "Tell me a short story about a careful budget keeper please"
	var openaiCalls, anthropicCalls []*sdkCall
	n := 0
	next := func(u struct{ user, team string }, sdk, kind, model string, variant int) *sdkCall {
		n++
		base := fleet[n%len(fleet)].URL
		c := &sdkCall{ID: fmt.Sprintf("%s-%s-%d", u.user, model, n), APIKey: "sk-" + u.user, Kind: kind,
			Headers: map[string]any{"X-Org": "acme", "X-Team": u.team, "X-User": u.user}}
		switch sdk {
		case "openai":
			c.BaseURL = base + "/v1"
			content := any(prompt)
			if variant == 3 { // an image: 1,105 tokens the body does not show
				content = []any{map[string]any{"type": "text", "text": prompt},
					map[string]any{"type": "image_url", "image_url": map[string]any{"url": "https://example.com/cat.png"}}}
			}
			c.Params = map[string]any{"model": model, "max_tokens": 40, "messages": []any{map[string]any{"role": "user", "content": content}}}
			switch variant {
			case 1:
				c.Params["stream"] = true
			case 2:
				c.Params["stream"], c.Params["stream_options"] = true, map[string]any{"include_usage": true}
			}
			openaiCalls = append(openaiCalls, c)
		default:
			c.BaseURL = base
			c.Params = map[string]any{"model": model, "max_tokens": 40, "stream": variant%2 == 1,
				"messages": []any{map[string]any{"role": "user", "content": prompt}}}
			anthropicCalls = append(anthropicCalls, c)
		}
		return c
	}
	for round := range 8 {
		for _, u := range users {
			next(u, "openai", "chat", "gpt-4.1", round%4)
			if round%2 == 0 {
				next(u, "anthropic", "messages", "claude-sonnet-4-5", round/2)
			}
		}
	}
	for round := range 24 {
		for _, u := range users {
			next(u, "openai", "chat", "gpt-4.1-nano", round%4)
			if round%3 == 0 {
				next(u, "anthropic", "messages", "claude-haiku-4-5", round)
			}
		}
	}
	start := time.Now()
	done := make(chan struct{})
	go func() {
		defer close(done)
		runSDK(t, sdkPlan{SDK: "anthropic", MaxRetries: intp(0), Concurrency: 8, Calls: anthropicCalls}, 120*time.Second)
	}()
	runSDK(t, sdkPlan{SDK: "openai", MaxRetries: intp(0), Concurrency: 24, Calls: openaiCalls}, 120*time.Second)
	<-done
	elapsed := time.Since(start)

	// The ledger, level by level, as the provider answered.
	calls := prov.reported(0)
	slices.SortFunc(calls, func(a, b providerCall) int { return a.at.Compare(b.at) })
	idOf := func(l level, c providerCall) string {
		switch l.policy {
		case "org":
			return c.org
		case "team":
			return c.org + "/" + c.team
		}
		return c.org + "/" + c.user
	}
	spent := map[level]int64{} // pico-dollars
	peak := map[level]float64{}
	peakSpent := map[level]int64{}
	var charged int64 // µ$, rounded up call by call
	for _, c := range calls {
		p := ledgerPico(t, c)
		charged += chargedMicros(p)
		for _, l := range levels {
			if idOf(l, c) != l.id {
				continue
			}
			spent[l] += p
			// The cap at that moment: a full bucket and what the rate
			// refilled since the load began.
			capPico := l.usd * 1e12 * (1 + c.at.Sub(start).Seconds()/86400)
			if r := float64(spent[l]) / capPico; r > peak[l] {
				peak[l], peakSpent[l] = r, spent[l]
			}
		}
	}
	end := start.Add(elapsed)
	var table []string
	for _, l := range levels {
		capEnd := l.usd * (1 + end.Sub(start).Seconds()/86400)
		final := float64(spent[l]) / 1e12
		table = append(table, fmt.Sprintf("| %s %s | $%.6f (at the end $%.6f) | $%.6f (%.4f of its cap then) | $%.6f (%.4f) |",
			l.policy, l.id, l.usd, capEnd, float64(peakSpent[l])/1e12, peak[l], final, final/capEnd))
		if peak[l] > 1 {
			t.Errorf("%s %s: the ledger's spend reached %.4f of its cap", l.policy, l.id, peak[l])
		}
	}
	denied, streamedUnasked, unaskedGotUsage := 0, 0, 0
	for _, c := range append(append([]*sdkCall(nil), openaiCalls...), anthropicCalls...) {
		if c.done == nil {
			t.Errorf("%s: %s", c.ID, c.surfaced())
			continue
		}
		if !c.done.OK {
			denied++
			if c.done.Status != 429 {
				t.Errorf("%s: %s (status %d)", c.ID, c.surfaced(), c.done.Status)
			}
		}
		if c.Kind == "chat" && c.Params["stream"] == true && c.Params["stream_options"] == nil && c.done.OK {
			streamedUnasked++
			if u := string(c.done.Usage); u != "" && u != "null" {
				unaskedGotUsage++
			}
		}
	}
	t.Logf("%d calls in %v (%d answered by the provider, %d denied: 429); the ledger's spend against each level's cap:\n"+
		"| level | cap (burst; + 24 h's rate over the run) | peak | final |\n|---|---|---|---|\n%s",
		len(openaiCalls)+len(anthropicCalls), elapsed.Round(time.Millisecond), len(calls), denied, strings.Join(table, "\n"))
	org := levels[0]
	if used := float64(spent[org]) / 1e12 / org.usd; used < 0.9 {
		t.Errorf("the organisation's budget, the binding one, used to %.4f; want at least 0.9 (demand exceeded it: %d denied)", used, denied)
	}
	if unaskedGotUsage > 0 || streamedUnasked == 0 {
		t.Errorf("%d of %d streams that did not ask for usage got some", unaskedGotUsage, streamedUnasked)
	}
	// What the gateway charged, summed over the instances' spend counters:
	// the ledger's, each call rounded up to the micro-dollar.
	var counted float64
	for _, in := range fleet {
		counted += metricValue(t, in, "caddy_rate_limit_spend_usd_total", map[string]string{"policy": "org"})
	}
	t.Logf("charged (caddy_rate_limit_spend_usd_total{policy=\"org\"}, 4 instances): $%.6f; the ledger, call by call rounded up: $%.6f", counted, float64(charged)/1e6)
	if d := counted - float64(charged)/1e6; d > 1e-6 || d < -1e-6 {
		t.Errorf("charged $%.6f, the ledger $%.6f", counted, float64(charged)/1e6)
	}
}

// moneyGateway is one Caddy with the money policy given on both APIs.
func moneyGateway(t *testing.T, redisAddr string, prov *sdkProvider, extra map[string]any, policy func(settle string) map[string]any) *instance {
	t.Helper()
	tune := moneyRoutes(redisAddr, prov.addr, func(settle string) []map[string]any { return []map[string]any{policy(settle)} })
	in := startCaddyTuned(t, func(cfg map[string]any) {
		tune(cfg)
		for _, r := range cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)["routes"].([]any) {
			h := r.(map[string]any)["handle"].([]any)[0].(map[string]any)
			for k, v := range extra {
				h[k] = v
			}
		}
	}, respond())
	return in
}

// slowMoney is a money budget that does not refill during a test (a
// micro-dollar every 8.64 s), of $100, keyed on the credential.
func slowMoney(name string, includeUsage bool) func(settle string) map[string]any {
	return func(settle string) map[string]any {
		s := map[string]any{"from": settle}
		if includeUsage && settle == "openai" {
			s["include_usage"] = true
		}
		return map[string]any{"name": name, "key": "{http.rate_limit.credential}", "unit": "usd", "rate": "1/2400h", "burst": 100,
			"cost": "openai", "max_cost": 5, "settle": s}
	}
}

// chargedTo is what a fresh key's money bucket was charged, in µ$: $100
// less what it holds.
func chargedTo(t *testing.T, in *instance, policy, identity string) int64 {
	t.Helper()
	return 100_000_000 - bucketTokens(t, in, policy, identity)
}

// TestMoneyStreams: streamed chat completions through the official openai
// SDK, which does not ask for usage: with `settle openai include_usage`
// each is charged exactly what the provider's ledger says, and the SDK
// gets no usage; without it each is charged an estimate. And the bytes a
// client gets through the gateway are those the provider sends without
// the option, byte for byte.
func TestMoneyStreams(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	serveSnapshots(prov)
	with := moneyGateway(t, srv.Addr, prov, map[string]any{"redis": map[string]any{"addresses": []string{srv.Addr}, "timeout": "1s", "key_prefix": "with:"}}, slowMoney("streams", true))
	without := moneyGateway(t, srv.Addr, prov, map[string]any{"redis": map[string]any{"addresses": []string{srv.Addr}, "timeout": "1s", "key_prefix": "without:"}}, slowMoney("streams", false))
	prompts := []string{"Say hello", "Tell me a story about a small gateway that kept its budget", strings.Repeat("Write a long answer about rate limits ", 20)}
	var table []string
	var exact, estimated, truth int64
	for gi, gw := range []*instance{with, without} {
		var calls []*sdkCall
		for i, p := range prompts {
			for j, out := range []string{"5", "30", "200"} {
				calls = append(calls, &sdkCall{ID: fmt.Sprintf("%d-%d-%d", gi, i, j), APIKey: fmt.Sprintf("sk-stream-%d-%d-%d", gi, i, j), Kind: "chat",
					Headers: map[string]any{"X-Output-Tokens": out},
					Params:  map[string]any{"model": []string{"gpt-4.1", "gpt-4.1-nano"}[j%2], "max_tokens": 256, "stream": true, "messages": []any{map[string]any{"role": "user", "content": p}}}})
			}
		}
		from := prov.count()
		runSDK(t, sdkPlan{SDK: "openai", BaseURL: gw.URL + "/v1", MaxRetries: intp(0), Concurrency: 4, Calls: calls}, 60*time.Second)
		got := byCredential(prov.reported(from))
		for _, c := range calls {
			p, ok := got[c.APIKey]
			if c.done == nil || !c.done.OK || !ok {
				t.Fatalf("%s: %s", c.ID, c.surfaced())
			}
			if u := string(c.done.Usage); u != "" && u != "null" {
				t.Errorf("%s: the SDK, which did not ask, got usage %s", c.ID, u)
			}
			ledger := chargedMicros(ledgerPico(t, p))
			charged := chargedTo(t, gw, "streams", c.APIKey)
			asked := "no"
			if p.askedUsage {
				asked = "yes (added)"
			}
			table = append(table, fmt.Sprintf("| %s | %s | %d in, %d out | %s | %d | %d |",
				[]string{"include_usage", "without"}[gi], p.model, p.input, p.output, asked, ledger, charged))
			if gi == 0 {
				exact += charged
				truth += ledger
				if charged != ledger || !p.askedUsage {
					t.Errorf("%s: with include_usage charged %d µ$, the ledger %d (the provider was asked for usage: %v)", c.ID, charged, ledger, p.askedUsage)
				}
			} else {
				estimated += charged
				if charged < ledger || p.askedUsage {
					t.Errorf("%s: without the option charged %d µ$ for %d of usage (asked %v)", c.ID, charged, ledger, p.askedUsage)
				}
			}
		}
	}
	t.Logf("9 streams through each gateway (the SDK does not ask for usage), charged against the ledger (µ$):\n| settle | model | usage | usage asked of the provider | ledger | charged |\n|---|---|---|---|---|---|\n%s", strings.Join(table, "\n"))
	t.Logf("total: the ledger %d µ$; charged with include_usage %d µ$ (%.3f×), without %d µ$ (%.3f×)", truth, exact, float64(exact)/float64(truth), estimated, float64(estimated)/float64(truth))

	// Byte for byte: the stream through the gateway, which asked for the
	// usage, is the provider's stream to a request that did not ask.
	body := `{"model":"gpt-4.1","max_tokens":100,"stream":true,"messages":[{"role":"user","content":"Say hello"}]}`
	direct := postRaw(t, "http://"+prov.addr+"/v1/chat/completions", body, "sk-direct")
	through := postRaw(t, with.URL+"/v1/chat/completions", body, "sk-bytes")
	if !bytes.Equal(direct, through) || bytes.Contains(through, []byte(`"usage"`)) {
		t.Errorf("the stream through the gateway differs from the provider's own:\n%s\n---\n%s", through, direct)
	}
	asked := prov.reported(prov.count() - 1)[0]
	if !asked.askedUsage || chargedTo(t, with, "streams", "sk-bytes") != chargedMicros(ledgerPico(t, asked)) {
		t.Errorf("the raw stream: usage asked %v, charged %d µ$, the ledger %d", asked.askedUsage, chargedTo(t, with, "streams", "sk-bytes"), chargedMicros(ledgerPico(t, asked)))
	}
	t.Logf("byte for byte: %d bytes through the gateway (which asked for the usage), %d from the provider to a request that did not ask", len(through), len(direct))
}

// postRaw posts a JSON body with a bearer credential and returns the
// response's body.
func postRaw(t *testing.T, url, body, key string) []byte {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+key)
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d %s", url, resp.StatusCode, raw)
	}
	return raw
}

// TestMoneyPrices: prices from a LiteLLM price list and lines, through
// both SDKs: a model with no price is refused before it reaches the
// provider and charged nothing; cached tokens are charged at their own
// price (Anthropic's cache writes and reads, OpenAI's cached prompt); a
// dated snapshot, asked for or served, is priced as its family; a reload
// with other prices keeps every bucket.
func TestMoneyPrices(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	serveSnapshots(prov)
	// The list: the large models in LiteLLM's format (USD a token); the
	// small ones as lines.
	list := map[string]any{"sample_spec": map[string]any{"input_cost_per_token": 0, "output_cost_per_token": 0, "max_tokens": "LEGACY"}}
	for _, m := range moneyModels[:1] {
		list[m.name] = map[string]any{"input_cost_per_token": m.input / 1e6, "output_cost_per_token": m.output / 1e6, "cache_read_input_token_cost": m.cacheRead / 1e6, "mode": "chat"}
	}
	list[moneyModels[2].name] = map[string]any{"input_cost_per_token": moneyModels[2].input / 1e6, "output_cost_per_token": moneyModels[2].output / 1e6,
		"cache_creation_input_token_cost": moneyModels[2].cacheWrite / 1e6, "cache_read_input_token_cost": moneyModels[2].cacheRead / 1e6}
	list["dall-e-3"] = map[string]any{"output_cost_per_image": 0.04, "mode": "image_generation"}
	file := filepath.Join(t.TempDir(), "model_prices.json")
	raw, _ := json.MarshalIndent(list, "", "  ")
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	prices := map[string]any{"file": file, "models": []any{
		map[string]any{"model": moneyModels[1].name, "input": moneyModels[1].input, "output": moneyModels[1].output, "cache_read": moneyModels[1].cacheRead}}}
	gateway := func(prices map[string]any) map[string]any {
		return map[string]any{"prices": prices, "error_format": "openai"}
	}
	in := moneyGateway(t, srv.Addr, prov, gateway(prices), slowMoney("money", false))

	system := strings.Repeat("You answer in one short sentence. ", 200) // 6,800 bytes of letters: 1,700 tokens
	cached := []any{map[string]any{"type": "text", "text": system, "cache_control": map[string]any{"type": "ephemeral"}}}
	messages := func() map[string]any {
		return map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 100, "system": cached, "messages": []any{map[string]any{"role": "user", "content": "Say hello"}}}
	}
	chat := func(model string) map[string]any {
		return map[string]any{"model": model, "max_tokens": 100, "messages": []any{
			map[string]any{"role": "system", "content": system}, map[string]any{"role": "user", "content": "Say hello"}}}
	}
	runs := []struct {
		sdk   string
		calls []*sdkCall
	}{
		{"openai", []*sdkCall{
			{ID: "a model with no price", APIKey: "sk-unpriced", Kind: "chat", Params: chat("gpt-5-secret")},
			{ID: "a name only like a listed one", APIKey: "sk-unpriced-2", Kind: "chat", Params: chat("gpt-4.1x")},
			{ID: "chat, the cache written", APIKey: "sk-cache-1", Kind: "chat", Params: chat("gpt-4.1")},
			{ID: "chat, cached prompt tokens", APIKey: "sk-cache-2", Kind: "chat", Params: chat("gpt-4.1")},
			{ID: "a dated snapshot asked for", APIKey: "sk-dated", Kind: "chat", Params: chat("gpt-4.1-nano-2025-04-14")},
		}},
		{"anthropic", []*sdkCall{
			{ID: "messages, cache write", APIKey: "sk-write", Kind: "messages", Params: messages()},
			{ID: "messages, cache read", APIKey: "sk-read", Kind: "messages", Params: messages()},
		}},
	}
	var table []string
	for _, r := range runs {
		from := prov.count()
		runSDK(t, sdkPlan{SDK: r.sdk, BaseURL: in.URL + map[string]string{"openai": "/v1"}[r.sdk], MaxRetries: intp(0), Concurrency: 1, Calls: r.calls}, 60*time.Second)
		got := byCredential(prov.reported(from))
		for _, c := range r.calls {
			p, reached := got[c.APIKey]
			charged := chargedTo(t, in, "money", c.APIKey)
			if strings.HasPrefix(c.APIKey, "sk-unpriced") {
				table = append(table, fmt.Sprintf("| %s | %s | refused: %s | — | %d |", c.ID, c.Params["model"], c.surfaced(), charged))
				if c.done == nil || c.done.OK || c.done.Status != 403 || reached || charged != 0 || !strings.Contains(c.done.Message, "has no price") {
					t.Errorf("%s: %s (status %v), reached the provider %v, charged %d µ$", c.ID, c.surfaced(), c.done, reached, charged)
				}
				continue
			}
			if c.done == nil || !c.done.OK || !reached {
				t.Fatalf("%s: %s", c.ID, c.surfaced())
			}
			ledger := chargedMicros(ledgerPico(t, p))
			table = append(table, fmt.Sprintf("| %s | %s served %s | %d in (%d cached), %d cache write, %d cache read, %d out | %d | %d |",
				c.ID, p.model, p.served, p.input, p.cached, p.cacheWrite, p.cacheRead, p.output, ledger, charged))
			if charged != ledger {
				t.Errorf("%s: charged %d µ$, the ledger %d", c.ID, charged, ledger)
			}
		}
	}
	t.Logf("charged against the ledger (µ$):\n| call | model | usage | ledger | charged |\n|---|---|---|---|---|\n%s", strings.Join(table, "\n"))
	if got := metricValue(t, in, "caddy_rate_limit_unpriced_models_total", map[string]string{"at": "request"}); got != 2 {
		t.Errorf("unpriced models counted %v, want 2", got)
	}

	// A reload with other prices keeps every bucket.
	before := bucketTokens(t, in, "money", "sk-cache-1")
	prices["models"] = []any{map[string]any{"model": moneyModels[1].name, "input": 1, "output": 1}}
	in.Tune = func(cfg map[string]any) {
		moneyRoutes(srv.Addr, prov.addr, func(settle string) []map[string]any { return []map[string]any{slowMoney("money", false)(settle)} })(cfg)
		for _, r := range cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)["routes"].([]any) {
			r.(map[string]any)["handle"].([]any)[0].(map[string]any)["prices"] = prices
		}
	}
	in.reload(t, respond())
	if after := bucketTokens(t, in, "money", "sk-cache-1"); after < before || after > before+2 {
		t.Errorf("after a reload with other prices the bucket holds %d µ$, it held %d", after, before)
	}
}

// v04Bin is v0.4.0's Caddy binary.
func v04Bin(t *testing.T) string {
	t.Helper()
	return releaseBin(t, testcaddy.ReleaseV04, "caddy-v0.4.0")
}

// TestMoneyBesideV040: a fleet in the middle of an upgrade to money
// budgets, v0.4.0 (the release before them) beside this build on one
// Redis: the token policies they share admit exactly what one build
// would, whichever goes first, while this build also enforces a money
// policy of its own; v0.4.0 refuses a config with money in it (the docs'
// upgrade: every instance first, then the money policies).
func TestMoneyBesideV040(t *testing.T) {
	srv := testredis.Start(t)
	on := func(header string, p map[string]any) map[string]any {
		p["match"] = map[string]any{"header": map[string]any{header: []string{"*"}}}
		return p
	}
	rate := on("X-Key", map[string]any{"name": "per_key", "key": "{http.request.header.X-Key}", "rate": "5/1h", "burst": 5})
	quota := on("X-Tenant", map[string]any{"name": "monthly", "key": "{http.request.header.X-Tenant}", "quota": "3/month"})
	money := on("X-Key", map[string]any{"name": "per_key_usd", "key": "{http.request.header.X-Key}", "unit": "usd", "rate": "1/2400h", "cost": "0.01"}) // a micro-dollar every 8.64 s
	old := startBinary(t, v04Bin(t), decidedByRedis(srv.Addr, rate, quota), respond())
	withMoney := decidedByRedis(srv.Addr, rate, quota, money)
	cur := startCaddy(t, withMoney, respond())
	orders(t, old, cur, func(t *testing.T, first, second *instance, id string) {
		for _, tc := range []struct {
			header, policy string
			want           int
		}{{"X-Key", "per_key", 5}, {"X-Tenant", "monthly", 3}} {
			hdr := map[string]string{tc.header: tc.policy + "-" + id}
			got, onCur := 0, 0
			alternateEach(t, first, second, 12, hdr, func(in *instance, status int) {
				if status == 200 {
					got++
					if in == cur {
						onCur++
					}
				}
			})
			t.Logf("%s: 12 requests alternating on v0.4.0 and this build: %d admitted (%d by this build)", tc.policy, got, onCur)
			if got != tc.want {
				t.Errorf("%s: admitted %d, want exactly %d", tc.policy, got, tc.want)
			}
			if tc.header == "X-Key" { // this build's money policy charged what it admitted
				if left := bucketTokens(t, cur, "per_key_usd", hdr["X-Key"]); left < 1_000_000-int64(onCur)*10_000 || left > 1_000_000-int64(onCur)*10_000+1 {
					t.Errorf("the money policy holds %d µ$ after %d admitted here, want %d", left, onCur, 1_000_000-int64(onCur)*10_000)
				}
			}
		}
	})
	// v0.4.0 refuses a money config: it does not know unit.
	file := filepath.Join(t.TempDir(), "money.json")
	if err := os.WriteFile(file, testcaddy.Config(1, 2, nil, []map[string]any{withMoney, respond()}), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(v04Bin(t), "validate", "--config", file).CombinedOutput()
	if err == nil || !strings.Contains(strings.ReplaceAll(string(out), `\"`, `"`), `unknown field "unit"`) {
		t.Errorf("v0.4.0 validating a money config: %v: %s", err, out)
	}
	t.Logf("v0.4.0 refuses a money config: %s", lastLine(string(out)))
}

// lastLine is the last line of s that is not empty.
func lastLine(s string) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return lines[len(lines)-1]
}
