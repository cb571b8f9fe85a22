package ratelimit

import (
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

// TestResolveMatchesReplaceAll: resolving a key or cost template the fast
// ways (a sole placeholder looked up directly, a request header read from
// the request) gives what Caddy's own replacer gives for the template, with
// the request's placeholders as a Caddy server sets them up.
func TestResolveMatchesReplaceAll(t *testing.T) {
	templates := []string{
		"{user.id}", "{user.cost}", "{user.empty}", "{user.nil}", "{unknown.thing}", "{}", "{", "}",
		"global", "", "{user.id}{user.cost}", "x{user.id}", "{user.id}x", "{user.{id}", `{user.id\}`, `\{user.id}`,
		"{{user.id}}", "{user.id", "user.id}",
		"{http.request.header.X-User}", "{http.request.header.x-user}", "{http.request.header.X-Missing}",
		"{http.request.header.X-Twice}", "{http.request.header.X-Empty}", "{http.request.header.}",
		"{http.request.header.X-User}:{http.request.header.X-Twice}", "{http.request.method}",
	}
	for _, headers := range []map[string][]string{
		{},
		{"X-User": {"alice"}, "X-Twice": {"a", "b"}, "X-Empty": {""}},
		{"X-User": {"bob", ""}, "X-Twice": {"c"}},
	} {
		r := httptest.NewRequest("GET", "/", nil)
		for k, vs := range headers {
			for _, v := range vs {
				r.Header.Add(k, v)
			}
		}
		repl := caddyhttp.NewTestReplacer(r)
		repl.Set("user.id", "alice")
		repl.Set("user.cost", 7)
		repl.Set("user.empty", "")
		repl.Set("user.nil", nil)
		for _, tmpl := range templates {
			if got, want := newTemplate(tmpl).resolve(r, repl, clientaddr.Mask{}), repl.ReplaceAll(tmpl, ""); got != want {
				t.Errorf("headers %v, template %q: resolved %q, ReplaceAll %q", headers, tmpl, got, want)
			}
		}
	}
	// The fast paths are the ones taken.
	if tm := newTemplate("{http.request.header.x-api-key}"); tm.header != "X-Api-Key" {
		t.Errorf("header template: %+v", tm)
	}
	if tm := newTemplate("{http.auth.user.id}"); tm.variable != "http.auth.user.id" || tm.header != "" {
		t.Errorf("placeholder template: %+v", tm)
	}
	for tmpl, constant := range map[string]bool{"global": true, "": true, "{user.id}": false, `\{x`: false, "a}": false} {
		if newTemplate(tmpl).constant() != constant {
			t.Errorf("template %q: constant %v", tmpl, !constant)
		}
		// What the constant text resolves to is the text itself.
		if constant && newTemplate(tmpl).resolve(httptest.NewRequest("GET", "/", nil), caddy.NewReplacer(), clientaddr.Mask{}) != tmpl {
			t.Errorf("template %q does not resolve to itself", tmpl)
		}
	}
}
