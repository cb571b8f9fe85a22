package integration_test

import (
	"encoding/json"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestPermanentRedisErrors: a Redis that answers, but refuses the
// limiter's calls (a wrong password, an ACL without the commands, a
// replica, a Redis out of memory): the requests follow on_error, the
// refusals are counted under their own kind, logged at ERROR with what to
// change (once, not per request), never as "Redis unavailable", and the
// breaker stays closed.
func TestPermanentRedisErrors(t *testing.T) {
	for _, tc := range []struct {
		kind  string
		setup func(t *testing.T, srv *testredis.Server) map[string]any // the redis block
		fix   string                                                   // in the ERROR line
	}{
		{"wrongpass", func(t *testing.T, srv *testredis.Server) map[string]any {
			do(t, srv, "ACL", "SETUSER", "limiter", "on", ">right", "~rl:*", "+@all")
			return map[string]any{"addresses": []string{srv.Addr}, "username": "limiter", "password": "wrong"}
		}, "check the redis username and password"},
		{"noperm", func(t *testing.T, srv *testredis.Server) map[string]any {
			do(t, srv, "ACL", "SETUSER", "limiter", "on", ">pw", "~rl:*", "+@all", "-evalsha", "-eval")
			return map[string]any{"addresses": []string{srv.Addr}, "username": "limiter", "password": "pw"}
		}, "ACL SETUSER"},
		{"readonly", func(t *testing.T, srv *testredis.Server) map[string]any {
			master := testredis.Start(t)
			do(t, srv, "REPLICAOF", "127.0.0.1", strings.TrimPrefix(master.Addr, "127.0.0.1:"))
			return map[string]any{"addresses": []string{srv.Addr}}
		}, "the address is a replica"},
		{"oom", func(t *testing.T, srv *testredis.Server) map[string]any {
			do(t, srv, "CONFIG", "SET", "maxmemory-policy", "noeviction")
			do(t, srv, "CONFIG", "SET", "maxmemory", "1")
			return map[string]any{"addresses": []string{srv.Addr}}
		}, "maxmemory"},
	} {
		t.Run(tc.kind, func(t *testing.T) {
			srv := testredis.Start(t)
			h := limiter("", nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"})
			h["redis"] = tc.setup(t, srv)
			in := startCaddy(t, h, echo())
			for i := range 30 {
				if r := get(t, in.URL, "X-User", "u"+strconv.Itoa(i%3)); r.status != 200 || !strings.HasPrefix(string(r.body), "fail_open") {
					t.Fatalf("request %d: %d %q, want 200 fail_open", i, r.status, r.body)
				}
			}
			kinds := storeErrorKinds(t, in)
			t.Logf("store errors: %v", kinds)
			if kinds[tc.kind] == 0 || kinds["circuit_open"] != 0 {
				t.Errorf("store_errors_total %v, want %s counted and no circuit_open", kinds, tc.kind)
			}
			errors, unavailable := 0, 0
			raw, _ := os.ReadFile(in.Log)
			for _, line := range strings.Split(string(raw), "\n") {
				var entry map[string]any
				if json.Unmarshal([]byte(line), &entry) != nil {
					continue
				}
				msg, _ := entry["msg"].(string)
				switch {
				case strings.Contains(msg, "unavailable"):
					unavailable++
				case entry["level"] == "error" && strings.Contains(msg, tc.fix):
					errors++
				}
			}
			if errors != 1 || unavailable != 0 {
				t.Errorf("%d ERROR lines naming %q and %d saying unavailable, want 1 and 0:\n%s", errors, tc.fix, unavailable, raw)
			}
		})
	}
}

// TestEvictionWarning: a Redis that may evict any key to make room is
// warned about once, at connect.
func TestEvictionWarning(t *testing.T) {
	srv := testredis.Start(t)
	do(t, srv, "CONFIG", "SET", "maxmemory-policy", "allkeys-lru")
	in := startCaddy(t, limiter(srv.Addr, nil, map[string]any{"name": "p", "key": "global", "rate": "3/1h"}), echo())
	get(t, in.URL)
	deadline := time.Now().Add(5 * time.Second)
	for !logMentions(t, in, "volatile-ttl") {
		if time.Now().After(deadline) {
			raw, _ := os.ReadFile(in.Log)
			t.Fatalf("no warning about allkeys-lru within 5 s:\n%s", raw)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// do runs a Redis command that must succeed.
func do(t *testing.T, srv *testredis.Server, args ...string) string {
	t.Helper()
	v, err := srv.Do(args...)
	if err != nil {
		t.Fatalf("%v: %v", args, err)
	}
	return v
}
