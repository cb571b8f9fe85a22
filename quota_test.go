package ratelimit

import (
	"context"
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// fixedBounds is a periodSource whose bounds a test places anywhere.
type fixedBounds calendar.Bounds

func (b fixedBounds) Bounds(time.Time) calendar.Bounds { return calendar.Bounds(b) }

func TestParseQuota(t *testing.T) {
	for s, want := range map[string]struct {
		n    int64
		unit calendar.Unit
	}{
		"1000000/month":        {1_000_000, calendar.Month},
		"30/minute":            {30, calendar.Minute},
		"1/year":               {1, calendar.Year},
		"9007199254740992/day": {1 << 53, calendar.Day},
	} {
		n, unit, err := parseQuota(s)
		if err != nil || n != want.n || unit != want.unit {
			t.Errorf("parseQuota(%q) = %d, %v, %v", s, n, unit, err)
		}
	}
	for s, msg := range map[string]string{
		"1000000":              "not N/",
		"0/month":              "from 1 to 9007199254740992",
		"-5/day":               "from 1 to",
		"+5/day":               "from 1 to",
		"1.5/day":              "from 1 to",
		"9007199254740993/day": "from 1 to",
		"5/fortnight":          "minute, hour, day, week, month or year",
		"5/1m":                 "minute, hour, day, week, month or year",
		"5/Month":              "minute, hour, day, week, month or year",
		"5/months":             "minute, hour, day, week, month or year",
	} {
		if _, _, err := parseQuota(s); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("parseQuota(%q): error %v, want one saying %q", s, err, msg)
		}
	}
}

func TestQuotaAdjusted(t *testing.T) {
	cur, past := calendar.Period{Start: 100, End: 200}, calendar.Period{Start: 0, End: 100}
	for _, c := range []struct {
		name                  string
		used, n, slack, delta int64
		of                    calendar.Period
		want                  int64
	}{
		{"a refund within the period", 5, 10, 0, -3, cur, 2},
		{"a refund of the current period, unnamed", 5, 10, 0, -3, calendar.Period{}, 2},
		{"never below 0", 2, 10, 0, -5, cur, 0},
		{"a grant to a count of 0", 0, 10, 0, -5, calendar.Period{}, 0},
		{"a charge", 5, 10, 20, 3, cur, 8},
		{"a charge beyond the quota, within the slack", 9, 10, 20, 15, cur, 24},
		{"a charge capped at quota + slack", 9, 10, 20, 50, cur, 30},
		{"a charge never lowers a count above the cap (a lowered quota)", 40, 10, 20, 5, cur, 40},
		{"a refund of a period that is over changes nothing", 5, 10, 0, -3, past, 5},
		{"a charge of a period that is over changes nothing", 5, 10, 20, 3, past, 5},
	} {
		if got := quotaAdjusted(c.used, c.n, c.slack, c.delta, c.of, cur); got != c.want {
			t.Errorf("%s: quotaAdjusted = %d, want %d", c.name, got, c.want)
		}
	}
}

func TestQuotaFormat(t *testing.T) {
	p := calendar.Period{Start: 1_764_547_200_000_000, End: 1_767_225_600_000_000} // December 2025, UTC
	v := encodeQuota(p, 123)
	if v != "q:1764547200000000:1767225600000000:123" || len(v) > 44 {
		t.Fatalf("encodeQuota = %q", v)
	}
	if got, used, ok := decodeQuota(v); !ok || got != p || used != 123 {
		t.Fatalf("decodeQuota(%q) = %v %d %v", v, got, used, ok)
	}
	// 44 bytes hold up to 99,999,999 used: Redis keeps the string in the
	// key's object (embstr).
	if v := encodeQuota(p, 99_999_999); len(v) != 44 {
		t.Fatalf("%q is %d bytes", v, len(v))
	}
	for _, bad := range []string{"", "q:", "q:1:2", "q:1:2:3:4", "q:a:2:3", "q:1:2:-3", "q:1:2:+3", "1764547200000000:600000", "x:1:2:3"} {
		if _, _, ok := decodeQuota(bad); ok {
			t.Errorf("decodeQuota(%q) took it for a quota count", bad)
		}
	}
	// No rate reader takes a quota count for a bucket: v0.2's and this
	// release's rate formats start with a digit.
	if _, _, ok := decodeBucket(v, 1000); ok {
		t.Fatalf("decodeBucket(%q) took a quota count for a rate bucket", v)
	}
}

// TestBoundaryRetryAfter: a quota's denial is never sent back before its
// boundary, and the spread past it is jitter of the period, at most an hour.
func TestBoundaryRetryAfter(t *testing.T) {
	minute := calendar.Period{Start: 0, End: 60 * sec}
	month := calendar.Period{Start: 0, End: 31 * 86400 * sec}
	for _, c := range []struct {
		name     string
		p        calendar.Period
		jitter   float64
		wait     int64
		min, max int64 // seconds
	}{
		{"a minute, 10.2 s left, 20%", minute, 0.2, 10_200_000, 11, 11 + 12},
		{"a minute, 1 µs left, 20%", minute, 0.2, 1, 1, 1 + 12},
		{"a minute, jitter 0", minute, 0, 10_200_000, 11, 11},
		{"a month, 20 days left, 20%: at most an hour past", month, 0.2, 20 * 86400 * sec, 20 * 86400, 20*86400 + 3600},
		{"a month, 1000%", month, 10, 5 * sec, 5, 5 + 3600},
	} {
		spread := boundarySpread(c.p, c.jitter)
		var lo, hi int64 = math.MaxInt64, 0
		for range 2000 {
			ra := boundaryRetryAfter(c.wait, spread)
			lo, hi = min(lo, ra), max(hi, ra)
		}
		if lo < c.min || hi > c.max || c.max > c.min && hi-lo < (c.max-c.min)/2 {
			t.Errorf("%s: Retry-After from %d to %d s over 2000 denials, want within [%d, %d] and spread", c.name, lo, hi, c.min, c.max)
		}
	}
}

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
