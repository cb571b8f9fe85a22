package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
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
	rq := bucketRequest{key: "k", limit: lim, op: opTake, cost: 1}
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
		d, answer, _ := c.answer([]bucketRequest{rq})
		ok := answer == denied
		if ok != tc.deny {
			t.Fatalf("at local %d: denied=%v, want %v", tc.local, ok, tc.deny)
		}
		if ok {
			earliest := redisNow + (tc.local - 1_020_000)
			// The tokens at the earliest time: the TAT 0.5s ahead of a burst
			// of 0.2s owes 3 at first.
			avail := earliest + lim.tau() - tat
			remaining := avail / lim.interval
			if avail < 0 {
				remaining = -((-avail + lim.interval - 1) / lim.interval)
			}
			if d.admitted || d.verdicts[0].untilFits != fitsAt-earliest || d.verdicts[0].remaining != remaining {
				t.Fatalf("at local %d: %+v, want denied with wait %d", tc.local, d, fitsAt-earliest)
			}
		}
	}
	// A request that costs more than the burst is denied without knowing
	// anything; one on an unknown bucket goes to Redis.
	if d, answer, _ := c.answer([]bucketRequest{{key: "new", limit: lim, op: opTake, cost: 3}}); answer != denied || d.verdicts[0].untilFits != neverFits {
		t.Fatalf("cost above burst: %+v %v", d, answer)
	}
	if _, answer, _ := c.answer([]bucketRequest{{key: "new", limit: lim, op: opTake, cost: 1}}); answer != unknown {
		t.Fatalf("a bucket never seen: %v, want unknown", answer)
	}
	// What Redis said is used for denyMaxAge only: then Redis must say it
	// again (an operator may have reset the bucket), one flight at a time.
	c.learn([]bucketRequest{rq}, decision{now: redisNow, verdicts: []verdict{{allowed: false}}}, []int64{tat + 3_600_000_000}, 1_000_000, 1_020_000)
	local = 1_020_000 + denyMaxAge
	if _, answer, _ := c.answer([]bucketRequest{rq}); answer != denied {
		t.Fatalf("a bucket drained for an hour, %d µs after Redis said so: %v, want denied", denyMaxAge, answer)
	}
	local++
	if _, answer, gate := c.answer([]bucketRequest{rq}); answer != uncertain || gate != c.ids.of("k") {
		t.Fatalf("a bucket drained for an hour, more than %d µs after Redis said so: %v, want uncertain", denyMaxAge, answer)
	}
}

// TestDenyCacheBounded: a flood of distinct drained buckets keeps the cache
// within denyMaxBuckets.
func TestDenyCacheBounded(t *testing.T) {
	local := int64(1_000_000)
	c := newDenyCache(func() int64 { return local })
	lim := limit{interval: 1_000_000, burst: 1}
	for i := range 1_000_000 {
		rq := bucketRequest{key: "rl:p:{" + strconv.Itoa(i) + "}", limit: lim, op: opTake, cost: 1}
		c.learn([]bucketRequest{rq}, decision{now: 50_000_000, verdicts: []verdict{{allowed: false}}}, []int64{3_600_000_000}, local, local)
	}
	n := 0
	for i := range c.shards {
		n += len(c.shards[i].known)
	}
	t.Logf("1,000,000 drained buckets learned: %d remembered (bound %d)", n, denyMaxBuckets)
	if n > denyMaxBuckets || n == 0 {
		t.Fatalf("%d buckets remembered, want 1 to %d", n, denyMaxBuckets)
	}
}

// TestFlightsOneAtATime: a thousand requests for one uncertain bucket go
// to Redis one flight at a time, and the requests waiting for a flight
// leave together when it lands.
func TestFlightsOneAtATime(t *testing.T) {
	fs := flights{m: make(map[bucketID]*flight)}
	id := bucketID{1, 2}
	var flown atomic.Int64
	var firstLanded atomic.Bool
	var mu sync.Mutex
	followers := map[*flight]int{}
	var wg sync.WaitGroup
	release := make(chan struct{})
	for range 1000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f, after := fs.board(id)
			first := after == nil
			if first {
				<-release // the first flight stays in the air until all have boarded
			} else {
				mu.Lock()
				followers[f]++
				mu.Unlock()
				<-after
				if !firstLanded.Load() {
					t.Error("a request took off before the flight in the air landed")
				}
			}
			flown.Add(1)
			if first {
				firstLanded.Store(true)
			}
			fs.land(id, f)
		}()
	}
	for {
		fs.mu.Lock()
		f := fs.m[id]
		waiting := 0
		if f != nil && f.next != nil {
			waiting = f.next.members
		}
		fs.mu.Unlock()
		if waiting == 999 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	close(release)
	wg.Wait()
	if len(fs.m) != 0 || flown.Load() != 1000 {
		t.Fatalf("after all landed: %d flights left, %d flown", len(fs.m), flown.Load())
	}
	if len(followers) != 1 {
		t.Fatalf("the 999 that waited boarded %d flights, want one", len(followers))
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
		conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 8, Timeout: testTimeout}.resolved(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Destruct() })
		stores = append(stores, conn)
	}
	lim := limit{interval: 20_000, burst: 5} // 50/s
	var cached, confirmed, refilled, wrong, admitted atomic.Int64
	var wg sync.WaitGroup
	// 3 s, and on a machine too busy for 1,000 cached denials in them (the
	// race detector beside two CPU hogs made 602), on until there are, for
	// at most 20 s.
	start := time.Now()
	going := func() bool {
		return time.Since(start) < 3*time.Second || cached.Load() < 1000 && time.Since(start) < 20*time.Second
	}
	for g := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := stores[g%len(stores)]
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for going() {
				rq := []bucketRequest{{key: fmt.Sprintf("rl:p:{%d}", rng.IntN(3)), limit: lim, op: opTake, cost: 1 + rng.Int64N(3)}}
				if cd, answer, _ := s.denials.answer(rq); answer == denied {
					cached.Add(1)
					// The truth: Redis decides the same request now.
					res, err := evalDecide(context.Background(), s.client, rq)
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
					fitsAt := cd.now + cd.verdicts[0].untilFits
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
	t.Logf("cached denials %d in %v: Redis agreed %d, refilled since %d, disagreed %d; Redis admitted %d",
		cached.Load(), time.Since(start).Round(time.Millisecond), confirmed.Load(), refilled.Load(), wrong.Load(), admitted.Load())
	if wrong.Load() != 0 {
		t.Errorf("Redis admitted %d requests the cache had denied", wrong.Load())
	}
	if cached.Load() < 1000 || confirmed.Load() < cached.Load()/2 {
		t.Errorf("too few cached denials to mean anything: %d (%d confirmed)", cached.Load(), confirmed.Load())
	}
}
