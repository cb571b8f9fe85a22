package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

func newTestRedis(t *testing.T) (*testredis.Server, *redis.Client, *redisStore) {
	t.Helper()
	srv := testredis.Start(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })
	conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}}, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	return srv, client, &redisStore{conn: conn, timeout: 2 * time.Second}
}

// evalDecide runs lua/decide.lua for requests in one call, with EVAL (as
// after NOSCRIPT).
func evalDecide(ctx context.Context, client redis.UniversalClient, requests ...[]bucketRequest) ([]int64, error) {
	return evalScript(ctx, client, decideLua, requests...)
}

// evalScript is evalDecide with another version of the script.
func evalScript(ctx context.Context, client redis.UniversalClient, script string, requests ...[]bucketRequest) ([]int64, error) {
	batch := make([]*pendingDecision, len(requests))
	for i, r := range requests {
		batch[i] = &pendingDecision{reqs: r}
	}
	args := scriptCall(batch)
	args[0], args[1] = "eval", script
	return client.Do(ctx, args...).Int64Slice()
}

// TestLuaMatchesGoBucket drives the same random request sequences through
// lua/decide.lua on a real Redis and through the Go algorithm (fed the
// script's own clock), and requires identical decisions, stored state,
// remaining tokens and waits, and TTLs that end no later than the bucket is
// full again. Calls carry one to four requests, which may share buckets, as
// coalesced calls do: the script decides them in order. It runs the script
// as Redis 7 runs it (a missing key created by SET NX GET, undone when the
// request is denied) and as older Redis runs it (GET, then SET).
func TestLuaMatchesGoBucket(t *testing.T) {
	_, client, _ := newTestRedis(t)
	const probe = "redis.REDIS_VERSION_NUM ~= nil"
	if v, err := client.Eval(context.Background(), "return "+probe, nil).Bool(); err != nil || !v {
		t.Fatalf("this test wants Redis 7 or later (%v, %v)", v, err)
	}
	if !strings.Contains(decideLua, probe) {
		t.Fatalf("decide.lua no longer chooses its path with %q", probe)
	}
	t.Run("SET NX GET", func(t *testing.T) { luaMatchesGoBucket(t, client, decideLua) })
	client.FlushAll(context.Background())
	t.Run("GET then SET", func(t *testing.T) {
		luaMatchesGoBucket(t, client, strings.Replace(decideLua, probe, "false", 1))
	})
}

