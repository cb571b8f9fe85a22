package ratelimit

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// BenchmarkLaterRides: script calls per request of the paths with work
// after the response (settle, acquire_release) beside take, through the
// Redis store's coalescer, 32 callers over 10,000 identities, each pausing
// 200 µs between its response and its next request as a client's round
// trip makes it (the work after a response is queued before the response
// goes out). later-only is the share of calls that carried only work after
// responses: such work should ride with decisions, so that every path
// makes about as many calls per request as take.
//
//	go test -run '^$' -bench BenchmarkLaterRides -benchtime 2s .
func BenchmarkLaterRides(b *testing.B) {
	srv := testredis.Start(b)
	conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Destruct()
	var calls, laterOnly atomic.Int64
	call := conn.coalescer.call
	conn.coalescer.call = func(batch []*pending) {
		calls.Add(1)
		if leader(batch) == nil {
			laterOnly.Add(1)
		}
		call(batch)
	}
	rs := &redisStore{conn: conn}
	p, kh := &Policy{keyPrefix: "rl:bench:"}, newKeyHasher("secret")
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = p.storageKey(kh, strconv.Itoa(i))
	}
	wide := limit{interval: 10, burst: 1_000_000}
	slots := limit{interval: 30_000_000, burst: 100}
	paths := []struct {
		name string
		one  func(key string) error
	}{
		{"take", func(key string) error {
			_, err := rs.decide(context.Background(), []bucketRequest{{key: key, limit: wide, op: opTake, cost: 1}})
			return err
		}},
		{"settle", func(key string) error {
			rq := bucketRequest{key: key, limit: wide, op: opTake, cost: 10, givesBack: true}
			if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
				return err
			}
			rq.op, rq.delta, rq.cost = opAdjust, -7, 0
			rs.decideAfter([]bucketRequest{rq}, func(decision, error) {})
			return nil
		}},
		{"acquire_release", func(key string) error {
			rq := bucketRequest{key: key, limit: slots, op: opAcquire, lease: leaseIDs(), events: "rl:bench:events"}
			if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
				return err
			}
			rq.op = opRelease
			rs.decideAfter([]bucketRequest{rq}, func(decision, error) {})
			return nil
		}},
	}
	for _, path := range paths {
		b.Run(path.name, func(b *testing.B) {
			calls.Store(0)
			laterOnly.Store(0)
			var n atomic.Int64
			var wg sync.WaitGroup
			b.ResetTimer()
			for range 32 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for n.Add(1) <= int64(b.N) {
						if err := path.one(keys[n.Load()%int64(len(keys))]); err != nil {
							b.Error(err)
							return
						}
						time.Sleep(200 * time.Microsecond)
					}
				}()
			}
			wg.Wait()
			b.StopTimer()
			time.Sleep(20 * time.Millisecond) // the last work after responses goes out
			b.ReportMetric(float64(calls.Load())/float64(b.N), "calls/request")
			b.ReportMetric(float64(laterOnly.Load())/float64(max(calls.Load(), 1)), "later-only")
		})
	}
}
