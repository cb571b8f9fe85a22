package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// moneyPrices are the prices the money tests use: USD per million tokens.
func moneyPrices(unknown string) *Prices {
	return &Prices{Unknown: unknown, Models: []*ModelPrice{
		{Model: "gpt-4.1", Input: "2", Output: "8", CacheRead: "0.5"},
		{Model: "gpt-4.1-mini", Input: "0.4", Output: "1.6"},
		{Model: "claude-sonnet-4-5", Input: "3", Output: "15", CacheWrite: "3.75", CacheRead: "0.3"},
	}}
}

// moneyPolicy is a budget of $5 a day per API key, reserving the priced
// estimate of an LLM request and settling its priced usage.
func moneyPolicy(from string) *Policy {
	return &Policy{Name: "spend", Key: "{http.rate_limit.bearer}", Unit: "usd", Rate: "5/24h", Cost: "openai", MaxCost: 1, Settle: &Settle{From: from}}
}

// remainingOf is what the money policy's bucket of the key holds now, in µ$.
func remainingOf(t *testing.T, h *Handler, p *Policy, identity string) int64 {
	t.Helper()
	d, err := h.store.decide(context.Background(), []bucketRequest{{key: p.storageKey(h.hasher, identity), limit: p.limit, op: opInspect}})
	if err != nil {
		t.Fatal(err)
	}
	return d.verdicts[0].remaining
}

