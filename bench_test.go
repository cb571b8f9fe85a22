package ratelimit

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// BenchmarkPath measures each path of a decision through the Redis store,
// as the handler makes it, with 32 concurrent callers over 10,000
// identities (coalesced, as in production), allocations included:
//
//   - take: a rate bucket's decision, admitted (the common case);
//   - settle: a take, then its settle after the response (rides with the
//     next call); settle_usd the same in a money policy's micro-dollars;
//   - acquire_release: a concurrency slot taken, then freed (rides with the
//     next call);
//   - deny_cache_hit: a request the deny cache denies without Redis.
//
// Redis's own cost is in make bench's tables; this is the instance's.
func BenchmarkPath(b *testing.B) {
	conn := benchConn(b)
	rs := conn
	keys := benchKeys(10_000)
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
	for _, path := range benchPaths(rs) {
		b.Run(path.name, func(b *testing.B) { run(b, path.one) })
	}
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

// BenchmarkRedisHotKey measures decisions per second on one bucket (a
// global policy) through the Redis store, with many concurrent callers, and
// Redis's own time per decision: one call per decision (as in Cluster mode)
// and coalesced (a single Redis or Sentinel), where the call reads and
// writes the hot key once for all its requests; and a settle policy's
// bucket, which reads what its key learned (learned_usage.go) too.
func BenchmarkRedisHotKey(b *testing.B) {
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	for _, run := range []struct{ coalesce, learns bool }{{false, false}, {true, false}, {false, true}, {true, true}} {
		coalesce := run.coalesce
		b.Run(fmt.Sprintf("coalesced=%v/learns=%v", coalesce, run.learns), func(b *testing.B) {
			noCoalescing = !coalesce
			defer func() { noCoalescing = false }()
			conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 64, Timeout: testTimeout}.resolved(), zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Destruct()
			rs := conn
			reqs := []bucketRequest{{key: "rl:global:{hot}", limit: limit{interval: 1, burst: 1_000_000}, op: opTake, cost: 1, learns: run.learns}}
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
// allocations per decision included. The settle cases decide a bucket of
// a settle policy that may have overrides: its call also reads (and
// declares in KEYS) the bucket's override and learned usage.
func BenchmarkRedisDecide(b *testing.B) {
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	for _, tc := range []struct {
		name     string
		coalesce bool
		settle   bool
	}{
		{"coalesced=false", false, false}, {"coalesced=true", true, false},
		{"settle,coalesced=false", false, true}, {"settle,coalesced=true", true, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			noCoalescing = !tc.coalesce
			defer func() { noCoalescing = false }()
			conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Destruct()
			rs := conn
			keys := benchKeys(10_000)
			var n atomic.Int64
			client.ConfigResetStat(context.Background())
			b.SetParallelism(32)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := n.Add(1)
					rq := bucketRequest{key: keys[i%int64(len(keys))], limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}
					if tc.settle {
						rq.learns, rq.overridable, rq.overrideDebt = true, true, 1_000_000
					}
					if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "decisions/s")
			// Redis's own time, which more KEYS would cost first.
			info, _ := client.Info(context.Background(), "commandstats").Result()
			if m := regexp.MustCompile(`cmdstat_evalsha:calls=\d+,usec=(\d+)`).FindStringSubmatch(info); m != nil {
				usec, _ := strconv.ParseFloat(m[1], 64)
				b.ReportMetric(usec/float64(b.N), "redis-µs/decision")
			}
		})
	}
}

// BenchmarkRedisDecideAlone measures one decision at a time through the
// Redis store (one caller, 10,000 identities, nothing denied): what an
// instance at one request at a time pays, where there is nothing to
// coalesce; blocking, waiting for Redis in a blocking system call as such
// a decision does on Linux, and poller, in Go's network poller, side by
// side. It reports this process's CPU per decision (getrusage: user and
// system, syscalls and wake-ups included), Redis's own µs per script call
// (INFO commandstats) and the wall time per decision; allocations included.
//
//	go test -run '^$' -bench BenchmarkRedisDecideAlone -benchtime 20000x -count 5 .
func BenchmarkRedisDecideAlone(b *testing.B) {
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Destruct()
	keys := benchKeys(10_000)
	l := limit{interval: 1000, burst: 1_000_000}
	lone := conn.lone
	// Opened first: the goroutine opening it reads conn.lone, which the
	// ways below set.
	for deadline := time.Now().Add(10 * time.Second); lone != nil && conn.loneDown.Load(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			b.Fatal("the lone connection did not open within 10 s")
		}
	}
	for _, way := range []string{"poller", "blocking"} {
		// A decision alone is made on the lone connection, which waits for
		// Redis in a blocking call (store_lone.go); poller: on the pool, as
		// it would in Go's network poller.
		b.Run(way, func(b *testing.B) {
			conn.lone = lone
			if way == "poller" {
				conn.lone = nil
			} else if lone == nil {
				b.Skip("sockets to Redis wait in blocking calls only on Linux")
			}
			defer func() { conn.lone = lone }()
			for i := range 200 { // the connection dialed, the script loaded
				if _, err := conn.decide(context.Background(), []bucketRequest{{key: keys[i], limit: l, op: opTake, cost: 1}}); err != nil {
					b.Fatal(err)
				}
			}
			client.ConfigResetStat(context.Background())
			cpu0 := processCPU()
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				if _, err := conn.decide(context.Background(), []bucketRequest{{key: keys[i%len(keys)], limit: l, op: opTake, cost: 1}}); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64((processCPU()-cpu0).Nanoseconds())/1000/float64(b.N), "cpu-µs/op")
			info, _ := client.Info(context.Background(), "commandstats").Result()
			if m := regexp.MustCompile(`cmdstat_evalsha:calls=\d+,usec=(\d+)`).FindStringSubmatch(info); m != nil {
				usec, _ := strconv.ParseFloat(m[1], 64)
				b.ReportMetric(usec/float64(b.N), "redis-µs/decision")
			}
		})
	}
}