func luaMatchesGoBucket(t *testing.T, client *redis.Client, script string) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))

	limits := []limit{
		{interval: 1000, burst: 5},           // 1000/1s, burst 5
		{interval: 20_000, burst: 3},         // 50/1s
		{interval: 333_333, burst: 10},       // 3/1s, burst 10
		{interval: 600_000, burst: 100},      // 100/1m
		{interval: 1, burst: 1_000_000},      // the fastest allowed
		{interval: 86_400_000_000, burst: 1}, // 1/1d
	}
	randomRequest := func() []bucketRequest {
		n := 1 + rng.IntN(3)
		var reqs []bucketRequest
		used := map[string]bool{}
		for len(reqs) < n {
			li := rng.IntN(len(limits))
			key := fmt.Sprintf("rl:p%d:{id%d}", li, rng.IntN(3))
			if used[key] {
				continue
			}
			used[key] = true
			l := limits[li]
			cost := 1 + rng.Int64N(3)
			if rng.IntN(20) == 0 {
				cost = l.burst + 1 // can never pass
			}
			rq := bucketRequest{key: key, limit: l, cost: cost, shadow: rng.IntN(5) == 0}
			if !rq.shadow && rng.IntN(4) == 0 {
				rq.wait = rng.Int64N(4 * l.interval) // may reserve a future slot
			}
			reqs = append(reqs, rq)
		}
		return reqs
	}
	model := map[string]int64{} // the Go side's own state
	var admitted, denied, requests int
	for step := range 2000 {
		batch := make([][]bucketRequest, 1+rng.IntN(4))
		for r := range batch {
			batch[r] = randomRequest()
		}
		res, err := evalScript(ctx, client, script, batch...)
		if err != nil {
			t.Fatalf("step %d: script: %v", step, err)
		}
		now, off := res[0], 1
		pb := make([]*pendingDecision, len(batch))
		for r, reqs := range batch {
			pb[r] = &pendingDecision{reqs: reqs}
			out := res[off : off+1+2*len(reqs)]
			off += len(out)
			tats := make([]int64, len(reqs))
			for i, rq := range reqs {
				tats[i] = model[rq.key]
				if got := start(out[2+2*i], now); got != start(tats[i], now) {
					t.Fatalf("step %d, request %d: bucket %s: Redis held TAT %d, Go %d (now %d)", step, r, rq.key, out[2+2*i], tats[i], now)
				}
			}
			want, next := decideBuckets(tats, now, reqs)
			if want.admitted != (out[0] == 1) {
				t.Fatalf("step %d, request %d: Lua admitted=%d, Go %v", step, r, out[0], want.admitted)
			}
			got, _, err := decisionFromScript(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s: Lua-state verdict %+v, Go %+v", step, r, rq.key, got.verdicts[i], want.verdicts[i])
				}
				model[rq.key] = next[i]
			}
			if want.admitted {
				admitted++
			} else {
				denied++
			}
			requests++
		}
		if off != len(res) || decisionsFromScript(res, pb) != nil {
			t.Fatalf("step %d: reply of %d numbers for %d requests", step, len(res), len(batch))
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				stored, err := client.Get(ctx, rq.key).Int64()
				if err == redis.Nil {
					// Expired since: Redis expires a key no earlier than its TAT.
					after, err := client.Time(ctx).Result()
					if err != nil {
						t.Fatal(err)
					}
					if model[rq.key] > after.UnixMicro() {
						t.Fatalf("step %d: bucket %s: gone at %d, before its TAT %d", step, rq.key, after.UnixMicro(), model[rq.key])
					}
					continue
				} else if err != nil {
					t.Fatal(err)
				}
				if start(stored, now) != start(model[rq.key], now) {
					t.Fatalf("step %d: bucket %s: Redis stored %d after the call, Go %d", step, rq.key, stored, model[rq.key])
				}
				// A live key expires once its bucket is full again, not later
				// (give or take the 2 ms of rounding TTLs to whole ms twice:
				// when set, and in PTTL). PTTL: -1 no expiry, -2 gone since.
				if pttl, err := client.PTTL(ctx, rq.key).Result(); err != nil || pttl == -1 ||
					pttl.Microseconds() > max(stored-now, 0)+2000 {
					t.Fatalf("step %d: bucket %s: TTL %v (%v) for TAT %d µs ahead", step, rq.key, pttl, err, stored-now)
				}
			}
		}
		if rng.IntN(50) == 0 {
			time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond) // let buckets refill
		}
	}
	if admitted < 500 || denied < 500 {
		t.Fatalf("sequence exercised too little: %d admitted, %d denied", admitted, denied)
	}
	t.Logf("%d requests in 2000 calls: %d admitted, %d denied, identical in Lua and Go", requests, admitted, denied)
}

// TestRedisStoreKeys checks what lands in Redis: hashed identities under
// <prefix><policy>:{hash}, a TTL that ends when the bucket is full again,
// and no trace of the raw identity.
func TestRedisStoreKeys(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	p := &Policy{Name: "per_user", keyPrefix: "rl:per_user:"}
	kh := newKeyHasher("s3cret")
	identity := "alice@example.com"
	key := p.storageKey(kh, identity)
	if !strings.HasPrefix(key, "rl:per_user:{") || strings.Contains(key, "alice") || len(key) != len("rl:per_user:{}")+22 {
		t.Fatalf("storage key %q", key)
	}
	if key == p.storageKey(newKeyHasher("other"), identity) {
		t.Fatal("changing key_secret did not change the key")
	}
	d, err := rs.decide(ctx, []bucketRequest{{key: key, limit: limit{interval: 600_000, burst: 100}, cost: 3}})
	if err != nil || !d.admitted || d.verdicts[0].remaining != 97 {
		t.Fatalf("decide: %+v %v", d, err)
	}
	ttl, err := client.PTTL(ctx, key).Result()
	if err != nil || ttl <= 1700*time.Millisecond || ttl > 1800*time.Millisecond {
		t.Fatalf("TTL %v (%v), want 1.8s: 3 tokens at 600ms each", ttl, err)
	}
	keys, _ := client.Keys(ctx, "*").Result()
	for _, k := range keys {
		v, _ := client.Get(ctx, k).Result()
		if strings.Contains(k+v, "alice") {
			t.Fatalf("raw identity in Redis: %s = %s", k, v)
		}
	}
}

