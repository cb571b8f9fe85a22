package ratelimit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestUnauthenticatedKeyWarning: provisioned by Caddy (caddy.Validate: the
// whole config provisioned, nothing started), a policy keyed on
// {http.auth.user.id} in a config without any authentication handler gets
// one WARN naming it; an authentication handler anywhere in the HTTP app
// (before it in its route, in an earlier route's subroute, provisioned
// already, or in another server) or a key that is not an authenticated
// identity gets none.
func TestUnauthenticatedKeyWarning(t *testing.T) {
	rateLimit := func(key string) map[string]any {
		return map[string]any{"handler": "rate_limit", "policies": []any{
			map[string]any{"name": "per_user", "key": key, "concurrent": 3},
			map[string]any{"name": "per_ip", "key": "{http.vars.client_ip}", "rate": "10/1s"},
		}}
	}
	basicAuth := map[string]any{"handler": "authentication", "providers": map[string]any{"http_basic": map[string]any{
		"accounts": []any{map[string]any{"username": "alice", "password": "$2a$14$Zkx19XLiW6VYouLHR5NmfOFU0z2GTNmpkT/5qqR7hx4IjWJPDhjvG"}},
	}}}
	respond := map[string]any{"handler": "static_response", "body": "ok"}
	route := func(handlers ...any) map[string]any { return map[string]any{"handle": handlers} }
	subroute := func(routes ...any) map[string]any { return map[string]any{"handler": "subroute", "routes": routes} }
	port := 10000
	server := func(routes ...any) map[string]any { // never bound: caddy.Validate starts nothing
		port++
		return map[string]any{"listen": []string{"127.0.0.1:" + strconv.Itoa(port)}, "automatic_https": map[string]any{"disable": true}, "routes": routes}
	}
	for _, tc := range []struct {
		name    string
		servers map[string]any
		warn    bool
	}{
		{"no authentication", map[string]any{"a": server(route(rateLimit("{http.auth.user.id}"), respond))}, true},
		{"no authentication, in a subroute", map[string]any{"a": server(route(subroute(route(rateLimit("{http.auth.user.tenant}-x"), respond))))}, true},
		{"basic_auth before it", map[string]any{"a": server(route(basicAuth, rateLimit("{http.auth.user.id}"), respond))}, false},
		{"basic_auth in an earlier route's subroute", map[string]any{"a": server(route(subroute(route(basicAuth))), route(rateLimit("{http.auth.user.id}"), respond))}, false},
		{"basic_auth in a later route", map[string]any{"a": server(route(rateLimit("{http.auth.user.id}")), route(subroute(route(basicAuth, respond))))}, false},
		{"basic_auth on another server", map[string]any{"a": server(route(rateLimit("{http.auth.user.id}"), respond)), "b": server(route(basicAuth, respond))}, false},
		{"a key on a header", map[string]any{"a": server(route(rateLimit("{http.request.header.X-User}"), respond))}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			warnings, out := provisionWarnings(t, tc.servers, "no authentication handler")
			if !tc.warn {
				if len(warnings) != 0 {
					t.Fatalf("warned: %v", warnings)
				}
				return
			}
			if len(warnings) != 1 {
				t.Fatalf("want one warning, got %d:\n%s", len(warnings), out)
			}
			w := warnings[0]
			msg := w["msg"].(string)
			if w["level"] != "warn" || w["policy"] != "per_user" || !strings.Contains(msg, "policy per_user") ||
				!strings.Contains(msg, "empty-key bucket") || !strings.Contains(msg, "forward_auth") {
				t.Errorf("warning %v", w)
			}
		})
	}
}

