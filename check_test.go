package ratelimit

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// checkConfig writes a Caddy JSON config whose one route runs the
// handlers, nested in a subroute as the Caddyfile adapter nests them.
func checkConfig(t *testing.T, handlers ...map[string]any) string {
	t.Helper()
	for _, h := range handlers {
		h["handler"] = "rate_limit"
	}
	cfg := map[string]any{"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"srv0": map[string]any{
		"listen": []string{"127.0.0.1:0"},
		"routes": []any{map[string]any{"handle": []any{map[string]any{"handler": "subroute", "routes": []any{
			map[string]any{"handle": handlers},
		}}}}},
	}}}}}
	raw, _ := json.Marshal(cfg)
	path := filepath.Join(t.TempDir(), "caddy.json")
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func checkHandlerJSON(redis map[string]any, secret string, names ...string) map[string]any {
	if names == nil {
		names = []string{"api", "slots"}
	}
	h := map[string]any{"key_secret": secret, "policies": []any{
		map[string]any{"name": names[0], "key": "{client_ip}", "rate": "100/1m"},
		map[string]any{"name": names[1], "key": "global", "concurrent": 2},
	}}
	if redis != nil {
		h["redis"] = redis
	}
	return h
}

// TestRunCheck: `caddy rate-limit check` says, per policy, whether Redis
// decides it, and fails naming those it would not decide; an in-process
// handler is no problem; a config that does not load is.
func TestRunCheck(t *testing.T) {
	srv := testredis.Start(t)
	if _, err := srv.Do("ACL", "SETUSER", "limiter", "on", ">right", "~rl:*", "+@all"); err != nil {
		t.Fatal(err)
	}
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	for _, tc := range []struct {
		name     string
		handlers []map[string]any
		problems []string
		out      []string
	}{
		{"decided", []map[string]any{checkHandlerJSON(map[string]any{"addresses": []string{srv.Addr}}, "s1"), checkHandlerJSON(nil, "s1", "local_api", "local_slots")},
			nil, []string{"policy api: decided by Redis", "policy slots: decided by Redis", "in-process buckets", "0 live instance(s)"}},
		{"wrong password", []map[string]any{checkHandlerJSON(map[string]any{"addresses": []string{srv.Addr}, "username": "limiter", "password": "wrong"}, "s1")},
			[]string{"policy api would not be decided by Redis (wrongpass)", "policy slots would not be decided by Redis (wrongpass)"},
			[]string{"policy api: NOT decided by Redis: Redis refuses the username or password", "check the redis username and password", "policy api will fail_open (admit every request) until Redis answers"}},
		{"unreachable", []map[string]any{checkHandlerJSON(map[string]any{"addresses": []string{closed}}, "s1")},
			[]string{"policy api would not be decided by Redis (connection)", "policy slots would not be decided by Redis (connection)"},
			[]string{"Redis cannot be reached", "connection refused"}},
		{"does not load", []map[string]any{checkHandlerJSON(map[string]any{"addresses": []string{srv.Addr}}, "{env.RATE_LIMIT_CHECK_UNSET}")},
			[]string{"the handler at apps.http.servers.srv0.routes[0].handle[0].routes[0].handle[0] does not load"}, []string{"resolves to the empty string"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			problems, _, err := runCheck(&out, checkConfig(t, tc.handlers...), "")
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(problems, "\n") != strings.Join(tc.problems, "\n") {
				t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(problems, "\n"), strings.Join(tc.problems, "\n"))
			}
			for _, s := range tc.out {
				if !strings.Contains(out.String(), s) {
					t.Errorf("the output does not say %q:\n%s", s, out.String())
				}
			}
		})
	}
}