// processCPU is the CPU time this process has used, user and system.
func processCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// BenchmarkBytesPerIdentity: what one identity costs Redis, per policy
// kind, and for how long: used_memory (INFO memory) before and after
// 20,000 identities each make one admitted request, divided by 20,000
// (the key, its value, its expiry and the keyspace's share). A rate
// bucket lives until it is full again (burst × interval at most); a
// concurrency slot's key while a lease is held and a lease after; a quota's
// count until its period ends: a month for /month, whatever the identity.
//
//	go test -run '^$' -bench BenchmarkBytesPerIdentity -benchtime 1x .
func BenchmarkBytesPerIdentity(b *testing.B) {
	ctx := context.Background()
	srv := testredis.Start(b)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	b.Cleanup(func() { client.Close() })
	month := &quotaSpec{periods: calendar.New(calendar.Month, time.UTC), name: "monthly"}
	kinds := []struct {
		name   string
		format int
		req    func(key string) bucketRequest
	}{
		{"rate_v1", formatV1, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 1}
		}},
		{"rate_v2", formatV2, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 1}
		}},
		{"concurrent", formatV2, func(key string) bucketRequest {
			return bucketRequest{key: key, limit: limit{interval: 30_000_000, burst: 3}, op: opAcquire, lease: leaseIDs(), events: "rl:events"}
		}},
		{"quota_month", formatV2, func(key string) bucketRequest {
			return quotaRequest(key, 1_000_000, month, opTake, 1)
		}},
	}
	const identities = 20_000
	kh := newKeyHasher("secret")
	for _, k := range kinds {
		b.Run(k.name, func(b *testing.B) {
			for range b.N {
				if err := client.FlushAll(ctx).Err(); err != nil {
					b.Fatal(err)
				}
				before := usedMemory(b, client)
				p := &Policy{Name: k.name, keyPrefix: "rl:"}
				for i := 0; i < identities; i += 100 {
					var reqs [][]bucketRequest
					for j := i; j < i+100; j++ {
						reqs = append(reqs, []bucketRequest{k.req(p.storageKey(kh, "identity-"+strconv.Itoa(j)))})
					}
					if _, err := evalScriptFormat(ctx, client, decideLua, k.format, reqs...); err != nil {
						b.Fatal(err)
					}
				}
				if n := client.DBSize(ctx).Val(); n != identities {
					b.Fatalf("%d keys for %d identities", n, identities)
				}
				b.ReportMetric(float64(usedMemory(b, client)-before)/identities, "bytes/identity")
			}
		})
	}
}