// TestRedisStoreReloadsFlushedScript: after SCRIPT FLUSH (or a restarted
// Redis) EVALSHA answers NOSCRIPT and the store loads the script again.
func TestRedisStoreReloadsFlushedScript(t *testing.T) {
	srv, _, rs := newTestRedis(t)
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{x}", limit: limit{interval: 1000, burst: 10}, cost: 1}}
	for i := range 3 {
		if _, err := srv.Do("SCRIPT", "FLUSH"); err != nil {
			t.Fatal(err)
		}
		if d, err := rs.decide(ctx, r); err != nil || !d.admitted {
			t.Fatalf("decision %d after SCRIPT FLUSH: %+v %v", i, d, err)
		}
	}
}

// BenchmarkRedisHotKey measures decisions per second on one bucket (a
// global policy) through the Redis store, with many concurrent callers, and
// Redis's own time per decision: one call per decision (as in Cluster mode)
// and coalesced (a single Redis or Sentinel), where the call reads and
// writes the hot key once for all its requests.
func BenchmarkRedisHotKey(b *testing.B) {
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	for _, coalesce := range []bool{false, true} {
		b.Run(fmt.Sprintf("coalesced=%v", coalesce), func(b *testing.B) {
			noBatching = !coalesce
			defer func() { noBatching = false }()
			conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 64}.resolved(), zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Destruct()
			rs := &redisStore{conn: conn, timeout: time.Second}
			reqs := []bucketRequest{{key: "rl:global:{hot}", limit: limit{interval: 1, burst: 1_000_000}, cost: 1}}
			client.ConfigResetStat(context.Background())
			b.SetParallelism(16)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					if _, err := rs.decide(context.Background(), reqs); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			// Redis's own time: what caps one slot, whatever the client.
			info, _ := client.Info(context.Background(), "commandstats").Result()
			if m := regexp.MustCompile(`cmdstat_evalsha:calls=\d+,usec=(\d+)`).FindStringSubmatch(info); m != nil {
				usec, _ := strconv.ParseFloat(m[1], 64)
				b.ReportMetric(usec/float64(b.N), "redis-µs/decision")
			}
		})
	}
}

// BenchmarkRedisDecide measures one decision through the Redis store with
// many concurrent callers and 10,000 identities, with concurrent decisions
// coalesced into one script call and with one call per decision;
// allocations per decision included.
func BenchmarkRedisDecide(b *testing.B) {
	srv := testredis.Start(b)
	for _, coalesce := range []bool{false, true} {
		b.Run(fmt.Sprintf("coalesced=%v", coalesce), func(b *testing.B) {
			noBatching = !coalesce
			defer func() { noBatching = false }()
			conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}}.resolved(), zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Destruct()
			rs := &redisStore{conn: conn, timeout: time.Second}
			p := &Policy{keyPrefix: "rl:bench:"}
			kh := newKeyHasher("secret")
			keys := make([]string, 10_000)
			for i := range keys {
				keys[i] = p.storageKey(kh, strconv.Itoa(i))
			}
			var n atomic.Int64
			b.SetParallelism(32)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := n.Add(1)
					reqs := []bucketRequest{{key: keys[i%int64(len(keys))], limit: limit{interval: 1000, burst: 1_000_000}, cost: 1}}
					if _, err := rs.decide(context.Background(), reqs); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
		})
	}
}
