package ratelimit

import (
	"context"
	"net/http"
	"os/exec"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
)

// TestLearnedUsageEncoding: what Redis holds for a key's learned usage is
// read back as written; the previous release's l1 reads as a floor; a
// value that is not one reads as none, and more records than a key keeps
// keep the newest.
func TestLearnedUsageEncoding(t *testing.T) {
	var l learnedUsage
	for _, r := range []learnedRecord{{7, 0}, {7, 400}, {14, 0}, {14, 30248}} {
		l.push(r.class, r.excess)
	}
	if v := encodeLearned(l); v != "l2 14:30248 14:0 7:400" || decodeLearned(v) != l || l.most() != 30248 { // the first 0 changed nothing
		t.Fatalf("pushed: %q (%+v), most %d", v, decodeLearned(v), l.most())
	}
	for range learnRecords {
		l.push(7, 0)
	}
	if !l.nothing() || encodeLearned(l) != "" || l.n != 0 {
		t.Fatalf("after %d settles within their reservations: %+v %q, want forgotten", learnRecords, l, encodeLearned(l))
	}
	for v, want := range map[string]int64{
		"l2 3:10 3:20": 20,
		"l2 1:9 1:1 1:1 1:1 1:1 1:1 1:1 1:1 1:100": 9, // the first eight
		"l2":                         0,
		"l2 5":                       0,
		"l2 5:":                      0,
		"l2 64:5":                    0, // no class that large
		"l2 3:12345678901234567":     0, // 17 digits: never written
		"l1 1 2 3":                   3, // the previous release's: a floor
		"l1 9007199254740991 1":      9007199254740991,
		"l1 12345678901234567":       0,
		"l1 5x":                      0,
		"l3 1:2":                     0,
		"20251203000000000000000000": 0, // a bucket, not this
	} {
		if got := decodeLearned(v); got.most() != want {
			t.Errorf("%q reads as %+v, most %d, want %d", v, got, got.most(), want)
		}
	}
	// The previous release's floor goes with the first settle of this one.
	l = decodeLearned("l1 40010 500")
	if r := l.raise(reservationClass(100), 100); r != 40010-100 {
		t.Errorf("l1 40010: a take of 100 raised by %d, want to the floor (39910)", r)
	}
	l.push(7, 0)
	if encodeLearned(l) != "" {
		t.Errorf("after a settle within its reservation: %q, want forgotten", encodeLearned(l))
	}
}

// TestLearnedUsageClasses: a take is raised by a high percentile of what
// requests of its class used beyond their reservations: the largest while
// fewer than five are remembered, the second largest from five on; a class
// that taught nothing raises nothing, whatever the others taught.
func TestLearnedUsageClasses(t *testing.T) {
	var l learnedUsage
	l.push(reservationClass(9762), 40010-9762) // one honest large call
	if r := l.raise(reservationClass(100), 100); r != 0 {
		t.Errorf("a small take after one large call: raised by %d, want 0", r)
	}
	if r := l.raise(reservationClass(9000), 9000); r != 30248 {
		t.Errorf("a take like the large call: raised by %d, want its excess 30248", r)
	}
	for _, e := range []int64{100, 120, 90, 110} {
		l.push(reservationClass(9000), e)
	}
	if r := l.raise(reservationClass(9000), 9000); r != 120 {
		t.Errorf("five of the class, one an outlier: raised by %d, want the second largest (120)", r)
	}
	if c := reservationClass(8000); c != reservationClass(8191) || c == reservationClass(8192) || reservationClass(1) != 1 || reservationClass(0) != 0 {
		t.Errorf("classes by powers of two: %d %d %d", reservationClass(8000), reservationClass(8191), reservationClass(8192))
	}
}

