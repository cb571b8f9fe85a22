package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/shed"
)

// The shed policy in the handler, in process: what a client gets when it
// is shed (503, the problem, Retry-After, the placeholders), which class a
// priority value is, what each class may use, and what the adaptive limit
// is told (a slot given back unmeasured when another policy denies, a
// latency when the handler chain returns).

// designClasses are the design's classes: critical 100%, default 80%,
// batch 50%, from the X-Priority header.
func designClasses() *Priority {
	return &Priority{From: "{http.request.header.X-Priority}", Classes: []PriorityClass{
		{Name: "critical", Share: "100%"}, {Name: "default", Share: "80%"}, {Name: "batch", Share: "50%"}}}
}

// held is n requests through the handlers held in the upstream until
// release is called; their exchanges come on done.
type held struct {
	release chan struct{}
	done    chan exchange
}

func holdRequests(t *testing.T, handlers []*Handler, n int, header ...string) *held {
	t.Helper()
	hd := &held{release: make(chan struct{}), done: make(chan exchange, n)}
	entered := make(chan struct{}, n)
	up := func(w http.ResponseWriter, r *http.Request) error {
		entered <- struct{}{}
		<-hd.release
		w.WriteHeader(200)
		return nil
	}
	for range n {
		go func() { hd.done <- serveWith(handlers, nil, up, header...) }()
	}
	for range n {
		select {
		case <-entered:
		case <-time.After(5 * time.Second):
			t.Fatalf("held requests did not all reach the upstream")
		}
	}
	return hd
}

// end releases the held requests and waits for them.
func (hd *held) end(t *testing.T) {
	t.Helper()
	close(hd.release)
	for range cap(hd.done) {
		if x := <-hd.done; x.status != 200 {
			t.Errorf("a held request ended %d", x.status)
		}
	}
}

// checkShed requires the 503 of a shed request.
func checkShed(t *testing.T, x exchange, policy string) {
	t.Helper()
	if x.status != 503 || x.passed {
		t.Fatalf("status %d, passed %v: want 503, not passed on", x.status, x.passed)
	}
	p := problemOf(t, x)
	if p.Type != problemReducedCapacity || p.Status != 503 || !strings.Contains(p.Detail, "overloaded") || strings.Contains(p.Detail, "limiter") || len(p.ViolatedPolicies) != 0 {
		t.Fatalf("problem %+v: want temporary-reduced-capacity saying the service is overloaded", p)
	}
	if ra, err := strconv.Atoi(x.header.Get("Retry-After")); err != nil || ra < 1 {
		t.Fatalf("Retry-After %q, want whole seconds >= 1", x.header.Get("Retry-After"))
	}
	if x.header.Get("Cache-Control") != "no-store" {
		t.Fatalf("Cache-Control %q", x.header.Get("Cache-Control"))
	}
	if x.vars["decision"] != "shed" || x.vars["policy"] != policy {
		t.Fatalf("placeholders %v: want decision shed, policy %s", x.vars, policy)
	}
}