// provisionWarnings provisions an HTTP app of the servers as Caddy does
// (caddy.Validate: the whole config provisioned, nothing started) and
// returns its WARN entries whose message holds about, and the whole log.
func provisionWarnings(t *testing.T, servers map[string]any, about string) (warnings []map[string]any, log []byte) {
	t.Helper()
	logFile := filepath.Join(t.TempDir(), "caddy.log")
	raw, err := json.Marshal(map[string]any{
		"admin":   map[string]any{"disabled": true},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "WARN", "writer": map[string]any{"output": "file", "filename": logFile}}}},
		"apps":    map[string]any{"http": map[string]any{"servers": servers}},
	})
	if err != nil {
		t.Fatal(err)
	}
	cfg := new(caddy.Config)
	if err := caddy.StrictUnmarshalJSON(raw, cfg); err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(cfg); err != nil {
		t.Fatal(err)
	}
	out, _ := os.ReadFile(logFile)
	for _, line := range strings.Split(string(out), "\n") {
		var entry map[string]any
		if json.Unmarshal([]byte(line), &entry) == nil && strings.Contains(entry["msg"].(string), about) {
			warnings = append(warnings, entry)
		}
	}
	return warnings, out
}

// TestAnonymousQuotaKeyWarning: a quota keyed on a value the client
// chooses (a header, the query), in a config where nothing authenticates
// it, gets one WARN naming the policy and how long its keys live; a quota
// keyed on an authenticated identity, one behind basic_auth or
// forward_auth, or a rate policy keyed on a header gets none.
func TestAnonymousQuotaKeyWarning(t *testing.T) {
	quota := func(key string) map[string]any {
		return map[string]any{"handler": "rate_limit", "policies": []any{
			map[string]any{"name": "monthly", "key": key, "quota": "1000/month"},
			map[string]any{"name": "per_header", "key": "{http.request.header.X-Anything}", "rate": "10/1s"},
		}}
	}
	basicAuth := map[string]any{"handler": "authentication", "providers": map[string]any{"http_basic": map[string]any{
		"accounts": []any{map[string]any{"username": "alice", "password": "$2a$14$Zkx19XLiW6VYouLHR5NmfOFU0z2GTNmpkT/5qqR7hx4IjWJPDhjvG"}},
	}}}
	forwardAuth := map[string]any{"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": "127.0.0.1:9"}},
		"handle_response": []any{map[string]any{"match": map[string]any{"status_code": []int{2}},
			"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "headers", "request": map[string]any{"set": map[string]any{"X-Tenant": []string{"{http.reverse_proxy.header.X-Tenant}"}}}}}}}}}}
	respond := map[string]any{"handler": "static_response", "body": "ok"}
	server := func(handlers ...any) map[string]any {
		return map[string]any{"a": map[string]any{"listen": []string{"127.0.0.1:10100"}, "automatic_https": map[string]any{"disable": true},
			"routes": []any{map[string]any{"handle": handlers}}}}
	}
	for _, tc := range []struct {
		name    string
		servers map[string]any
		warn    bool
	}{
		{"a header", server(quota("{http.request.header.X-Tenant}"), respond), true},
		{"the query", server(quota("{http.request.uri.query.key}"), respond), true},
		{"a header behind basic_auth", server(basicAuth, quota("{http.request.header.X-Tenant}"), respond), false},
		{"a header behind forward_auth", server(forwardAuth, quota("{http.request.header.X-Tenant}"), respond), false},
		{"an authenticated identity", server(basicAuth, quota("{http.auth.user.id}"), respond), false},
		{"the client's address", server(quota("{http.vars.client_ip}"), respond), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			warnings, out := provisionWarnings(t, tc.servers, "a value the client chooses")
			if !tc.warn {
				if len(warnings) != 0 {
					t.Fatalf("warned: %v", warnings)
				}
				return
			}
			if len(warnings) != 1 {
				t.Fatalf("want one warning, got %d:\n%s", len(warnings), out)
			}
			w := warnings[0]
			msg := w["msg"].(string)
			if w["level"] != "warn" || w["policy"] != "monthly" || w["period"] != "month" || !strings.Contains(msg, "until the month ends") {
				t.Errorf("warning %v", w)
			}
		})
	}
}
