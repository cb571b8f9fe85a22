package ratelimit

import (
	"crypto/tls"
	"encoding/json"
	"errors"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	dto "github.com/prometheus/client_model/go"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

const sec = int64(1_000_000) // µs

// clock is an injected µs clock for the in-process store.
type clock struct{ t int64 }

func (c *clock) now() int64 { return c.t }

// newTestRedis starts a redis-server for the test and returns it, a client
// of it and a Redis store on it.
func newTestRedis(t *testing.T) (*testredis.Server, *redis.Client, *redisStore) {
	t.Helper()
	srv := testredis.Start(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })
	return srv, client, storeOn(t, srv.Addr, time.Duration(testTimeout))
}

// storeOn is a Redis store on addr with the given timeout.
func storeOn(t *testing.T, addr string, timeout time.Duration) *redisStore {
	t.Helper()
	return storeWith(t, RedisConfig{Addresses: []string{addr}, Timeout: caddy.Duration(timeout)}, zap.NewNop())
}

// storeWith is a Redis store made from cfg, logging to logger from the
// start: its goroutines (store_lone.go's loneBack among them) log from
// the moment it is made, so a test that reads the logs cannot swap the
// logger in afterwards.
func storeWith(t *testing.T, cfg RedisConfig, logger *zap.Logger) *redisStore {
	t.Helper()
	conn, err := newRedisStore(cfg.resolved(), logger)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	return conn
}

// counterValue reads a counter (a metric's child).
func counterValue(c interface{ Write(*dto.Metric) error }) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}

// decisionsOf reads caddy_rate_limit_decisions_total{policy, outcome,
// class, plan} ("" for no class or no plan).
func decisionsOf(policy, outcome, class, plan string) float64 {
	return counterValue(decisionsTotal.WithLabelValues(policy, outcome, class, plan))
}

// adminDo calls the admin API in process, as Caddy's admin server would,
// and returns the status and the body (an error's message).
func adminDo(t *testing.T, method, target, body string) (int, string) {
	t.Helper()
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	w := httptest.NewRecorder()
	if err := (adminAPI{}).serve(w, r); err != nil {
		var ae caddy.APIError
		if !errors.As(err, &ae) {
			t.Fatalf("%s %s: %v", method, target, err)
		}
		return ae.HTTPStatus, ae.Err.Error()
	}
	return w.Code, w.Body.String()
}

// rateLimitHandlers is every rate_limit handler of a JSON config (as caddy
// adapt writes it), each as its JSON object, in the order found.
func rateLimitHandlers(t *testing.T, config []byte) []map[string]any {
	t.Helper()
	var cfg any
	if err := json.Unmarshal(config, &cfg); err != nil {
		t.Fatal(err)
	}
	var out []map[string]any
	var walk func(v any)
	walk = func(v any) {
		switch x := v.(type) {
		case map[string]any:
			if x["handler"] == "rate_limit" {
				out = append(out, x)
				return
			}
			for _, e := range x {
				walk(e)
			}
		case []any:
			for _, e := range x {
				walk(e)
			}
		}
	}
	walk(cfg)
	return out
}

// tlsRedis is a redis-server that takes connections under TLS only, with
// a certificate for 127.0.0.1 (testredis.CA; clients skip its check).
func tlsRedis(t *testing.T) *testredis.Server {
	t.Helper()
	_, certFile, keyFile, pool := testredis.CA(t)
	return testredis.StartTLS(t, certFile, keyFile, &tls.Config{RootCAs: pool})
}
