package ratelimit

import (
	"strconv"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// fixedBounds is a periodSource whose bounds a test places anywhere.
type fixedBounds calendar.Bounds

func (b fixedBounds) Bounds(time.Time) calendar.Bounds { return calendar.Bounds(b) }

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

// TestServeHTTPQuota: a monthly quota in New York beside a per-second rate,
// through the handler on the in-process store, across the end of November
// 2024 (30 days and the hour of the autumn change: w = 2,595,600): the
// fields a client reads (q, w = the period's length, r, t = the seconds to
// the boundary), the denial (429, Retry-After at the boundary exactly with
// jitter 0), all-or-nothing with the rate, and the first request after the
// boundary admitted, with December's w.
func TestServeHTTPQuota(t *testing.T) {
	ny := calendartest.Zone(t, "America/New_York")
	c := &clock{t: calendartest.Instant(t, "2024-11-30T23:59:50-05:00").UnixMicro()}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "monthly", Key: "{http.request.header.X-User}", Quota: "3/month", Timezone: ny.String()},
		{Name: "per_second", Key: "{http.request.header.X-User}", Rate: "10/1s"},
	}}, newMemoryStore(c.now))
	type want struct {
		status             int
		w, r, t, ra        int64
		perSecondRemaining int64
	}
	november, december := int64(30*86400+3600), int64(31*86400)
	for i, s := range []struct {
		advance time.Duration
		want    want
	}{
		{0, want{200, november, 2, 10, 0, 9}},
		{0, want{200, november, 1, 10, 0, 8}},
		{500 * time.Millisecond, want{200, november, 0, 10, 0, 9}}, // per_second refilled to 10, less 1
		{0, want{429, november, 0, 10, 10, 9}},                     // per_second uncharged: all or nothing
		{9500*time.Millisecond - time.Microsecond, want{429, november, 0, 1, 1, 10}},
		{time.Microsecond, want{200, december, 2, december, 0, 9}}, // 00:00:00 on December 1st
	} {
		c.t += s.advance.Microseconds()
		x := serve([]*Handler{h}, nil, "X-User", "ann")
		pol, lim := fields(t, x.header, "RateLimit-Policy"), fields(t, x.header, "RateLimit")
		ra, _ := strconv.ParseInt(x.header.Get("Retry-After"), 10, 64)
		got := want{x.status, pol["monthly"]["w"], lim["monthly"]["r"], lim["monthly"]["t"], ra, lim["per_second"]["r"]}
		if got != s.want || pol["monthly"]["q"] != 3 {
			t.Fatalf("request %d at %s: %+v (q=%d), want %+v", i+1, time.UnixMicro(c.t).In(ny).Format(time.RFC3339Nano), got, pol["monthly"]["q"], s.want)
		}
		if x.status == 429 {
			if p := problemOf(t, x); len(p.ViolatedPolicies) != 1 || p.ViolatedPolicies[0] != "monthly" {
				t.Fatalf("request %d: problem %+v", i+1, p)
			}
			if x.vars["decision"] != "denied" || x.vars["policy"] != "monthly" || x.vars["retry_after"] != strconv.FormatInt(ra, 10) {
				t.Fatalf("request %d: placeholders %v", i+1, x.vars)
			}
		}
	}
}

// TestServeHTTPQuotaRetryAfter: denied clients are sent back no earlier
// than the boundary, spread over 20% of the period (a minute's 12 s), and
// for a month at most an hour past it.
func TestServeHTTPQuotaRetryAfter(t *testing.T) {
	for _, c := range []struct {
		quota    string
		at       string
		min, max int64
	}{
		{"1/minute", "2026-04-01T12:00:50Z", 10, 10 + 12},
		{"1/month", "2026-04-30T23:00:00Z", 3600, 3600 + 3600},
	} {
		cl := &clock{t: calendartest.Instant(t, c.at).UnixMicro()}
		h := testHandler(t, &Handler{Policies: []*Policy{{Name: "q", Key: "{http.request.header.X-User}", Quota: c.quota}}}, newMemoryStore(cl.now))
		serve([]*Handler{h}, nil, "X-User", "first")
		lo, hi := int64(1<<62), int64(0)
		for range 300 {
			x := serve([]*Handler{h}, nil, "X-User", "first")
			if x.status != 429 || x.elapsed > 200*time.Millisecond {
				t.Fatalf("%s: %d after %v: want 429 answered at once (not paced)", c.quota, x.status, x.elapsed)
			}
			ra, _ := strconv.ParseInt(x.header.Get("Retry-After"), 10, 64)
			lo, hi = min(lo, ra), max(hi, ra)
		}
		if lo < c.min || hi > c.max || hi-lo < (c.max-c.min)/2 {
			t.Fatalf("%s: Retry-After from %d to %d s, want spread over [%d, %d]", c.quota, lo, hi, c.min, c.max)
		}
	}
}

