package ratelimit

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// TestServeHTTPQuotaPlans: a quota policy's plans set its N; a tenant that
// switches plans keeps its one count in the period, read against the new
// N on its next request (an upgrade admits at once what the new N leaves
// of the units used, a downgrade below the units used denies at once, and
// no plan change resets the count); RateLimit-Policy shows the plan's q;
// decisions_total counts by plan; a value that names no plan gets the
// policy's own N.
func TestServeHTTPQuotaPlans(t *testing.T) {
	c := &clock{t: calendartest.Instant(t, "2026-03-10T12:00:00Z").UnixMicro()}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{
		Name: "qplans_switch", Key: "{http.request.header.X-Tenant}", Quota: "5/month",
		Plan: &Plan{From: "{http.request.header.X-Plan}", Plans: map[string]*PlanLimit{"pro": {Quota: "12"}, "max": {Quota: "1000/month"}}},
	}}}, newMemoryStore(c.now))
	counted := func(outcome, plan string) float64 { return decisionsOf("qplans_switch", outcome, plan) }
	before := map[[2]string]float64{}
	for _, o := range []string{"allowed", "denied"} {
		for _, p := range []string{"default", "pro", "max", ""} {
			before[[2]string{o, p}] = counted(o, p) // the counters are the process's
		}
	}
	burst := func(tenant, plan string, n int) (admitted int, last exchange) {
		for admitted < n {
			last = serve([]*Handler{h}, nil, "X-Tenant", tenant, "X-Plan", plan)
			if last.status != 200 {
				return admitted, last
			}
			admitted++
		}
		return admitted, last
	}
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["qplans_switch"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["qplans_switch"]["r"] }
	for i, s := range []struct {
		plan         string
		n            int   // requests sent at most
		admitted     int   // of them
		status, q, r int64 // the last response's
		why          string
	}{
		{"", 2, 2, 200, 5, 3, "free: 2 of 5"},
		{"pro", 2, 2, 200, 12, 8, "upgraded: the 2 used count, 4 of 12"},
		{"", 5, 1, 429, 5, 0, "downgraded: 4 of 5 used, one more, then denied"},
		{"pro", 20, 7, 429, 12, 0, "upgraded again: 12 - 5 = 7, not a fresh 12"},
		{"", 1, 0, 429, 5, 0, "downgraded below the units used (12 of 5): denied at once"},
		{"enterprise", 1, 0, 429, 5, 0, "a plan that does not exist: the policy's own 5"},
		{strings.Repeat("pro", 30), 1, 0, 429, 5, 0, "a value longer than any plan name: the policy's own 5"},
		{"max", 1, 1, 200, 1000, 987, "quota 1000/month, the policy's unit"},
	} {
		n, x := burst("acme", s.plan, s.n)
		if n != s.admitted || int64(x.status) != s.status || q(x) != s.q || r(x) != s.r {
			t.Fatalf("step %d (%s): %d admitted, last %d q=%d r=%d; want %d, %d q=%d r=%d", i+1, s.why, n, x.status, q(x), r(x), s.admitted, s.status, s.q, s.r)
		}
	}
	// The period's boundary: every plan starts again from 0.
	c.t = calendartest.Instant(t, "2026-04-01T00:00:00Z").UnixMicro()
	if n, x := burst("acme", "", 10); n != 5 || x.status != 429 {
		t.Fatalf("in April on free: %d admitted, then %d; want 5 then 429", n, x.status)
	}
	if n, _ := burst("bob", "pro", 20); n != 12 {
		t.Fatalf("another tenant on pro: %d admitted, want 12", n)
	}
	for _, m := range []struct {
		outcome, plan string
		want          float64
	}{{"allowed", "default", 8}, {"denied", "default", 5}, {"allowed", "pro", 21}, {"denied", "pro", 2}, {"allowed", "max", 1}, {"allowed", "", 0}} {
		if got := counted(m.outcome, m.plan) - before[[2]string{m.outcome, m.plan}]; got != m.want {
			t.Errorf("decisions_total{policy=qplans_switch, outcome=%s, plan=%q} = %v, want %v", m.outcome, m.plan, got, m.want)
		}
	}
}

