package integration_test

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Plans through real Caddy processes and a real Redis: the plan comes from
// forward_auth (copy_headers), as docs/plans-and-overrides.md sets it up,
// from an auth service the test runs, which a test changes as a billing
// system would.

// authServer is forward_auth's upstream: for a known bearer token it
// answers 200 with the tenant and its plan in X-Tenant and X-Plan (none for
// the default plan); otherwise 401.
type authServer struct {
	addr   string
	mu     sync.Mutex
	tokens map[string][2]string // token -> tenant, plan
}

func startAuth(t *testing.T) *authServer {
	t.Helper()
	a := &authServer{tokens: map[string][2]string{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		token, _ := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
		a.mu.Lock()
		who, ok := a.tokens[token]
		a.mu.Unlock()
		if !ok {
			w.WriteHeader(http.StatusUnauthorized)
			return
		}
		w.Header().Set("X-Tenant", who[0])
		if who[1] != "" {
			w.Header().Set("X-Plan", who[1])
		}
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return a
}

// set puts the token's tenant on plan ("" for the default).
func (a *authServer) set(token, tenant, plan string) {
	a.mu.Lock()
	a.tokens[token] = [2]string{tenant, plan}
	a.mu.Unlock()
}

// forwardAuth is the handler the Caddyfile's `forward_auth <addr> { uri
// /verify; copy_headers <headers...> }` adapts to: on a 2xx from the auth
// service, each header is deleted from the request, then set from the
// auth response when it has it; otherwise the auth response is the answer.
func forwardAuth(addr string, headers ...string) map[string]any {
	var routes []any
	routes = append(routes, map[string]any{"handle": []any{map[string]any{"handler": "vars"}}})
	for _, h := range headers {
		routes = append(routes,
			map[string]any{"handle": []any{map[string]any{"handler": "headers", "request": map[string]any{"delete": []string{h}}}}},
			map[string]any{
				"handle": []any{map[string]any{"handler": "headers", "request": map[string]any{"set": map[string]any{h: []string{"{http.reverse_proxy.header." + h + "}"}}}}},
				"match":  []any{map[string]any{"not": []any{map[string]any{"vars": map[string]any{"{http.reverse_proxy.header." + h + "}": []string{""}}}}}},
			})
	}
	return map[string]any{
		"handler":         "reverse_proxy",
		"upstreams":       []any{map[string]any{"dial": addr}},
		"rewrite":         map[string]any{"method": "GET", "uri": "/verify"},
		"headers":         map[string]any{"request": map[string]any{"set": map[string]any{"X-Forwarded-Method": []string{"{http.request.method}"}, "X-Forwarded-Uri": []string{"{http.request.uri}"}}}},
		"handle_response": []any{map[string]any{"match": map[string]any{"status_code": []int{2}}, "routes": routes}},
	}
}

// tenantPlans is a policy of 6/1h per tenant (a token every 600 s), whose
// pro plan is 60/1h burst 20 (a token every 60 s), the plan from X-Plan.
func tenantPlans() map[string]any {
	return map[string]any{"name": "per_tenant", "key": "{http.request.header.X-Tenant}", "rate": "6/1h",
		"plan": map[string]any{"from": "{http.request.header.X-Plan}", "plans": map[string]any{"pro": map[string]any{"rate": "60/1h", "burst": 20}}}}
}

// planFleet is 4 instances on one Redis, each authenticating with
// forward_auth at auth and limiting per tenant by plan.
func planFleet(t *testing.T, redisAddr string, auth *authServer) []*instance {
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, forwardAuth(auth.addr, "X-Tenant", "X-Plan"),
			limiter(redisAddr, map[string]any{"jitter": 0}, tenantPlans()), echo()))
	}
	return fleet
}