// usedMemory is Redis's used_memory, in bytes.
func usedMemory(b *testing.B, client *redis.Client) int64 {
	info, err := client.Info(context.Background(), "memory").Result()
	if err != nil {
		b.Fatal(err)
	}
	for line := range strings.SplitSeq(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "used_memory:"); ok {
			n, _ := strconv.ParseInt(v, 10, 64)
			return n
		}
	}
	b.Fatal("no used_memory in INFO memory")
	return 0
}

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

// BenchmarkSettleLLM measures a chat completion through the handler, its
// reservation read from its body and its settle from its response's
// usage, in tokens and in dollars (at the prices of the models the
// request and its response name), with the in-process store: what pricing
// adds to the handler's own cost. make bench's (l) and (m) measure the
// same through Redis, as Caddy's CPU per request.
//
//	go test -run '^$' -bench BenchmarkSettleLLM -count 5 .
func BenchmarkSettleLLM(b *testing.B) {
	const body = `{"model":"gpt-4.1","messages":[{"role":"system","content":"You answer in one short sentence."},{"role":"user","content":"Say hello to the gateway"}],"max_tokens":100}`
	const answer = `{"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion","created":1741569952,"model":"gpt-4.1-2025-04-14",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello, gateway! How can I help you today?","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":24,"completion_tokens":11,"total_tokens":35,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},` +
		`"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_ef015fa747"}`
	for _, tc := range []struct {
		name string
		h    *Handler
	}{
		{"tokens", &Handler{Policies: []*Policy{{Name: "llm_tokens", Key: "{http.request.header.X-User}", Rate: "1000000/1s", Burst: 1e9,
			Cost: "openai", MaxCost: 8000, Settle: &Settle{From: settleOpenAI}}}}},
		{"usd", &Handler{Prices: &Prices{Models: []*ModelPrice{{Model: "gpt-4.1", Input: "2", Output: "8", CacheRead: "0.5"}}},
			Policies: []*Policy{{Name: "llm_usd", Key: "{http.request.header.X-User}", Unit: "usd", Rate: "1/1s", Burst: 1000,
				Cost: "openai", MaxCost: 1, Settle: &Settle{From: settleOpenAI}}}}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			h := tc.h
			h.KeySecret = "secret"
			ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
			defer cancel()
			if err := h.Provision(ctx); err != nil {
				b.Fatal(err)
			}
			defer h.Cleanup()
			users := benchKeys(10_000)
			next := caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
				_, _ = io.Copy(io.Discard, r.Body)
				w.Header().Set("Content-Type", "application/json")
				_, err := io.WriteString(w, answer)
				return err
			})
			var n atomic.Int64
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(body))
					r.Header.Set("X-User", users[n.Add(1)%int64(len(users))])
					repl := caddy.NewReplacer()
					ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
					r = r.WithContext(context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{}))
					w := httptest.NewRecorder()
					if err := h.ServeHTTP(w, r, next); err != nil || w.Code != 200 {
						b.Fatal(err, w.Code)
					}
				}
			})
		})
	}
}

// BenchmarkAfterRides: script calls per request of the paths with work
// after the response (settle, acquire_release) beside take, through the
// Redis store's coalescer, 32 callers over 10,000 identities, each pausing
// 200 µs between its response and its next request as a client's round
// trip makes it (the work after a response is queued before the response
// goes out). after-only is the share of calls that carried only work after
// responses: such work should ride with decisions, so that every path
// makes about as many calls per request as take.
//
//	go test -run '^$' -bench BenchmarkAfterRides -benchtime 2s .
func BenchmarkAfterRides(b *testing.B) {
	conn := benchConn(b)
	var calls, afterOnly atomic.Int64
	call := conn.coalescer.call
	conn.coalescer.call = func(batch []*pending) {
		calls.Add(1)
		if leader(batch) == nil {
			afterOnly.Add(1)
		}
		call(batch)
	}
	rs := conn
	keys := benchKeys(10_000)
	for _, path := range benchPaths(rs) {
		b.Run(path.name, func(b *testing.B) {
			calls.Store(0)
			afterOnly.Store(0)
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
			b.ReportMetric(float64(afterOnly.Load())/float64(max(calls.Load(), 1)), "after-only")
		})
	}
}

