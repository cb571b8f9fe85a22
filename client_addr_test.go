package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

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

// TestServeHTTPClientPrefixes: through the handler, the addresses of one
// network share a bucket (the defaults: IPv6 by /64, IPv4 by address), a
// policy's prefix overrides the handler's, and the bucket a request was
// decided in is the one the admin API names for any address of it.
func TestServeHTTPClientPrefixes(t *testing.T) {
	h := testHandler(t, &Handler{
		Jitter:     jitterOff(), // no pacing: denials answered at once
		IPv4Prefix: 24,
		Policies: []*Policy{
			{Name: "net", Key: "{http.vars.client_ip}", Rate: "5/1h"},
			{Name: "addr", Key: "{remote_host}", Rate: "5/1h", IPv6Prefix: 128, IPv4Prefix: 32},
		},
	}, nil)
	admitted := func(clientIP, remote string) bool {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = remote
		// As Caddy's server does: the vars, then a replacer of the request
		// that holds them.
		r = r.WithContext(context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{"client_ip": clientIP}))
		repl := caddyhttp.NewTestReplacer(r)
		r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
		w := httptest.NewRecorder()
		err := h.ServeHTTP(w, r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return nil }))
		return err == nil && w.Code == 200
	}
	// 20 addresses of 2001:db8:1:2::/64, each from its own remote address:
	// the network's bucket admits its burst of 5; each address's own bucket
	// would have admitted all 20.
	n := 0
	for i := range 20 {
		ip := fmt.Sprintf("2001:db8:1:2::%x", i+1)
		if admitted(ip, "["+fmt.Sprintf("2001:db8:9:9::%x", i+1)+"]:4000") {
			n++
		}
	}
	if n != 5 {
		t.Errorf("20 addresses of one /64: %d admitted, want the burst, 5", n)
	}
	if !admitted("2001:db8:1:3::1", "[2001:db8:9:9::1]:4001") {
		t.Error("another /64 was denied")
	}
	// IPv4 by /24 (the handler's), and the policy keyed per address (its
	// own /32 and /128) beside it.
	n = 0
	for i := range 10 {
		if admitted(fmt.Sprintf("192.0.2.%d", i+1), fmt.Sprintf("198.51.100.%d:4000", i+1)) {
			n++
		}
	}
	if n != 5 {
		t.Errorf("10 addresses of one /24: %d admitted, want 5", n)
	}
	n = 0
	for range 10 {
		if admitted(fmt.Sprintf("192.0.3.%d", 1), "[2001:db8:5::1]:4000") {
			n++
		}
	}
	if n != 5 {
		t.Errorf("one remote address: %d admitted, want its own burst of 5", n)
	}
	net, addr := h.Policies[0], h.Policies[1]
	if a, b := net.storageKey(h.hasher, net.identityOf("2001:db8:1:2::ffff")), net.storageKey(h.hasher, "2001:db8:1:2::/64"); a != b {
		t.Errorf("the admin API's key of an address of the /64, %s, is not the /64's, %s", a, b)
	}
	if got := addr.identityOf("2001:db8:5::1"); got != "2001:db8:5::1" {
		t.Errorf("per address: identity %q", got)
	}
}

// FuzzParseTemplate: the split of any template into literals and
// placeholders resolves as Caddy's replacer resolves the template, and
// masking any value, as a host or host:port, never panics and is stable.
func FuzzParseTemplate(f *testing.F) {
	f.Add("{client_ip}-{http.request.uri.path}", "2001:db8::1")
	f.Add(`a\{b}{user.id\}c}`, "[::ffff:1.2.3.4]:80")
	f.Fuzz(func(t *testing.T, tmpl, value string) {
		if len(tmpl) > 512 {
			return
		}
		r := httptest.NewRequest("GET", "/a", nil)
		repl := caddyhttp.NewTestReplacer(r)
		repl.Set("user.id", value)
		parts, ok := parseTemplate(tmpl)
		if ok {
			var long []templatePart // the parts with no address, which resolve unmasked
			for _, p := range parts {
				if p.addr == clientaddr.None {
					long = append(long, p)
				}
			}
			if len(long) == len(parts) {
				if got, want := resolveParts(parts, repl, clientaddr.Mask{V4: 32, V6: 64}), repl.ReplaceAll(tmpl, ""); got != want {
					t.Fatalf("%q: parts %+v resolve to %q, ReplaceAll to %q", tmpl, parts, got, want)
				}
			}
		}
		m := clientaddr.Mask{V4: 24, V6: 64}
		for _, kind := range []clientaddr.Kind{clientaddr.Host, clientaddr.HostPort} {
			once := m.Masked(value, kind)
			if m.Masked(once, kind) != once {
				t.Fatalf("%q masked to %q, which masks to %q", value, once, m.Masked(once, kind))
			}
		}
	})
}