// TestServeHTTPShedAdaptive: shed { latency } with the design's classes,
// at the initial limit of 20: batch passes while fewer than 10 are in
// flight, default while fewer than 16, critical while fewer than 20. A
// shed request is answered 503 without a store call, and charges no other
// policy.
func TestServeHTTPShedAdaptive(t *testing.T) {
	c := &clock{t: 1000 * sec}
	st := &countingStore{store: newMemoryStore(c.now)}
	name := "adaptive_" + t.Name()
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: name, Key: "global", Shed: &Shed{Latency: caddy.Duration(time.Second)}, Priority: designClasses()},
		{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "100/1h"},
	}}, st)
	l := h.Policies[0].shed.limiter
	if l.Limit() != shed.Initial {
		t.Fatalf("limit %d, want the initial %d", l.Limit(), shed.Initial)
	}
	batch := holdRequests(t, []*Handler{h}, 10, "X-Priority", "batch", "X-User", "a")
	calls := st.calls.Load()
	x := serve([]*Handler{h}, nil, "X-Priority", "batch", "X-User", "a")
	checkShed(t, x, name)
	if st.calls.Load() != calls {
		t.Fatalf("a shed request made %d store calls, want none", st.calls.Load()-calls)
	}
	if x.header.Get("RateLimit") != "" || x.header.Get("RateLimit-Policy") != "" {
		t.Fatalf("a shed request got RateLimit fields: %v", x.header)
	}
	// Unknown, hostile and empty values are batch, the lowest class.
	for _, v := range []string{"", "CRITICAL", "urgent", strings.Repeat("x", 10000)} {
		checkShed(t, serve([]*Handler{h}, nil, "X-Priority", v, "X-User", "a"), name)
	}
	// default and critical still pass: 6 more default, then 4 critical.
	def := holdRequests(t, []*Handler{h}, 6, "X-Priority", "default", "X-User", "a")
	checkShed(t, serve([]*Handler{h}, nil, "X-Priority", "default", "X-User", "a"), name)
	crit := holdRequests(t, []*Handler{h}, 4, "X-Priority", "critical", "X-User", "a")
	checkShed(t, serve([]*Handler{h}, nil, "X-Priority", "critical", "X-User", "a"), name)
	if l.InFlight() != 20 {
		t.Fatalf("%d in flight, want 20", l.InFlight())
	}
	for _, hd := range []*held{batch, def, crit} {
		hd.end(t)
	}
	if l.InFlight() != 0 {
		t.Fatalf("%d in flight after all ended", l.InFlight())
	}
	// The per_user bucket was charged by the 20 admitted requests only.
	x = serve([]*Handler{h}, nil, "X-Priority", "critical", "X-User", "a")
	if x.status != 200 || fields(t, x.header, "RateLimit")["per_user"]["r"] != 100-21 {
		t.Fatalf("after 20 admitted: %d RateLimit %q, want r=79", x.status, x.header.Get("RateLimit"))
	}
	if _, ok := fields(t, x.header, "RateLimit-Policy")[name]; ok {
		t.Fatalf("the shed policy is in RateLimit-Policy: %q", x.header.Get("RateLimit-Policy"))
	}
	for class, want := range map[string][2]float64{"batch": {10, 5}, "default": {6, 1}, "critical": {5, 1}} {
		if a, s := decisionsOf(name, "allowed", class, ""), decisionsOf(name, "shed", class, ""); a != want[0] || s != want[1] {
			t.Errorf("class %s: %v allowed, %v shed; want %v and %v", class, a, s, want[0], want[1])
		}
	}
	for _, v := range []string{"", "urgent", "CRITICAL"} {
		if n := decisionsOf(name, "shed", v, ""); n != 0 {
			t.Errorf("a class label %q that is no class name: %v", v, n)
		}
	}
}

// countingStore counts the calls to a store.
type countingStore struct {
	store
	calls atomic.Int64
}

func (s *countingStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	s.calls.Add(1)
	return s.store.decide(ctx, reqs)
}

