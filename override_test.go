package ratelimit

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

func TestDecodeOverride(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want override
		ok   bool
	}{
		{"o1 r 12000 500", override{overrideRate, 12000, 500}, true},
		{"o1 c 0 10", override{overrideSlots, 0, 10}, true},
		{"o1 r 1 2251799813685248", override{overrideRate, 1, 1 << 51}, true}, // burst × interval at maxBucketSpan
		{"o1 r 2 2251799813685248", override{}, false},                        // beyond it
		{"o1 r 0 5", override{}, false},
		{"o1 r 5 0", override{}, false},
		{"o1 c 0 0", override{}, false},
		{"o1 r 12000", override{}, false},
		{"o1 r 12000 500 7", override{}, false},
		{"o1 r -1 5", override{}, false},
		{"o1 r +1 5", override{}, false},
		{"o1 r 12345678901234567 5", override{}, false}, // 17 digits: beyond what Lua holds exactly
		{"o1 c 12345678901234567 5", override{}, false},
		{"o1 q 0 5000", override{overrideQuota, 0, 5000}, true},
		{"o1 q 1 5", override{overrideQuota, 1, 5}, true}, // the interval is not read, as for slots
		{"o1 q 0 0", override{}, false},
		{"o1 q 0 9007199254740993", override{}, false}, // beyond 2^53
		{"o2 r 1 5", override{}, false},
		{"1700000000000000:1000", override{}, false}, // a bucket
		{"", override{}, false},
	} {
		got, ok := decodeOverride(tc.v)
		if ok != tc.ok || ok && got != tc.want {
			t.Errorf("decodeOverride(%q) = %+v, %v; want %+v, %v", tc.v, got, ok, tc.want, tc.ok)
		}
		if ok && got.encode() != tc.v {
			t.Errorf("%+v encodes as %q, want %q", got, got.encode(), tc.v)
		}
	}
}

