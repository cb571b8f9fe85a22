package integration_test

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestClientPrefixes: through real Caddy and Redis, with 127.0.0.1 a
// trusted proxy so that X-Forwarded-For is {client_ip}, a policy keyed on
// the client address counts a network, not an address: one IPv6 client
// cycling through the addresses of its /64 gets the burst once, ten /64s
// get ten buckets, ipv6_prefix 128 one per address, ipv4_prefix 24 one per
// /24, and a key combining the address with the path masks the address
// part. The admin API finds a network's bucket from any of its addresses.
func TestClientPrefixes(t *testing.T) {
	srv := testredis.Start(t)
	policy := func(name, path, key string, extra map[string]any) map[string]any {
		p := map[string]any{"name": name, "key": key, "rate": "5/1h", "burst": 5, "match": map[string]any{"path": []string{path}}}
		for k, v := range extra {
			p[k] = v
		}
		return p
	}
	// jitter 0: no Retry-After pacing, which holds denials, so that the
	// denials here are answered at once.
	in := startCaddyTuned(t, trustLoopback, redisLimiter(srv.Addr, "1s", map[string]any{"jitter": 0},
		policy("per64", "/default", "{http.vars.client_ip}", nil),
		policy("per128", "/whole", "{http.vars.client_ip}", map[string]any{"ipv6_prefix": 128}),
		policy("per24", "/v4", "{http.vars.client_ip}", map[string]any{"ipv4_prefix": 24}),
		policy("perpath", "/login", "{http.vars.client_ip}-{http.request.uri.path}", nil),
	), echo())
	c := redisClient(t, srv.Addr)
	keysOf := func(policy string) []string {
		var out []string
		for _, k := range allKeys(t, c) {
			if strings.HasPrefix(k, "rl:"+policy+":") {
				out = append(out, k)
			}
		}
		return out
	}
	// admitted sends one request per address and counts the 200s; any
	// other status than 200 or 429 fails.
	admitted := func(path string, addrs []string) int {
		n := 0
		for _, a := range addrs {
			switch r := get(t, in.URL+path, "X-Forwarded-For", a); r.status {
			case 200:
				n++
			case 429:
			default:
				t.Fatalf("%s from %s: status %d %s", path, a, r.status, r.body)
			}
		}
		return n
	}
	// addresses of the /64 2001:db8:<net>::/64, spread over its 2^64.
	addrsOf64 := func(net, n int) []string {
		var out []string
		for i := range n {
			out = append(out, fmt.Sprintf("2001:db8:%x::%x:%x:%x:%x", net, i*7919%65536, i*104729%65536, i+1, i*31%65536))
		}
		return out
	}

	t.Run("100 addresses of one /64", func(t *testing.T) {
		got := admitted("/default", addrsOf64(1, 100))
		t.Logf("100 addresses of 2001:db8:1::/64, rate 5/1h burst 5: %d admitted, %d bucket(s)", got, len(keysOf("per64")))
		if got != 5 {
			t.Errorf("%d admitted, want the burst, 5", got)
		}
		if keys := keysOf("per64"); len(keys) != 1 || keys[0] != plainKey("per64", "2001:db8:1::/64") {
			t.Errorf("keys %v, want the one bucket of 2001:db8:1::/64", keys)
		}
	})

	t.Run("ten /64s", func(t *testing.T) {
		total := 0
		for net := 16; net < 26; net++ {
			got := admitted("/default", addrsOf64(net, 10))
			if got != 5 {
				t.Errorf("2001:db8:%x::/64: %d of 10 admitted, want 5", net, got)
			}
			total += got
		}
		buckets := len(keysOf("per64")) - 1 // less the /64 of the subtest before
		t.Logf("ten /64s, 10 addresses each: %d admitted, %d buckets", total, buckets)
		if total != 50 || buckets != 10 {
			t.Errorf("%d admitted in %d buckets, want 50 in 10", total, buckets)
		}
	})

	t.Run("ipv6_prefix 128", func(t *testing.T) {
		addrs := addrsOf64(1, 20)
		total := 0
		for range 6 {
			total += admitted("/whole", addrs)
		}
		t.Logf("ipv6_prefix 128: 20 addresses of one /64, 6 requests each: %d admitted, %d buckets", total, len(keysOf("per128")))
		if total != 100 || len(keysOf("per128")) != 20 {
			t.Errorf("%d admitted in %d buckets, want 100 (5 per address) in 20", total, len(keysOf("per128")))
		}
	})

	t.Run("ipv4_prefix 24", func(t *testing.T) {
		var a, b []string
		for i := range 50 {
			a = append(a, fmt.Sprintf("198.51.100.%d", i*5+1))
			b = append(b, fmt.Sprintf("203.0.113.%d", i*5+1))
		}
		gotA, gotB := admitted("/v4", a), admitted("/v4", b)
		t.Logf("ipv4_prefix 24: 50 addresses of 198.51.100.0/24: %d admitted; of 203.0.113.0/24: %d; %d buckets", gotA, gotB, len(keysOf("per24")))
		if gotA != 5 || gotB != 5 {
			t.Errorf("%d and %d admitted, want 5 per /24", gotA, gotB)
		}
		if keys := keysOf("per24"); len(keys) != 2 || !strings.Contains(strings.Join(keys, " "), plainKey("per24", "198.51.100.0/24")) {
			t.Errorf("keys %v, want the buckets of the two /24s", keys)
		}
	})

	t.Run("a key of address and path", func(t *testing.T) {
		got := admitted("/login", addrsOf64(2, 30))
		t.Logf("{client_ip}-{path}: 30 addresses of one /64: %d admitted", got)
		if got != 5 {
			t.Errorf("%d admitted, want 5", got)
		}
		if keys := keysOf("perpath"); len(keys) != 1 || keys[0] != plainKey("perpath", "2001:db8:2::/64-/login") {
			t.Errorf("keys %v, want the bucket of 2001:db8:2::/64-/login", keys)
		}
	})

	t.Run("the admin API names the network's bucket", func(t *testing.T) {
		var answer struct {
			Identity string `json:"identity"`
			Key      string `json:"key"`
			Tokens   int64  `json:"tokens"`
		}
		// Any address of the drained /64, none of which sent a request.
		out := rateLimitCLI(t, in, "inspect", "per64", "2001:db8:1::abcd", "--json")
		if err := json.Unmarshal([]byte(out), &answer); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		if answer.Identity != "2001:db8:1::/64" || answer.Key != plainKey("per64", "2001:db8:1::/64") || answer.Tokens > 0 {
			t.Errorf("inspect of an address of the drained /64: %+v, want the /64's empty bucket", answer)
		}
		rateLimitCLI(t, in, "reset", "per64", "2001:db8:1:0:ffff::1")
		if got := admitted("/default", addrsOf64(1, 7)); got != 5 {
			t.Errorf("after a reset through another address of the /64: %d of 7 admitted, want 5", got)
		}
		out = rateLimitCLI(t, in, "inspect", "perpath", "2001:db8:2::77-/login", "--json")
		if err := json.Unmarshal([]byte(out), &answer); err != nil {
			t.Fatalf("%v: %s", err, out)
		}
		if answer.Key != plainKey("perpath", "2001:db8:2::/64-/login") || answer.Tokens > 0 {
			t.Errorf("inspect of address-and-path: %+v, want the drained bucket of 2001:db8:2::/64-/login", answer)
		}
	})
}

