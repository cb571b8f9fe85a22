package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

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

// TestLuaMatchesGoOverrides drives random requests through lua/decide.lua,
// every bucket overridable, while overrides are set, changed and deleted
// beside the buckets between calls (valid ones of either kind, and values
// that are not overrides, which the script ignores as decodeOverride does),
// and through the Go algorithm under the same overrides (limitFor), and
// requires the same decisions, the same limits in the reply, the same
// verdicts and stored state.
func TestLuaMatchesGoOverrides(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	limits := []limit{
		{interval: 1000, burst: 5},
		{interval: 20_000, burst: 3, slack: 60_000},        // wait 60ms
		{interval: 333_333, burst: 10, slack: 6_666_660},   // settle: twice the burst of debt
		{interval: 600_000, burst: 100, slack: 1_000_000},  // wait 1s
		{interval: 86_400_000_000, burst: 1, slack: 0},     // 1/1d
		{interval: 100_000, burst: 20, slack: 100_000 * 7}, // settle max 7
	}
	rules := [][2]int64{{0, 0}, {60_000, 0}, {0, -2}, {1_000_000, 0}, {0, 0}, {0, 7}}
	values := []string{
		"o1 r 500 8", "o1 r 2000 2", "o1 r 100000 50", "o1 r 1000000 1", "o1 r 10 1000",
		"o1 c 0 4",                                                                    // another kind: ignored
		"o1 r 0 5", "garbage", "o1 r 12345678901234567 1", "o1 c 12345678901234567 4", // not overrides: ignored
	}
	keyOf := func(li, id int) string { return fmt.Sprintf("rl:p%d:{id%d}", li, id) }
	model := map[string]storedBucket{}
	overrides := map[string]override{} // the valid ones in force
	ops := []bucketOp{opTake, opTake, opTake, opCheck, opAdjust, opInspect}
	var requests, under, ignored int
	for step := range 2000 {
		if rng.IntN(4) == 0 { // an operator changes an override
			li, id := rng.IntN(len(limits)), rng.IntN(3)
			okey := overrideKey(keyOf(li, id))
			switch n := rng.IntN(len(values) + 2); {
			case n >= len(values):
				client.Del(ctx, okey)
				delete(overrides, keyOf(li, id))
			default:
				client.Set(ctx, okey, values[n], 0)
				if o, ok := decodeOverride(values[n]); ok {
					overrides[keyOf(li, id)] = o
				} else {
					delete(overrides, keyOf(li, id))
				}
			}
		}
		batch := make([][]bucketRequest, 1+rng.IntN(3))
		for r := range batch {
			op := ops[rng.IntN(len(ops))]
			n := 1 + rng.IntN(2)
			if !op.admits() {
				n = 1
			}
			used := map[string]bool{}
			for len(batch[r]) < n {
				li, id := rng.IntN(len(limits)), rng.IntN(3)
				if used[keyOf(li, id)] {
					continue
				}
				used[keyOf(li, id)] = true
				rq := bucketRequest{key: keyOf(li, id), limit: limits[li], op: op, cost: 1 + rng.Int64N(3),
					overridable: true, overrideWait: rules[li][0], overrideDebt: rules[li][1]}
				if op == opAdjust {
					rq.cost, rq.delta = 0, rng.Int64N(9)-4
				}
				if op == opTake && rng.IntN(2) == 0 {
					rq.wait = rules[li][0]
				}
				batch[r] = append(batch[r], rq)
			}
		}
		res, err := evalDecide(ctx, client, batch...)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		now, off := res[0], 1
		for r, reqs := range batch {
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			eff := append([]bucketRequest(nil), reqs...) // as decided: under the overrides

			tats := make([]int64, len(reqs))
			for i, rq := range reqs {
				if o, ok := overrides[rq.key]; ok {
					eff[i] = rq.applyOverride(o)
				}
				b := model[rq.key]
				tats[i] = eff[i].limit.rebase(b.tat, b.interval, now)
			}
			want, next := decideBuckets(tats, now, eff)
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s (override %+v): Lua verdict %+v, Go %+v", step, r, rq.key, overrides[rq.key], got.verdicts[i], want.verdicts[i])
				}
				if applied(eff, want, i) {
					if next[i] <= now {
						delete(model, rq.key)
					} else {
						model[rq.key] = storedBucket{next[i], eff[i].limit.interval}
					}
				}
			}
			requests += len(reqs)
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				if _, ok := overrides[rq.key]; ok {
					under++
				} else if v, err := client.Get(ctx, overrideKey(rq.key)).Result(); err == nil && v != "" {
					ignored++
				}
				v, err := client.Get(ctx, rq.key).Result()
				if err == redis.Nil {
					continue
				} else if err != nil {
					t.Fatal(err)
				}
				stored, want := parseStored(t, v, formatV1), model[rq.key]
				if start(stored.tat, now) != start(want.tat, now) || stored.tat > now && stored.interval != want.interval {
					t.Fatalf("step %d: bucket %s: Redis stored %+v, Go %+v", step, rq.key, stored, want)
				}
			}
		}
		if rng.IntN(50) == 0 {
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
		}
	}
	if under < 500 || ignored < 100 {
		t.Fatalf("too little exercised: %d buckets decided under an override, %d beside a value ignored", under, ignored)
	}
	t.Logf("%d bucket operations: %d under an override, %d beside a value that is not one (ignored); identical in Lua and Go", requests, under, ignored)
}

