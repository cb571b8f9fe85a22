package ratelimit

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestCredential: {http.rate_limit.credential} is the key a request
// carries however the SDK sends it (Authorization: Bearer, x-api-key,
// api-key, x-goog-api-key), one credential however it is written; empty
// without one, and when two different ones are sent (which one the upstream
// takes cannot be known, and either would let a client pick its bucket).
func TestCredential(t *testing.T) {
	for _, tc := range []struct {
		name   string
		header []string
		want   string
	}{
		{"openai and anthropic's TypeScript SDK", []string{"Authorization", "Bearer sk-ant-1"}, "sk-ant-1"},
		{"the scheme in any case, spaces around", []string{"Authorization", "bearer   sk-1 "}, "sk-1"},
		{"x-api-key", []string{"X-Api-Key", "sk-ant-1"}, "sk-ant-1"},
		{"x-api-key with spaces", []string{"X-Api-Key", " sk-ant-1\t"}, "sk-ant-1"},
		{"azure api-key", []string{"Api-Key", "az-1"}, "az-1"},
		{"gemini x-goog-api-key", []string{"X-Goog-Api-Key", "AIza-1"}, "AIza-1"},
		{"the same in two fields", []string{"Authorization", "Bearer k", "X-Api-Key", "k"}, "k"},
		{"two different credentials", []string{"Authorization", "Bearer k", "X-Api-Key", "other"}, ""},
		{"two different Authorization", []string{"Authorization", "Bearer k", "Authorization", "Bearer other"}, ""},
		{"Basic, and a key", []string{"Authorization", "Basic eDp5", "X-Api-Key", "k"}, "k"},
		{"an empty key field", []string{"X-Api-Key", "", "Api-Key", "k"}, "k"},
		{"none", nil, ""},
		{"another scheme only", []string{"Authorization", "Token k"}, ""},
	} {
		h := http.Header{}
		for i := 0; i+1 < len(tc.header); i += 2 {
			h.Add(tc.header[i], tc.header[i+1])
		}
		if got := credential(h); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
		// The template's fast path and the placeholder give the same.
		r := httptest.NewRequest("GET", "/", nil)
		r.Header = h
		repl := caddy.NewReplacer()
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{}))
		requestStateOf(r, repl)
		tm := newTemplate("{http.rate_limit.credential}")
		if got, viaRepl := tm.resolve(r, repl, clientaddr.Mask{}), repl.ReplaceAll("{http.rate_limit.credential}", ""); !tm.cred || got != tc.want || viaRepl != tc.want {
			t.Errorf("%s: template %q (fast path %v), replacer %q, want %q", tc.name, got, tm.cred, viaRepl, tc.want)
		}
	}
}

