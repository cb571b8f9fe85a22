package ratelimit

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestGoRedisLogsThroughZap: what go-redis logs of itself (here, a failed
// dial to a Redis that is not there) reaches the module's zap logger, at
// DEBUG, once per kind of line within reportInterval, and not stderr.
func TestGoRedisLogsThroughZap(t *testing.T) {
	core, logs := observer.New(zap.DebugLevel)
	prev := goRedisLog.logger.Load()
	goRedisLog.use(zap.New(core))
	goRedisLog.mu.Lock()
	goRedisLog.seen = nil // what earlier tests logged
	goRedisLog.mu.Unlock()
	t.Cleanup(func() { goRedisLog.logger.Store(prev) })

	addr := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t)) // nothing listens
	for range 3 {
		c := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 100 * time.Millisecond, MaxRetries: -1, DialerRetries: 1})
		_ = c.Ping(context.Background()).Err()
		c.Close()
	}
	var dial []observer.LoggedEntry
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "failed to dial") {
			dial = append(dial, e)
		}
	}
	if len(dial) != 1 {
		t.Fatalf("%d lines about the failed dials, want 1 (the others within %s dropped): %v", len(dial), reportInterval, logs.All())
	}
	e := dial[0]
	if e.Level != zap.DebugLevel || e.LoggerName != "go-redis" || strings.HasPrefix(e.Message, "redis:") {
		t.Errorf("logged %q at %s by %q, want DEBUG by go-redis without go-redis's prefix", e.Message, e.Level, e.LoggerName)
	}
}

// TestGoRedisLogAdmit: one line of each kind per reportInterval, the next
// saying how many were dropped.
func TestGoRedisLogAdmit(t *testing.T) {
	var l goRedisLogger
	t0 := time.Unix(1000, 0)
	for _, tc := range []struct {
		format  string
		at      time.Duration
		ok      bool
		dropped int
	}{
		{"a %v", 0, true, 0},
		{"a %v", time.Second, false, 0},
		{"b %v", time.Second, true, 0},
		{"a %v", 2 * time.Second, false, 0},
		{"a %v", reportInterval, true, 2},
		{"a %v", reportInterval + time.Second, false, 0},
	} {
		dropped, ok := l.admit(tc.format, t0.Add(tc.at))
		if ok != tc.ok || dropped != tc.dropped {
			t.Errorf("%q at %s: admitted %v, %d dropped; want %v, %d", tc.format, tc.at, ok, dropped, tc.ok, tc.dropped)
		}
	}
}