// benchKeys are the storage keys of n identities of a policy, as the
// handler makes them.
func benchKeys(n int) []string {
	p, kh := &Policy{keyPrefix: "rl:bench:"}, newKeyHasher("secret")
	keys := make([]string, n)
	for i := range keys {
		keys[i] = p.storageKey(kh, strconv.Itoa(i))
	}
	return keys
}

// BenchmarkRedisOverrides: Redis's own µs per decision (INFO
// commandstats: the script's time over the decisions) for 10,000
// identities of which none, 1,000 or all have an override, and for 100,000
// identities of which none or 10,000 have one, each on its own redis-server, called
// in turn (so that the machine's load falls on them alike), 8 requests per
// call as a coalesced call carries them. The requests of an identity with
// an override read it (the overridable bit), the others do not, as the
// store's filter (overrideSet) has them.
func BenchmarkRedisOverrides(b *testing.B) {
	ctx := context.Background()
	usec := regexp.MustCompile(`cmdstat_evalsha:calls=\d+,usec=(\d+)`)
	p := &Policy{keyPrefix: "rl:bench:"}
	kh := newKeyHasher("secret")
	keys := make([]string, 100_000)
	for i := range keys {
		keys[i] = p.storageKey(kh, strconv.Itoa(i))
	}
	l := limit{interval: 10, burst: 100_000}
	variants := []struct{ identities, overridden int }{{10_000, 0}, {10_000, 1000}, {10_000, 10_000}, {100_000, 0}, {100_000, 10_000}}
	clients := make([]*redis.Client, len(variants))
	for v, vr := range variants {
		n := vr.overridden
		clients[v] = redis.NewClient(&redis.Options{Addr: testredis.Start(b).Addr})
		defer clients[v].Close()
		for i := range n {
			clients[v].Set(ctx, overrideKey(keys[i]), override{kind: overrideRate, interval: 3, burst: 300_000}.encode(), 0)
		}
		clients[v].ScriptLoad(ctx, decideLua)
		clients[v].ConfigResetStat(ctx)
	}
	b.ResetTimer()
	for c := range b.N {
		for v, vr := range variants {
			n := vr.overridden
			batch := make([]*pending, 8)
			for r := range batch {
				i := (c*8 + r) * 7919 % vr.identities
				batch[r] = &pending{reqs: []bucketRequest{{key: keys[i], limit: l, op: opTake, cost: 1, overridable: i < n}}}
			}
			if err := clients[v].Do(ctx, encodeCall(batch, formatV1)...).Err(); err != nil {
				b.Fatal(err)
			}
		}
	}
	b.StopTimer()
	for v, vr := range variants {
		m := usec.FindStringSubmatch(clients[v].Info(ctx, "commandstats").Val())
		if m == nil {
			b.Fatal("no evalsha in INFO commandstats")
		}
		us, _ := strconv.ParseFloat(m[1], 64)
		b.ReportMetric(us/float64(8*b.N), fmt.Sprintf("redis-µs/decision-%d-of-%d-overridden", vr.overridden, vr.identities))
	}
}

// secondWaveBase is the build before the second wave, whose script issue
// 26 holds this one's cost to (git history).
const secondWaveBase = "bf47ad3b79ed0fa252ecf581bbd608ea5cacefa3"

