package ratelimit

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/hotkey"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// hotTestPolicy is a policy's hot keys at the default threshold, with
// metrics of its own.
func hotTestPolicy(name string) *hotPolicy {
	return &hotPolicy{threshold: hotThreshold(defaultHotKeys),
		held:   prometheus.NewGauge(prometheus.GaugeOpts{Name: name + "_held"}),
		blocks: prometheus.NewCounter(prometheus.CounterOpts{Name: name + "_blocks"})}
}

// hotLimit is the key: 5,000/s, burst 500, with the reach hot keys
// give it.
var hotLimit = limit{interval: 200, burst: 500, slack: hotkey.Horizon}

// hotInstances are n connections to srv: as many instances.
func hotInstances(t *testing.T, srv *testredis.Server, n int) []*redisStore {
	t.Helper()
	var out []*redisStore
	for range n {
		conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Destruct() })
		out = append(out, &redisStore{conn: conn})
	}
	return out
}

// TestHotKeysNeverOverBudget: four instances' stores deciding one key at
// full speed, hot on every one: what they admit by any instant never
// exceeds burst + rate × elapsed, comes within 5% of it, and takes at most
// one script call per 50 admissions.
func TestHotKeysNeverOverBudget(t *testing.T) {
	srv := testredis.Start(t)
	fleet := hotInstances(t, srv, 4)
	hp := hotTestPolicy("never_over")
	const run = 2 * time.Second
	key := "rl:hot:{one}"
	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var admittedAt []time.Duration
	var denied atomic.Int64
	perInstance := make([]atomic.Int64, len(fleet))
	var wg sync.WaitGroup
	start := time.Now() // the bucket is full: its budget counts from here
	for n, rs := range fleet {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Since(start) < run {
					d, err := rs.decide(context.Background(), []bucketRequest{{key: key, limit: hotLimit, op: opTake, cost: 1, hot: hp}})
					if err != nil {
						t.Error(err)
						return
					}
					if !d.admitted {
						denied.Add(1)
						continue
					}
					at := time.Since(start) // decided before this
					perInstance[n].Add(1)
					mu.Lock()
					admittedAt = append(admittedAt, at)
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	calls := scriptCalls(t, srv)
	slices.Sort(admittedAt)
	for i, at := range admittedAt {
		if budget := hotLimit.burst + at.Microseconds()/hotLimit.interval; int64(i+1) > budget {
			t.Fatalf("%d admitted by %v: budget %d", i+1, at, budget)
		}
	}
	last := admittedAt[len(admittedAt)-1]
	budget := float64(hotLimit.burst + last.Microseconds()/hotLimit.interval)
	share := float64(len(admittedAt)) / budget
	var each []int64
	for i := range perInstance {
		each = append(each, perInstance[i].Load())
	}
	t.Logf("admitted %d of a budget of %.0f by the last admission (%.3f), %d denied; %d script calls, %.4f per admission; %.0f blocks; by instance %v",
		len(admittedAt), budget, share, denied.Load(), calls, float64(calls)/float64(len(admittedAt)), testutilValue(hp.blocks), each)
	if share < 0.95 {
		t.Errorf("admitted %.3f of the budget, want at least 0.95", share)
	}
	if perAdmission := float64(calls) / float64(len(admittedAt)); perAdmission > 0.02 {
		t.Errorf("%.4f script calls per admission, want at most 0.02", perAdmission)
	}
}

// testutilValue is a counter's value.
func testutilValue(c prometheus.Counter) float64 {
	var m dto.Metric
	_ = c.Write(&m)
	return m.GetCounter().GetValue()
}