// TestUnauthenticatedKeyLogged: Caddy logs, when it loads the config, a
// WARN naming a policy keyed on {http.auth.user.id} in a config that has no
// authentication handler, and none for the same config with basic_auth.
func TestUnauthenticatedKeyLogged(t *testing.T) {
	policy := map[string]any{"name": "exports", "key": "{http.auth.user.id}", "concurrent": 3}
	warned := func(in *instance) []string {
		var out []string
		for _, line := range strings.Split(logText(t, in), "\n") {
			if strings.Contains(line, "no authentication handler") {
				out = append(out, line)
			}
		}
		return out
	}
	in := startCaddy(t, limiter("", nil, policy), echo())
	lines := warned(in)
	if len(lines) != 1 || !strings.Contains(lines[0], `"level":"warn"`) || !strings.Contains(lines[0], `"policy":"exports"`) ||
		!strings.Contains(lines[0], "empty-key bucket") {
		t.Errorf("without authentication: log lines %q, want one WARN naming the policy", lines)
	}
	basicAuth := map[string]any{"handler": "authentication", "providers": map[string]any{"http_basic": map[string]any{
		"accounts": []any{map[string]any{"username": "alice", "password": "$2a$14$Zkx19XLiW6VYouLHR5NmfOFU0z2GTNmpkT/5qqR7hx4IjWJPDhjvG"}},
	}}}
	in = startCaddy(t, basicAuth, limiter("", nil, policy), echo())
	if lines := warned(in); len(lines) != 0 {
		t.Errorf("with basic_auth: %q", lines)
	}
}