// BenchmarkScriptCost: Redis's CPU per request (the process's own time,
// /proc/<pid>/schedstat, which a stall of the shared machine does not
// inflate as it does INFO commandstats' wall clock) for lua/decide.lua and
// for secondWaveBase's script, each on its own redis-server, called in
// turn, 8 takes a call over 10,000 identities as make bench's (b) sends
// them (format v2). The ratio is the median of the rounds' ratios, each
// round 500 calls of each script.
//
//	go test -run '^$' -bench BenchmarkScriptCost -benchtime 20x .
func BenchmarkScriptCost(b *testing.B) {
	old, err := exec.Command("git", "show", secondWaveBase+":lua/decide.lua").Output()
	if err != nil {
		b.Skipf("reading the script of %.7s from git history: %v", secondWaveBase, err)
	}
	ctx := context.Background()
	type side struct {
		client *redis.Client
		pid    int
		sha    string
		keys   []string
		cpu    []float64 // µs per request, per round
	}
	start := func(script, prefix string) *side {
		srv := testredis.Start(b)
		client := redis.NewClient(&redis.Options{Addr: srv.Addr})
		b.Cleanup(func() { client.Close() })
		sha, err := client.ScriptLoad(ctx, script).Result()
		if err != nil {
			b.Fatal(err)
		}
		p, kh := &Policy{keyPrefix: prefix}, newKeyHasher("secret")
		keys := make([]string, 10_000)
		for i := range keys {
			keys[i] = p.storageKey(kh, strconv.Itoa(i))
		}
		return &side{client: client, pid: srv.Pid(), sha: sha, keys: keys}
	}
	before, now := start(string(old), "rl:before:"), start(decideLua, "rl:now:")
	l := limit{interval: 10, burst: 100_000} // (b)'s 100000/1s
	const calls, per = 500, 8
	c := 0
	b.ResetTimer()
	for range b.N {
		cpu0 := []int64{schedMicros(b, before.pid), schedMicros(b, now.pid)}
		for range calls {
			c++
			batch := make([]*pending, per)
			args := []any{"evalsha", before.sha, per}
			for q := range batch {
				i := (c*per + q) * 7919 % len(now.keys)
				batch[q] = &pending{reqs: []bucketRequest{{key: now.keys[i], limit: l, op: opTake, cost: 1}}}
				args = append(args, before.keys[i])
			}
			// The base's ARGV: per request its bucket count, then interval,
			// burst, cost, wait, shadow.
			for range batch {
				args = append(args, 1, l.interval, l.burst, 1, 0, 0)
			}
			if err := before.client.Do(ctx, args...).Err(); err != nil {
				b.Fatal(err)
			}
			args = encodeCall(batch, formatV2)
			args[1] = now.sha
			res, err := now.client.Do(ctx, args...).Int64Slice()
			if err == nil {
				err = decodeReply(res, batch)
			}
			if err != nil {
				b.Fatal(err)
			}
		}
		before.cpu = append(before.cpu, float64(schedMicros(b, before.pid)-cpu0[0])/(calls*per))
		now.cpu = append(now.cpu, float64(schedMicros(b, now.pid)-cpu0[1])/(calls*per))
	}
	b.StopTimer()
	ratios := make([]float64, b.N)
	for i := range ratios {
		ratios[i] = now.cpu[i] / before.cpu[i]
	}
	med := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)/2] }
	b.ReportMetric(med(before.cpu), "redis-cpu-µs/request-"+secondWaveBase[:7])
	b.ReportMetric(med(now.cpu), "redis-cpu-µs/request")
	b.ReportMetric(med(ratios), "ratio")
	b.ReportMetric(slices.Min(ratios), "ratio-min")
	b.ReportMetric(slices.Max(ratios), "ratio-max")
}

// schedMicros is the CPU time a process has run, in µs.
func schedMicros(b *testing.B, pid int) int64 {
	raw, err := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", pid))
	if err != nil {
		b.Skipf("no schedstat: %v", err)
	}
	ns, err := strconv.ParseInt(strings.Fields(string(raw))[0], 10, 64)
	if err != nil {
		b.Fatal(err)
	}
	return ns / 1000
}

// benchConn is a connection to a Redis of the benchmark's own, closed
// when it ends.
func benchConn(b *testing.B) *redisStore {
	srv := testredis.Start(b)
	conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = conn.Destruct() })
	return conn
}

// benchPath is one path of decisions through the Redis store, for one key.
type benchPath struct {
	name string
	one  func(key string) error
}

