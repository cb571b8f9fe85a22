package ratelimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// BenchmarkHandler measures the handler's own cost per request (matching,
// keys, the decision, headers) with the in-process store: no network, so
// what remains is our code; and, for its allocations, the same through a
// real redis-server. Allocations per request included.
func BenchmarkHandler(b *testing.B) {
	srv := testredis.Start(b)
	for _, tc := range []struct {
		name     string
		policies []*Policy
		redis    bool
	}{
		{"no_handler", nil, false}, // the harness alone: subtract it from the others
		{"one_policy", []*Policy{{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "1000000/1s"}}, false},
		{"two_policies", []*Policy{
			{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "1000000/1s"},
			{Name: "global", Key: "global", Rate: "1000000/1s"},
		}, false},
		{"one_policy_redis", []*Policy{{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "1000000/1s"}}, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			var serve func(http.ResponseWriter, *http.Request, caddyhttp.Handler) error = func(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
				return next.ServeHTTP(w, r)
			}
			if tc.policies != nil {
				h := &Handler{KeySecret: "secret", Policies: tc.policies}
				if tc.redis {
					h.Redis = &RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(time.Second)}
				}
				ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
				defer cancel()
				if err := h.Provision(ctx); err != nil {
					b.Fatal(err)
				}
				defer h.Cleanup()
				serve = h.ServeHTTP
			}
			users := make([]string, 10_000)
			for i := range users {
				users[i] = "user-" + strconv.Itoa(i)
			}
			next := caddyhttp.HandlerFunc(func(http.ResponseWriter, *http.Request) error { return nil })
			var n atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r := httptest.NewRequest("GET", "/", nil)
					r.Header.Set("X-User", users[n.Add(1)%int64(len(users))])
					repl := caddy.NewReplacer()
					r = r.WithContext(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl))
					w := httptest.NewRecorder()
					if err := serve(w, r, next); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}