// TestMoneySettle: a request reserves its model's price of its prompt's
// estimate and max_tokens, and settles at the price of the model its
// response names (a dated snapshot is its family's), input, output and
// cached tokens each at its own price; the spend is counted by policy and
// model; the fields count micro-dollars.
func TestMoneySettle(t *testing.T) {
	const req = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100}`
	// "gpt-4.1" "user" "Say hi": 17 bytes, 5 tokens at $2 + 100 at $8 per million.
	const reserved = 5*2 + 100*8
	for _, tc := range []struct {
		name, from, ct, body, model string
		usage                       int64 // µ$
	}{
		// 488 prompt tokens at $2, 512 cached at $0.50, 50 out at $8.
		{"openai JSON, a dated snapshot, cached", settleOpenAI, "application/json",
			`{"model":"gpt-4.1-2025-04-14","choices":[],"usage":{"prompt_tokens":1000,"completion_tokens":50,"total_tokens":1050,"prompt_tokens_details":{"cached_tokens":512}}}`,
			"gpt-4.1", 976 + 400 + 256},
		// Served by another model than asked: priced as served.
		{"openai, another model served", settleOpenAI, "application/json",
			`{"model":"gpt-4.1-mini-2025-04-14","usage":{"prompt_tokens":1000,"completion_tokens":50,"total_tokens":1050}}`,
			"gpt-4.1-mini", 400 + 80},
		{"openai stream", settleOpenAI, "text/event-stream",
			"data: {\"model\":\"gpt-4.1-2025-04-14\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n" +
				"data: {\"model\":\"gpt-4.1-2025-04-14\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n\ndata: [DONE]\n\n",
			"gpt-4.1", 9*2 + 3*8},
		// 100 input at $3, 1000 written to the cache at $3.75, 2000 read at
		// $0.30, 50 out at $15.
		{"anthropic stream, cache writes and reads", settleAnthropic, "text/event-stream",
			"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"model\":\"claude-sonnet-4-5-20250929\",\"usage\":{\"input_tokens\":100,\"cache_creation_input_tokens\":1000,\"cache_read_input_tokens\":2000,\"output_tokens\":1}}}\n\n" +
				"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":50}}\n\n",
			"claude-sonnet-4-5", 300 + 3750 + 600 + 750},
		// A response naming a model the prices lack is priced as its
		// request's model, and counted.
		{"a model the prices lack", settleOpenAI, "application/json",
			`{"model":"gpt-9-preview","usage":{"prompt_tokens":10,"completion_tokens":10,"total_tokens":20}}`,
			"gpt-4.1", 10*2 + 10*8},
		// Absurd usage is capped at the most one response settles.
		{"absurd usage", settleOpenAI, "application/json",
			`{"model":"gpt-4.1","usage":{"prompt_tokens":999999999999999999,"completion_tokens":999999999999999999}}`,
			"gpt-4.1", -1},
	} {
		p := moneyPolicy(tc.from)
		h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		spent := counterValue(spendUSD.WithLabelValues("spend", tc.model))
		unpriced := counterValue(p.money.unpriced[unpricedResponse])
		x := serveLLM(t, h, req, answering([]byte(tc.body), "Content-Type", tc.ct), "Authorization", "Bearer sk-1")
		if x.status != 200 || string(x.body) != tc.body || string(x.upstream) != req {
			t.Fatalf("%s: %d, body unchanged %v, upstream's %q", tc.name, x.status, string(x.body) == tc.body, x.upstream)
		}
		pol := fields(t, x.header, "RateLimit-Policy")["spend"]
		if pol["q"] != 5_000_000 || pol["w"] != 86400 || !strings.Contains(x.header.Get("RateLimit-Policy"), `qu="usd-micros"`) {
			t.Errorf("%s: RateLimit-Policy %s", tc.name, x.header.Get("RateLimit-Policy"))
		}
		if r := fields(t, x.header, "RateLimit")["spend"]["r"]; r != 5_000_000-reserved {
			t.Errorf("%s: RateLimit r=%d, want the reservation's %d", tc.name, r, 5_000_000-reserved)
		}
		usage := tc.usage
		if usage < 0 {
			usage = p.after.maxUsage
		}
		if left := remainingOf(t, h, p, "sk-1"); left != 5_000_000-usage {
			t.Errorf("%s: %d µ$ left, want %d (a usage of %d µ$)", tc.name, left, 5_000_000-usage, usage)
		}
		if got := counterValue(spendUSD.WithLabelValues("spend", tc.model)) - spent; fmt.Sprintf("%.6f", got) != fmt.Sprintf("%.6f", float64(usage)/1e6) {
			t.Errorf("%s: spend of %s counted $%.6f, want $%.6f", tc.name, tc.model, got, float64(usage)/1e6)
		}
		if strings.HasPrefix(tc.name, "a model the prices lack") != (counterValue(p.money.unpriced[unpricedResponse]) > unpriced) {
			t.Errorf("%s: unpriced responses counted %v", tc.name, counterValue(p.money.unpriced[unpricedResponse])-unpriced)
		}
	}
}

// TestMoneyUnknownModel: a request for a model with no price is refused
// before it reaches the provider (403, naming the model and the policy),
// counted and charged nothing; with `unknown <model>` it is priced as that
// model. A shadow policy never refuses.
func TestMoneyUnknownModel(t *testing.T) {
	for _, model := range []string{"gpt-5-secret", "GPT-4.1", "gpt-4.10", "gpt-4.1\u00a0", `gpt-4.1\"`, strings.Repeat("m", 300)} {
		p := moneyPolicy(settleOpenAI)
		h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		body, _ := json.Marshal(map[string]any{"model": model, "messages": []any{map[string]any{"role": "user", "content": "hi"}}, "max_tokens": 10})
		reached := false
		x := serveLLM(t, h, string(body), func(w http.ResponseWriter, r *http.Request) { reached = true }, "Authorization", "Bearer sk-1")
		var pr struct {
			problem
			Policy, Model string
		}
		if err := json.Unmarshal(x.body, &pr); err != nil || x.status != 403 || reached || pr.Policy != "spend" || pr.Model != model && len(model) <= 256 {
			t.Errorf("model %q: %d %s, reached the upstream %v", model, x.status, x.body, reached)
		}
		if len(model) > 256 && x.status != 403 {
			t.Errorf("a model name of %d bytes: %d", len(model), x.status)
		}
		if left := remainingOf(t, h, p, "sk-1"); left != 5_000_000 {
			t.Errorf("model %q: charged %d µ$", model, 5_000_000-left)
		}
		if counterValue(p.money.unpriced[unpricedRequest]) < 1 {
			t.Errorf("model %q: not counted", model)
		}
	}
	// unknown gpt-4.1-mini: priced as it.
	p := moneyPolicy(settleOpenAI)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices("gpt-4.1-mini"), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	x := serveLLM(t, h, `{"model":"house-llm","messages":[],"max_tokens":1000}`,
		answering([]byte(`{"model":"house-llm","usage":{"prompt_tokens":1000,"completion_tokens":1000}}`), "Content-Type", "application/json"), "Authorization", "Bearer sk-1")
	if x.status != 200 || remainingOf(t, h, p, "sk-1") != 5_000_000-400-1600 {
		t.Errorf("unknown gpt-4.1-mini: %d, %d µ$ left", x.status, remainingOf(t, h, p, "sk-1"))
	}
	// A request that names no model is priced as the unknown model; under
	// unknown deny, it reserves max (and is not refused: the provider
	// refuses it, or names the model it served).
	x = serveLLM(t, h, `{"messages":[],"max_tokens":10}`, answering([]byte(`{}`), "Content-Type", "application/json"), "Authorization", "Bearer sk-2")
	if x.status != 200 || remainingOf(t, h, p, "sk-2") != 5_000_000-10*1.6 {
		t.Errorf("no model, unknown gpt-4.1-mini: %d, %d µ$ left", x.status, remainingOf(t, h, p, "sk-2"))
	}
	p = moneyPolicy(settleOpenAI)
	h = testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	x = serveLLM(t, h, `{"messages":[],"max_tokens":10}`, answering([]byte(`{}`), "Content-Type", "application/json"), "Authorization", "Bearer sk-2")
	if x.status != 200 || remainingOf(t, h, p, "sk-2") != 5_000_000-1_000_000 {
		t.Errorf("no model, unknown deny: %d, %d µ$ left, want max ($1) reserved and standing", x.status, remainingOf(t, h, p, "sk-2"))
	}
	// A shadow money policy counts, never refuses.
	sp := moneyPolicy(settleOpenAI)
	sp.Shadow = true
	h = testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{sp}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	if x := serveLLM(t, h, `{"model":"nope","max_tokens":1}`, answering([]byte(`{}`)), "Authorization", "Bearer sk-1"); x.status != 200 {
		t.Errorf("shadow: %d", x.status)
	}
}