// TestServeHTTPQuotaOverride, in process (no redis block): an override of
// a quota policy set through the admin API applies to the identity's next
// request, its count kept: raised, it admits at once what the new N leaves;
// lowered below the units used, it denies at once; inspect and the list
// show it; a limit of the wrong kind is 400 and changes nothing; delete
// brings the policy's N back.
func TestServeHTTPQuotaOverride(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "qovr_unit", Key: "{http.request.header.X-User}", Quota: "5/year", Timezone: "Europe/Berlin"},
		{Name: "qovr_rate", Key: "{http.request.header.X-User}", Rate: "1000/1s"},
	}}, nil)
	acme := "acme-" + time.Now().Format("150405.000000") // the store is the process's
	get := func(user string) exchange { return serve([]*Handler{h}, nil, "X-User", user) }
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["qovr_unit"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["qovr_unit"]["r"] }
	for range 5 {
		get(acme)
	}
	if x := get(acme); x.status != 429 {
		t.Fatalf("6th of 5: %d", x.status)
	}
	for _, tc := range []struct{ body, says string }{
		{`{"policy":"qovr_unit","identity":"` + acme + `","rate":"100/1h"}`, `policy qovr_unit is a quota (5/year): its overrides take quota <N>, not rate`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","concurrent":5}`, `is a quota (5/year): its overrides take quota <N>`},
		{`{"policy":"qovr_unit","identity":"` + acme + `"}`, "a limit is required: quota <N>, e.g. quota 50/year"},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"50/month"}`, `quota: "50/month": the period is the policy's (quota 5/year, timezone Europe/Berlin)`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"0"}`, `quota: "0": N must be an integer from 1`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"lots"}`, `quota: "lots": N must be an integer`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"9007199254740992"}`, "an override's N is below 9007199254740992"},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":50}`, "the body is not"},
		{`{"policy":"qovr_rate","identity":"` + acme + `","quota":"50"}`, "policy qovr_rate is a rate limit: its overrides take rate <N>/<duration> [burst <n>], not quota"},
	} {
		if status, body := adminDo(t, "POST", "/rate_limit/override", tc.body); status != 400 || !strings.Contains(body, tc.says) {
			t.Errorf("POST %s: %d %q, want 400 saying %q", tc.body, status, body, tc.says)
		}
	}
	if x := get(acme); x.status != 429 || q(x) != 5 {
		t.Fatalf("after refused overrides: %d q=%d, want still 429 q=5", x.status, q(x))
	}

	set := func(body string) {
		t.Helper()
		if status, answer := adminDo(t, "POST", "/rate_limit/override", body); status != 200 {
			t.Fatalf("POST %s: %d %s", body, status, answer)
		}
	}
	// Raised to 8: the 5 used count: 3 more, then denied.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"8/year","note":"contract 7"}`)
	if x := get(acme); x.status != 200 || q(x) != 8 || r(x) != 2 {
		t.Fatalf("under quota 8: %d q=%d r=%d, want 200 q=8 r=2", x.status, q(x), r(x))
	}
	if x := get("bob-" + acme); q(x) != 5 {
		t.Fatalf("another identity: q=%d, want the policy's 5", q(x))
	}
	status, body := adminDo(t, "GET", "/rate_limit/inspect?policy=qovr_unit&identity="+acme, "")
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); status != 200 || err != nil || st.Override == nil || st.Override.describe() != "quota 8/year" ||
		st.Quota != 8 || st.Used == nil || *st.Used != 6 || st.Tokens != 2 {
		t.Fatalf("inspect: %d %s", status, body)
	}
	var out bytes.Buffer
	if err := printAnswer(&out, "inspect", []byte(body)); err != nil || !strings.Contains(out.String(), "used      6 of 8; 2 left") || !strings.Contains(out.String(), `override  quota 8/year, until deleted, note "contract 7"`) {
		t.Fatalf("caddy rate-limit inspect prints (%v):\n%s", err, out.String())
	}
	status, body = adminDo(t, "GET", "/rate_limit/overrides?policy=qovr_unit", "")
	var list overridesAnswer
	if err := json.Unmarshal([]byte(body), &list); status != 200 || err != nil || len(list.Overrides) != 1 || list.Overrides[0].describe() != "quota 8/year" || list.Overrides[0].Note != "contract 7" {
		t.Fatalf("overrides: %d %s", status, body)
	}
	// Lowered to 3, below the 6 used: denied at once, nothing left.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"3"}`)
	if x := get(acme); x.status != 429 || q(x) != 3 || r(x) != 0 {
		t.Fatalf("under quota 3 with 6 used: %d q=%d r=%d, want 429 q=3 r=0", x.status, q(x), r(x))
	}
	// Raised again: the count was never reset.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"7"}`)
	if x := get(acme); x.status != 200 || r(x) != 0 {
		t.Fatalf("under quota 7 with 6 used: %d r=%d, want 200 r=0", x.status, r(x))
	}
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"qovr_unit","identity":"`+acme+`"}`); status != 200 {
		t.Fatalf("delete: %d %s", status, body)
	}
	if x := get(acme); x.status != 429 || q(x) != 5 {
		t.Fatalf("after the delete: %d q=%d, want 429 q=5", x.status, q(x))
	}
}

// TestParseOverrideArgsQuota: the command line's quota limit.
func TestParseOverrideArgsQuota(t *testing.T) {
	req, del, err := parseOverrideArgs(strings.Fields("quota 5000000/month for 30d note contract 123"))
	if err != nil || del || req.Quota != "5000000/month" || req.For != "30d" || req.Note != "contract 123" || req.Rate != "" {
		t.Fatalf("quota 5000000/month for 30d note ...: %+v %v %v", req, del, err)
	}
	if _, _, err := parseOverrideArgs([]string{"quota"}); err == nil || !strings.Contains(err.Error(), "quota: a value is required") {
		t.Fatalf("quota without a value: %v", err)
	}
	if e := (overrideEntry{Kind: "quota", Quota: "5000/month"}); e.describe() != "quota 5000/month" {
		t.Fatalf("describe: %q", e.describe())
	}
}

// TestQuotaPlanCheck: a quota policy's plans in JSON, as `caddy validate`
// reads them: mistakes name the policy and the plan; a plan inherits the
// policy's max_cost and settle room, scaled to its N.
func TestQuotaPlanCheck(t *testing.T) {
	plan := func(lim PlanLimit) *Plan { return &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": &lim}} }
	for _, tc := range []struct {
		name string
		p    Policy
		want string
	}{
		{"rate in a quota policy", Policy{Quota: "5/day", Plan: plan(PlanLimit{Rate: "2/1s"})}, `plan "pro": policy "api" is a quota: its plans take quota <N> and cost max, not rate, burst or concurrent`},
		{"burst in a quota policy", Policy{Quota: "5/day", Plan: plan(PlanLimit{Burst: 9})}, `plan "pro": policy "api" is a quota`},
		{"concurrent in a quota policy", Policy{Quota: "5/day", Plan: plan(PlanLimit{Concurrent: 2})}, `plan "pro": policy "api" is a quota`},
		{"quota in a rate policy", Policy{Rate: "1/1s", Plan: plan(PlanLimit{Quota: "5"})}, `plan "pro": policy "api" is a rate limit: its plans take rate, burst and cost max, not quota`},
		{"quota in a concurrent policy", Policy{Concurrent: 2, Plan: plan(PlanLimit{Quota: "5"})}, `plan "pro": policy "api" is a concurrency limit`},
		{"another unit", Policy{Quota: "5/day", Timezone: "Asia/Tokyo", Plan: plan(PlanLimit{Quota: "50/month"})}, `plan "pro": quota: "50/month": the period is the policy's (quota 5/day, timezone Asia/Tokyo): a plan or an override sets N only, as quota 50 or quota 50/day`},
		{"zero", Policy{Quota: "5/day", Plan: plan(PlanLimit{Quota: "0"})}, `plan "pro": quota: "0": N must be an integer from 1 to 9007199254740992`},
		{"beyond 2^53", Policy{Quota: "5/day", Plan: plan(PlanLimit{Quota: "9007199254740993/day"})}, `plan "pro": quota: "9007199254740993/day": N must be`},
		{"plus sign", Policy{Quota: "5/day", Plan: plan(PlanLimit{Quota: "+5"})}, `plan "pro": quota: "+5"`},
		{"fixed cost above the plan's N", Policy{Quota: "10/day", Cost: "5", Plan: plan(PlanLimit{Quota: "4"})}, `plan "pro": cost: 5 is more than max 4 or quota 4`},
		{"negative max_cost", Policy{Quota: "10/day", Plan: plan(PlanLimit{Quota: "20", MaxCost: -1})}, `plan "pro": max_cost: -1`},
	} {
		h := &Handler{Policies: []*Policy{&tc.p}}
		tc.p.Name, tc.p.Key = "api", "{client_ip}"
		err := h.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), `policy "api": `) {
			t.Errorf("%s: %v, want an error naming policy \"api\" and containing %q", tc.name, err, tc.want)
		}
	}
	p := &Policy{Name: "api", Key: "k", Quota: "10/month", Timezone: "Europe/Berlin", Cost: "{c}", MaxCost: 7,
		Settle: &Settle{From: settleHeader, Field: "X-Used"},
		Plan:   &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Quota: "100/month"}, "dear": {Quota: "40", MaxCost: 30}}}}
	if err := p.check(); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]struct{ n, slack, maxCost int64 }{
		"pro": {100, 200, 7}, "dear": {40, 80, 30}, // settle's room: twice the plan's N
	} {
		q, err := p.planPolicy(name, p.Plan.Plans[name])
		if err != nil || q.limit != (limit{burst: want.n, slack: want.slack}) || q.costs.max != want.maxCost || q.quota == nil ||
			q.quota.unit != calendar.Month || q.quota.loc.String() != "Europe/Berlin" || q.planLabel() != name {
			t.Errorf("plan %s: %+v max %d quota %+v (%v), want %+v, monthly in Europe/Berlin", name, q.limit, q.costs.max, q.quota, err, want)
		}
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