// TestServeHTTPShedTickets: what the adaptive limit learns from a request.
// Denied by another policy, the request gives its slot back and is not
// measured; passed on, it is measured from then until its handler chain
// returns, also when that panics; a shadow shed policy lets through what it
// would shed, counted shadow_denied.
func TestServeHTTPShedTickets(t *testing.T) {
	c := &clock{t: 1000 * sec}
	name := "tickets_" + t.Name()
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: name, Key: "global", Shed: &Shed{Latency: caddy.Duration(time.Hour)}},
		{Name: "one", Key: "global", Rate: "1/1h"},
	}}, newMemoryStore(c.now))
	l := h.Policies[0].shed.limiter
	seen := func() int { return len(l.Latencies()) }
	if x := serve([]*Handler{h}, nil); x.status != 200 || x.vars["decision"] != "allowed" {
		t.Fatalf("first: %d %v", x.status, x.vars)
	}
	if seen() != 1 || l.InFlight() != 0 {
		t.Fatalf("after one passed: %d samples, %d in flight; want 1 and 0", seen(), l.InFlight())
	}
	if x := serve([]*Handler{h}, nil); x.status != 429 {
		t.Fatalf("second: %d, want 429 from the rate policy", x.status)
	}
	if seen() != 1 || l.InFlight() != 0 {
		t.Fatalf("after one denied by another policy: %d samples, %d in flight; want 1 and 0", seen(), l.InFlight())
	}
	// Measured from being passed on.
	only := testHandler(t, &Handler{Policies: []*Policy{{Name: name, Key: "global", Shed: &Shed{Latency: caddy.Duration(time.Hour)}}}}, nil)
	x := serveWith([]*Handler{only}, nil, func(w http.ResponseWriter, r *http.Request) error {
		time.Sleep(30 * time.Millisecond)
		return nil
	})
	latency := l.Latencies()[1]
	if x.status != 200 || latency < 30*time.Millisecond || latency > x.elapsed {
		t.Fatalf("measured %v of a request that ran 30ms (%v in all)", latency, x.elapsed)
	}
	// A panic in the handler chain frees the slot.
	func() {
		defer func() { _ = recover() }()
		serveWith([]*Handler{only}, nil, func(http.ResponseWriter, *http.Request) error { panic("upstream") })
	}()
	if l.InFlight() != 0 || seen() != 3 {
		t.Fatalf("after a panic: %d in flight, %d samples", l.InFlight(), seen())
	}
	// Shadow: at the limit, what would be shed passes.
	shadowName := "shadow_" + t.Name()
	sh := testHandler(t, &Handler{Shadow: true, Policies: []*Policy{{Name: shadowName, Key: "global", Shed: &Shed{Latency: caddy.Duration(time.Hour)}}}}, nil)
	hd := holdRequests(t, []*Handler{sh}, shed.Initial)
	if x := serve([]*Handler{sh}, nil); x.status != 200 || !x.passed {
		t.Fatalf("shadow at the limit: %d", x.status)
	}
	hd.end(t)
	if n := decisionsOf(shadowName, "shadow_denied", "", ""); n != 1 {
		t.Fatalf("shadow_denied %v, want 1", n)
	}
}