// TestPlanSwitchFleet: 4 instances; a tenant changes plans (the auth
// service says so) part-way through its budget. Each change is read on the
// next request on every instance, against the tenant's one bucket: the
// tokens it owes are kept, capped by the new plan. The deny caches, which
// hold denials under the old plan, are not consulted for the new one.
func TestPlanSwitchFleet(t *testing.T) {
	srv := testredis.Start(t)
	auth := startAuth(t)
	auth.set("tok-acme", "acme", "")
	fleet := planFleet(t, srv.Addr, auth)
	next := 0
	// burst sends up to n requests, one instance after the other, until
	// one is denied; it checks every response's RateLimit-Policy against
	// the plan's q, and returns the admitted and the statuses.
	burst := func(what string, q int64, n int) (admitted int, statuses []int, last response) {
		t.Helper()
		for admitted < n {
			in := fleet[next%len(fleet)]
			next++
			last = get(t, in.URL, "Authorization", "Bearer tok-acme")
			pol := parseFields(t, last.header, "RateLimit-Policy")
			if len(pol) != 1 || pol[0].params["q"] != q {
				t.Fatalf("%s: request %d on %s: RateLimit-Policy %+v, want q=%d", what, len(statuses)+1, in.URL, pol, q)
			}
			statuses = append(statuses, last.status)
			if last.status != 200 {
				break
			}
			admitted++
		}
		t.Logf("%s: %d admitted, statuses %v", what, admitted, statuses)
		return admitted, statuses, last
	}
	left := func(r response) int64 { return remainingOf(t, r.header)["per_tenant"] }

	// Default plan: 1 of 6 (owes 1 token).
	if n, _, r := burst("default", 6, 1); n != 1 || left(r) != 5 {
		t.Fatalf("default: %d admitted, r=%d; want 1, r=5", n, left(r))
	}
	// Upgrade: the 1 owed is kept: 19 of pro's 20 left; 4 requests, one per
	// instance, all admitted (owes 5).
	auth.set("tok-acme", "acme", "pro")
	if n, _, r := burst("upgraded to pro", 60, 4); n != 4 || left(r) != 15 {
		t.Fatalf("upgraded: %d admitted, r=%d; want 4, r=15 (the bucket kept, not a fresh one of 20)", n, left(r))
	}
	// Downgrade: the 5 owed are 5 of the default's 6: 1 admitted, then
	// every instance denies at once.
	auth.set("tok-acme", "acme", "")
	if n, st, _ := burst("downgraded", 6, 10); n != 1 || fmt.Sprint(st) != "[200 429]" {
		t.Fatalf("downgraded: %d admitted, %v; want 1 admitted, then 429", n, st)
	}
	for range fleet { // the next request on each instance
		if _, st, _ := burst("downgraded", 6, 1); st[0] != 429 {
			t.Fatalf("downgraded: %v, want 429 on every instance", st)
		}
	}
	// Upgrade again: the default's 6 owed are 6 of pro's 20: 14 admitted,
	// each instance's first request among them, whatever it denied under
	// the default plan a moment ago.
	auth.set("tok-acme", "acme", "pro")
	if n, st, r := burst("upgraded again", 60, 30); n != 14 || r.status != 429 {
		t.Fatalf("upgraded again: %d admitted, then %v; want 14 (20 less the 6 owed), then 429", n, st)
	}
	// Downgrade when everything is owed: the debt is capped at the
	// default's 6 tokens, and a token is 600 s away on every instance.
	auth.set("tok-acme", "acme", "")
	for range fleet {
		_, st, r := burst("downgraded when empty", 6, 1)
		if st[0] != 429 || r.header.Get("Retry-After") != "600" {
			t.Fatalf("downgraded when empty: %v Retry-After %q, want 429 after 600", st, r.header.Get("Retry-After"))
		}
	}
	// One bucket, whatever the plan.
	keys := allKeys(t, redisClient(t, srv.Addr))
	if fmt.Sprint(keys) != "["+plainKey("per_tenant", "acme")+"]" {
		t.Fatalf("keys in Redis: %v, want the tenant's one bucket", keys)
	}
	// decisions_total by plan, over the fleet: default 1+1 admitted, 1+4+4
	// denied; pro 4+14 admitted, 1 denied.
	sum := func(outcome, plan string) float64 {
		total := 0.0
		for _, in := range fleet {
			total += metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "per_tenant", "outcome": outcome, "plan": plan})
		}
		return total
	}
	got := fmt.Sprint(sum("allowed", "default"), sum("denied", "default"), sum("allowed", "pro"), sum("denied", "pro"))
	if got != "2 9 18 1" {
		t.Fatalf("decisions_total allowed/denied by plan (default, then pro): %s, want 2 9 18 1", got)
	}
}

