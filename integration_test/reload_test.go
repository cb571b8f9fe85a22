package integration_test

import (
	"testing"
)

// TestReloadKeepsBuckets: a drained bucket stays drained across config
// reloads, with Redis and in-process.
func TestReloadKeepsBuckets(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"}
		in := startCaddy(t, limiter(redisAddr, nil, policy), echo())
		for range 3 {
			if r := get(t, in.URL, "X-User", "carol"); r.status != 200 {
				t.Fatalf("draining: status %d", r.status)
			}
		}
		for i := range 5 {
			// Each reload changes something else in the config.
			in.reload(t, limiter(redisAddr, map[string]any{"jitter": float64(i) / 10}, policy), echo())
			if r := get(t, in.URL, "X-User", "carol"); r.status != 429 {
				t.Fatalf("after reload %d: status %d, want the bucket still drained (429)", i+1, r.status)
			}
		}
		if r := get(t, in.URL, "X-User", "dave"); r.status != 200 {
			t.Fatalf("another user after reloads: %d", r.status)
		}
	})
}