// TestServeHTTPShedSlots: shed { concurrent 10 } with the design's
// classes: batch takes at most 5 slots, default 8, critical all 10, in one
// set: a burst of batch never takes what critical needs. A shed request
// is a 503 with the RateLimit fields of its other policies (which did not
// charge it); with a rate policy denying as well, it is that policy's 429.
func TestServeHTTPShedSlots(t *testing.T) {
	c := &clock{t: 1000 * sec}
	name := "slots_" + t.Name()
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: name, Key: "global", Shed: &Shed{Concurrent: 10}, Priority: designClasses()},
		{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "100/1h", Burst: 30},
		{Name: "tiny", Key: "global", Rate: "1/1h", MatchRaw: caddy.ModuleMap{"header": json.RawMessage(`{"X-Tiny": ["yes"]}`)}},
	}}, newMemoryStore(c.now))
	if x := serve([]*Handler{h}, nil, "X-Priority", "critical", "X-User", "v", "X-Tiny", "yes"); x.status != 200 {
		t.Fatalf("tiny's one request: %d", x.status)
	}
	batch := holdRequests(t, []*Handler{h}, 5, "X-Priority", "batch", "X-User", "u")
	for range 3 {
		x := serve([]*Handler{h}, nil, "X-Priority", "batch", "X-User", "u")
		checkShed(t, x, name)
		if x.header.Get("Retry-After") != "1" {
			t.Fatalf("Retry-After %q without jitter, want 1", x.header.Get("Retry-After"))
		}
		lim := fields(t, x.header, "RateLimit")
		if _, shown := lim[name]; shown || lim["per_user"]["r"] != 30-5 {
			t.Fatalf("shed: RateLimit %q, want only per_user, r=25 (not charged)", x.header.Get("RateLimit"))
		}
	}
	def := holdRequests(t, []*Handler{h}, 3, "X-Priority", "default", "X-User", "u")
	checkShed(t, serve([]*Handler{h}, nil, "X-Priority", "default", "X-User", "u"), name)
	crit := holdRequests(t, []*Handler{h}, 2, "X-Priority", "critical", "X-User", "u")
	checkShed(t, serve([]*Handler{h}, nil, "X-Priority", "critical", "X-User", "u"), name)
	// Out of budget as well: the caller's own policy answers, 429.
	x := serve([]*Handler{h}, nil, "X-Priority", "critical", "X-User", "u", "X-Tiny", "yes")
	if x.status != 429 || !strings.Contains(x.body, `"violated-policies":["tiny"]`) || x.vars["decision"] != "denied" {
		t.Fatalf("shed and out of budget: %d %s %v, want tiny's 429", x.status, x.body, x.vars)
	}
	for _, hd := range []*held{batch, def, crit} {
		hd.end(t)
	}
	x = serve([]*Handler{h}, nil, "X-Priority", "batch", "X-User", "u")
	if x.status != 200 || x.vars["decision"] != "allowed" || x.vars["policy"] != "per_user" {
		t.Fatalf("after all ended: %d %v", x.status, x.vars)
	}
	for class, want := range map[string][2]float64{"batch": {6, 3}, "default": {3, 1}, "critical": {3, 2}} {
		if a, s := decisionsOf(name, "allowed", class, ""), decisionsOf(name, "shed", class, ""); a != want[0] || s != want[1] {
			t.Errorf("class %s: %v allowed, %v shed; want %v and %v", class, a, s, want[0], want[1])
		}
	}
}

// TestServeHTTPShedFailures: a shed policy fails open while the store
// cannot decide, whatever the handler's on_error (unless it sets its own):
// its adaptive limit still sheds. A site with handle_errors gets the 503
// as an error.
func TestServeHTTPShedFailures(t *testing.T) {
	name := "failures_" + t.Name()
	h := testHandler(t, &Handler{OnError: failClosed, Policies: []*Policy{
		{Name: name, Key: "global", Shed: &Shed{Concurrent: 10, Latency: caddy.Duration(time.Hour)}},
	}}, failingStore{})
	if x := serve([]*Handler{h}, nil); x.status != 200 || x.vars["decision"] != "fail_open" {
		t.Fatalf("store down: %d %v, want fail_open", x.status, x.vars)
	}
	hd := holdRequests(t, []*Handler{h}, shed.Initial)
	checkShed(t, serve([]*Handler{h}, nil), name)
	srv := &caddyhttp.Server{Errors: &caddyhttp.HTTPErrorConfig{Routes: caddyhttp.RouteList{{}}}}
	x := serve([]*Handler{h}, srv)
	var he caddyhttp.HandlerError
	if !errors.As(x.err, &he) || he.StatusCode != 503 || x.body != "" || x.header.Get("Retry-After") == "" || x.vars["decision"] != "shed" {
		t.Fatalf("shed with handle_errors: error %v, body %q, header %v, placeholders %v", x.err, x.body, x.header, x.vars)
	}
	hd.end(t)
	closed := testHandler(t, &Handler{Policies: []*Policy{
		{Name: "closed_" + name, Key: "global", OnError: failClosed, Shed: &Shed{Concurrent: 10}},
	}}, failingStore{})
	if x := serve([]*Handler{closed}, nil); x.status != 503 || x.vars["decision"] != "fail_closed" {
		t.Fatalf("on_error fail_closed of its own: %d %v", x.status, x.vars)
	}
}
