package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"regexp"
	"slices"
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
	conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	return srv, client, &redisStore{conn: conn}
}

// evalDecide runs lua/decide.lua for requests in one call, with EVAL (as
// after NOSCRIPT).
func evalDecide(ctx context.Context, client redis.UniversalClient, requests ...[]bucketRequest) ([]int64, error) {
	return evalScript(ctx, client, decideLua, requests...)
}

// evalScript is evalDecide with another version of the script.
func evalScript(ctx context.Context, client redis.UniversalClient, script string, requests ...[]bucketRequest) ([]int64, error) {
	return evalScriptFormat(ctx, client, script, formatV1, requests...)
}

// evalScriptFormat is evalScript writing buckets in the given format.
func evalScriptFormat(ctx context.Context, client redis.UniversalClient, script string, format int, requests ...[]bucketRequest) ([]int64, error) {
	batch := make([]*pending, len(requests))
	for i, r := range requests {
		batch[i] = &pending{reqs: r}
	}
	args := encodeCall(batch, format)
	args[0], args[1] = "eval", script
	return client.Do(ctx, args...).Int64Slice()
}

// TestLuaMatchesGoBucket drives the same random request sequences through
// lua/decide.lua on a real Redis and through the Go algorithm (fed the
// script's own clock), and requires identical decisions, stored state,
// remaining tokens and waits, and TTLs that end no later than the bucket is
// full again. Requests take, check, adjust (charges into debt and refunds),
// inspect and reset, under limits that change from request to request (as
// a reload changes them: the state is rebased); calls carry one to four
// requests, which may share buckets, as coalesced calls do: the script
// decides them in order. It runs the script as Redis 7 runs it (a missing
// key created by SET NX GET, undone when the request is denied) and as
// older Redis runs it (GET, then SET). The buckets of two of the policies
// learn their usage (learned_usage.go): their settles remember usage, their
// takes are raised to it, their resets forget it, and the memory Redis
// keeps beside the bucket is the one the Go model keeps, as Go writes it.
func TestLuaMatchesGoBucket(t *testing.T) {
	_, client, _ := newTestRedis(t)
	const probe = "redis.REDIS_VERSION_NUM ~= nil"
	if v, err := client.Eval(context.Background(), "return "+probe, nil).Bool(); err != nil || !v {
		t.Fatalf("this test wants Redis 7 or later (%v, %v)", v, err)
	}
	if !strings.Contains(decideLua, probe) {
		t.Fatalf("decide.lua no longer chooses its path with %q", probe)
	}
	for _, format := range []int{formatV1, formatV2} {
		t.Run("SET NX GET, "+formatName(format), func(t *testing.T) { luaMatchesGoBucket(t, client, decideLua, format) })
		client.FlushAll(context.Background())
		t.Run("GET then SET, "+formatName(format), func(t *testing.T) {
			luaMatchesGoBucket(t, client, strings.Replace(decideLua, probe, "false", 1), format)
		})
		client.FlushAll(context.Background())
	}
}

// parseStored reads a bucket as the script stores it, in any format, and
// checks that it is written as encodeBucket writes it in format.
func parseStored(t *testing.T, v string, format int) storedBucket {
	t.Helper()
	tat, interval, ok := decodeBucket(v, 0)
	if !ok || interval == 0 {
		t.Fatalf("stored bucket %q is not a bucket", v)
	}
	if want := encodeBucket(tat, interval, format); v != want {
		t.Fatalf("stored bucket %q, Go writes %q in format %s", v, want, formatName(format))
	}
	return storedBucket{tat, interval}
}

