package ratelimit

import (
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// tenantPolicy is a policy of 6/1h per tenant whose pro plan is 60/1h burst
// 20: the default plan's token is 600 s, pro's 60 s.
func tenantPolicy(name string) *Policy {
	return &Policy{Name: name, Key: "{http.request.header.X-Tenant}", Rate: "6/1h",
		Plan: &Plan{From: "{http.request.header.X-Plan}", Plans: map[string]*PlanLimit{"pro": {Rate: "60/1h", Burst: 20}}}}
}

// TestServeHTTPPlans: a tenant that switches plans keeps its one bucket,
// read against the new plan's limit on its next request (an upgrade frees
// it, a downgrade holds it at once, what it owes kept up to the new cap);
// RateLimit-Policy shows the plan the request was decided under;
// decisions_total counts by plan.
func TestServeHTTPPlans(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{tenantPolicy("plans_switch")}}, newMemoryStore(c.now))
	// burst sends requests on a plan until one is denied, or n were
	// admitted; it returns the admitted and the fields of the last response.
	burst := func(plan string, n int) (admitted int, last exchange) {
		for admitted < n {
			last = serve([]*Handler{h}, nil, "X-Tenant", "acme", "X-Plan", plan)
			if last.status != 200 {
				return admitted, last
			}
			admitted++
		}
		return admitted, last
	}
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["plans_switch"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["plans_switch"]["r"] }

	// Free: 2 of 6 (owes 2 free tokens, 1200 s).
	if n, x := burst("", 2); n != 2 || q(x) != 6 || r(x) != 4 {
		t.Fatalf("free: %d admitted, q=%d r=%d; want 2, q=6 r=4", n, q(x), r(x))
	}
	// Upgrade: the 2 owed are kept (120 s at pro's rate): 18 left; take 2.
	if n, x := burst("pro", 2); n != 2 || q(x) != 60 || r(x) != 16 {
		t.Fatalf("upgraded: %d admitted, q=%d r=%d; want 2, q=60 r=16 (the bucket kept)", n, q(x), r(x))
	}
	// Downgrade: 4 owed (240 s at pro) are 4 of free's 6: 2 left, then 429.
	n, x := burst("", 10)
	if n != 2 || x.status != 429 || q(x) != 6 || r(x) != 0 {
		t.Fatalf("downgraded: %d admitted then %d, q=%d r=%d; want 2 then 429, q=6 r=0", n, x.status, q(x), r(x))
	}
	// Upgrade again: 6 free tokens owed (3600 s) are 6 of pro's (360 s):
	// 14 left, then 429. A fresh bucket would have given 20.
	n, x = burst("pro", 30)
	if n != 14 || x.status != 429 || q(x) != 60 {
		t.Fatalf("upgraded again: %d admitted then %d, q=%d; want 14 then 429, q=60", n, x.status, q(x))
	}
	// Downgrade with everything owed: at once denied, the debt capped at
	// free's 6 tokens, the Retry-After a free token's 600 s.
	if n, x := burst("", 5); n != 0 || x.status != 429 || x.header.Get("Retry-After") != "600" {
		t.Fatalf("downgraded when empty: %d admitted, %d Retry-After %q; want 0, 429 after 600", n, x.status, x.header.Get("Retry-After"))
	}
	for _, m := range []struct {
		outcome, plan string
		want          float64
	}{{"allowed", "default", 4}, {"denied", "default", 2}, {"allowed", "pro", 16}, {"denied", "pro", 1}, {"allowed", "", 0}} {
		if got := decisionsOf("plans_switch", m.outcome, "", m.plan); got != m.want {
			t.Errorf("decisions_total{policy=plans_switch, outcome=%s, plan=%q} = %v, want %v", m.outcome, m.plan, got, m.want)
		}
	}
}