// TestServeHTTPLearnedUsage: in process, a key whose settles used more
// than they reserved reserves, for requests like them, what they used
// beyond (at most the burst), for at most learnRecords settles within
// their reservations, and for at most learnTTL; requests of another size
// and another key learn nothing from it; a reset forgets.
func TestServeHTTPLearnedUsage(t *testing.T) {
	c := &clock{t: 1000 * sec}
	st := newMemoryStore(c.now)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "tokens", Key: "{http.request.header.X-Api-Key}", Rate: "100000/1s",
		Burst: 50000, Cost: "{http.request.header.X-Max-Tokens}", Settle: &Settle{From: settleHeader, Field: "X-Usage-Tokens"}}}}, st)
	// reserve sends a request of key reserving 100 that uses usage, and
	// returns what its key learned once it is settled.
	reserve := func(key string, usage int64) int64 {
		t.Helper()
		x := serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Usage-Tokens", strconv.FormatInt(usage, 10)), "X-Api-Key", key, "X-Max-Tokens", "100")
		if x.status != 200 {
			t.Fatalf("%s: %d", key, x.status)
		}
		c.t += 2 * sec // the bucket is full again
		d, _ := st.decide(context.Background(), []bucketRequest{{key: h.Policies[0].storageKey(h.hasher, key), limit: h.Policies[0].limit, op: opInspect, learns: true}})
		return d.verdicts[0].learned
	}
	if l := reserve("a", 80); l != 0 {
		t.Fatalf("a settle within its reservation: %d learned", l)
	}
	if l := reserve("a", 40010); l != 40010-100 {
		t.Fatalf("after a settle of 40010 on a reservation of 100: %d learned, want 39910", l)
	}
	if l := reserve("b", 80); l != 0 {
		t.Fatalf("another key found %d learned", l)
	}
	// What the next request of a like it reserves: 100 + 39910 (its
	// upstream reports no usage: the reservation stands, and nothing is
	// remembered); one of another size, its own cost.
	x := serveWith([]*Handler{h}, nil, func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(200)
		return nil
	}, "X-Api-Key", "a", "X-Max-Tokens", "100")
	if got := fields(t, x.header, "RateLimit")["tokens"]["r"]; got != 50000-40010 {
		t.Fatalf("a request of a key that learned 39910 beyond 100 left r=%d, want %d", got, 50000-40010)
	}
	c.t += 2 * sec
	x = serveWith([]*Handler{h}, nil, upstreamAnswering(200), "X-Api-Key", "a", "X-Max-Tokens", "5000")
	if got := fields(t, x.header, "RateLimit")["tokens"]["r"]; got != 50000-5000 {
		t.Fatalf("a request of another size left r=%d, want %d: raised by another class's excess", got, 50000-5000)
	}
	c.t += 2 * sec
	for i := range learnRecords - 1 {
		if l := reserve("a", 80); l != 40010-100 {
			t.Fatalf("settle %d within its reservation: %d learned", i, l)
		}
	}
	if l := reserve("a", 80); l != 0 {
		t.Fatalf("after %d settles within their reservations: %d learned, want forgotten", learnRecords, l)
	}
	// Learned more than the burst: a request reserves the whole burst.
	if l := reserve("c", 100100); l != 100000 {
		t.Fatalf("learned %d", l)
	}
	x = serveWith([]*Handler{h}, nil, upstreamAnswering(200), "X-Api-Key", "c", "X-Max-Tokens", "100")
	if got := fields(t, x.header, "RateLimit")["tokens"]["r"]; x.status != 200 || got != 0 {
		t.Fatalf("a key that learned 100100 (burst 50000): %d, r=%d, want 200 and r=0", x.status, got)
	}
	c.t += 2 * sec
	c.t += int64(learnTTL / time.Microsecond)
	if l := reserve("c", 5); l != 0 {
		t.Fatalf("after %v: %d learned, want forgotten", learnTTL, l)
	}
	// A reset forgets.
	reserve("d", 9000)
	key := h.Policies[0].storageKey(h.hasher, "d")
	if _, err := st.decide(context.Background(), []bucketRequest{{key: key, limit: h.Policies[0].limit, op: opReset, learns: true}}); err != nil {
		t.Fatal(err)
	}
	if l := reserve("d", 5); l != 0 {
		t.Fatalf("after a reset: %d learned", l)
	}
}

// TestMemoryStoreLearnedBound: the learned usage an in-process store keeps
// is bounded whatever the number of keys that learn.
func TestMemoryStoreLearnedBound(t *testing.T) {
	c := &clock{t: 1000 * sec}
	st := newMemoryStore(c.now)
	l := limit{interval: 10, burst: 1000, slack: 1 << 30}
	for i := range 3 * memoryShards * learnedMaxKeys / 2 {
		rq := bucketRequest{key: "rl:p:{" + strconv.Itoa(i) + "}", limit: l, op: opAdjust, delta: 1, learns: true, record: 5000, class: 3}
		if _, err := st.decide(context.Background(), []bucketRequest{rq}); err != nil {
			t.Fatal(err)
		}
	}
	n := 0
	for i := range st.shards {
		if k := len(st.shards[i].learned); k > learnedMaxKeys {
			t.Fatalf("shard %d keeps %d learned usages, more than %d", i, k, learnedMaxKeys)
		} else {
			n += k
		}
	}
	t.Logf("%d keys learned, %d kept (at most %d)", 3*memoryShards*learnedMaxKeys/2, n, memoryShards*learnedMaxKeys)
}

