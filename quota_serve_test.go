package ratelimit

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

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

// TestAdminQuota: inspect, grant and reset through the admin API, on the
// in-process store: used, quota, the period in UTC and the zone; a grant
// gives units back (never below 0 used); a reset zeroes the period.
func TestAdminQuota(t *testing.T) {
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: "admin-quota-test", Key: "{http.request.header.X-User}", Quota: "10/month", Timezone: "Europe/Berlin"},
	}}, nil)
	carol := "carol-" + strconv.FormatInt(time.Now().UnixNano(), 10) // the store is the process's
	for range 4 {
		serve([]*Handler{h}, nil, "X-User", carol)
	}
	call := func(method, path, body string) bucketState {
		t.Helper()
		r := httptest.NewRequest(method, path, strings.NewReader(body))
		w := httptest.NewRecorder()
		if err := (adminAPI{}).serve(w, r); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		var st bucketState
		if err := json.Unmarshal(w.Body.Bytes(), &st); err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		action := strings.TrimPrefix(strings.SplitN(path, "?", 2)[0], "/rate_limit/")
		if err := printAnswer(&out, action, w.Body.Bytes()); err != nil {
			t.Fatal(err)
		}
		t.Logf("caddy rate-limit %s:\n%s", action, out.String())
		return st
	}
	st := call("GET", "/rate_limit/inspect?policy=admin-quota-test&identity="+carol, "")
	now := time.Now().In(calendartest.Zone(t, "Europe/Berlin"))
	start := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, now.Location())
	if st.Used == nil || *st.Used != 4 || st.Quota != 10 || st.Tokens != 6 || st.Unit != "month" || st.Kind != "quota" || st.Period == nil ||
		st.Period.StartZone != start.Format(time.RFC3339) || st.Period.Start != start.UTC().Format(time.RFC3339) ||
		st.Period.EndZone != start.AddDate(0, 1, 0).Format(time.RFC3339) || st.Period.Zone != "Europe/Berlin" {
		t.Fatalf("inspect: %+v %+v", st, st.Period)
	}
	if st := call("POST", "/rate_limit/grant", `{"policy":"admin-quota-test","identity":"`+carol+`","tokens":3}`); *st.Used != 1 || *st.Granted != 3 {
		t.Fatalf("grant 3: %+v", st)
	}
	if st := call("POST", "/rate_limit/grant", `{"policy":"admin-quota-test","identity":"`+carol+`","tokens":5}`); *st.Used != 0 || *st.Granted != 1 {
		t.Fatalf("grant 5 of 1 used: %+v, want 1 granted, 0 used", st)
	}
	serve([]*Handler{h}, nil, "X-User", carol)
	if st := call("POST", "/rate_limit/reset", `{"policy":"admin-quota-test","identity":"`+carol+`"}`); *st.Used != 0 || st.Tokens != 10 {
		t.Fatalf("reset: %+v", st)
	}
	x := serve([]*Handler{h}, nil, "X-User", carol)
	if lim := fields(t, x.header, "RateLimit")["admin-quota-test"]; lim["r"] != 9 {
		t.Fatalf("after the reset: %v", lim)
	}
}
