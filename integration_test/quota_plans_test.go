package integration_test

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Plans and overrides on a quota policy, through real Caddy processes and
// a real Redis: the plan from forward_auth, as for a rate policy; the
// override through one instance's admin API, applied on another.

// yearlyPlans is a quota of 10 a year per tenant whose pro plan is 25, the
// plan from X-Plan. (A year, so that no run meets a boundary but one that
// spans New Year's midnight UTC.)
func yearlyPlans() map[string]any {
	return map[string]any{"name": "yearly", "key": "{http.request.header.X-Tenant}", "quota": "10/year",
		"plan": map[string]any{"from": "{http.request.header.X-Plan}", "plans": map[string]any{"pro": map[string]any{"quota": "25"}}}}
}

// quotaInspect decodes `caddy rate-limit inspect --json` of a quota.
type quotaInspect struct {
	Quota    int64  `json:"quota"`
	Used     *int64 `json:"used"`
	Tokens   int64  `json:"tokens"`
	Plan     string `json:"plan"`
	Override *struct {
		Kind  string `json:"kind"`
		Quota string `json:"quota"`
		Note  string `json:"note"`
	} `json:"override"`
}

// TestQuotaPlansOverrides: 2 instances; a tenant uses 4 of its free 10,
// upgrades (the auth service says so) and is admitted pro's 25 less the 4
// it used, 21, across both instances, then denied; an override of 30 set
// through instance 0's admin API applies to the very next request on
// instance 1, which is admitted with 4 left; the count is kept through it
// all; `inspect` shows the override; deleted through the command line,
// pro's 25 applies again on the next request (denied, 30 used), and a
// downgrade to free is denied at once. Every response's RateLimit fields
// say the N it was decided under.
func TestQuotaPlansOverrides(t *testing.T) {
	srv := testredis.Start(t)
	auth := startAuth(t)
	auth.set("tok-acme", "acme", "")
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, forwardAuth(auth.addr, "X-Tenant", "X-Plan"),
			limiter(srv.Addr, map[string]any{"jitter": 0}, yearlyPlans()), echo()))
	}
	next := 0
	// fields are a response's q and r of the quota, and its t (seconds to
	// the boundary).
	fields := func(r response) (q, rem, until int64) {
		t.Helper()
		pol, lim := parseFields(t, r.header, "RateLimit-Policy"), parseFields(t, r.header, "RateLimit")
		if len(pol) != 1 || len(lim) != 1 || pol[0].name != "yearly" || lim[0].name != "yearly" {
			t.Fatalf("fields: RateLimit-Policy %+v, RateLimit %+v", pol, lim)
		}
		return pol[0].params["q"], lim[0].params["r"], lim[0].params["t"]
	}
	// burst sends up to n requests, one instance after the other, until one
	// is denied; each response's q must be q, and an admitted one's r what
	// the count leaves.
	burst := func(what string, q int64, used *int64, n int) (admitted int, last response) {
		t.Helper()
		for admitted < n {
			last = get(t, fleet[next%len(fleet)].URL, "Authorization", "Bearer tok-acme")
			next++
			gotQ, rem, until := fields(last)
			if gotQ != q || until <= 0 {
				t.Fatalf("%s: request %d: q=%d t=%d, want q=%d and t > 0", what, admitted+1, gotQ, until, q)
			}
			if last.status != 200 {
				if rem != 0 {
					t.Fatalf("%s: denied with r=%d, want 0", what, rem)
				}
				break
			}
			*used++
			if rem != max(0, q-*used) {
				t.Fatalf("%s: request %d: r=%d, want %d (%d used of %d)", what, admitted+1, rem, q-*used, *used, q)
			}
			admitted++
		}
		t.Logf("%s: %d admitted, then %d (q=%d, %d used)", what, admitted, last.status, q, *used)
		return admitted, last
	}
	var used int64
	if n, _ := burst("free", 10, &used, 4); n != 4 {
		t.Fatalf("free: %d admitted, want 4", n)
	}
	auth.set("tok-acme", "acme", "pro")
	if n, last := burst("upgraded to pro", 25, &used, 40); n != 21 || last.status != 429 {
		t.Fatalf("upgraded to pro: %d admitted then %d, want 25 - 4 = 21 then 429", n, last.status)
	}

	start := time.Now()
	status, body := adminCall(t, fleet[0], "POST", "/rate_limit/override", `{"policy":"yearly","identity":"acme","quota":"30/year","note":"contract 9"}`)
	set := time.Since(start)
	if status != 200 || !strings.Contains(body, `"announced":true`) {
		t.Fatalf("setting the override: %d %s", status, body)
	}
	r := get(t, fleet[1].URL, "Authorization", "Bearer tok-acme")
	applied := time.Since(start)
	q, rem, _ := fields(r)
	t.Logf("override quota 30 set through instance 0 in %v; the next request, on instance 1, answered %v after the call began: %d q=%d r=%d",
		set.Round(time.Microsecond), applied.Round(time.Microsecond), r.status, q, rem)
	if r.status != 200 || q != 30 || rem != 4 {
		t.Fatalf("the next request on another instance: %d q=%d r=%d; want 200 q=30 r=4 (25 used before it)", r.status, q, rem)
	}
	used++
	next = 0
	if n, last := burst("under the override", 30, &used, 10); n != 4 || last.status != 429 {
		t.Fatalf("under the override: %d admitted then %d, want 4 then 429", n, last.status)
	}
	// A limit of the wrong kind: 400, nothing changes.
	if status, body := adminCall(t, fleet[1], "POST", "/rate_limit/override", `{"policy":"yearly","identity":"acme","rate":"100/1m"}`); status != 400 || !strings.Contains(body, "is a quota") {
		t.Fatalf("a rate on a quota policy: %d %s, want 400", status, body)
	}

	var b quotaInspect
	if err := json.Unmarshal([]byte(rateLimitCLI(t, fleet[1], "inspect", "yearly", "acme", "--json")), &b); err != nil {
		t.Fatal(err)
	}
	if b.Override == nil || b.Override.Kind != "quota" || b.Override.Quota != "30/year" || b.Override.Note != "contract 9" || b.Quota != 30 || b.Used == nil || *b.Used != 30 || b.Tokens != 0 {
		t.Fatalf("inspect under the override: %+v (override %+v)", b, b.Override)
	}
	text := rateLimitCLI(t, fleet[1], "inspect", "yearly", "acme")
	t.Logf("caddy rate-limit inspect yearly acme:\n%s", text)
	if !strings.Contains(text, "override") || !strings.Contains(text, "quota 30/year, until deleted") {
		t.Fatalf("caddy rate-limit inspect does not show the override:\n%s", text)
	}
	if out := rateLimitCLI(t, fleet[1], "overrides", "yearly"); !strings.Contains(out, "quota 30/year") {
		t.Fatalf("caddy rate-limit overrides yearly:\n%s", out)
	}

	out := rateLimitCLI(t, fleet[1], "override", "yearly", "acme", "delete")
	t.Logf("caddy rate-limit override yearly acme delete: %s", strings.TrimSpace(out))
	if r := get(t, fleet[0].URL, "Authorization", "Bearer tok-acme"); r.status != 429 {
		t.Fatalf("after the delete: %d, want 429 under pro's 25 (30 used)", r.status)
	} else if q, rem, _ := fields(r); q != 25 || rem != 0 {
		t.Fatalf("after the delete: q=%d r=%d, want q=25 r=0", q, rem)
	}
	auth.set("tok-acme", "acme", "")
	if r := get(t, fleet[1].URL, "Authorization", "Bearer tok-acme"); r.status != 429 {
		t.Fatalf("downgraded to free: %d, want 429", r.status)
	} else if q, rem, _ := fields(r); q != 10 || rem != 0 {
		t.Fatalf("downgraded to free: q=%d r=%d, want q=10 r=0", q, rem)
	}
}

