package ratelimit

import (
	"context"
	"strconv"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// quotaRequest is a request to a quota bucket of n units.
func quotaRequest(key string, n int64, q *quotaSpec, op bucketOp, cost int64) bucketRequest {
	return bucketRequest{key: key, limit: limit{burst: n}, op: op, cost: cost, quota: q}
}

// TestMemoryStoreQuota: the in-process store counts a quota within the
// period its clock is in, starts again from 0 at the boundary, and gives
// back within the period only.
func TestMemoryStoreQuota(t *testing.T) {
	utc := calendartest.Zone(t, "UTC")
	c := &clock{t: calendartest.Instant(t, "2026-03-31T23:59:58Z").UnixMicro()}
	m := newMemoryStore(c.now)
	q := &quotaSpec{periods: calendar.New(calendar.Minute, utc), name: "q"}
	take := func(cost int64) decision {
		t.Helper()
		d, err := m.decide(context.Background(), []bucketRequest{quotaRequest("rl:q:{a}", 5, q, opTake, cost)})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for i := range 5 {
		if d := take(1); !d.admitted || d.verdicts[0].remaining != int64(4-i) || d.verdicts[0].untilFits != 2*sec {
			t.Fatalf("take %d: %+v", i, d)
		}
	}
	d := take(1)
	if d.admitted || d.verdicts[0].untilFits != 2*sec || d.verdicts[0].period != (calendar.Period{Start: c.t - 58*sec, End: c.t + 2*sec}) {
		t.Fatalf("the sixth of 5: %+v", d)
	}
	if d := take(6); d.admitted || d.verdicts[0].untilFits != neverFits {
		t.Fatalf("a cost above the quota: %+v, want never fits", d)
	}
	// A refund of this period; then the boundary.
	refund := quotaRequest("rl:q:{a}", 5, q, opAdjust, 0)
	refund.delta, refund.period = -2, d.verdicts[0].period
	if d, _ := m.decide(context.Background(), []bucketRequest{refund}); d.verdicts[0].remaining != 2 {
		t.Fatalf("after a refund of 2: %+v", d)
	}
	c.t += 2 * sec // 00:00:00 on April 1st
	if d, _ := m.decide(context.Background(), []bucketRequest{refund}); d.verdicts[0].remaining != 5 {
		t.Fatalf("a refund of last minute, made in this one: %+v, want nothing given (5 left)", d)
	}
	if d := take(1); !d.admitted || d.verdicts[0].remaining != 4 || d.verdicts[0].untilFits != 60*sec {
		t.Fatalf("the first request after the boundary: %+v", d)
	}
	if n := m.len(); n != 1 {
		t.Fatalf("%d counts held, want 1", n)
	}
	reset := quotaRequest("rl:q:{a}", 5, q, opReset, 0)
	if d, _ := m.decide(context.Background(), []bucketRequest{reset}); d.verdicts[0].remaining != 5 || m.len() != 0 {
		t.Fatalf("reset: %+v, %d held", d, m.len())
	}
}

// TestMemoryStoreQuotaBound: counts of past periods are swept out, and the
// store's memory stays bounded whatever the number of identities.
func TestMemoryStoreQuotaBound(t *testing.T) {
	utc := calendartest.Zone(t, "UTC")
	c := &clock{t: calendartest.Instant(t, "2026-03-31T12:00:00Z").UnixMicro()}
	m := newMemoryStore(c.now)
	q := &quotaSpec{periods: calendar.New(calendar.Minute, utc), name: "q"}
	for i := range 3 * memoryMaxBuckets / 2 {
		if i == memoryMaxBuckets/2 {
			c.t += 60 * sec // the first ones' minute is over
		}
		if _, err := m.decide(context.Background(), []bucketRequest{quotaRequest("rl:q:{"+strconv.Itoa(i)+"}", 5, q, opTake, 1)}); err != nil {
			t.Fatal(err)
		}
	}
	if n := m.len(); n > memoryMaxBuckets {
		t.Fatalf("%d counts held, more than %d", n, memoryMaxBuckets)
	}
}