// TestServeHTTPQuotaAfterResponse: settle gives back within the period
// what the response did not use (and the fields of that response say so);
// charge_if gives the cost back to a response that does not match; a
// shadow quota never denies.
func TestServeHTTPQuotaAfterResponse(t *testing.T) {
	c := &clock{t: calendartest.Instant(t, "2026-04-01T12:00:00Z").UnixMicro()}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "tokens", Key: "{http.request.header.X-User}", Quota: "100/day", Cost: "10", Settle: &Settle{From: settleHeader, Field: "X-Usage"}},
	}}, newMemoryStore(c.now))
	x := serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Usage", "3"), "X-User", "ann")
	if lim := fields(t, x.header, "RateLimit")["tokens"]; x.status != 200 || lim["r"] != 97 || lim["t"] != 12*3600 {
		t.Fatalf("settled at 3 of 10: %d %v, want r=97 t=43200", x.status, lim)
	}
	x = serve([]*Handler{h}, nil, "X-User", "ann")
	if lim := fields(t, x.header, "RateLimit")["tokens"]; lim["r"] != 87 {
		t.Fatalf("the next reservation: %v, want r=87 (97 - 10: the settle was made)", lim)
	}

	logins := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "logins", Key: "{http.request.header.X-User}", Quota: "2/week", ChargeIf: mustResponseMatcher(t, 401)},
	}}, newMemoryStore(c.now))
	for i := range 5 {
		if x := serveWith([]*Handler{logins}, nil, upstreamAnswering(200), "X-User", "bob"); x.status != 200 {
			t.Fatalf("success %d: %d: a response that does not match is not charged", i, x.status)
		}
	}
	for i := range 2 {
		if x := serveWith([]*Handler{logins}, nil, upstreamAnswering(401), "X-User", "bob"); !x.passed {
			t.Fatalf("failure %d did not reach the upstream", i)
		}
	}
	if x := serveWith([]*Handler{logins}, nil, upstreamAnswering(401), "X-User", "bob"); x.status != 429 || x.passed {
		t.Fatalf("the third failure of 2 a week: %d passed=%v", x.status, x.passed)
	}

	shadow := testHandler(t, &Handler{Policies: []*Policy{{Name: "shadowed", Key: "global", Quota: "1/day", Shadow: true}}}, newMemoryStore(c.now))
	for i := range 3 {
		if x := serve([]*Handler{shadow}, nil); x.status != 200 || x.header.Get("RateLimit") != "" {
			t.Fatalf("shadow quota, request %d: %d %v", i, x.status, x.header)
		}
	}
}

// mustResponseMatcher is charge_if { status <code> }.
func mustResponseMatcher(t *testing.T, code int) *caddyhttp.ResponseMatcher {
	t.Helper()
	return &caddyhttp.ResponseMatcher{StatusCode: []int{code}}
}

// TestServeHTTPQuotaLocal: with Redis away, on_error local gives each of
// the instances 1/instances of the quota, in the same calendar period.
func TestServeHTTPQuotaLocal(t *testing.T) {
	h := testHandler(t, &Handler{OnError: "local", Instances: 2, Jitter: jitterOff(), Policies: []*Policy{
		{Name: "quota-local-test", Key: "{http.request.header.X-User}", Quota: "4/hour"},
	}}, failingStore{})
	var statuses []int
	user := "local-" + strconv.FormatInt(time.Now().UnixNano(), 10) // the fallback store is the process's
	for range 3 {
		x := serve([]*Handler{h}, nil, "X-User", user)
		statuses = append(statuses, x.status)
		if pol := fields(t, x.header, "RateLimit-Policy")["quota-local-test"]; x.status == 200 && (pol["q"] != 2 || pol["w"] != 3600) {
			t.Fatalf("local quota fields %v, want q=2 w=3600", pol)
		}
	}
	if statuses[0] != 200 || statuses[1] != 200 || statuses[2] != 429 {
		t.Fatalf("local quota of 4/hour over 2 instances: %v, want 200 200 429", statuses)
	}
}
