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
			logFile := filepath.Join(t.TempDir(), "caddy.log")
			raw, err := json.Marshal(map[string]any{
				"admin":   map[string]any{"disabled": true},
				"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "WARN", "writer": map[string]any{"output": "file", "filename": logFile}}}},
				"apps":    map[string]any{"http": map[string]any{"servers": tc.servers}},
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
			var warnings []map[string]any
			for _, line := range strings.Split(string(out), "\n") {
				var entry map[string]any
				if json.Unmarshal([]byte(line), &entry) == nil && strings.Contains(entry["msg"].(string), "no authentication handler") {
					warnings = append(warnings, entry)
				}
			}
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