// TestQuotaOverrideCluster: 2 instances on a 3-master Redis Cluster; 24
// identities each use their `quota 5/year` on one instance, get an
// override of 8 through its admin API, and are admitted on the other
// instance's next request with 2 left: the override is in its count's
// slot, where the script reads it. Each delete brings the policy's 5 back.
func TestQuotaOverrideCluster(t *testing.T) {
	c := testredis.StartCluster(t, 3, false)
	policy := map[string]any{"name": "yearly_c", "key": "{http.request.header.X-User}", "quota": "5/year"}
	var fleet []*instance
	for range 2 {
		h := limiter("", map[string]any{"jitter": 0, "on_error": "fail_closed"}, policy)
		h["redis"] = map[string]any{"addresses": c.Addrs(), "cluster": true, "timeout": "1s"}
		fleet = append(fleet, startCaddy(t, h, echo()))
	}
	quotaOf := func(r response) (q, rem int64) {
		t.Helper()
		pol, lim := parseFields(t, r.header, "RateLimit-Policy"), parseFields(t, r.header, "RateLimit")
		if len(pol) != 1 || len(lim) != 1 {
			t.Fatalf("fields: RateLimit-Policy %+v, RateLimit %+v", pol, lim)
		}
		return pol[0].params["q"], lim[0].params["r"]
	}
	owner := func(key string) string { // the master that holds key
		for _, m := range c.Masters {
			if v, err := m.Do("EXISTS", key); err == nil && v == "1" {
				return m.Addr
			}
		}
		return ""
	}
	const n = 24
	nodes := map[string]bool{}
	for i := range n {
		id := "tenant-" + strconv.Itoa(i)
		admitted := 0
		for range 6 {
			if r := get(t, fleet[0].URL, "X-User", id); r.status == 200 {
				admitted++
			}
		}
		if admitted != 5 {
			t.Fatalf("%s: %d of 6 admitted, want 5", id, admitted)
		}
		if status, body := adminCall(t, fleet[0], "POST", "/rate_limit/override", `{"policy":"yearly_c","identity":"`+id+`","quota":"8"}`); status != 200 || !strings.Contains(body, `"announced":true`) {
			t.Fatalf("%s: setting the override: %d %s, want it confirmed by both instances", id, status, body)
		}
		r := get(t, fleet[1].URL, "X-User", id)
		if q, rem := quotaOf(r); r.status != 200 || q != 8 || rem != 2 {
			t.Fatalf("%s on the other instance: %d q=%d r=%d; want 200 q=8 r=2", id, r.status, q, rem)
		}
		key := plainKey("yearly_c", id)
		if owner(key) == "" || owner(key) != owner(key+":override") {
			t.Fatalf("%s: the override (on %q) is not beside its count (on %q)", id, owner(key+":override"), owner(key))
		}
		nodes[owner(key)] = true
	}
	if len(nodes) != 3 {
		t.Fatalf("the %d identities' counts are on %d masters, want all 3", n, len(nodes))
	}
	for i := range n {
		id := "tenant-" + strconv.Itoa(i)
		rateLimitCLI(t, fleet[1], "override", "yearly_c", id, "delete")
		r := get(t, fleet[0].URL, "X-User", id)
		if q, rem := quotaOf(r); r.status != 429 || q != 5 || rem != 0 {
			t.Fatalf("%s after the delete: %d q=%d r=%d, want 429 q=5 r=0 (6 used)", id, r.status, q, rem)
		}
	}
	t.Logf("%d quota overrides on a 3-master cluster (counts on %d masters): each applied on the other instance's next request, each deleted", n, len(nodes))
}