// TestPlanHostileFleet: a plan a request names but no plan has, whatever
// it holds, gets the policy's own limit, never more. Behind forward_auth,
// the client's own X-Plan and X-Tenant (another tenant's plan and name)
// are removed before rate_limit sees the request; a plan claim the auth
// service returns that names no plan (a 4 KiB random string) is the
// default; and where a config takes the plan from a header the client
// sets, values that name no plan are the default too.
func TestPlanHostileFleet(t *testing.T) {
	srv := testredis.Start(t)
	auth := startAuth(t)
	auth.set("tok-acme", "acme", "pro")
	auth.set("tok-mallory", "mallory", "")
	long := make([]byte, 2048)
	_, _ = rand.Read(long)
	auth.set("tok-junk", "junk", hex.EncodeToString(long))
	fleet := planFleet(t, srv.Addr, auth)

	count := func(n int, q int64, header ...string) (admitted int) {
		for i := range n {
			r := get(t, fleet[i%len(fleet)].URL, header...)
			if pol := parseFields(t, r.header, "RateLimit-Policy"); len(pol) != 1 || pol[0].params["q"] != q {
				t.Fatalf("%.60v: RateLimit-Policy %+v, want q=%d", header, pol, q)
			}
			if r.status == 200 {
				admitted++
			}
		}
		return admitted
	}
	if n := count(20, 6, "Authorization", "Bearer tok-mallory", "X-Plan", "pro", "X-Tenant", "acme"); n != 6 {
		t.Fatalf("mallory naming acme's tenant and plan pro in her own headers: %d admitted, want the default's 6", n)
	}
	if n := count(20, 6, "Authorization", "Bearer tok-junk"); n != 6 {
		t.Fatalf("a 4 KiB random plan from the auth service: %d admitted, want the default's 6", n)
	}
	// acme's bucket was not touched by mallory: full.
	if b := inspect(t, fleet[0], "per_tenant", "acme"); b.Tokens != 6 {
		t.Fatalf("acme's bucket under the default plan: %d tokens, want 6 (untouched)", b.Tokens)
	}
	if n := count(25, 60, "Authorization", "Bearer tok-acme"); n != 20 {
		t.Fatalf("acme on pro: %d admitted, want 20", n)
	}

	// A config that takes the plan from a header the client sets (what the
	// docs warn against): values that name no plan still get the default.
	var naive []*instance
	for range 2 {
		naive = append(naive, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, tenantPlans()), echo()))
	}
	values := []string{hex.EncodeToString(long), "PRO", "Pro", "", "default", "enterprise", "pro,pro"} // ("pro " is pro: HTTP trims the space)
	admitted := 0
	for i := range 3 * len(values) {
		if r := get(t, naive[i%2].URL, "X-Tenant", "eve", "X-Plan", values[i%len(values)]); r.status == 200 {
			admitted++
		}
	}
	if admitted != 6 {
		t.Fatalf("%d admitted across %d plan values that name no plan, want the default's 6", admitted, len(values))
	}
}

// planOf decodes an inspect's plan and override.
type inspectedOverride struct {
	Plan     string `json:"plan"`
	Burst    int64  `json:"burst"`
	Rate     string `json:"rate"`
	Tokens   int64  `json:"tokens"`
	Override *struct {
		Kind    string `json:"kind"`
		Rate    string `json:"rate"`
		Burst   int64  `json:"burst"`
		Expires int64  `json:"expires_ms"`
		Note    string `json:"note"`
	} `json:"override"`
}

func inspectOverride(t *testing.T, in *instance, args ...string) inspectedOverride {
	t.Helper()
	var b inspectedOverride
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, append([]string{"inspect"}, append(args, "--json")...)...)), &b); err != nil {
		t.Fatal(err)
	}
	return b
}
