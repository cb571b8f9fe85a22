package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestDenyCacheClockBounds: the cache denies only while even the latest
// possible Redis time is before the request could fit, and reports the
// wait from the earliest possible Redis time.
func TestDenyCacheClockBounds(t *testing.T) {
	local := int64(1_000_000)
	c := newDenyCache(func() int64 { return local })
	lim := limit{interval: 100_000, burst: 2} // 10/s, burst 2
	rq := bucketRequest{key: "k", limit: lim, cost: 1}
	// Redis said, at its time 50s, that the bucket's TAT is 50.5s (empty,
	// the next token at 50.3s); the request took from local 1.00s to 1.02s.
	redisNow, tat := int64(50_000_000), int64(50_500_000)
	local = 1_020_000
	c.learn([]bucketRequest{rq}, decision{now: redisNow, verdicts: []verdict{{allowed: false}}}, []int64{tat}, 1_000_000, 1_020_000)
	fitsAt := tat + lim.interval - lim.tau() // 50.4s
	for _, tc := range []struct {
		local int64
		deny  bool
	}{
		{1_020_000, true},
		{1_000_000 + (fitsAt - redisNow) - 1, true},   // latest Redis time just before fitsAt
		{1_000_000 + (fitsAt - redisNow), false},      // latest Redis time reaches fitsAt
		{1_000_000 + (fitsAt - redisNow) + 10, false}, // and beyond
	} {
		local = tc.local
		d, ok := c.deny([]bucketRequest{rq})
		if ok != tc.deny {
			t.Fatalf("at local %d: denied=%v, want %v", tc.local, ok, tc.deny)
		}
		if ok {
			earliest := redisNow + (tc.local - 1_020_000)
			if d.admitted || d.verdicts[0].wait != fitsAt-earliest || d.verdicts[0].remaining != 0 {
				t.Fatalf("at local %d: %+v, want denied with wait %d", tc.local, d, fitsAt-earliest)
			}
		}
	}
	// A request that costs more than the burst is denied without knowing
	// anything; one on an unknown bucket goes to Redis.
	if d, ok := c.deny([]bucketRequest{{key: "new", limit: lim, cost: 3}}); !ok || d.verdicts[0].wait != neverWait {
		t.Fatalf("cost above burst: %+v %v", d, ok)
	}
	if _, ok := c.deny([]bucketRequest{{key: "new", limit: lim, cost: 1}}); ok {
		t.Fatal("denied on a bucket never seen")
	}
}

// TestDenyCacheNeverWrong: four stores, as four Caddy instances with their
// own caches, hammer the same buckets on a real Redis with mixed costs.
// Every request the cache denies is then put to Redis itself: Redis must
// deny it too, unless the bucket refilled in between (Redis's clock had
// reached the time the cache computed the request would fit).
func TestDenyCacheNeverWrong(t *testing.T) {
	srv := testredis.Start(t)
	var stores []*redisStore
	for range 4 {
		conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 8}.resolved(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Destruct() })
		stores = append(stores, &redisStore{conn: conn, timeout: 2 * time.Second, denials: conn.denials})
	}
	lim := limit{interval: 20_000, burst: 5} // 50/s
	var cached, confirmed, refilled, wrong, admitted atomic.Int64
	var wg sync.WaitGroup
	deadline := time.Now().Add(3 * time.Second)
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := stores[g%len(stores)]
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for time.Now().Before(deadline) {
				rq := []bucketRequest{{key: fmt.Sprintf("rl:p:{%d}", rng.IntN(3)), limit: lim, cost: 1 + rng.Int64N(3)}}
				if cd, ok := s.denials.deny(rq); ok {
					cached.Add(1)
					// The truth: Redis decides the same request now.
					res, err := evalDecide(context.Background(), s.conn.client, rq)
					if err != nil {
						t.Error(err)
						return
					}
					if res[1] == 0 {
						confirmed.Add(1)
						continue
					}
					// Redis admitted: only a refill since the cached denial
					// excuses that, Redis's clock having reached the time
					// the cache computed the request would fit.
					fitsAt := cd.now + cd.verdicts[0].wait
					if res[0] >= fitsAt {
						refilled.Add(1)
					} else {
						wrong.Add(1)
					}
					continue
				}
				d, err := s.decide(context.Background(), rq)
				if err != nil {
					t.Error(err)
					return
				}
				if d.admitted {
					admitted.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("cached denials %d: Redis agreed %d, refilled since %d, disagreed %d; Redis admitted %d",
		cached.Load(), confirmed.Load(), refilled.Load(), wrong.Load(), admitted.Load())
	if wrong.Load() != 0 {
		t.Errorf("Redis admitted %d requests the cache had denied", wrong.Load())
	}
	if cached.Load() < 1000 || confirmed.Load() < cached.Load()/2 {
		t.Errorf("too few cached denials to mean anything: %d (%d confirmed)", cached.Load(), confirmed.Load())
	}
}