func luaMatchesGoBucket(t *testing.T, client *redis.Client, script string, format int) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))

	// Each policy has two limits, as two configs before and after a
	// reload may give it.
	limits := [][2]limit{
		{{interval: 1000, burst: 5}, {interval: 500, burst: 8}},                             // 1000/1s burst 5, then 2000/1s burst 8
		{{interval: 20_000, burst: 3, slack: 60_000}, {interval: 20_000, burst: 2}},         // 50/1s with wait, then a lower burst
		{{interval: 333_333, burst: 10, slack: 3_333_330}, {interval: 1_000_000, burst: 4}}, // 3/1s with debt, then 1/1s
		{{interval: 600_000, burst: 100}, {interval: 10_000, burst: 100}},                   // 100/1m, then 100/1s
		{{interval: 1, burst: 1_000_000}, {interval: 1, burst: 1_000_000}},                  // the fastest allowed
		{{interval: 86_400_000_000, burst: 1}, {interval: 60_000_000, burst: 3}},            // 1/1d, then 1/1m burst 3
	}
	ops := []bucketOp{opTake, opTake, opTake, opTake, opTake, opCheck, opAdjust, opAdjust, opInspect}
	learns := func(li int) bool { return li == 2 || li == 3 } // settle policies
	randomRequest := func() []bucketRequest {
		if rng.IntN(40) == 0 { // an operator's reset
			li := rng.IntN(len(limits))
			return []bucketRequest{{key: fmt.Sprintf("rl:p%d:{id%d}", li, rng.IntN(3)), limit: limits[li][rng.IntN(2)], op: opReset, learns: learns(li)}}
		}
		op := ops[rng.IntN(len(ops))]
		n := 1 + rng.IntN(3)
		if !op.admits() {
			n = 1 // adjustments and reads go alone, as after a response
		}
		var reqs []bucketRequest
		used := map[string]bool{}
		for len(reqs) < n {
			li := rng.IntN(len(limits))
			key := fmt.Sprintf("rl:p%d:{id%d}", li, rng.IntN(3))
			if used[key] {
				continue
			}
			used[key] = true
			l := limits[li][0]
			if rng.IntN(10) == 0 {
				l = limits[li][1]
			}
			rq := bucketRequest{key: key, limit: l, op: op, learns: learns(li)}
			switch op {
			case opTake, opCheck:
				rq.cost = 1 + rng.Int64N(3)
				if rng.IntN(20) == 0 {
					rq.cost = l.burst + 1 // can never pass
				}
				rq.shadow = rng.IntN(5) == 0
				if op == opTake && !rq.shadow && l.slack > 0 && rng.IntN(2) == 0 {
					rq.wait = rng.Int64N(l.slack + 1) // may reserve a future turn
				}
				if op == opTake && rng.IntN(3) == 0 {
					op = opCheck // a charge_if policy beside a rate one
					rq.op = opCheck
				}
			case opAdjust:
				rq.delta = rng.Int64N(9) - 4 // a charge after the response, or a refund
				if rq.delta == 0 {
					rq.delta = 3
				}
				if rq.learns && rng.IntN(3) == 0 {
					rq.record = 1 + rng.Int64N(2*l.burst) // a settle beyond its own reservation
				}
			}
			reqs = append(reqs, rq)
		}
		return reqs
	}
	model := map[string]storedBucket{} // the Go side's own state
	learnedModel := map[string]learnedUsage{}
	var raised, remembered int
	writtenIn := map[string]int{} // the step that last wrote a bucket
	// The longest call (µs from its TIME to Redis's clock after it) of
	// those that touched a bucket since the one that last wrote it: any of
	// them may have set its TTL, as a call may rewrite a bucket it only
	// reads (a changed limit); beside two CPU hogs, the call that wrote it
	// was once not the longest (TTL 15 ms for a TAT 12.1 ms ahead, slack
	// 2.2 ms).
	callSlack := map[string]int64{}
	var admitted, denied, requests, rebased, compact int
	for step := range 3000 {
		batch := make([][]bucketRequest, 1+rng.IntN(4))
		for r := range batch {
			batch[r] = randomRequest()
		}
		res, err := evalScriptFormat(ctx, client, script, format, batch...)
		if err != nil {
			t.Fatalf("step %d: script: %v", step, err)
		}
		now, off := res[0], 1
		pb := make([]*pending, len(batch))
		for r, reqs := range batch {
			pb[r] = &pending{reqs: reqs}
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			tats := make([]int64, len(reqs))
			lv := make([]int64, len(reqs))
			for i, at := 0, 1; i < len(reqs); i++ {
				rq := reqs[i]
				b := model[rq.key]
				tats[i] = rq.limit.rebase(b.tat, b.interval, now)
				if b.tat > now && b.interval != rq.limit.interval {
					rebased++
				}
				if got := start(out[at+1], now); got != start(tats[i], now) { // rate buckets: allowed, TAT [, learned]
					t.Fatalf("step %d, request %d: bucket %s: Redis held TAT %d, Go %d (now %d)", step, r, rq.key, out[at+1], tats[i], now)
				}
				at += replyWidthOf(rq)
				if rq.learns {
					l := learnedModel[rq.key]
					lv[i] = l.max()
				}
			}
			decided := withLearned(reqs, lv)
			want, next := decideBuckets(tats, now, decided)
			for i, rq := range reqs {
				if rq.learns {
					want.verdicts[i].learned = lv[i]
				}
				if decided[i].cost != rq.cost {
					raised++
				}
			}
			if want.admitted != (out[0] == scriptAdmitted) {
				t.Fatalf("step %d, request %d: Lua status %d, Go admitted %v", step, r, out[0], want.admitted)
			}
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s: Lua-state verdict %+v, Go %+v", step, r, rq.key, got.verdicts[i], want.verdicts[i])
				}
				switch {
				case !applied(reqs, want, i):
				case next[i] <= now:
					delete(model, rq.key)
				default:
					model[rq.key] = storedBucket{next[i], rq.limit.interval}
					writtenIn[rq.key] = step
				}
				switch {
				case !rq.learns:
				case rq.op == opReset:
					delete(learnedModel, rq.key)
				case rq.op == opAdjust:
					l := learnedModel[rq.key]
					if l.push(rq.record) {
						learnedModel[rq.key] = l
						remembered++
					}
				}
			}
			if reqs[0].op.admits() {
				if want.admitted {
					admitted++
				} else {
					denied++
				}
			}
			requests++
		}
		if off != len(res) || decodeReply(res, pb) != nil {
			t.Fatalf("step %d: reply of %d numbers for %d requests", step, len(res), len(batch))
		}
		// Redis's clock once the call is over: TTLs are counted from a time
		// Redis takes within the call, after the script read TIME (by up to
		// the call's length, which a loaded machine stretches).
		after, err := client.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		callLength := after.UnixMicro() - now
		for _, reqs := range batch {
			for _, rq := range reqs {
				if writtenIn[rq.key] == step {
					callSlack[rq.key] = callLength
				} else {
					callSlack[rq.key] = max(callSlack[rq.key], callLength)
				}
			}
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				if !rq.learns {
					continue
				}
				v, err := client.Get(ctx, rq.key+learnedSuffix).Result()
				if err == redis.Nil {
					v = ""
				} else if err != nil {
					t.Fatal(err)
				}
				if want := encodeLearned(learnedModel[rq.key]); v != want || decodeLearned(v) != learnedModel[rq.key] && want != "" {
					t.Fatalf("step %d: %s%s holds %q, Go %q", step, rq.key, learnedSuffix, v, want)
				}
				if pttl, err := client.PTTL(ctx, rq.key+learnedSuffix).Result(); v != "" && (err != nil || pttl <= 0 || pttl > learnTTL) {
					t.Fatalf("step %d: %s%s: TTL %v (%v), want at most %v", step, rq.key, learnedSuffix, pttl, err, learnTTL)
				}
			}
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				v, err := client.Get(ctx, rq.key).Result()
				if err == redis.Nil {
					// Expired since: Redis expires a key no earlier than its TAT.
					after, err := client.Time(ctx).Result()
					if err != nil {
						t.Fatal(err)
					}
					if model[rq.key].tat > after.UnixMicro() {
						t.Fatalf("step %d: bucket %s: gone at %d, before its TAT %d", step, rq.key, after.UnixMicro(), model[rq.key].tat)
					}
					continue
				} else if err != nil {
					t.Fatal(err)
				}
				stored, want := parseStored(t, v, format), model[rq.key]
				if format == formatV2 && intervalCode(stored.interval) != 0 {
					compact++
				}
				if start(stored.tat, now) != start(want.tat, now) || stored.tat > now && stored.interval != want.interval {
					t.Fatalf("step %d: bucket %s: Redis stored %+v after the call, Go %+v", step, rq.key, stored, want)
				}
				// A live key expires once its bucket is full again, not later
				// (give or take the 2 ms of rounding TTLs to whole ms twice:
				// when set, and in PTTL, and the length of the call that set
				// it: callSlack). PTTL: -1 no expiry, -2 gone since.
				slack := 2000 + callSlack[rq.key]
				if pttl, err := client.PTTL(ctx, rq.key).Result(); err != nil || pttl == -1 ||
					pttl.Microseconds() > max(stored.tat-now, 0)+slack {
					t.Fatalf("step %d: bucket %s: TTL %v (%v) for TAT %d µs ahead (slack %d µs)", step, rq.key, pttl, err, stored.tat-now, slack)
				}
			}
		}
		if rng.IntN(50) == 0 {
			time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond) // let buckets refill
		}
	}
	if admitted < 500 || denied < 500 || rebased < 100 || format == formatV2 && compact < 500 || raised < 100 || remembered < 100 {
		t.Fatalf("sequence exercised too little: %d admitted, %d denied, %d rebased, %d stored compact, %d raised to a learned usage, %d usages remembered",
			admitted, denied, rebased, compact, raised, remembered)
	}
	t.Logf("%d requests in 3000 calls: %d admitted, %d denied, %d buckets read against a changed limit, %d stored in v2, %d takes raised to a learned usage, %d usages remembered, identical in Lua and Go",
		requests, admitted, denied, rebased, compact, raised, remembered)
}

