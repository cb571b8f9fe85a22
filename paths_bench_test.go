package ratelimit

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// BenchmarkPath measures each path of a decision through the Redis store,
// as the handler makes it, with 32 concurrent callers over 10,000
// identities (coalesced, as in production), allocations included:
//
//   - take: a rate bucket's decision, admitted (the common case);
//   - settle: a take, then its settle after the response (rides with the
//     next call);
//   - acquire_release: a concurrency slot taken, then freed (rides with the
//     next call);
//   - deny_cache_hit: a request the deny cache denies without Redis.
//
// Redis's own cost is in make bench's tables; this is the instance's.
func BenchmarkPath(b *testing.B) {
	srv := testredis.Start(b)
	conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Destruct()
	rs := &redisStore{conn: conn}
	p := &Policy{keyPrefix: "rl:bench:"}
	kh := newKeyHasher("secret")
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = p.storageKey(kh, strconv.Itoa(i))
	}
	wide := limit{interval: 10, burst: 1_000_000}
	run := func(b *testing.B, one func(key string) error) {
		var n atomic.Int64
		b.SetParallelism(16) // 32 callers on 2 cores
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := one(keys[n.Add(1)%int64(len(keys))]); err != nil {
					b.Error(err)
					return
				}
			}
		})
		b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
	}
	b.Run("take", func(b *testing.B) {
		run(b, func(key string) error {
			_, err := rs.decide(context.Background(), []bucketRequest{{key: key, limit: wide, op: opTake, cost: 1}})
			return err
		})
	})
	b.Run("settle", func(b *testing.B) {
		run(b, func(key string) error {
			rq := bucketRequest{key: key, limit: wide, op: opTake, cost: 10, givesBack: true}
			if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
				return err
			}
			rq.op, rq.delta, rq.cost = opAdjust, -7, 0
			rs.decideAfter([]bucketRequest{rq}, func(decision, error) {})
			return nil
		})
	})
	b.Run("acquire_release", func(b *testing.B) {
		slots := limit{interval: 30_000_000, burst: 100}
		run(b, func(key string) error {
			rq := bucketRequest{key: key, limit: slots, op: opAcquire, lease: leaseIDs(), events: "rl:bench:events"}
			if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
				return err
			}
			rq.op = opRelease
			rs.decideAfter([]bucketRequest{rq}, func(decision, error) {})
			return nil
		})
	})
	b.Run("deny_cache_hit", func(b *testing.B) {
		// One drained bucket (a token a minute), learned once.
		drained := []bucketRequest{{key: keys[0], limit: limit{interval: 60_000_000, burst: 1}, op: opTake, cost: 1}}
		for range 2 {
			if _, err := rs.decide(context.Background(), drained); err != nil {
				b.Fatal(err)
			}
		}
		run(b, func(string) error {
			_, err := rs.decide(context.Background(), drained)
			return err
		})
	})
}