// adminDo calls the admin API in process, as Caddy's admin server would,
// and returns the status and the body (an error's message).
func adminDo(t *testing.T, method, target, body string) (int, string) {
	t.Helper()
	r := httptest.NewRequest(method, target, strings.NewReader(body))
	w := httptest.NewRecorder()
	if err := (adminAPI{}).serve(w, r); err != nil {
		var ae caddy.APIError
		if !errors.As(err, &ae) {
			t.Fatalf("%s %s: %v", method, target, err)
		}
		return ae.HTTPStatus, ae.Err.Error()
	}
	return w.Code, w.Body.String()
}

// TestServeHTTPOverride, in process (no redis block): an override set
// through the admin API applies to the identity's next request, its bucket
// kept; inspect and the list show it; bad input changes nothing; `for`
// expires by itself; delete brings the policy's limit back.
func TestServeHTTPOverride(t *testing.T) {
	fake := time.Now()
	processOverrides.mu.Lock()
	processOverrides.now = func() time.Time { return fake }
	processOverrides.mu.Unlock()
	defer func() {
		processOverrides.mu.Lock()
		processOverrides.now = time.Now
		processOverrides.mu.Unlock()
	}()
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "ovr_unit", Key: "{http.request.header.X-User}", Rate: "5/1h"}}}, nil)
	get := func() exchange { return serve([]*Handler{h}, nil, "X-User", "acme") }
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["ovr_unit"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["ovr_unit"]["r"] }
	for range 5 {
		get()
	}
	if x := get(); x.status != 429 {
		t.Fatalf("6th of 5: %d", x.status)
	}
	if h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatal("the policy's overrides flag is on before any override")
	}

	list := func() []overrideEntry {
		t.Helper()
		status, body := adminDo(t, "GET", "/rate_limit/overrides?policy=ovr_unit", "")
		var a overridesAnswer
		if err := json.Unmarshal([]byte(body), &a); status != 200 || err != nil {
			t.Fatalf("overrides: %d %s", status, body)
		}
		return a.Overrides
	}
	// Bad input: 400, and nothing changes.
	for _, tc := range []struct{ body, says string }{
		{`{"policy":"nope","identity":"acme","rate":"100/1h"}`, `policy "nope": no such policy`},
		{`{"identity":"acme","rate":"100/1h"}`, "policy: required"},
		{`{"policy":"ovr_unit","rate":"100/1h"}`, "identity: required"},
		{`{"policy":"ovr_unit","identity":"acme"}`, "a limit is required"},
		{`{"policy":"ovr_unit","identity":"acme","concurrent":5}`, "is a rate limit: its overrides take rate"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"0/1h"}`, "rate: \"0/1h\": N must be a positive integer"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","burst":-1}`, "burst: -1"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"1/1s","burst":9007199254740991}`, "take too long to refill"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"soon"}`, "for: "},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"500ms"}`, "for: 500ms must be from 1s"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"400d"}`, "for: 9600h0m0s must be from 1s to 8784h0m0s"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","note":"` + strings.Repeat("n", 201) + `"}`, "note: 201 bytes, at most 200"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","note":"line\nbreak"}`, "note: one line"},
		{`{"policy":"ovr_unit","identity":"acme","limit":"rate 100/1h"}`, `unknown field "limit"`},
		{`not json`, "the body is not"},
	} {
		if status, body := adminDo(t, "POST", "/rate_limit/override", tc.body); status != 400 || !strings.Contains(body, tc.says) {
			t.Errorf("POST %s: %d %q, want 400 saying %q", tc.body, status, body, tc.says)
		}
	}
	if n := len(list()); n != 0 || h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatalf("after refused overrides: %d listed, flag %v", n, h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")))
	}
	if x := get(); x.status != 429 {
		t.Fatalf("after refused overrides: %d, want still denied", x.status)
	}

	// An override: the bucket's 5 owed tokens are kept (5 of 20), and the
	// field shows the override's limit per the policy's window.
	status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme","rate":"100/1h","burst":20,"note":"contract 1"}`)
	if status != 200 {
		t.Fatalf("setting an override: %d %s", status, body)
	}
	if x := get(); x.status != 200 || q(x) != 100 || r(x) != 14 {
		t.Fatalf("under the override: %d q=%d r=%d, want 200 q=100 r=14", x.status, q(x), r(x))
	}
	if x := serve([]*Handler{h}, nil, "X-User", "bob"); q(x) != 5 {
		t.Fatalf("another identity: q=%d, want the policy's 5", q(x))
	}
	if l := list(); len(l) != 1 || l[0].Note != "contract 1" || l[0].describe() != "rate 100/1h burst 20" || l[0].Key != h.Policies[0].storageKey(h.hasher, "acme") {
		t.Fatalf("list: %+v", l)
	}
	status, body = adminDo(t, "GET", "/rate_limit/inspect?policy=ovr_unit&identity=acme", "")
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); status != 200 || err != nil || st.Override == nil || st.Burst != 20 || st.Rate != "100/1h" || st.Tokens != 14 {
		t.Fatalf("inspect: %d %s", status, body)
	}

	// Delete: the policy's limit again, the 6 override tokens owed capped
	// at its 5: denied.
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme"}`); status != 200 {
		t.Fatalf("delete: %d %s", status, body)
	}
	if x := get(); x.status != 429 || q(x) != 5 {
		t.Fatalf("after the delete: %d q=%d, want 429 q=5", x.status, q(x))
	}
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme"}`); status != 404 || !strings.Contains(body, "no override in force") {
		t.Fatalf("deleting again: %d %s, want 404", status, body)
	}

	// for 2s: in force until then, gone after, by itself.
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme","rate":"1000/1h","for":"2s"}`); status != 200 {
		t.Fatalf("setting an override for 2s: %d %s", status, body)
	}
	fake = fake.Add(1999 * time.Millisecond)
	if x := get(); x.status != 200 || q(x) != 1000 {
		t.Fatalf("1.999 s into an override for 2s: %d q=%d", x.status, q(x))
	}
	fake = fake.Add(time.Millisecond)
	if x := get(); q(x) != 5 || len(list()) != 0 || h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatalf("2 s into an override for 2s: q=%d, %d listed, flag %v; want it gone", q(x), len(list()), h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")))
	}
}