// TestLearnedUsageBesideV040: v0.4.0 (testcaddy.ReleaseV04, the release before
// this one) and this one on one Redis read each other's learned usage: this
// one writes l2, which v0.4.0 reads as nothing learned (its take is its cost
// alone); v0.4.0's settle writes l1 over it, which this one reads as a floor
// (a take raised to at least the largest usage), until its next settle
// writes l2 again. Neither fails on the other's value.
func TestLearnedUsageBesideV040(t *testing.T) {
	old, err := exec.Command("git", "show", testcaddy.ReleaseV04+":lua/decide.lua").Output()
	if err != nil {
		t.Fatalf("reading v0.4.0's script from git history: %v", err)
	}
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	const interval = 100 // 10,000/s
	l := limit{interval: interval, burst: 50000, slack: 100000 * interval}
	const key = "rl:llm:{beside}"
	// v0.4.0's call of one learning bucket: op, interval, burst, slack,
	// amount, wait, and the usage a settle remembers.
	v040 := func(op bucketOp, amount, record int64) []int64 {
		t.Helper()
		nums := callNumbers(nil).add(1).add(4*int64(op) + learnsOp).add(l.interval).add(l.burst).add(l.slack).add(amount).add(0).add(record)
		res, err := client.Eval(ctx, string(old), []string{key}, formatV2, []byte(nums)).Int64Slice()
		if err != nil {
			t.Fatalf("v0.4.0's script: %v", err)
		}
		return res
	}
	// This release settles a request of 9,762 that used 40,010.
	settle := bucketRequest{key: key, limit: l, op: opAdjust, delta: 40010 - 9762, learns: true, record: 40010 - 9762, class: reservationClass(9762)}
	if _, err := evalDecide(ctx, client, []bucketRequest{settle}); err != nil {
		t.Fatal(err)
	}
	if v := client.Get(ctx, key+learnedSuffix).Val(); v != "l2 14:30248" {
		t.Fatalf("this release remembered %q, want l2 14:30248", v)
	}
	// v0.4.0 takes 100: its cost alone (it reads nothing learned).
	client.Del(ctx, key)
	if res := v040(opTake, 100, 0); res[1] != scriptAdmitted || res[len(res)-1] != 0 {
		t.Fatalf("v0.4.0's take beside l2: %v (want admitted, nothing learned)", res)
	}
	if pttl := client.PTTL(ctx, key).Val(); pttl > 20*time.Millisecond {
		t.Fatalf("v0.4.0's take of 100 at 10,000/s: the bucket expires in %v, it took more", pttl)
	}
	// v0.4.0 settles a usage of 5,000 beyond its reservation: it writes l1.
	v040(opAdjust, 0, 5000)
	if v := client.Get(ctx, key+learnedSuffix).Val(); v != "l1 5000" {
		t.Fatalf("v0.4.0 remembered %q, want l1 5000 (over this release's l2)", v)
	}
	// This release reads l1 as a floor: a take of 100 reserves 5,000.
	client.Del(ctx, key)
	res, err := evalDecide(ctx, client, []bucketRequest{{key: key, limit: l, op: opTake, cost: 100, learns: true}})
	if err != nil || res[1] != scriptAdmitted || res[len(res)-1] != 4900 {
		t.Fatalf("this release's take beside l1 5000: %v %v (want raised by 4,900)", res, err)
	}
	// Its next settle writes l2 again: the floor goes.
	settle = bucketRequest{key: key, limit: l, op: opAdjust, delta: -50, learns: true, record: 0, class: reservationClass(100)}
	if _, err := evalDecide(ctx, client, []bucketRequest{settle}); err != nil {
		t.Fatal(err)
	}
	if v, err := client.Get(ctx, key+learnedSuffix).Result(); err != redis.Nil {
		t.Fatalf("after a settle within its reservation: %q %v, want forgotten", v, err)
	}
}