func TestOverrideLimitFor(t *testing.T) {
	sent := limit{interval: 600_000, burst: 100, slack: 5_000_000} // 100/1m, wait 5s
	slots := limit{interval: 30_000_000, burst: 3}                 // 3 slots, lease 30s
	rate := override{kind: overrideRate, interval: 12_000, burst: 500}
	for _, tc := range []struct {
		name         string
		o            override
		sent         limit
		slots        bool
		waitUS, debt int64
		want         limit
	}{
		{"rate, wait", rate, sent, false, 5_000_000, 0, limit{12_000, 500, 5_000_000}},
		{"rate, settle max 800", rate, sent, false, 0, 800, limit{12_000, 500, 800 * 12_000}},
		{"rate, settle twice the burst", rate, sent, false, 1_000, -2, limit{12_000, 500, 1_000 + 1000*12_000}},
		{"rate on slots: ignored", rate, slots, true, 0, 0, slots},
		{"slots", override{kind: overrideSlots, burst: 10}, slots, true, 0, 0, limit{30_000_000, 10, 0}},
		{"slots on a rate bucket: ignored", override{kind: overrideSlots, burst: 10}, sent, false, 0, 0, sent},
		{"debt beyond the span: capped", override{kind: overrideRate, interval: 1 << 20, burst: 1 << 30}, sent, false, 0, -2, limit{1 << 20, 1 << 30, 1<<51 - 1<<50}},
		{"wait beyond the span: capped", override{kind: overrideRate, interval: 1 << 20, burst: 1 << 31}, sent, false, 1 << 40, 0, limit{1 << 20, 1 << 31, 0}},
	} {
		if got := tc.o.limitFor(tc.sent, tc.slots, tc.waitUS, tc.debt); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

// TestLuaOverrideValues: for each stored value, beside a rate bucket,
// beside a concurrency policy's slots and beside a quota's count (under
// each debt rule: none, settle max 7, settle's twice the N), the script
// decides under the limit decodeOverride and limitFor (quotaLimitFor) give
// (the sent one for a value that is not an override, or one of another
// kind).
func TestLuaOverrideValues(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000, burst: 5, slack: 2_000_000}
	slots := limit{interval: 30_000_000, burst: 1}
	quota := limit{burst: 5, slack: 10} // settle, twice the quota of debt
	year := &quotaSpec{periods: calendar.New(calendar.Year, time.UTC), unit: calendar.Year, loc: time.UTC, name: "q"}
	for i, v := range []string{
		"o1 r 12000 500", "o1 c 0 10", "o1 c 7 3", "o1 r 0 5", "o1 c 0 0", "o1 r 12345678901234567 1", "o1 c 12345678901234567 4",
		"o1 c 0 12345678901234567", "o1 r 2 2251799813685248", "o1 r 1 2251799813685248", "o1 x 1 1", " o1 r 1 1", "o1 r 1 1 ", "",
		"o1 q 0 5000", "o1 q 3 7", "o1 q 0 1", "o1 q 0 0", "o1 q 0 4503599627370496", "o1 q 0 9007199254740991",
		"o1 q 0 9007199254740992", "o1 q 0 9007199254740993", "o1 c 0 9007199254740993", "o1 q 0 12345678901234567", "o1 q 0 -5",
	} {
		for _, rq := range []bucketRequest{
			{key: fmt.Sprintf("rl:r:{v%d}", i), limit: rate, op: opTake, cost: 1, overridable: true, overrideWait: 2_000_000},
			{key: fmt.Sprintf("rl:s:{v%d}", i), limit: slots, op: opAcquire, cost: 1, lease: "l", events: "rl:events", overridable: true},
			{key: fmt.Sprintf("rl:q:{v%d}", i), limit: quota, op: opTake, cost: 1, quota: year, overridable: true, overrideDebt: -2},
			{key: fmt.Sprintf("rl:qm:{v%d}", i), limit: limit{burst: 5, slack: 7}, op: opCheck, cost: 1, quota: year, overridable: true, overrideDebt: 7},
			{key: fmt.Sprintf("rl:q0:{v%d}", i), limit: limit{burst: 5}, op: opInspect, quota: year, overridable: true},
		} {
			client.Set(ctx, overrideKey(rq.key), v, 0)
			res, err := evalDecide(ctx, client, []bucketRequest{rq})
			if err != nil {
				t.Fatalf("%q: %v", v, err)
			}
			o := 1 + 1 + bucketReplyWidth(rq) // now, status, the op's numbers
			got := limit{interval: res[o], burst: res[o+1], slack: res[o+2]}
			want := rq.limit
			if ov, ok := decodeOverride(v); ok {
				want = rq.applyOverride(ov).limit
			}
			if got != want {
				t.Errorf("%q beside %s: Lua decided under %+v, Go %+v", v, rq.key, got, want)
			}
		}
	}
}

// TestLuaOverrideAfterSlots: an overridable bucket after a concurrency
// slot in one call (a request of a `concurrent` and a rate policy, or an
// inspect that rode with a slot's release) reads its override. The
// script made its table of overrides with the first overridable bucket's
// other tables, which a slot makes too: the call failed as a whole
// ("attempt to index local 'overrides'"), found beside two CPU hogs by
// TestConcurrentWithRate.
func TestLuaOverrideAfterSlots(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000, burst: 5, slack: 2_000_000}
	year := &quotaSpec{periods: calendar.New(calendar.Year, time.UTC), unit: calendar.Year, loc: time.UTC, name: "q"}
	slot := bucketRequest{key: "rl:s:{after}", limit: limit{interval: 30_000_000, burst: 1}, op: opAcquire, cost: 1, lease: "l", events: "rl:events"}
	for _, rq := range []bucketRequest{
		{key: "rl:r:{after}", limit: rate, op: opTake, cost: 1, overridable: true, overrideWait: 2_000_000},
		{key: "rl:r:{after}", limit: rate, op: opInspect, overridable: true},
		{key: "rl:q:{after}", limit: limit{burst: 5}, op: opTake, cost: 1, quota: year, overridable: true},
	} {
		client.Set(ctx, overrideKey(rq.key), "o1 r 12000 500", 0)
		if rq.quota != nil {
			client.Set(ctx, overrideKey(rq.key), "o1 q 0 5000", 0)
		}
		client.Del(ctx, slot.key)
		res, err := evalDecide(ctx, client, []bucketRequest{slot, rq})
		if err != nil {
			t.Fatalf("a slot, then %s (op %d): %v", rq.key, rq.op, err)
		}
		o := 1 + 1 + bucketReplyWidth(slot) + bucketReplyWidth(rq) // now, status, the slot's numbers, this op's
		got := limit{interval: res[o], burst: res[o+1], slack: res[o+2]}
		v, _ := client.Get(ctx, overrideKey(rq.key)).Result()
		ov, _ := decodeOverride(v)
		if want := rq.applyOverride(ov).limit; got != want {
			t.Errorf("a slot, then %s (op %d): decided under %+v, want the override's %+v", rq.key, rq.op, got, want)
		}
	}
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

// TestServeHTTPQuotaOverrideSettle: a quota's override applies to what a
// settle charges after the response, and to what the fields and the
// placeholders predict of it: reserved 5 of an override's 100, settled at
// 2, 98 left (the policy's own N is 10).
func TestServeHTTPQuotaOverrideSettle(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "qovr_settle", Key: "{http.request.header.X-User}", Quota: "10/year", Cost: "5", Settle: &Settle{From: settleHeader, Field: "X-Used"}},
	}}, nil)
	dana := "dana-" + time.Now().Format("150405.000000")
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"qovr_settle","identity":"`+dana+`","quota":"100"}`); status != 200 {
		t.Fatalf("setting the override: %d %s", status, body)
	}
	defer adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"qovr_settle","identity":"`+dana+`"}`)
	x := serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Used", "2"), "X-User", dana)
	pol, lim := fields(t, x.header, "RateLimit-Policy")["qovr_settle"], fields(t, x.header, "RateLimit")["qovr_settle"]
	if x.status != 200 || pol["q"] != 100 || lim["r"] != 98 || x.vars["remaining"] != "98" {
		t.Fatalf("settled at 2 under quota 100: %d q=%d r=%d remaining %q, want 200 q=100 r=98 remaining 98", x.status, pol["q"], lim["r"], x.vars["remaining"])
	}
	if x := serve([]*Handler{h}, nil, "X-User", dana); fields(t, x.header, "RateLimit")["qovr_settle"]["r"] != 93 {
		t.Fatalf("the next reservation: %v, want r=93 (98 - 5: the settle was made under the override)", fields(t, x.header, "RateLimit")["qovr_settle"])
	}
}