// TestMoneyDenial: a money budget's denial says which budget, in dollars.
func TestMoneyDenial(t *testing.T) {
	p := &Policy{Name: "team", Key: "{http.rate_limit.bearer}", Unit: "usd", Rate: "0.001/1h", Cost: "openai", Settle: &Settle{From: settleOpenAI}}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	const req = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100}`
	up := answering([]byte(`{"model":"gpt-4.1","usage":{"prompt_tokens":10,"completion_tokens":100}}`), "Content-Type", "application/json")
	if x := serveLLM(t, h, req, up, "Authorization", "Bearer sk-1"); x.status != 200 {
		t.Fatalf("first: %d", x.status)
	}
	x := serveLLM(t, h, req, up, "Authorization", "Bearer sk-1")
	var pr struct {
		problem
		Budgets []moneyBudget `json:"budgets"`
	}
	if err := json.Unmarshal(x.body, &pr); err != nil || x.status != 429 {
		t.Fatalf("%d %s", x.status, x.body)
	}
	// The first used 820 µ$ (10 prompt tokens at $2, 100 out at $8), 10
	// more than it reserved: the key learned it, and reserves 820 now.
	want := moneyBudget{Policy: "team", Currency: "USD", Limit: "0.001", Remaining: "0.00018", Request: "0.00082"}
	if len(pr.Budgets) != 1 || pr.Budgets[0] != want || !strings.Contains(pr.Detail, "Budget team has $0.00018 left of $0.001, and this request reserves $0.00082") {
		t.Errorf("denial: %s", x.body)
	}
	// In the provider's format too.
	p.ErrorFormat = errorFormatOpenAI
	x = serveLLM(t, h, req, up, "Authorization", "Bearer sk-1")
	if !strings.Contains(string(x.body), "$0.00018 left of $0.001") {
		t.Errorf("openai format: %s", x.body)
	}
}

// TestMoneyModelKey: {http.rate_limit.model} keys per model: with prices,
// a dated snapshot shares its family's bucket (a client cannot make one a
// request by naming the model differently).
func TestMoneyModelKey(t *testing.T) {
	p := &Policy{Name: "per_model", Key: "{http.rate_limit.bearer}/{http.rate_limit.model}", Rate: "100/1h", Cost: "1"}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices("gpt-4.1-mini"), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	for _, m := range []string{"gpt-4.1", "gpt-4.1-2025-04-14", "gpt-4.1-2024-01-01", "claude-sonnet-4-5", "other", "another"} {
		serveLLM(t, h, `{"model":"`+m+`","max_tokens":1}`, answering([]byte(`{}`)), "Authorization", "Bearer sk-1")
	}
	for id, used := range map[string]int64{"sk-1/gpt-4.1": 3, "sk-1/claude-sonnet-4-5": 1, "sk-1/gpt-4.1-mini": 2, "sk-1/other": 0} {
		if left := remainingOf(t, h, p, id); left != 100-used {
			t.Errorf("%s: %d used, want %d", id, 100-left, used)
		}
	}
}

// openAIUpstream answers a streaming chat completion as OpenAI does: with
// `"usage": null` in every chunk and a usage chunk when the request asks
// (stream_options.include_usage), without any usage otherwise. It records
// what it was sent: the body, its declared length and Accept-Encoding.
func openAIUpstream(got *[]byte, length *int64, accept *string) func(http.ResponseWriter, *http.Request) {
	return func(w http.ResponseWriter, r *http.Request) {
		*got, _ = io.ReadAll(r.Body)
		*length, *accept = r.ContentLength, r.Header.Get("Accept-Encoding")
		var req struct {
			StreamOptions struct {
				IncludeUsage bool `json:"include_usage"`
			} `json:"stream_options"`
		}
		_ = json.Unmarshal(*got, &req)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, chatStream(req.StreamOptions.IncludeUsage))
	}
}

// chatStream is a chat completions stream of 12 tokens' usage.
func chatStream(includeUsage bool) string {
	usage := ""
	if includeUsage {
		usage = `,"usage":null`
	}
	var b strings.Builder
	for _, d := range []string{`{"role":"assistant","content":""}`, `{"content":"Hello"}`, `{"content":" there"}`, `{}`} {
		fmt.Fprintf(&b, "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4.1-2025-04-14\",\"choices\":[{\"index\":0,\"delta\":%s,\"finish_reason\":null}]%s}\n\n", d, usage)
	}
	if includeUsage {
		b.WriteString("data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"gpt-4.1-2025-04-14\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12}}\n\n")
	}
	b.WriteString("data: [DONE]\n\n")
	return b.String()
}

// TestIncludeUsage: settle openai include_usage makes a stream that does
// not ask for its usage ask, settles it exactly, and gives the client the
// stream it would have had, byte for byte; a client that asks gets the
// usage as it asked; without the option the stream is estimated.
func TestIncludeUsage(t *testing.T) {
	const stream = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100,"stream":true}`
	const asks = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100,"stream":true,"stream_options":{"include_usage":true}}`
	for _, tc := range []struct {
		name         string
		includeUsage bool
		body         string
		client       string // what the client gets
		charged      int64  // µ$
	}{
		{"asked for the client", true, stream, chatStream(false), 9*2 + 3*8},
		{"asked by the client", true, asks, chatStream(true), 9*2 + 3*8},
		// Without the option, no usage: the estimate of a stream without
		// usage (internal/llm/cut_estimate.go: the prompt's 17 bytes at a
		// token each, at $2, and max_tokens at $8), more than reserved.
		{"without the option", false, stream, chatStream(false), 17*2 + 100*8},
	} {
		p := moneyPolicy(settleOpenAI)
		p.Settle.IncludeUsage = tc.includeUsage
		h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		var sent []byte
		var length int64
		var accept string
		x := serveLLM(t, h, tc.body, openAIUpstream(&sent, &length, &accept), "Authorization", "Bearer sk-1", "Accept-Encoding", "gzip")
		if x.status != 200 || string(x.body) != tc.client {
			t.Errorf("%s: %d, the client got\n%s\nwant\n%s", tc.name, x.status, x.body, tc.client)
		}
		if left := remainingOf(t, h, p, "sk-1"); left != 5_000_000-tc.charged {
			t.Errorf("%s: charged %d µ$, want %d", tc.name, 5_000_000-left, tc.charged)
		}
		var up map[string]any
		if err := json.Unmarshal(sent, &up); err != nil || int64(len(sent)) != length {
			t.Errorf("%s: the upstream got %q (%d bytes, declared %d): %v", tc.name, sent, len(sent), length, err)
		}
		if asked := tc.includeUsage && tc.body == stream; asked != (accept == "") {
			t.Errorf("%s: the upstream was sent Accept-Encoding %q", tc.name, accept)
		}
		so, _ := up["stream_options"].(map[string]any)
		if tc.includeUsage != (so != nil && so["include_usage"] == true) && tc.body != asks {
			t.Errorf("%s: the upstream got stream_options %v", tc.name, up["stream_options"])
		}
	}
	// The request's body and its length as a provider reads them.
	r, _ := http.NewRequest("POST", "http://x/v1/chat/completions", strings.NewReader(stream))
	if r.ContentLength != int64(len(stream)) {
		t.Fatal(strconv.Itoa(int(r.ContentLength)))
	}
}

// TestMoneyHierarchy: an organisation, a team and a user, each a money
// policy on every request: the lowest remaining ceiling binds, all or
// nothing (a denied request is charged at no level), and the 429 names
// the level that denied, in dollars.
func TestMoneyHierarchy(t *testing.T) {
	level := func(name, key, usd string) *Policy {
		return &Policy{Name: name, Key: key, Unit: "usd", Rate: usd + "/24h", Cost: "openai", MaxCost: 0.01, Settle: &Settle{From: settleOpenAI}}
	}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{
		level("org", "{http.request.header.X-Org}", "0.03"),
		level("team", "{http.request.header.X-Team}", "0.018"),
		level("user", "{http.request.header.X-User}", "0.015"),
	}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	// Each call: 5 prompt tokens and max_tokens 100 at $2/$8 reserve 810
	// µ$, and use 1,000 in and 500 out: $0.006, which each level's key
	// then learns and reserves.
	const req = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100}`
	up := answering([]byte(`{"model":"gpt-4.1","usage":{"prompt_tokens":1000,"completion_tokens":500}}`), "Content-Type", "application/json")
	call := func(team, user string) (int, []string) {
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(req))
		r.Header.Set("X-Org", "acme")
		r.Header.Set("X-Team", team)
		r.Header.Set("X-User", user)
		x := serveOn([]*Handler{h}, nil, func(w http.ResponseWriter, r *http.Request) error { up(w, r); return nil }, r)
		var p problem
		_ = json.Unmarshal([]byte(x.body), &p)
		return x.status, p.ViolatedPolicies
	}
	var got []string
	for _, c := range []struct {
		team, user string
		status     int
		violated   string
	}{
		// ann ($0.015): two calls, then her own budget binds ($0.003 left).
		{"search", "ann", 200, ""}, {"search", "ann", 200, ""}, {"search", "ann", 429, "user"},
		// bob, the same team ($0.018, $0.012 used): one call, then the team.
		{"search", "bob", 200, ""}, {"search", "bob", 429, "team"},
		// cat, another team: the organisation ($0.03, $0.018 used) has room
		// for two, then binds for dan, whose user and team have room.
		{"ads", "cat", 200, ""}, {"ads", "cat", 200, ""}, {"ads", "dan", 429, "org"},
	} {
		status, violated := call(c.team, c.user)
		got = append(got, fmt.Sprintf("%s/%s %d %v", c.team, c.user, status, violated))
		if status != c.status || c.violated != "" && (len(violated) != 1 || violated[0] != c.violated) {
			t.Errorf("%s/%s: %d %v, want %d naming %q; so far %v", c.team, c.user, status, violated, c.status, c.violated, got)
		}
	}
	// All or nothing: the denied requests were charged at no level.
	for _, c := range []struct {
		p, id string
		used  int64
	}{{"org", "acme", 5 * 6000}, {"team", "search", 3 * 6000}, {"team", "ads", 2 * 6000}, {"user", "ann", 2 * 6000}, {"user", "bob", 6000}, {"user", "cat", 2 * 6000}, {"user", "dan", 0}} {
		pol := h.Policies[slices.IndexFunc(h.Policies, func(p *Policy) bool { return p.Name == c.p })]
		if left := remainingOf(t, h, pol, c.id); left != pol.limit.burst-c.used {
			t.Errorf("%s %s: %d µ$ used, want %d", c.p, c.id, pol.limit.burst-left, c.used)
		}
	}
}

