package integration_test

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// A finished request is finished everywhere: a client that sends its next
// request the instant it has the previous response, to the other of two
// instances, is never denied by that previous request: its concurrency
// slot is free, its charge_if reservation given back, its settle made.

// startFastUpstream answers at once: /length with a body of declared
// length, /chunked with a chunked one (flushed, then ended when its
// handler returns), /empty with 204, and /settle with its usage in the
// X-Usage-Tokens header (the request's X-Usage, or 0).
func startFastUpstream(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/chunked":
			_, _ = io.WriteString(w, "part one, ")
			w.(http.Flusher).Flush()
			_, _ = io.WriteString(w, "part two")
		case "/empty":
			w.WriteHeader(http.StatusNoContent)
		case "/settle":
			usage := r.Header.Get("X-Usage")
			if usage == "" {
				usage = "0"
			}
			w.Header().Set("X-Usage-Tokens", usage)
			w.Header().Set("Content-Length", "2")
			_, _ = io.WriteString(w, "ok")
		default:
			w.Header().Set("Content-Length", "4")
			_, _ = io.WriteString(w, "done")
		}
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String()
}

// sequentially sends n requests one after the other, alternating between
// the instances, each the instant the one before has its whole response,
// on one keep-alive connection per instance; it returns the responses
// that were not 200 (or 204), in order, as "i: status".
func sequentially(t *testing.T, fleet []*instance, n int, method, path string, header ...string) []string {
	t.Helper()
	clients := make([]*http.Client, len(fleet))
	for i := range clients {
		clients[i] = newClient()
	}
	var refused []string
	for i := range n {
		in := fleet[i%len(fleet)]
		req, _ := http.NewRequest(method, in.URL+path, nil)
		for k := 0; k+1 < len(header); k += 2 {
			req.Header.Set(header[k], header[k+1])
		}
		resp, err := clients[i%len(fleet)].Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 && resp.StatusCode != 204 {
			refused = append(refused, fmt.Sprintf("%d: %d RateLimit %q", i+1, resp.StatusCode, resp.Header.Get("RateLimit")))
		}
	}
	return refused
}

// TestSequentialClientSlot: concurrent 1 over two instances, a fast
// upstream: 100 requests in a row, alternating, are all admitted, whatever
// the response's framing (a declared length, chunked, no body, HEAD).
func TestSequentialClientSlot(t *testing.T) {
	srv := testredis.Start(t)
	up := startFastUpstream(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, slotsPolicy(1, "lease", "2s")), proxyTo(up)))
	}
	for _, c := range []struct{ method, path string }{{"GET", "/length"}, {"GET", "/chunked"}, {"GET", "/empty"}, {"HEAD", "/length"}} {
		t.Run(c.method+c.path, func(t *testing.T) {
			if refused := sequentially(t, fleet, 100, c.method, c.path, "X-User", "alice"+c.path); len(refused) > 0 {
				t.Fatalf("%d of 100 sequential requests refused, want none (denied by their own finished request): %v", len(refused), refused)
			}
		})
	}
}

// TestSequentialLogins: charge_if on 401, burst 3, over two instances: 20
// successful logins in a row, alternating, each see the whole budget: its
// own reservation is given back in its response's fields, and every
// earlier one was given back before its response ended.
func TestSequentialLogins(t *testing.T) {
	srv := testredis.Start(t)
	up := startFastUpstream(t)
	policy := map[string]any{"name": "failed_logins", "key": "{http.request.header.X-Client}", "rate": "3/15m",
		"charge_if": map[string]any{"status_code": []int{401}}}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, policy), proxyTo(up)))
	}
	clients := []*http.Client{newClient(), newClient()}
	for i := range 20 {
		req, _ := http.NewRequest("GET", fleet[i%2].URL+"/length", nil)
		req.Header.Set("X-Client", "bob")
		resp, err := clients[i%2].Do(req)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || remainingOf(t, resp.Header)["failed_logins"] != 3 {
			t.Fatalf("successful login %d: %d RateLimit %q, want 200 with the whole budget, 3", i+1, resp.StatusCode, resp.Header.Get("RateLimit"))
		}
	}
}

// TestSequentialSettle: a settle whose reservation is the whole burst and
// whose usage is 0: 20 requests in a row, alternating, are all admitted,
// each finding the one before settled; then one that used 7 leaves 3.
func TestSequentialSettle(t *testing.T) {
	srv := testredis.Start(t)
	up := startFastUpstream(t)
	policy := map[string]any{"name": "tokens", "key": "{http.request.header.X-User}", "rate": "10/1h",
		"cost": "10", "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, policy), proxyTo(up)))
	}
	if refused := sequentially(t, fleet, 20, "GET", "/settle", "X-User", "carol"); len(refused) > 0 {
		t.Fatalf("%d of 20 sequential requests refused, want none (denied by their own settled request): %v", len(refused), refused)
	}
	if refused := sequentially(t, fleet[1:], 1, "GET", "/settle", "X-User", "carol", "X-Usage", strconv.Itoa(7)); len(refused) > 0 {
		t.Fatal(refused)
	}
	if got := bucketTokens(t, fleet[0], "tokens", "carol"); got != 3 {
		t.Fatalf("after a settle of 7, the other instance reads %d tokens, want 3", got)
	}
}
