package ratelimit

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

// decisionsOf reads a decisions_total child.
func decisionsOf(policy, outcome, plan string) float64 {
	var m dto.Metric
	_ = decisionsTotal.WithLabelValues(policy, outcome, "", plan).Write(&m)
	return m.GetCounter().GetValue()
}

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
		if got := decisionsOf("plans_switch", m.outcome, m.plan); got != m.want {
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

// TestAdminInspectPlan: inspect reads a bucket under the plan asked for,
// and refuses one the policy does not have.
func TestAdminInspectPlan(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{tenantPolicy("plans_inspect")}}, nil)
	for range 2 {
		serve([]*Handler{h}, nil, "X-Tenant", "acme", "X-Plan", "pro")
	}
	for _, tc := range []struct {
		plan          string
		status        int
		planLabel     string
		burst, tokens int64
		says          string
	}{
		{"", 200, "default", 6, 4, ""},
		{"pro", 200, "pro", 20, 18, ""},
		{"default", 200, "default", 6, 4, ""},
		{"gold", 400, "", 0, 0, `plan "gold": policy "plans_inspect" has no such plan`},
	} {
		status, body := adminDo(t, "GET", "/rate_limit/inspect?policy=plans_inspect&identity=acme&plan="+tc.plan, "")
		var st bucketState
		_ = json.Unmarshal([]byte(body), &st)
		if status != tc.status || status == 200 && (st.Plan != tc.planLabel || st.Burst != tc.burst || st.Tokens != tc.tokens) || !strings.Contains(body, tc.says) {
			t.Errorf("inspect plan %q: %d %s; want %d plan %q burst %d tokens %d %q", tc.plan, status, body, tc.status, tc.planLabel, tc.burst, tc.tokens, tc.says)
		}
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
