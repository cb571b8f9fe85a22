package integration_test

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// withErrorRoutes gives the server a handle_errors route that renders its
// own page from the error's and the limiter's placeholders, as a site's
// `handle_errors { respond ... }` does.
func withErrorRoutes(cfg map[string]any) {
	srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
	srv["errors"] = map[string]any{"routes": []any{map[string]any{"handle": []any{map[string]any{
		"handler": "static_response", "status_code": "{http.error.status_code}",
		"body": "our page: {http.error.status_code} {http.rate_limit.decision} {http.rate_limit.policy} retry in {http.rate_limit.retry_after}s",
	}}}}}
}

// TestHandleErrors: a site with handle_errors routes gets a denial as a
// Caddy error, rendered by its own route with the limiter's placeholders,
// and the response still carries Retry-After and the RateLimit fields; a
// fail_closed denial is a 503 error the same way. A site without them gets
// the handler's problem+json (TestDenialContract).
func TestHandleErrors(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		h := limiter(redisAddr, map[string]any{"jitter": 0},
			map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1/1m"})
		if redisAddr != "" {
			// 1s: a call timed out on a loaded machine would follow the
			// default fail_open, which this test is not about.
			h["redis"].(map[string]any)["timeout"] = "1s"
		}
		in := startCaddyTuned(t, withErrorRoutes, h, echo())
		start := time.Now()
		if r := get(t, in.URL, "X-User", "gil"); r.status != 200 {
			t.Fatalf("first request: %d", r.status)
		}
		r := get(t, in.URL, "X-User", "gil")
		if r.status != 429 {
			t.Fatalf("second request: %d %q, want 429", r.status, r.body)
		}
		// The token comes back 60 s after the first decision, which came
		// after start: the wait (Retry-After with jitter 0, t and the
		// placeholder alike) is from 60 - elapsed, rounded up, to 60. On a
		// quiet machine that is 60.
		least, wait := leastWait(60, time.Since(start)), r.retryAfter(t)
		lim := parseFields(t, r.header, "RateLimit")
		if wait < least || wait > 60 || string(r.body) != fmt.Sprintf("our page: 429 denied per_user retry in %ds", wait) ||
			len(lim) != 1 || lim[0].params["t"] != wait || r.header.Get("RateLimit-Policy") == "" {
			t.Fatalf("denied with handle_errors, %v after the first request: %d %q, Retry-After %q, RateLimit %+v; want 429 and a wait from %d to 60 s",
				time.Since(start).Round(time.Millisecond), r.status, r.body, r.header.Get("Retry-After"), lim, least)
		}
	})
	dead := "127.0.0.1:1"
	in := startCaddyTuned(t, withErrorRoutes, limiter(dead, map[string]any{"on_error": "fail_closed"},
		map[string]any{"name": "closed", "key": "global", "rate": "1/1m"}), echo())
	r := get(t, in.URL)
	if r.status != 503 || !strings.HasPrefix(string(r.body), "our page: 503 fail_closed closed") || r.header.Get("Retry-After") == "" {
		t.Fatalf("fail_closed with handle_errors: %d %q, Retry-After %q", r.status, r.body, r.header.Get("Retry-After"))
	}
}

// TestNestedHandlers: a request through two rate_limit handlers (a
// site-wide one and one in a route) is charged once per policy name, and
// its RateLimit fields list the policies of both; a cost given as a JSON
// number works as a string does.
func TestNestedHandlers(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		site := map[string]any{"name": "site", "key": "global", "rate": "100/1h"}
		in := startCaddy(t,
			limiter(redisAddr, nil, site),
			limiter(redisAddr, nil, site, map[string]any{"name": "api", "key": "{http.request.header.X-User}", "rate": "10/1h", "cost": 2}),
			echo())
		for i, want := range []map[string]int64{{"site": 99, "api": 8}, {"site": 98, "api": 6}} {
			r := get(t, in.URL, "X-User", "hal")
			got := remainingOf(t, r.header)
			pol := parseFields(t, r.header, "RateLimit-Policy")
			if r.status != 200 || len(got) != 2 || got["site"] != want["site"] || got["api"] != want["api"] || len(pol) != 2 {
				t.Fatalf("request %d: %d RateLimit %v RateLimit-Policy %+v, want %v (site charged once, api 2 tokens)", i+1, r.status, got, pol, want)
			}
		}
	})
}