// TestLuaBadKeys: a bucket key holding a hash (WRONGTYPE) or a string that
// is not a bucket fails only the requests that touch it; the other requests
// of the same call are decided and charged as usual, and the bad keys are
// left as they are. A key holding a concurrency policy's slots (a sorted
// set, from a config that gave the name to another kind of policy) is
// replaced.
func TestLuaBadKeys(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	// Buckets that live long enough to be read back on a loaded machine.
	l := limit{interval: 1_000_000, burst: 5}
	client.HSet(ctx, "rl:p:{hash}", "debug", "1")
	client.Set(ctx, "rl:p:{garbage}", "not a bucket", 0)
	client.ZAdd(ctx, "rl:p:{slots}", redis.Z{Score: 1, Member: "lease"})
	take := func(key string) []bucketRequest {
		return []bucketRequest{{key: key, limit: l, op: opTake, cost: 1}}
	}
	res, err := evalDecide(ctx, client, take("rl:p:{a}"), take("rl:p:{hash}"), append(take("rl:p:{b}"), take("rl:p:{garbage}")...), take("rl:p:{slots}"), take("rl:p:{b}"))
	if err != nil {
		t.Fatalf("a call with bad keys failed as a whole: %v", err)
	}
	// Each request: status, then 2 numbers per bucket.
	statuses := []int64{res[1], res[4], res[7], res[12], res[15]}
	want := []int64{scriptAdmitted, scriptWrongType, scriptCorrupt, scriptAdmitted, scriptAdmitted}
	if fmt.Sprint(statuses) != fmt.Sprint(want) {
		t.Fatalf("statuses %v, want %v (reply %v)", statuses, want, res)
	}
	if res[10] != scriptCorrupt || res[8] != 1 {
		t.Fatalf("the bad bucket of a two-bucket request: reply %v", res[7:11])
	}
	// {b} was charged once: by the last request, not by the one whose other
	// bucket was bad.
	if v := client.Get(ctx, "rl:p:{b}").Val(); v == "" {
		t.Fatal("{b} not charged")
	} else if b := parseStored(t, v, formatV1); b.tat-res[0] != l.interval {
		t.Fatalf("{b} charged %d µs, want one token (%d)", b.tat-res[0], l.interval)
	}
	if typ := client.Type(ctx, "rl:p:{hash}").Val(); typ != "hash" {
		t.Fatalf("the hash was replaced by a %s", typ)
	}
	if v := client.Get(ctx, "rl:p:{garbage}").Val(); v != "not a bucket" {
		t.Fatalf("the bad string became %q", v)
	}
	if typ := client.Type(ctx, "rl:p:{slots}").Val(); typ != "string" {
		t.Fatalf("the old slots are a %s, want replaced by a bucket", typ)
	}
	p := &pending{reqs: take("rl:p:{hash}")}
	if err := decodeReply([]int64{res[0], res[4], res[5], res[6]}, []*pending{p}); err != nil || p.err == nil || errorKind(p.err) != "wrongtype" || !strings.Contains(p.err.Error(), "rl:p:{hash}") {
		t.Fatalf("a WRONGTYPE request: call error %v, request error %v (kind %s)", err, p.err, errorKind(p.err))
	}
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
	d, err := rs.decide(ctx, []bucketRequest{{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 3}})
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
	r := []bucketRequest{{key: "rl:p:{x}", limit: limit{interval: 1000, burst: 10}, op: opTake, cost: 1}}
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
			conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, PoolSize: 64, Timeout: testTimeout}.resolved(), zap.NewNop())
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Destruct()
			rs := &redisStore{conn: conn}
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
// allocations per decision included.
func BenchmarkRedisDecide(b *testing.B) {
	srv := testredis.Start(b)
	for _, coalesce := range []bool{false, true} {
		b.Run(fmt.Sprintf("coalesced=%v", coalesce), func(b *testing.B) {
			noCoalescing = !coalesce
			defer func() { noCoalescing = false }()
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
			var n atomic.Int64
			b.SetParallelism(32)
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				for pb.Next() {
					i := n.Add(1)
					reqs := []bucketRequest{{key: keys[i%int64(len(keys))], limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
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

// TestLuaSlots: concurrency slots in lua/decide.lua, against the Go
// decision: at most N leases held; a request denied by any policy takes no
// slot and charges no bucket, and one denied a slot charges nothing;
// releasing from a full set announces it; an unrenewed lease expires and
// is counted; renewing a lease that expired says so; a key of another type
// fails alone, except a rate bucket left by an earlier config, replaced.
func TestLuaSlots(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	slots := limit{interval: 200_000, burst: 2} // 2 slots, leases of 200 ms
	acquire := func(key, lease string) bucketRequest {
		return bucketRequest{key: key, limit: slots, op: opAcquire, cost: 1, lease: lease, events: "rl:events"}
	}
	decide := func(reqs ...bucketRequest) decision {
		t.Helper()
		d, err := rs.decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := decide(acquire("rl:s:{a}", "l1")); !d.admitted || d.verdicts[0].remaining != 1 {
		t.Fatalf("first slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{a}", "l2")); !d.admitted || d.verdicts[0].remaining != 0 {
		t.Fatalf("second slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{a}", "l3")); d.admitted || d.verdicts[0].allowed || d.verdicts[0].untilFits != slotWait {
		t.Fatalf("third slot of 2: %+v, want denied", d)
	}
	// All or nothing: a full set of slots leaves the rate bucket uncharged,
	// and an empty rate bucket leaves the slot untaken.
	rate := bucketRequest{key: "rl:r:{a}", limit: limit{interval: 1_000_000, burst: 1}, op: opTake, cost: 1}
	if d := decide(acquire("rl:s:{a}", "l4"), rate); d.admitted || !d.verdicts[1].allowed {
		t.Fatalf("slot full, rate free: %+v", d)
	}
	if d := decide(rate); !d.admitted {
		t.Fatalf("the rate bucket was charged by a request denied a slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{b}", "l5"), rate); d.admitted || !d.verdicts[0].allowed {
		t.Fatalf("rate empty, slot free: %+v", d)
	}
	if n := client.ZCard(ctx, "rl:s:{b}").Val(); n != 0 {
		t.Fatalf("%d slots taken by a request the rate policy denied", n)
	}
	// Releasing from a full set announces it to every instance.
	sub := client.Subscribe(ctx, "rl:events")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	rel := acquire("rl:s:{a}", "l1")
	rel.op = opRelease
	decide(rel)
	select {
	case msg := <-sub.Channel():
		if msg.Payload != "freed rl:s:{a}" {
			t.Fatalf("announced %q", msg.Payload)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("no announcement of a slot freed from a full set")
	}
	// l2 is not renewed: it expires, and the next read reclaims it.
	renew := acquire("rl:s:{a}", "l2")
	renew.op = opRenew
	time.Sleep(250 * time.Millisecond)
	if d := decide(renew); d.verdicts[0].allowed {
		t.Fatalf("renewing an expired lease: %+v, want not held", d)
	}
	d := decide(acquire("rl:s:{a}", "l6"), acquire("rl:s:{a}", "l7"))
	if !d.admitted {
		t.Fatalf("after the leases expired: %+v", d)
	}
	held := acquire("rl:s:{a}", "l6")
	held.op = opRenew
	if d := decide(held); !d.verdicts[0].allowed {
		t.Fatalf("renewing a held lease: %+v", d)
	}
	// Another type under the key: a hash fails alone; a rate bucket of an
	// earlier config is replaced.
	client.HSet(ctx, "rl:s:{hash}", "x", "1")
	client.Set(ctx, "rl:s:{old}", "1:1000", 0)
	p := &pending{reqs: []bucketRequest{acquire("rl:s:{hash}", "l8")}}
	q := &pending{reqs: []bucketRequest{acquire("rl:s:{old}", "l9")}}
	rs.conn.call([]*pending{p, q})
	if errorKind(p.err) != "wrongtype" || q.err != nil || !q.d.admitted {
		t.Fatalf("a hash: %v; an old rate bucket: %+v %v", p.err, q.d, q.err)
	}
}

// TestLuaLargeCall: one call of 64 requests of five buckets each (1,984
// numbers, which the script unpacks 1,000 at a time) decides each request
// in order, as the calls of one request would, and names each lease by its
// own string.
func TestLuaLargeCall(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000_000, burst: 3}
	var batch []*pending
	for r := range 64 {
		var reqs []bucketRequest
		for j := range 4 { // request r's keys are those of r+16, r+32 and r+48
			reqs = append(reqs, bucketRequest{key: fmt.Sprintf("rl:big:{%d}:%d", r%16, j), limit: rate, op: opTake, cost: 1})
		}
		reqs = append(reqs, bucketRequest{key: "rl:big-slots", limit: limit{interval: 60_000_000, burst: 100}, op: opAcquire, cost: 1,
			lease: fmt.Sprintf("lease-%d", r), events: "rl:events"})
		batch = append(batch, &pending{reqs: reqs})
	}
	rs.conn.call(batch)
	var want []string
	for r, p := range batch {
		if p.err != nil {
			t.Fatalf("request %d: %v", r, p.err)
		}
		// Each key's 3 tokens go to the first three requests that take it.
		if p.d.admitted != (r < 48) || p.d.verdicts[0].allowed != (r < 48) || !p.d.verdicts[4].allowed {
			t.Fatalf("request %d: %+v, want admitted iff it is among the first 48", r, p.d)
		}
		if r < 48 {
			want = append(want, fmt.Sprintf("lease-%d", r))
		}
	}
	held, err := client.ZRange(ctx, "rl:big-slots", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(held)
	slices.Sort(want)
	if !slices.Equal(held, want) {
		t.Fatalf("leases held %v, want those of the 48 admitted requests %v", held, want)
	}
}

// countedLeases counts what leasesExpired is given.
type countedLeases struct{ n atomic.Int64 }

func (c *countedLeases) Add(v float64) { c.n.Add(int64(v)) }

// TestLuaSlotsFaults: a restore puts back a lease the store lost; a reset
// (free) keeps the leases of running requests and drops the stale ones;
// expired leases are counted by whatever op finds them: a denied acquire, a
// renewal, a count.
func TestLuaSlotsFaults(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	slots := limit{interval: 10_000_000, burst: 2} // 2 slots, leases of 10 s
	expired := &countedLeases{}
	op := func(o bucketOp, key, lease string) bucketRequest {
		return bucketRequest{key: key, limit: slots, op: o, lease: lease, events: "rl:events", leasesExpired: expired}
	}
	decide := func(reqs ...bucketRequest) decision {
		t.Helper()
		d, err := rs.decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	decide(op(opAcquire, "rl:s:{f}", "a"))
	client.Del(ctx, "rl:s:{f}") // as a FLUSHALL would
	if d := decide(op(opRenew, "rl:s:{f}", "a")); d.verdicts[0].allowed {
		t.Fatalf("renewing a lost lease: %+v, want not held", d)
	}
	decide(op(opRestore, "rl:s:{f}", "a"))
	if d := decide(op(opRenew, "rl:s:{f}", "a")); !d.verdicts[0].allowed {
		t.Fatalf("renewing a restored lease: %+v, want held", d)
	}
	// Free: a lease with 9 s left is a running request's; one with 1 s left
	// was not renewed for most of its lease: stale.
	now := time.Now().UnixMicro()
	client.ZAdd(ctx, "rl:s:{f}", redis.Z{Score: float64(now + 1_000_000), Member: "stale"})
	free := op(opFree, "rl:s:{f}", "")
	free.delta = slots.interval / staleAfter
	if d := decide(free); d.verdicts[0].remaining != 1 || d.verdicts[0].expired != 1 {
		t.Fatalf("reset: %+v, want 1 running kept (1 free) and 1 stale dropped", d)
	}
	if members := client.ZRange(ctx, "rl:s:{f}", 0, -1).Val(); len(members) != 1 || members[0] != "a" {
		t.Fatalf("after the reset the slots hold %v, want [a]", members)
	}
	expired.n.Store(0)
	// Expired leases, found by a denied acquire, a renewal and a count.
	past := float64(now - 1_000_000)
	for _, key := range []string{"rl:s:{d}", "rl:s:{r}", "rl:s:{c}"} {
		client.ZAdd(ctx, key, redis.Z{Score: past, Member: "gone"}, redis.Z{Score: float64(now + 9_000_000), Member: "x"}, redis.Z{Score: float64(now + 9_000_000), Member: "y"})
	}
	client.ZAdd(ctx, "rl:s:{d}", redis.Z{Score: float64(now + 9_000_000), Member: "z"}) // still full without "gone"
	if d := decide(op(opAcquire, "rl:s:{d}", "new")); d.admitted {
		t.Fatalf("acquire on a full set: %+v", d)
	}
	decide(op(opRenew, "rl:s:{r}", "x"))
	decide(op(opCount, "rl:s:{c}", ""))
	if n := expired.n.Load(); n != 3 {
		t.Fatalf("leases_expired counted %d, want 3 (a denied acquire, a renewal, a count)", n)
	}
}