// benchPaths are the paths BenchmarkPath and BenchmarkAfterRides measure:
// a take, a settle (a take, then its adjustment after the response), and a
// concurrency slot acquired then released.
func benchPaths(rs *redisStore) []benchPath {
	wide := limit{interval: 10, burst: 1_000_000}
	money := limit{interval: 720, burst: 5_000_000}
	slots := limit{interval: 30_000_000, burst: 100}
	return []benchPath{
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
		// A money policy's settle is a token bucket's, in micro-dollars: $5
		// an hour (720 µs a µ$), $810 µ$ reserved, 360 given back.
		{"settle_usd", func(key string) error {
			rq := bucketRequest{key: key, limit: money, op: opTake, cost: 810, givesBack: true}
			if _, err := rs.decide(context.Background(), []bucketRequest{rq}); err != nil {
				return err
			}
			rq.op, rq.delta, rq.cost = opAdjust, -360, 0
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
}

// BenchmarkDeclaredKeysCost: what declaring a bucket's override and
// learned usage in KEYS costs Redis, as CPU time (schedstat), the same
// calls with and without those keys in KEYS, each on its own
// redis-server, in turn: 8 takes a call of a settle policy that may have
// overrides (the script reads both keys either way), over 10,000
// identities. The ratio is the median of the rounds' ratios, each round
// 500 calls of each.
//
//	go test -run '^$' -bench BenchmarkDeclaredKeysCost -benchtime 20x .
func BenchmarkDeclaredKeysCost(b *testing.B) {
	ctx := context.Background()
	type side struct {
		client *redis.Client
		pid    int
		cpu    []float64
	}
	start := func() *side {
		srv := testredis.Start(b)
		client := redis.NewClient(&redis.Options{Addr: srv.Addr})
		b.Cleanup(func() { client.Close() })
		if err := client.ScriptLoad(ctx, decideLua).Err(); err != nil {
			b.Fatal(err)
		}
		return &side{client: client, pid: srv.Pid()}
	}
	undeclared, declared := start(), start()
	p, kh := &Policy{keyPrefix: "rl:tokens:"}, newKeyHasher("secret")
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = p.storageKey(kh, strconv.Itoa(i))
	}
	l := limit{interval: 10, burst: 100_000}
	const calls, per = 500, 8
	c := 0
	call := func(s *side, args []any) {
		res, err := s.client.Do(ctx, args...).Int64Slice()
		if err != nil || len(res) == 0 {
			b.Fatal(err)
		}
	}
	b.ResetTimer()
	for range b.N {
		cpu0 := []int64{schedMicros(b, undeclared.pid), schedMicros(b, declared.pid)}
		for range calls {
			c++
			batch := make([]*pending, per)
			for q := range batch {
				i := (c*per + q) * 7919 % len(keys)
				batch[q] = &pending{reqs: []bucketRequest{{key: keys[i], limit: l, op: opTake, cost: 1, learns: true, overridable: true}}}
			}
			args := encodeCall(batch, formatV2)
			call(declared, args)
			// The same call with KEYS the buckets' alone, as before.
			n := args[2].(int)
			short := append(append([]any{args[0], args[1], per}, args[3:3+per]...), args[3+n:]...)
			call(undeclared, short)
		}
		undeclared.cpu = append(undeclared.cpu, float64(schedMicros(b, undeclared.pid)-cpu0[0])/(calls*per))
		declared.cpu = append(declared.cpu, float64(schedMicros(b, declared.pid)-cpu0[1])/(calls*per))
	}
	b.StopTimer()
	ratios := make([]float64, b.N)
	for i := range ratios {
		ratios[i] = declared.cpu[i] / undeclared.cpu[i]
	}
	med := func(v []float64) float64 { v = slices.Clone(v); slices.Sort(v); return v[len(v)/2] }
	b.ReportMetric(med(undeclared.cpu), "redis-cpu-µs/request-undeclared")
	b.ReportMetric(med(declared.cpu), "redis-cpu-µs/request")
	b.ReportMetric(med(ratios), "ratio")
	b.ReportMetric(slices.Min(ratios), "ratio-min")
	b.ReportMetric(slices.Max(ratios), "ratio-max")
}