// TestServeHTTPPlanHostile: a value that names no plan, whatever it holds,
// is decided under the policy's own limit, in the tenant's one bucket: 6
// admitted in all.
func TestServeHTTPPlanHostile(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{tenantPolicy("plans_hostile")}}, newMemoryStore(c.now))
	long := make([]byte, 4096)
	_, _ = rand.Read(long)
	// As the handler sees them (HTTP trims a field value's outer spaces first).
	values := []string{"", "PRO", "Pro", "pro ", " pro", "pro,pro", "default", "enterprise", "pro\x00", "../pro", hex.EncodeToString(long), strings.Repeat("pro", 2000)}
	admitted := 0
	for i := 0; i < 3*len(values); i++ {
		x := serve([]*Handler{h}, nil, "X-Tenant", "mallory", "X-Plan", values[i%len(values)])
		if x.status == 200 {
			admitted++
		}
		if q := fields(t, x.header, "RateLimit-Policy")["plans_hostile"]["q"]; q != 6 {
			t.Fatalf("plan %.20q: RateLimit-Policy q=%d, want the default's 6", values[i%len(values)], q)
		}
	}
	if admitted != 6 {
		t.Fatalf("%d admitted across %d plan values that name no plan, want the default's 6", admitted, len(values))
	}
	// Two plan headers: the value is both joined ("pro,pro"), no plan.
	r := httptestRequest("X-Tenant", "mallory")
	r.Header.Add("X-Plan", "pro")
	r.Header.Add("X-Plan", "pro")
	if p := h.Policies[0].planned(r, nil); p != h.Policies[0] {
		t.Fatalf("two X-Plan fields: plan %q, want the default", p.planName)
	}
}

func httptestRequest(header ...string) *http.Request {
	r, _ := http.NewRequest("GET", "http://example.com/", nil)
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	return r
}

// TestPlanCheck: mistakes in a policy's plans, as `caddy validate` reports
// them: naming the policy, the plan and the field.
func TestPlanCheck(t *testing.T) {
	for _, tc := range []struct {
		name string
		p    Policy
		want string
	}{
		{"no from", Policy{Rate: "1/1s", Plan: &Plan{Plans: map[string]*PlanLimit{"pro": {Rate: "2/1s"}}}}, "plan: the placeholder"},
		{"from not a placeholder", Policy{Rate: "1/1s", Plan: &Plan{From: "pro", Plans: map[string]*PlanLimit{"pro": {Rate: "2/1s"}}}}, `plan: "pro" is not a placeholder`},
		{"no plans", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}"}}, "plan: at least one plan"},
		{"empty plan", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {}}}}, `plan "pro": a limit is required`},
		{"null plan", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": nil}}}, `plan "pro": a limit is required`},
		{"bad name", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro plan": {Rate: "2/1s"}}}}, `plan "pro plan": a plan name`},
		{"default", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"default": {Rate: "2/1s"}}}}, `plan "default": default names`},
		{"concurrent in a rate policy", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Concurrent: 2}}}}, `plan "pro": policy "api" is a rate limit`},
		{"rate in a concurrent policy", Policy{Concurrent: 2, Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Rate: "2/1s"}}}}, `plan "pro": policy "api" is a concurrency limit`},
		{"bad rate", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Rate: "2/1fortnight"}}}}, `plan "pro": rate: "2/1fortnight": bad duration`},
		{"negative burst", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Burst: -1}}}}, `plan "pro": burst: -1 must be at least 1`},
		{"negative max_cost", Policy{Rate: "1/1s", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {MaxCost: -1}}}}, `plan "pro": max_cost: -1`},
		{"zero slots", Policy{Concurrent: 2, Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Concurrent: -3}}}}, `plan "pro": concurrent: -3`},
		{"fixed cost above the plan's burst", Policy{Rate: "10/1s", Cost: "5", Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Burst: 4}}}}, `plan "pro": cost: 5 is more than max 4 or burst 4`},
		{"max above the plan's burst", Policy{Rate: "10/1s", Cost: "{c}", MaxCost: 8, Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"pro": {Burst: 4}}}}, `plan "pro": cost: max 8 is more than the burst 4`},
	} {
		h := &Handler{Policies: []*Policy{&tc.p}}
		tc.p.Name, tc.p.Key = "api", "{client_ip}"
		err := h.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.HasPrefix(err.Error(), `policy "api": `) {
			t.Errorf("%s: %v, want an error naming policy \"api\" and containing %q", tc.name, err, tc.want)
		}
	}
	// What a plan inherits: the policy's rate, burst and max_cost where it
	// sets none; a plan's rate brings its own burst.
	p := &Policy{Name: "api", Key: "k", Rate: "10/1s", Burst: 30, Cost: "{c}", MaxCost: 7, Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{
		"big": {Burst: 100}, "fast": {Rate: "100/1s"}, "dear": {MaxCost: 20},
	}}}
	if err := p.check(); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]struct{ interval, burst, maxCost int64 }{
		"big": {100_000, 100, 7}, "fast": {10_000, 100, 7}, "dear": {100_000, 30, 20},
	} {
		q, err := p.planPolicy(name, p.Plan.Plans[name])
		if err != nil || q.limit.interval != want.interval || q.limit.burst != want.burst || q.costs.max != want.maxCost {
			t.Errorf("plan %s: %+v max %d (%v), want %+v", name, q.limit, q.costs.max, err, want)
		}
	}
}

