package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

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