// TestMoneyProviderFailure: a money budget follows the rule of a provider's
// failure (charge_failed.go): an error without usage (a 400 for a prompt
// too long, a 503, a 529, Caddy's 502) gives the whole priced reservation
// back and counts no spend, streamed with include_usage or not; an error
// reporting usage is charged that usage at its model's price; a 200 stream
// cut before its usage keeps the priced estimate of what it delivered.
func TestMoneyProviderFailure(t *testing.T) {
	big := `{"model":"gpt-4.1","max_tokens":100,"messages":[{"role":"user","content":"` + strings.Repeat("x", 1<<20) + `"}]}`
	stream := `{"model":"gpt-4.1","stream":true,"max_tokens":100,"messages":[{"role":"user","content":"Say hi"}]}`
	const reserved = 5*2 + 100*8 // "gpt-4.1" "user" "Say hi": 5 tokens at $2, 100 out at $8 per million
	for _, tc := range []struct {
		name         string
		body         string
		status       int   // the upstream's; 0: Caddy's own error (err)
		err          error // what the handler chain returns
		ct, answer   string
		charged      int64 // µ$; -1: more than nothing, at least the reservation
		includeUsage bool
	}{
		{"400, context too long, a 1 MB prompt", big, 400, nil, "application/json", `{"error":{"message":"This model's maximum context length is 1047576 tokens."}}`, 0, false},
		{"503 to a stream asked for its usage", stream, 503, nil, "application/json", `{"error":{"message":"unavailable"}}`, 0, true},
		{"529 overloaded", stream, 529, nil, "application/json", `{"type":"error","error":{"type":"overloaded_error"}}`, 0, false},
		{"Caddy's 502: the provider down", stream, 0, caddyhttp.Error(http.StatusBadGateway, errors.New("dial tcp: connection refused")), "", "", 0, true},
		{"an error reporting usage is charged it", stream, 400, nil, "application/json", `{"error":{},"usage":{"prompt_tokens":10,"completion_tokens":0,"total_tokens":10}}`, 10 * 2, false},
		{"a 200 stream cut before its usage", stream, 200, nil, "text/event-stream", "data: {\"model\":\"gpt-4.1\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n", -1, false},
	} {
		p := moneyPolicy(settleOpenAI)
		p.Settle.IncludeUsage = tc.includeUsage
		h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		spent := counterValue(spendUSD.WithLabelValues("spend", "gpt-4.1"))
		x := serveLLMError(t, h, tc.body, func(w http.ResponseWriter, r *http.Request) error {
			if tc.err != nil {
				return tc.err
			}
			w.Header().Set("Content-Type", tc.ct)
			w.WriteHeader(tc.status)
			_, _ = io.WriteString(w, tc.answer)
			return nil
		}, "Authorization", "Bearer sk-failed")
		if x.panicked != nil {
			t.Fatalf("%s: panicked: %v", tc.name, x.panicked)
		}
		charged := 5_000_000 - remainingOf(t, h, p, "sk-failed")
		counted := counterValue(spendUSD.WithLabelValues("spend", "gpt-4.1")) - spent
		switch {
		case tc.charged >= 0 && charged != tc.charged:
			t.Errorf("%s: charged %d µ$, want %d", tc.name, charged, tc.charged)
		case tc.charged < 0 && charged < reserved:
			t.Errorf("%s: charged %d µ$, want at least the reservation's %d", tc.name, charged, reserved)
		}
		if fmt.Sprintf("%.6f", counted) != fmt.Sprintf("%.6f", float64(charged)/1e6) {
			t.Errorf("%s: spend counted $%.6f, charged $%.6f", tc.name, counted, float64(charged)/1e6)
		}
	}
}