// TestEmptyKeyWarning: a policy whose key resolves empty for a share of its
// requests counts them (caddy_rate_limit_empty_keys_total{policy}) and
// warns, naming the policy and the fix, once a minute at most; a policy
// whose requests all carry a key never warns; the empty-key bucket is
// inspected and reset through the admin API (empty_key).
func TestEmptyKeyWarning(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "empty_keys_llm", Key: "{http.request.header.X-Api-Key}", Rate: "5/1h"},
		{Name: "empty_keys_ok", Key: "{http.rate_limit.credential}", Rate: "1000/1h"},
	}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	h.logger = zap.New(core)
	before := counterValue(emptyKeys.WithLabelValues("empty_keys_llm"))
	denied := 0
	for i := range 60 {
		// The Anthropic SDK's requests: Authorization: Bearer, no x-api-key.
		x := serve([]*Handler{h}, nil, "Authorization", "Bearer sk-ant-"+string(rune('a'+i%3)))
		if x.status == 429 {
			denied++
		}
	}
	if got := counterValue(emptyKeys.WithLabelValues("empty_keys_llm")) - before; got != 60 || denied != 55 {
		t.Fatalf("60 requests of 3 tenants keyed on x-api-key: %v counted empty, %d denied (want 60, 55: one bucket for all)", got, denied)
	}
	var lines []observer.LoggedEntry
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "resolved empty") {
			lines = append(lines, e)
		}
	}
	if len(lines) != 1 || !strings.Contains(lines[0].Message, "empty_keys_llm") || !strings.Contains(lines[0].Message, "{http.rate_limit.credential}") || strings.Contains(lines[0].Message, "sk-ant") {
		t.Fatalf("%d lines, want one naming the policy and the fix, no credential: %v", len(lines), lines)
	}
	t.Logf("logged: %s", lines[0].Message)
	// The empty-key bucket, through the admin API.
	status, body := adminDo(t, "GET", "/rate_limit/inspect?policy=empty_keys_llm&empty_key=true", "")
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); status != 200 || err != nil || st.Tokens != 0 {
		t.Fatalf("inspect --empty-key: %d %s", status, body)
	}
	if status, body := adminDo(t, "GET", "/rate_limit/inspect?policy=empty_keys_llm", ""); status != 400 || !strings.Contains(body, "empty_key") {
		t.Fatalf("inspect without an identity: %d %s, want 400 saying empty_key", status, body)
	}
	if status, body := adminDo(t, "POST", "/rate_limit/reset", `{"policy":"empty_keys_llm","empty_key":true}`); status != 200 || !strings.Contains(body, `"tokens":5`) {
		t.Fatalf("reset --empty-key: %d %s", status, body)
	}
	if x := serve([]*Handler{h}, nil, "Authorization", "Bearer sk-ant-b"); x.status != 200 {
		t.Fatalf("after the reset: %d", x.status)
	}
	if status, body := adminDo(t, "POST", "/rate_limit/reset", `{"policy":"empty_keys_llm","empty_key":true,"identity":"x"}`); status != 400 {
		t.Fatalf("reset of an identity and the empty key: %d %s, want 400", status, body)
	}
}

// TestTwoCredentials: a request carrying two different credentials is
// refused with a 400 problem naming the fields (not their values) by a
// policy keyed on the credential, before the upstream and before any
// bucket is charged; the same credential twice, a shadow policy, and a
// policy keyed on something else let it through. A policy keyed on the
// credential whose requests carry none warns that they carry none, not to
// key on the credential.
func TestTwoCredentials(t *testing.T) {
	core, logs := observer.New(zapcore.WarnLevel)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "two_creds", Key: "{http.rate_limit.credential}", Rate: "5/1h"},
	}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	h.logger = zap.New(core)
	x := serve([]*Handler{h}, nil, "Authorization", "Bearer sk-tenant", "X-Api-Key", "junk-key")
	var p problem
	_ = json.Unmarshal([]byte(x.body), &p)
	if x.status != 400 || x.passed || p.Status != 400 || !strings.Contains(p.Detail, "Authorization, X-Api-Key") || strings.Contains(x.body, "sk-tenant") || strings.Contains(x.body, "junk") {
		t.Fatalf("two credentials: %d (upstream reached %v) %s; want 400 naming the fields, not the values", x.status, x.passed, x.body)
	}
	for range 5 { // the tenant's bucket is untouched: its 5 go through
		if x := serve([]*Handler{h}, nil, "Authorization", "Bearer sk-tenant"); x.status != 200 {
			t.Fatalf("the tenant after a refused request: %d", x.status)
		}
	}
	if x := serve([]*Handler{h}, nil, "Authorization", "Bearer sk-same", "X-Api-Key", "sk-same"); x.status != 200 {
		t.Errorf("the same credential twice: %d, want 200", x.status)
	}
	other := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "two_creds_shadow", Key: "{http.rate_limit.credential}", Rate: "5/1h", Shadow: true},
		{Name: "two_creds_ip", Key: "{client_ip}", Rate: "5/1h"},
	}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	if x := serve([]*Handler{other}, nil, "Authorization", "Bearer a", "X-Api-Key", "b"); x.status != 200 {
		t.Errorf("shadow and client-address policies: %d, want 200", x.status)
	}
	for i := range 30 {
		serve([]*Handler{h}, nil, "X-Client", string(rune('a'+i%3))) // no credential
	}
	var warned []string
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "resolved empty") {
			warned = append(warned, e.Message)
		}
	}
	if len(warned) != 1 || !strings.Contains(warned[0], "these requests carry none") || strings.Contains(warned[0], "Key on what identifies") {
		t.Errorf("the empty-key WARN of a policy keyed on the credential: %q", warned)
	}
}
