package ratelimit

import (
	"context"
	"net/http"
	"os/exec"
	"strconv"
	"testing"
	"time"
)

// TestLearnedUsageEncoding: what Redis holds for a key's learned usage is
// read back as written; a value that is not one reads as none, and more
// numbers than a key keeps keep the newest.
func TestLearnedUsageEncoding(t *testing.T) {
	var l learnedUsage
	for _, u := range []int64{0, 500, 0, 40010} {
		l.push(u)
	}
	if v := encodeLearned(l); v != "l1 40010 0 500" || decodeLearned(v) != l || l.max() != 40010 {
		t.Fatalf("pushed 0 500 0 40010: %q (%+v), max %d", v, decodeLearned(v), l.max())
	}
	for range learnRecords {
		l.push(0)
	}
	if l.max() != 0 || encodeLearned(l) != "" || l.n != 0 {
		t.Fatalf("after %d settles within their reservations: %+v %q, want forgotten", learnRecords, l, encodeLearned(l))
	}
	for v, want := range map[string]int64{
		"l1 1 2 3":                   3,
		"l1 9 1 1 1 1 1 1 1 100":     9, // the first eight
		"l1":                         0,
		"l2 5":                       0,
		"l1 5x":                      0,
		"l1 -5":                      0,
		"l1 12345678901234567":       0, // 17 digits: never written
		"l1 9007199254740991 1":      9007199254740991,
		"20251203000000000000000000": 0, // a bucket, not this
	} {
		if got := decodeLearned(v); got.max() != want {
			t.Errorf("%q reads as %+v, max %d, want %d", v, got, got.max(), want)
		}
	}
}

// TestServeHTTPLearnedUsage: in process, a key whose settles used more
// than they reserved reserves what it used (at most the burst), for at
// most learnRecords settles within their reservations, and for at most
// learnTTL; another key learns nothing from it; a reset forgets.
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
	if l := reserve("a", 40010); l != 40010 {
		t.Fatalf("after a settle of 40010 on a reservation of 100: %d learned", l)
	}
	if l := reserve("b", 80); l != 0 {
		t.Fatalf("another key found %d learned", l)
	}
	// What the next request of a reserves: 40010 (its upstream reports no
	// usage: the reservation stands, and nothing is remembered).
	x := serveWith([]*Handler{h}, nil, func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(200)
		return nil
	}, "X-Api-Key", "a", "X-Max-Tokens", "100")
	if got := fields(t, x.header, "RateLimit")["tokens"]["r"]; got != 50000-40010 {
		t.Fatalf("a request of a key that learned 40010 left r=%d, want %d", got, 50000-40010)
	}
	c.t += 2 * sec
	for i := range learnRecords - 1 {
		if l := reserve("a", 80); l != 40010 {
			t.Fatalf("settle %d within its reservation: %d learned", i, l)
		}
	}
	if l := reserve("a", 80); l != 0 {
		t.Fatalf("after %d settles within their reservations: %d learned, want forgotten", learnRecords, l)
	}
	// Learned more than the burst: a request reserves the whole burst.
	if l := reserve("c", 100100); l != 100100 {
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
		rq := bucketRequest{key: "rl:p:{" + strconv.Itoa(i) + "}", limit: l, op: opAdjust, delta: 1, learns: true, record: 5000}
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

// TestPreviousReleaseIgnoresLearnedUsage: v0.3.0 (commit 675d577), in a
// fleet with this release, never reads a key's learned usage (its take is
// its cost alone, the memory untouched), and reads a debt beyond its own
// cap (its settle max, by default twice the burst) as that cap, which its
// own settle then writes: the rest of the debt is forgiven, as v0.3.0
// always forgave it.
func TestPreviousReleaseIgnoresLearnedUsage(t *testing.T) {
	old, err := exec.Command("git", "show", "675d577:lua/decide.lua").Output()
	if err != nil {
		t.Fatalf("reading v0.3.0's script from git history: %v", err)
	}
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	// This release: burst 10 at 10/1s, a debt of up to 1000 tokens;
	// v0.3.0's: the same rate and burst, a debt of up to 20 (2 × burst).
	const interval = 100_000 // 10/1s
	now, ours := limit{interval: interval, burst: 10, slack: 1000 * interval}, limit{interval: interval, burst: 10, slack: 20 * interval}
	settle := bucketRequest{key: "rl:llm:{a}", limit: now, op: opAdjust, delta: 500, learns: true, record: 501}
	if _, err := evalDecide(ctx, client, []bucketRequest{settle}); err != nil {
		t.Fatal(err)
	}
	if v := client.Get(ctx, "rl:llm:{a}:usage").Val(); v != "l1 501" {
		t.Fatalf("this release remembered %q, want l1 501", v)
	}
	// v0.3.0 inspects: it reads its own cap, 20 owed (30 tokens' time ahead).
	res, err := evalScript(ctx, client, string(old), []bucketRequest{{key: "rl:llm:{a}", limit: ours, op: opInspect}})
	if err != nil {
		t.Fatal(err)
	}
	if ahead := res[3] - res[0]; ahead > 30*interval || ahead < 29*interval {
		t.Fatalf("v0.3.0 read a TAT %d µs ahead, want its cap of 30 tokens (%d µs)", ahead, 30*interval)
	}
	// This release still reads all of the debt.
	res, err = evalDecide(ctx, client, []bucketRequest{{key: "rl:llm:{a}", limit: now, op: opInspect, learns: true}})
	if err != nil {
		t.Fatal(err)
	}
	if ahead := res[3] - res[0]; ahead < 499*interval {
		t.Fatalf("this release read a TAT %d µs ahead, want the whole debt (500 tokens' time)", ahead)
	}
	// v0.3.0's settle writes the debt clamped to its cap; it leaves the
	// learned usage as it is.
	if _, err := evalScript(ctx, client, string(old), []bucketRequest{{key: "rl:llm:{a}", limit: ours, op: opAdjust, delta: 1}}); err != nil {
		t.Fatal(err)
	}
	res, err = evalDecide(ctx, client, []bucketRequest{{key: "rl:llm:{a}", limit: now, op: opInspect, learns: true}})
	if err != nil {
		t.Fatal(err)
	}
	if ahead := res[3] - res[0]; ahead > 31*interval || res[len(res)-1] != 501 || client.Get(ctx, "rl:llm:{a}:usage").Val() != "l1 501" {
		t.Fatalf("after v0.3.0's settle: %d µs ahead (its cap: %d), learned %d, %q", ahead, 31*interval, res[len(res)-1], client.Get(ctx, "rl:llm:{a}:usage").Val())
	}
	// A take of v0.3.0 is its cost alone.
	client.Del(ctx, "rl:llm:{a}")
	res, err = evalScript(ctx, client, string(old), []bucketRequest{{key: "rl:llm:{a}", limit: ours, op: opTake, cost: 2}})
	if err != nil || res[1] != scriptAdmitted {
		t.Fatalf("v0.3.0's take: %v %v", res, err)
	}
	if pttl := client.PTTL(ctx, "rl:llm:{a}").Val(); pttl > 200*time.Millisecond {
		t.Fatalf("v0.3.0's take of 2 tokens at 10/1s: the bucket expires in %v, it took more", pttl)
	}
}