// TestServeHTTPPlanConcurrent: a concurrency policy's plan sets its slots:
// 3 for pro, 1 for the default, the same key's slots either way; inspect
// reads them under the plan asked for.
func TestServeHTTPPlanConcurrent(t *testing.T) {
	c := &clock{t: 1000 * sec}
	p := &Policy{Name: "plans_slots", Key: "{http.request.header.X-Tenant}", Concurrent: 1,
		Plan: &Plan{From: "{http.request.header.X-Plan}", Plans: map[string]*PlanLimit{"pro": {Concurrent: 3}}}}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{p}}, newMemoryStore(c.now))
	hold := make(chan struct{})
	entered := make(chan struct{}, 4)
	blocking := func(w http.ResponseWriter, r *http.Request) error {
		entered <- struct{}{}
		<-hold
		w.WriteHeader(200)
		return nil
	}
	results := make(chan exchange, 3)
	for range 3 {
		go func() { results <- serveWith([]*Handler{h}, nil, blocking, "X-Tenant", "acme", "X-Plan", "pro") }()
		<-entered
	}
	if x := serve([]*Handler{h}, nil, "X-Tenant", "acme", "X-Plan", "pro"); x.status != 429 || x.header.Get("RateLimit-Policy") != `"plans_slots";q=3;qu="concurrent-requests"` {
		t.Fatalf("a fourth on pro: %d %q, want 429 with q=3", x.status, x.header.Get("RateLimit-Policy"))
	}
	// On the default plan the same 3 running fill its 1 slot.
	if x := serve([]*Handler{h}, nil, "X-Tenant", "acme"); x.status != 429 || x.header.Get("RateLimit-Policy") != `"plans_slots";q=1;qu="concurrent-requests"` {
		t.Fatalf("on the default plan with 3 running: %d %q, want 429 with q=1", x.status, x.header.Get("RateLimit-Policy"))
	}
	close(hold)
	for range 3 {
		if x := <-results; x.status != 200 {
			t.Fatalf("a pro request: %d", x.status)
		}
	}
	if x := serve([]*Handler{h}, nil, "X-Tenant", "acme"); x.status != 200 {
		t.Fatalf("on the default plan, none running: %d", x.status)
	}
}

// TestServeHTTPPlanLocal: while the store cannot decide, `local` decides
// under the request's plan (its share with instances): pro's burst of 20
// over 2 instances is 10 here, the default's 6 is 3.
func TestServeHTTPPlanLocal(t *testing.T) {
	p := tenantPolicy("plans_local")
	p.OnError = failLocal
	h := testHandler(t, &Handler{Jitter: jitterOff(), Instances: 2, Policies: []*Policy{p}}, failingStore{})
	count := func(tenant, plan string) (admitted int) {
		for range 30 {
			if x := serve([]*Handler{h}, nil, "X-Tenant", tenant, "X-Plan", plan); x.status == 200 && x.vars["decision"] == "local_allowed" {
				admitted++
			}
		}
		return admitted
	}
	if n := count("local-pro", "pro"); n != 10 {
		t.Fatalf("pro while the store is away: %d admitted locally, want 10 (20 over 2 instances)", n)
	}
	if n := count("local-free", ""); n != 3 {
		t.Fatalf("the default plan while the store is away: %d admitted locally, want 3 (6 over 2 instances)", n)
	}
}

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
	counted := func(outcome, plan string) float64 { return decisionsOf("qplans_switch", outcome, "", plan) }
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