// TestOverrideAnnouncement: the announcement of an override returns once
// every subscriber of the events channel confirmed it, so the other
// instance reads the bucket's override from the moment it returns (not
// merely soon after), and only that bucket's; a subscriber that never
// confirms makes it return errUnconfirmed after a second.
func TestOverrideAnnouncement(t *testing.T) {
	srv, client, a := newTestRedis(t)
	conn := func() *redisConn {
		c, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Destruct() })
		return c
	}
	b := conn()
	a.conn.watch("rl:")
	b.watch("rl:")
	set := b.overrideSet("rl:p:")
	ctx := context.Background()
	deadline := time.Now().Add(5 * time.Second)
	for (client.PubSubNumSub(ctx, "rl:events").Val()["rl:events"] < 2 || set.may("rl:p:{h}")) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // both subscribed; b read that p has no overrides
	}
	if set.may("rl:p:{h}") {
		t.Fatal("a bucket of a policy without overrides may have one")
	}
	// Stored first, as the admin API does: the announcement makes b read it
	// at once, and the read of the index b makes on the event (which, with
	// nothing stored, would empty b's set again) keeps it.
	if _, err := a.conn.setOverride(ctx, "rl:p:{h}", override{kind: overrideRate, interval: 3, burst: 300}, overrideEntry{}, 0); err != nil {
		t.Fatalf("storing the override: %v", err)
	}
	start := time.Now()
	if err := a.conn.announceOverride(ctx, "rl:", "rl:p:{h}"); err != nil {
		t.Fatalf("announcing: %v", err)
	}
	took := time.Since(start)
	if !set.may("rl:p:{h}") || set.may("rl:p:{other}") {
		t.Fatalf("when the announcement returns, the other instance's set says %v for the bucket, %v for another: want true, false", set.may("rl:p:{h}"), set.may("rl:p:{other}"))
	}
	t.Logf("announced and confirmed by 2 subscribers in %v", took)

	// A subscriber that never confirms (as an instance of the release
	// before this one): unconfirmed, after a second.
	deaf := client.Subscribe(ctx, "rl:events")
	defer deaf.Close()
	if _, err := deaf.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := a.conn.announceOverride(ctx, "rl:", "rl:p:{h}"); !errors.Is(err, errUnconfirmed) || time.Since(start) < time.Second {
		t.Fatalf("with a subscriber that does not confirm: %v after %v, want errUnconfirmed after 1s", err, time.Since(start))
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
