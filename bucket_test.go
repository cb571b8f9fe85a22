package ratelimit

import (
	"context"
	"testing"
)

func req(key string, interval, burst, cost int64) bucketRequest {
	return bucketRequest{key: key, limit: limit{interval: interval, burst: burst}, op: opTake, cost: cost}
}

func mustDecide(t *testing.T, m *memoryStore, reqs ...bucketRequest) decision {
	t.Helper()
	d, err := m.decide(context.Background(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestBucketBurstThenRate(t *testing.T) {
	c := &clock{t: 1000 * sec}
	m := newMemoryStore(c.now)
	r := req("k", sec/10, 5, 1) // 10/1s, burst 5
	for i := range 5 {
		d := mustDecide(t, m, r)
		if !d.admitted || d.verdicts[0].remaining != int64(4-i) {
			t.Fatalf("request %d of a full bucket: admitted=%v remaining=%d", i, d.admitted, d.verdicts[0].remaining)
		}
	}
	d := mustDecide(t, m, r)
	if d.admitted || d.verdicts[0].untilFits != sec/10 || d.verdicts[0].remaining != 0 {
		t.Fatalf("empty bucket: admitted=%v wait=%d remaining=%d, want denied, wait 100ms", d.admitted, d.verdicts[0].untilFits, d.verdicts[0].remaining)
	}
	// Over 2 s, 20 more: one per 100 ms, never two in one step.
	admitted := 0
	for range 200 {
		c.t += sec / 100
		if mustDecide(t, m, r).admitted {
			admitted++
		}
	}
	if admitted != 20 {
		t.Fatalf("admitted %d in 2s at 10/s, want 20", admitted)
	}
}

func TestBucketWaitsAndNextToken(t *testing.T) {
	c := &clock{t: 50 * sec}
	m := newMemoryStore(c.now)
	r := req("k", sec, 2, 1) // 1/1s, burst 2
	d := mustDecide(t, m, r)
	if v := d.verdicts[0]; v.remaining != 1 || v.untilFits != sec {
		t.Fatalf("after 1 of 2: remaining=%d next token in %dµs, want 1 and 1s", v.remaining, v.untilFits)
	}
	c.t += sec / 4
	d = mustDecide(t, m, r)
	if v := d.verdicts[0]; !d.admitted || v.remaining != 0 || v.untilFits != sec/4*3 {
		t.Fatalf("after 2 of 2: %+v, want remaining 0, next token in 750ms", v)
	}
	c.t += sec / 4
	d = mustDecide(t, m, r)
	if v := d.verdicts[0]; d.admitted || v.untilFits != sec/2 {
		t.Fatalf("empty: admitted=%v %+v, want denied with wait 500ms", d.admitted, v)
	}
	c.t += 10 * sec
	d = mustDecide(t, m, req("k", sec, 2, 2))
	if v := d.verdicts[0]; !d.admitted || v.remaining != 0 {
		t.Fatalf("cost 2 of a refilled bucket of 2: admitted=%v %+v", d.admitted, v)
	}
	d = mustDecide(t, m, req("other", sec, 2, 1))
	c.t += 10 * sec
	if d = mustDecide(t, m, req("other", sec, 2, 0+1)); d.verdicts[0].untilFits != sec {
		t.Fatalf("refilled bucket after 1: next token in %dµs, want 1s", d.verdicts[0].untilFits)
	}
}

func TestBucketCostAboveBurstNeverPasses(t *testing.T) {
	c := &clock{t: sec}
	m := newMemoryStore(c.now)
	d := mustDecide(t, m, req("k", sec, 3, 4))
	if d.admitted || d.verdicts[0].untilFits != neverFits || d.verdicts[0].remaining != 3 {
		t.Fatalf("cost 4 > burst 3: %+v, want denied, never, 3 left", d)
	}
}

func TestBucketAllOrNothing(t *testing.T) {
	c := &clock{t: sec}
	m := newMemoryStore(c.now)
	wide := req("wide", sec, 10, 1)
	narrow := req("narrow", sec, 1, 1)
	if d := mustDecide(t, m, wide, narrow); !d.admitted {
		t.Fatal("first request denied")
	}
	d := mustDecide(t, m, wide, narrow)
	if d.admitted || !d.verdicts[0].allowed || d.verdicts[1].allowed {
		t.Fatalf("second request: %+v, want denied by narrow only", d)
	}
	if d.verdicts[0].remaining != 9 {
		t.Fatalf("wide charged by a denied request: %d left, want 9", d.verdicts[0].remaining)
	}
	if d := mustDecide(t, m, wide); d.verdicts[0].remaining != 8 {
		t.Fatalf("wide alone: %d left, want 8", d.verdicts[0].remaining)
	}
}

func TestBucketShadow(t *testing.T) {
	c := &clock{t: sec}
	m := newMemoryStore(c.now)
	enforced := req("enforced", sec, 2, 1)
	shadow := req("shadow", sec, 1, 1)
	shadow.shadow = true
	d := mustDecide(t, m, enforced, shadow)
	if !d.admitted || d.verdicts[1].remaining != 0 {
		t.Fatalf("first: %+v, want admitted and shadow charged", d)
	}
	d = mustDecide(t, m, enforced, shadow)
	if !d.admitted || d.verdicts[1].allowed {
		t.Fatalf("second: %+v, want admitted although the shadow policy denies", d)
	}
	d = mustDecide(t, m, enforced, shadow)
	if d.admitted {
		t.Fatal("third: enforced policy should deny")
	}
	c.t += sec // shadow refills to 1; enforced to 1
	d = mustDecide(t, m, req("enforced", sec, 2, 2), shadow)
	if d.admitted || !d.verdicts[1].allowed {
		t.Fatalf("fourth: %+v, want denied by enforced, shadow would allow", d)
	}
	if d := mustDecide(t, m, shadow); d.verdicts[0].remaining != 0 || !d.admitted {
		t.Fatalf("a denied request must not charge the shadow bucket: %+v", d)
	}
}

func TestBucketClockBackwardsNeverRefills(t *testing.T) {
	c := &clock{t: 100 * sec}
	m := newMemoryStore(c.now)
	r := req("k", sec, 3, 3)
	if !mustDecide(t, m, r).admitted {
		t.Fatal("full bucket denied")
	}
	c.t -= 50 * sec
	d := mustDecide(t, m, req("k", sec, 3, 1))
	if d.admitted || d.verdicts[0].remaining != 0 {
		t.Fatalf("after the clock went back: %+v, want still empty", d)
	}
}

func TestBucketWaitReservesSlots(t *testing.T) {
	c := &clock{t: 10 * sec}
	m := newMemoryStore(c.now)
	r := req("k", sec, 1, 1) // 1/1s, burst 1
	r.wait = 3 * sec
	r.limit.slack = r.wait // the policy's wait: how far slots may be reserved
	for i := range 4 {
		d := mustDecide(t, m, r)
		if !d.admitted || d.delay != int64(i)*sec || d.verdicts[0].delay != d.delay {
			t.Fatalf("request %d: admitted=%v delay=%dµs, want held %ds", i, d.admitted, d.delay, i)
		}
	}
	d := mustDecide(t, m, r)
	if d.admitted || d.verdicts[0].untilFits != 4*sec {
		t.Fatalf("5th request: %+v, want denied: its slot is 4s away, beyond wait 3s", d)
	}
	c.t += sec / 2 // the queue moves on: the next slot is now 3.5s away
	if d := mustDecide(t, m, r); d.admitted {
		t.Fatalf("after 0.5s: %+v, want still denied", d)
	}
	c.t += sec / 2
	if d := mustDecide(t, m, r); !d.admitted || d.delay != 3*sec {
		t.Fatalf("after 1s: %+v, want held 3s", d)
	}
	// A policy without wait beside it: all or nothing still holds.
	strict := req("strict", sec, 1, 1)
	if d := mustDecide(t, m, req("k2", sec, 1, 1), strict); !d.admitted {
		t.Fatal("fresh buckets denied")
	}
	r2 := req("k2", sec, 1, 1)
	r2.wait = 5 * sec
	r2.limit.slack = r2.wait
	if d := mustDecide(t, m, r2, strict); d.admitted || d.verdicts[0].remaining != 0 {
		t.Fatalf("strict policy denies: %+v, and the waiting bucket must not be charged", d)
	}
}
