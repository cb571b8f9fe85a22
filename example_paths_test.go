package ratelimit

import (
	"encoding/json"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestLLMExamplePaths: the LLM gateway of docs/after-admission.md, adapted
// as written, limits every request under its provider's prefix however the
// path is spelled (a trailing slash, `;a=b`, a suffix, the case, doubled
// slashes, dot segments, percent-encoding), counts GETs as requests and
// POSTs as tokens too, leaves count_tokens out of the token budget only;
// and the rest of the site answers 404 rather than reach the provider.
func TestLLMExamplePaths(t *testing.T) {
	raw, err := os.ReadFile("docs/after-admission.md")
	if err != nil {
		t.Fatal(err)
	}
	var example string
	for _, m := range regexp.MustCompile("(?ms)^```caddyfile\n(.*?)^```").FindAllStringSubmatch(string(raw), -1) {
		if strings.Contains(m[1], "openai.llm.example.com") {
			example = m[1]
		}
	}
	if example == "" {
		t.Fatal("no LLM gateway example in docs/after-admission.md")
	}
	t.Setenv("RATE_LIMIT_SECRET", "test")
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(example), nil)
	if err != nil {
		t.Fatalf("the docs' example does not adapt: %v", err)
	}
	// Each site's rate_limit handler, in process (its redis block dropped).
	var handlers []*Handler
	var walk func(v any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			if x["handler"] == "rate_limit" {
				delete(x, "redis")
				b, _ := json.Marshal(x)
				h := new(Handler)
				if err := json.Unmarshal(b, h); err != nil {
					t.Fatal(err)
				}
				handlers = append(handlers, h)
				return
			}
			for _, e := range x {
				walk(e)
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	var cfg any
	_ = json.Unmarshal(adapted, &cfg)
	walk(cfg)
	if len(handlers) != 2 || !strings.Contains(string(adapted), `"status_code":404`) {
		t.Fatalf("%d rate_limit handlers in the example, a 404 for the rest: %v", len(handlers), strings.Contains(string(adapted), `"status_code":404`))
	}
	for _, h := range handlers {
		testHandler(t, h, newMemoryStore((&clock{t: 1000 * sec}).now))
	}
	openai, anthropic := handlers[0], handlers[1]
	if strings.HasPrefix(anthropic.Policies[0].Name, "openai") { // the sites in JSON's order
		openai, anthropic = anthropic, openai
	}
	decided := func(h *Handler, method, target string) []string {
		r := httptest.NewRequest(method, "http://gw"+target, strings.NewReader(`{"model":"m","max_tokens":10,"messages":[]}`))
		r.Header.Set("Authorization", "Bearer sk-paths")
		x := serveOn([]*Handler{h}, nil, upstreamAnswering(200), r)
		var names []string
		for name := range fields(t, x.header, "RateLimit") {
			names = append(names, name)
		}
		slices.Sort(names)
		return names
	}
	both := []string{"openai_requests", "openai_tokens"}
	for _, target := range []string{"/v1/chat/completions", "/v1/chat/completions/", "/v1/chat/completions;a=b", "/v1/chat/completions.json",
		"/V1/chat/completions", "//v1/chat/completions", "/v1//chat/completions", "/./v1/chat/completions", "/x/../v1/chat/completions",
		"/v1%2Fchat/completions", "/%761/chat/completions", "/v1/responses", "/v1/embeddings"} {
		if got := decided(openai, "POST", target); !slices.Equal(got, both) {
			t.Errorf("POST %s: decided by %v, want %v", target, got, both)
		}
	}
	if got := decided(openai, "GET", "/v1/models"); !slices.Equal(got, []string{"openai_requests"}) {
		t.Errorf("GET /v1/models: decided by %v, want the requests' policy alone", got)
	}
	for _, target := range []string{"/v1", "/v2/chat/completions", "/openai/v1/chat/completions"} {
		if got := decided(openai, "POST", target); len(got) != 0 {
			t.Errorf("POST %s: decided by %v, want none (the site answers 404)", target, got)
		}
	}
	if got := decided(anthropic, "POST", "/v1/messages/count_tokens"); !slices.Equal(got, []string{"anthropic_requests"}) {
		t.Errorf("POST /v1/messages/count_tokens: decided by %v, want the requests' policy alone", got)
	}
	for _, target := range []string{"/v1/messages", "/v1/messages/", "/v1/messages/count_tokens/", "/V1/Messages/count_tokens;x"} {
		if got := decided(anthropic, "POST", target); !slices.Equal(got, []string{"anthropic_requests", "anthropic_tokens"}) {
			t.Errorf("POST %s: decided by %v, want both", target, got)
		}
	}
}
