package ratelimit

import (
	"net/http/httptest"
	"strings"
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

// TestTemplateAddr: a key's client address is masked wherever it is, alone
// or among other parts (only the address parts), by its long or short
// name; other placeholders and literals resolve as Caddy's replacer
// resolves them.
func TestTemplateAddr(t *testing.T) {
	r := httptest.NewRequest("GET", "/login", nil)
	r.RemoteAddr = "[2001:db8:1:2::9]:5555"
	repl := caddyhttp.NewTestReplacer(r)
	repl.Set("http.vars.client_ip", "2001:db8:7:8::1")
	repl.Set("user.id", "alice")
	m := clientaddr.Mask{V4: 32, V6: 64}
	for tmpl, want := range map[string]string{
		"{http.vars.client_ip}":                         "2001:db8:7:8::/64",
		"{client_ip}":                                   "2001:db8:7:8::/64",
		"{http.request.remote.host}":                    "2001:db8:1:2::/64",
		"{remote_host}":                                 "2001:db8:1:2::/64",
		"{http.request.remote}":                         "[2001:db8:1:2::/64]:5555",
		"{http.vars.client_ip}-{http.request.uri.path}": "2001:db8:7:8::/64-/login",
		"ip={client_ip};u={user.id}":                    "ip=2001:db8:7:8::/64;u=alice",
		"{user.id}{remote_host}{user.id}":               "alice2001:db8:1:2::/64alice",
		`\{client_ip}-{client_ip}`:                      "{client_ip}-2001:db8:7:8::/64",
		"{client_ip}{unknown}x":                         "2001:db8:7:8::/64x",
		// Caddy's scan: a placeholder ends at its first }, so this is one
		// unknown placeholder, not an address.
		"{x{client_ip}}": "}",
		// Not an address placeholder: unmasked.
		"{http.request.remote.host/24,48}": "2001:db8:1::/48",
	} {
		tm := newTemplate(tmpl)
		if got := tm.resolve(r, repl, m); got != want {
			t.Errorf("%q resolved to %q, want %q", tmpl, got, want)
		}
	}
	if tm := newTemplate("{client_ip}"); tm.variable != "http.vars.client_ip" || tm.addr != clientaddr.Host || tm.parts != nil {
		t.Errorf("{client_ip}: not the one-placeholder path: %+v", tm)
	}
	if tm := newTemplate("{http.request.header.X-Real-IP}"); tm.header != "X-Real-Ip" || tm.usesAddr() {
		t.Errorf("a header is not a client address: %+v", tm)
	}
	if tm := newTemplate("{user.id}-{http.request.uri.path}"); tm.parts != nil {
		t.Errorf("a template without an address keeps the replacer's path: %+v", tm)
	}
}

// TestParseTemplateMatchesReplaceAll: the split of a template into
// literals and placeholders resolves, for any template, to what Caddy's
// replacer gives (the values here are not addresses, so nothing is
// masked).
func TestParseTemplateMatchesReplaceAll(t *testing.T) {
	r := httptest.NewRequest("GET", "/a/b", nil)
	r.RemoteAddr = "@"
	repl := caddyhttp.NewTestReplacer(r)
	repl.Set("user.id", "alice")
	repl.Set("user.cost", 7)
	repl.Set("user.nil", nil)
	repl.Set("http.vars.client_ip", "not-an-ip")
	for _, tmpl := range []string{
		"{user.id}", "{user.cost}", "{user.nil}", "{unknown.thing}", "{}", "{", "}", "global", "",
		"{user.id}{user.cost}", "x{user.id}", "{user.id}x", "{user.{id}", `{user.id\}`, `\{user.id}`, `\}`, `a\`, `\\{user.id}`,
		"{{user.id}}", "{user.id", "user.id}", `{user.id\}x}`, `{user.id\}`, `x{a\}b\}c}y`, "{a}{b}{", "}{user.id}{",
		"{client_ip}-{http.request.uri.path}", "{remote}", "{http.request.remote}:{user.id}",
		strings.Repeat("{", 120) + "{user.id}", strings.Repeat("{x", 50) + "}",
	} {
		parts, ok := parseTemplate(tmpl)
		if !ok {
			continue // resolved by the replacer itself
		}
		// JSON shorthands are read as their long forms, which Caddy's
		// replacer does not know: compare with the long forms.
		long := strings.NewReplacer("{client_ip}", "{http.vars.client_ip}", "{remote}", "{http.request.remote}").Replace(tmpl)
		if got, want := resolveParts(parts, repl, clientaddr.Mask{V4: 32, V6: 64}), repl.ReplaceAll(long, ""); got != want {
			t.Errorf("%q: parts %+v resolve to %q, ReplaceAll to %q", tmpl, parts, got, want)
		}
	}
	if _, ok := parseTemplate(strings.Repeat("{", 200)); ok {
		t.Error("200 unclosed braces: parsed, where Caddy's replacer gives up")
	}
}

// TestIdentityOf: the identity an operator names is the handler's: an
// address is masked to its network, in a combined key too (where the
// address can be told apart), and anything else is kept.
func TestIdentityOf(t *testing.T) {
	for _, tc := range []struct {
		key  string
		m    clientaddr.Mask
		raw  string
		want string
	}{
		{"{http.vars.client_ip}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::9", "2001:db8:1:2::/64"},
		{"{http.vars.client_ip}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::/64", "2001:db8:1:2::/64"},
		{"{http.vars.client_ip}", clientaddr.Mask{V4: 24, V6: 64}, "192.0.2.200", "192.0.2.0/24"},
		{"{http.vars.client_ip}", clientaddr.Mask{V4: 32, V6: 128}, "2001:db8:1:2::9", "2001:db8:1:2::9"},
		{"{http.request.remote.host}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::9", "2001:db8:1:2::/64"},
		{"{http.request.remote}", clientaddr.Mask{V4: 32, V6: 64}, "[2001:db8:1:2::9]:80", "[2001:db8:1:2::/64]:80"},
		{"{http.vars.client_ip}-{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::9-/login", "2001:db8:1:2::/64-/login"},
		{"{http.vars.client_ip}-{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::9-/a-b", "2001:db8:1:2::/64-/a-b"},
		{"{http.vars.client_ip}:{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::9:/x", "2001:db8:1:2::/64:/x"},
		{"{http.request.uri.path}|{http.vars.client_ip}", clientaddr.Mask{V4: 24, V6: 64}, "/x|192.0.2.9", "/x|192.0.2.0/24"},
		{"ip {http.vars.client_ip}", clientaddr.Mask{V4: 32, V6: 64}, "ip 2001:db8::1", "ip 2001:db8::/64"},
		// Not told apart, or not an address: kept.
		{"{http.vars.client_ip}-{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8:1:2::/64-/login", "2001:db8:1:2::/64-/login"},
		{"{http.vars.client_ip}-{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "nothing", "nothing"},
		{"{http.vars.client_ip}{http.request.uri.path}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8::1/x", "2001:db8::1/x"},
		{"ip {http.vars.client_ip}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8::1", "2001:db8::1"},
		{"{http.auth.user.id}", clientaddr.Mask{V4: 32, V6: 64}, "2001:db8::1", "2001:db8::1"},
		{"{http.vars.client_ip}-{a}-{b}-{c}", clientaddr.Mask{V4: 32, V6: 64}, "x" + strings.Repeat("-", 3000), "x" + strings.Repeat("-", 3000)},
	} {
		p := &Policy{Key: tc.key, keyTmpl: newTemplate(tc.key), addrMask: tc.m}
		if got := p.identityOf(tc.raw); got != tc.want {
			t.Errorf("key %s, %v: identity %q is %q, want %q", tc.key, tc.m, tc.raw, got, tc.want)
		}
	}
}
