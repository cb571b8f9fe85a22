package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dunglas/httpsfv"
	dto "github.com/prometheus/client_model/go"
)

// failingStore is a store that cannot decide, as Redis down.
type failingStore struct{}

func (failingStore) decide(context.Context, []bucketRequest) (decision, error) {
	return decision{}, errors.New("connection refused")
}

func (f failingStore) decideAfter(reqs []bucketRequest, then func(decision, error)) {
	then(f.decide(context.Background(), reqs))
}

func (f failingStore) decideAwaited(reqs []bucketRequest) (decision, error) {
	return f.decide(context.Background(), reqs)
}

// testHandler provisions h as Caddy would, then puts its buckets in st (an
// in-process store on an injected clock, or a failing one).
func testHandler(t *testing.T, h *Handler, st store) *Handler {
	t.Helper()
	if h.KeySecret == "" {
		h.KeySecret = "test"
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := h.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = h.Cleanup() })
	if st != nil {
		h.store = st
	}
	return h
}

// exchange is one request through the handler, as a client and the next
// handler saw it.
type exchange struct {
	status  int
	header  http.Header
	body    string
	err     error // what ServeHTTP returned
	passed  bool  // the next handler ran
	vars    map[string]string
	elapsed time.Duration
}

// serve sends a GET / with the header pairs through the handlers, nested
// in order, the last one's next answering 200.
func serve(handlers []*Handler, srv *caddyhttp.Server, header ...string) exchange {
	return serveWith(handlers, srv, func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(200)
		return nil
	}, header...)
}

// serveWith is serve with the upstream given.
func serveWith(handlers []*Handler, srv *caddyhttp.Server, upstream func(http.ResponseWriter, *http.Request) error, header ...string) exchange {
	return serveIn(context.Background(), handlers, srv, upstream, header...)
}

// serveIn is serveWith in the request context ctx (a traced request's).
func serveIn(ctx context.Context, handlers []*Handler, srv *caddyhttp.Server, upstream func(http.ResponseWriter, *http.Request) error, header ...string) exchange {
	r := httptest.NewRequestWithContext(ctx, "GET", "/", nil)
	for i := 0; i+1 < len(header); i += 2 {
		r.Header.Set(header[i], header[i+1])
	}
	return serveOn(handlers, srv, upstream, r)
}

// serveOn is serveWith for the request r.
func serveOn(handlers []*Handler, srv *caddyhttp.Server, upstream func(http.ResponseWriter, *http.Request) error, r *http.Request) exchange {
	repl := caddy.NewReplacer()
	ctx := context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl)
	ctx = context.WithValue(ctx, caddyhttp.VarsCtxKey, map[string]any{})
	if srv != nil {
		ctx = context.WithValue(ctx, caddyhttp.ServerCtxKey, srv)
	}
	r = r.WithContext(ctx)
	w := httptest.NewRecorder()
	var x exchange
	var next caddyhttp.Handler = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		x.passed = true
		return upstream(w, r)
	})
	for i := len(handlers) - 1; i >= 0; i-- {
		h, inner := handlers[i], next
		next = caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error { return h.ServeHTTP(w, r, inner) })
	}
	start := time.Now()
	x.err = next.ServeHTTP(w, r)
	x.elapsed = time.Since(start)
	x.status, x.header, x.body = w.Code, w.Header(), w.Body.String()
	x.vars = map[string]string{}
	for _, v := range []string{"decision", "policy", "remaining", "retry_after"} {
		x.vars[v], _ = repl.GetString("http.rate_limit." + v)
	}
	return x
}

// fields parses RateLimit-Policy or RateLimit as a client would: member
// name to parameters.
func fields(t *testing.T, h http.Header, name string) map[string]map[string]int64 {
	t.Helper()
	if len(h.Values(name)) == 0 {
		return nil
	}
	list, err := httpsfv.UnmarshalList(h.Values(name))
	if err != nil {
		t.Fatalf("%s %q: %v", name, h.Values(name), err)
	}
	out := map[string]map[string]int64{}
	for _, m := range list {
		item := m.(httpsfv.Item)
		params := map[string]int64{}
		for _, k := range item.Params.Names() {
			v, _ := item.Params.Get(k)
			if n, ok := v.(int64); ok {
				params[k] = n
			}
		}
		out[item.Value.(string)] = params
	}
	return out
}

func problemOf(t *testing.T, x exchange) problem {
	t.Helper()
	var p problem
	if err := json.Unmarshal([]byte(x.body), &p); err != nil || x.header.Get("Content-Type") != "application/problem+json" {
		t.Fatalf("body %q (%s) is not a problem: %v", x.body, x.header.Get("Content-Type"), err)
	}
	return p
}

// jitterOff makes Retry-After the true wait, rounded up.
func jitterOff() *float64 { z := 0.0; return &z }

// TestServeHTTP: the handler on the in-process store with an injected clock,
// request by request: what a client gets (status, Retry-After, RateLimit
// fields parsed as structured fields, the problem body) and what later
// handlers and logs read (the placeholders).
func TestServeHTTP(t *testing.T) {
	perUser := func(rate string, burst int64) *Policy {
		return &Policy{Name: "per_user", Key: "{http.request.header.X-User}", Rate: rate, Burst: float64(burst)}
	}
	type step struct {
		header  []string
		advance time.Duration // of the store's clock, before the request
		status  int
		passed  bool
		vars    string // decision policy remaining retry_after
		limit   string // the RateLimit field, members "name r t" joined by ", "
	}
	for _, tc := range []struct {
		name  string
		h     *Handler
		store func(*clock) store
		steps []step
	}{
		{
			name: "allowed then denied, then a token later",
			h:    &Handler{Jitter: jitterOff(), Policies: []*Policy{perUser("1/1s", 2)}},
			steps: []step{
				{header: []string{"X-User", "ann"}, status: 200, passed: true, vars: "allowed per_user 1 0", limit: "per_user 1 1"},
				{header: []string{"X-User", "ann"}, status: 200, passed: true, vars: "allowed per_user 0 0", limit: "per_user 0 1"},
				{header: []string{"X-User", "ann"}, status: 429, vars: "denied per_user 0 1", limit: "per_user 0 1"},
				{header: []string{"X-User", "bob"}, status: 200, passed: true, vars: "allowed per_user 1 0", limit: "per_user 1 1"},
				{header: []string{"X-User", "ann"}, advance: time.Second, status: 200, passed: true, vars: "allowed per_user 0 0", limit: "per_user 0 1"},
			},
		},
		{
			name: "shadow: never denies, never shown",
			h:    &Handler{Shadow: true, Policies: []*Policy{perUser("1/1m", 1)}},
			steps: []step{
				{header: []string{"X-User", "cy"}, status: 200, passed: true, vars: "allowed per_user 0 0"},
				{header: []string{"X-User", "cy"}, status: 200, passed: true, vars: "shadow_denied per_user 0 0"},
			},
		},
		{
			name: "all or nothing: the wide policy is not charged by a request the narrow one denies",
			h: &Handler{Jitter: jitterOff(), Policies: []*Policy{
				{Name: "wide", Key: "global", Rate: "100/1h"},
				perUser("1/1h", 1),
			}},
			steps: []step{
				{header: []string{"X-User", "di"}, status: 200, passed: true, limit: "wide 99 36, per_user 0 3600", vars: "allowed per_user 0 0"},
				{header: []string{"X-User", "di"}, status: 429, limit: "wide 99 36, per_user 0 3600", vars: "denied per_user 0 3600"},
				{header: []string{"X-User", "di"}, status: 429, limit: "wide 99 36, per_user 0 3600", vars: "denied per_user 0 3600"},
				{header: []string{"X-User", "ed"}, status: 200, passed: true, limit: "wide 98 36, per_user 0 3600", vars: "allowed per_user 0 0"},
			},
		},
		{
			name:  "fail_open: admitted, no fields",
			h:     &Handler{Policies: []*Policy{perUser("1/1m", 1)}},
			store: func(*clock) store { return failingStore{} },
			steps: []step{
				{header: []string{"X-User", "fo"}, status: 200, passed: true, vars: "fail_open   0"},
				{header: []string{"X-User", "fo"}, status: 200, passed: true, vars: "fail_open   0"},
			},
		},
		{
			name:  "fail_closed: 503, not 429",
			h:     &Handler{OnError: "fail_closed", Jitter: jitterOff(), Policies: []*Policy{perUser("1/1m", 1)}},
			store: func(*clock) store { return failingStore{} },
			steps: []step{
				{header: []string{"X-User", "fc"}, status: 503, vars: "fail_closed per_user  1"},
			},
		},
		{
			name:  "local: an in-process budget of 1/instances",
			h:     &Handler{OnError: "local", Instances: 2, Jitter: jitterOff(), Policies: []*Policy{perUser("2/1h", 4)}},
			store: func(*clock) store { return failingStore{} },
			steps: []step{
				{header: []string{"X-User", "serve-test-local"}, status: 200, passed: true, vars: "local_allowed per_user 1 0", limit: "per_user 1 3600"},
				{header: []string{"X-User", "serve-test-local"}, status: 200, passed: true, vars: "local_allowed per_user 0 0", limit: "per_user 0 3600"},
				{header: []string{"X-User", "serve-test-local"}, status: 429, vars: "local_denied per_user 0 3600", limit: "per_user 0 3600"},
			},
		},
		{
			name: "wait: held until the reserved turn, then passed on",
			h: &Handler{Jitter: jitterOff(), Policies: []*Policy{
				{Name: "vendor", Key: "global", Rate: "10/1s", Burst: 1, Wait: caddy.Duration(time.Second)},
			}},
			steps: []step{
				{status: 200, passed: true, vars: "allowed vendor 0 0", limit: "vendor 0 1"},
				{status: 200, passed: true, vars: "delayed vendor 0 0", limit: "vendor 0 1"},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := &clock{t: 1000 * sec}
			var st store = newMemoryStore(c.now)
			if tc.store != nil {
				st = tc.store(c)
			}
			h := testHandler(t, tc.h, st)
			for i, s := range tc.steps {
				c.t += s.advance.Microseconds()
				x := serve([]*Handler{h}, nil, s.header...)
				vars := strings.Join([]string{x.vars["decision"], x.vars["policy"], x.vars["remaining"], x.vars["retry_after"]}, " ")
				if x.status != s.status || x.passed != s.passed || vars != s.vars {
					t.Fatalf("request %d: %d passed=%v placeholders %q, want %d passed=%v %q (body %q)", i+1, x.status, x.passed, vars, s.status, s.passed, s.vars, x.body)
				}
				var members []string
				lim := fields(t, x.header, "RateLimit")
				pol := fields(t, x.header, "RateLimit-Policy")
				for _, p := range h.Policies {
					if f, ok := lim[p.Name]; ok {
						members = append(members, p.Name+" "+strconv.FormatInt(f["r"], 10)+" "+strconv.FormatInt(f["t"], 10))
						if _, ok := pol[p.Name]; !ok {
							t.Fatalf("request %d: %s in RateLimit but not in RateLimit-Policy", i+1, p.Name)
						}
					}
				}
				if got := strings.Join(members, ", "); got != s.limit {
					t.Fatalf("request %d: RateLimit %q, want %q", i+1, got, s.limit)
				}
				switch x.status {
				case 429:
					p := problemOf(t, x)
					if p.Status != 429 || !strings.HasSuffix(p.Type, "#quota-exceeded") || x.header.Get("Retry-After") != x.vars["retry_after"] {
						t.Fatalf("request %d: problem %+v, Retry-After %q", i+1, p, x.header.Get("Retry-After"))
					}
				case 503:
					if p := problemOf(t, x); !strings.HasSuffix(p.Type, "#temporary-reduced-capacity") || x.header.Get("Retry-After") == "" {
						t.Fatalf("request %d: problem %+v, Retry-After %q", i+1, p, x.header.Get("Retry-After"))
					}
				}
			}
		})
	}
}

// TestServeHTTPHandleErrors: with a handle_errors route for the request,
// a denial is returned as a Caddy error of status 429, with Retry-After,
// the RateLimit fields and the placeholders set and no body written; a
// fail_closed denial as one of status 503.
func TestServeHTTPHandleErrors(t *testing.T) {
	srv := &caddyhttp.Server{Errors: &caddyhttp.HTTPErrorConfig{Routes: caddyhttp.RouteList{{}}}}
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "p", Key: "global", Rate: "1/1m"}}}, newMemoryStore(c.now))
	serve([]*Handler{h}, srv)
	x := serve([]*Handler{h}, srv)
	var he caddyhttp.HandlerError
	if !errors.As(x.err, &he) || he.StatusCode != 429 || x.body != "" || x.header.Get("Retry-After") != "60" ||
		fields(t, x.header, "RateLimit")["p"]["t"] != 60 || x.vars["decision"] != "denied" {
		t.Fatalf("denial with handle_errors: error %v, body %q, header %v, placeholders %v", x.err, x.body, x.header, x.vars)
	}
	closed := testHandler(t, &Handler{OnError: "fail_closed", Policies: []*Policy{{Name: "q", Key: "global", Rate: "1/1m"}}}, failingStore{})
	x = serve([]*Handler{closed}, srv)
	if !errors.As(x.err, &he) || he.StatusCode != 503 || x.header.Get("Retry-After") == "" || x.vars["decision"] != "fail_closed" {
		t.Fatalf("fail_closed with handle_errors: error %v, header %v, placeholders %v", x.err, x.header, x.vars)
	}
}

// TestServeHTTPNested: a request through two rate_limit handlers is
// charged once per policy name, and its RateLimit fields list the
// policies of both.
func TestServeHTTPNested(t *testing.T) {
	c := &clock{t: 1000 * sec}
	st := newMemoryStore(c.now)
	shared := func() *Policy { return &Policy{Name: "site", Key: "global", Rate: "10/1h"} }
	outer := testHandler(t, &Handler{Policies: []*Policy{shared()}}, st)
	inner := testHandler(t, &Handler{Policies: []*Policy{shared(), {Name: "api", Key: "{http.request.header.X-User}", Rate: "5/1h"}}}, st)
	x := serve([]*Handler{outer, inner}, nil, "X-User", "fay")
	lim := fields(t, x.header, "RateLimit")
	pol := fields(t, x.header, "RateLimit-Policy")
	if x.status != 200 || len(lim) != 2 || lim["site"]["r"] != 9 || lim["api"]["r"] != 4 || len(pol) != 2 || pol["api"]["q"] != 5 {
		t.Fatalf("through both: %d RateLimit %v RateLimit-Policy %v, want site r=9 (charged once) and api r=4", x.status, lim, pol)
	}
}

// upstreamAnswering writes status with the header pairs.
func upstreamAnswering(status int, header ...string) func(http.ResponseWriter, *http.Request) error {
	return func(w http.ResponseWriter, r *http.Request) error {
		for i := 0; i+1 < len(header); i += 2 {
			w.Header().Set(header[i], header[i+1])
		}
		w.WriteHeader(status)
		return nil
	}
}

// TestServeHTTPChargeIf: a charge_if policy checks before the request and
// charges only matching responses (a Caddy error by its status): after 5
// failed logins the 6th attempt is denied before the upstream sees it,
// even one that would succeed.
func TestServeHTTPChargeIf(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "failed_logins", Key: "{http.request.header.X-Client}", Rate: "5/15m",
		ChargeIf: &caddyhttp.ResponseMatcher{StatusCode: []int{401, 403}}}}}, newMemoryStore(c.now))
	ok := upstreamAnswering(200)
	wrong := upstreamAnswering(401)
	failing := func(http.ResponseWriter, *http.Request) error { return caddyhttp.Error(403, errors.New("forbidden")) }
	for i := range 10 {
		if x := serveWith([]*Handler{h}, nil, ok, "X-Client", "ivy"); x.status != 200 || fields(t, x.header, "RateLimit")["failed_logins"]["r"] != 5 {
			t.Fatalf("successful login %d: %d %v, want 200 and nothing charged", i, x.status, x.header)
		}
	}
	for i := range 5 {
		up := wrong
		if i == 4 {
			up = failing // a handler's error counts by its status
		}
		x := serveWith([]*Handler{h}, nil, up, "X-Client", "ivy")
		if !x.passed || fields(t, x.header, "RateLimit")["failed_logins"]["r"] != int64(4-i) || x.vars["remaining"] != strconv.Itoa(4-i) {
			t.Fatalf("failed login %d: passed=%v RateLimit %v placeholders %v, want %d left after its own charge", i+1, x.passed, x.header.Get("RateLimit"), x.vars, 4-i)
		}
	}
	x := serveWith([]*Handler{h}, nil, ok, "X-Client", "ivy")
	if x.status != 429 || x.passed {
		t.Fatalf("6th attempt, with the right password: %d passed=%v, want 429 before the upstream", x.status, x.passed)
	}
	if x := serveWith([]*Handler{h}, nil, ok, "X-Client", "jon"); x.status != 200 {
		t.Fatalf("another client: %d", x.status)
	}
}

// TestServeHTTPChargeIfHoldsTheCost: a charge_if policy reserves the cost
// while the attempt runs, so parallel attempts are counted before their
// responses come: of 64 at once, burst reach the handler behind. A response
// that does not match gives the cost back; an attempt whose client went
// away before any response keeps it; the first charged 401 reports the
// time to the next token (a bucket that is not full has a t).
func TestServeHTTPChargeIfHoldsTheCost(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "failed_logins", Key: "{http.request.header.X-Client}", Rate: "5/15m",
		ChargeIf: &caddyhttp.ResponseMatcher{StatusCode: []int{401}}}}}, newMemoryStore(c.now))
	x := serveWith([]*Handler{h}, nil, upstreamAnswering(401), "X-Client", "eve")
	if f := fields(t, x.header, "RateLimit")["failed_logins"]; f["r"] != 4 || f["t"] != 180 {
		t.Fatalf("first failed login: RateLimit %v, want r=4;t=180 (a token every 3 minutes)", x.header.Get("RateLimit"))
	}
	if x := serveWith([]*Handler{h}, nil, upstreamAnswering(200), "X-Client", "eve"); fields(t, x.header, "RateLimit")["failed_logins"]["r"] != 4 {
		t.Fatalf("a success gives its reservation back: RateLimit %v, want r=4", x.header.Get("RateLimit"))
	}
	// 64 attempts at once, each held in the handler until all have arrived
	// or been denied.
	var reached, denied atomic.Int64
	gate := make(chan struct{})
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			x := serveWith([]*Handler{h}, nil, func(w http.ResponseWriter, r *http.Request) error {
				reached.Add(1)
				<-gate
				w.WriteHeader(401)
				return nil
			}, "X-Client", "mallory")
			if x.status == 429 {
				denied.Add(1)
			}
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); reached.Load()+denied.Load() < 64 && time.Now().Before(deadline); {
		time.Sleep(time.Millisecond)
	}
	close(gate)
	wg.Wait()
	if reached.Load() != 5 || denied.Load() != 59 {
		t.Fatalf("64 parallel attempts: %d reached the handler, %d denied; want 5 and 59", reached.Load(), denied.Load())
	}
	// A client that goes away before the response keeps its charge.
	ctx, cancel := context.WithCancel(context.Background())
	r := httptest.NewRequest("GET", "/", nil).WithContext(ctx)
	r.Header.Set("X-Client", "oscar")
	repl := caddy.NewReplacer()
	r = r.WithContext(context.WithValue(context.WithValue(r.Context(), caddy.ReplacerCtxKey, repl), caddyhttp.VarsCtxKey, map[string]any{}))
	_ = h.ServeHTTP(httptest.NewRecorder(), r, caddyhttp.HandlerFunc(func(w http.ResponseWriter, r *http.Request) error {
		cancel()
		return caddyhttp.Error(http.StatusBadGateway, context.Canceled) // as reverse_proxy returns
	}))
	if x := serveWith([]*Handler{h}, nil, upstreamAnswering(200), "X-Client", "oscar"); fields(t, x.header, "RateLimit")["failed_logins"]["r"] != 4 {
		t.Fatalf("after an aborted attempt: RateLimit %v, want r=4 (the abort kept its charge)", x.header.Get("RateLimit"))
	}
}

// TestServeHTTPSettle: a settle policy reserves its cost, then gives back
// usage below it, charges usage above it as debt (capped), and keeps the
// reservation when no usage is reported; once a request used more than it
// reserved, the key's next requests reserve what it used
// (learned_usage.go).
func TestServeHTTPSettle(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "tokens", Key: "{http.request.header.X-Api-Key}", Rate: "1000/1h",
		Cost: "{http.request.header.X-Max-Tokens}", MaxCost: 500, Settle: &Settle{From: settleHeader, Field: "X-Usage-Tokens", Max: 600}}}}, newMemoryStore(c.now))
	lost := func() float64 {
		var m dto.Metric
		_ = h.Policies[0].after.lost[lostNoUsage].Write(&m)
		return m.GetCounter().GetValue()
	}
	step := func(reserve, usage string, wantField, wantAfter int64) {
		t.Helper()
		up := upstreamAnswering(200)
		if usage != "" {
			up = upstreamAnswering(200, "X-Usage-Tokens", usage)
		}
		x := serveWith([]*Handler{h}, nil, up, "X-Api-Key", "k", "X-Max-Tokens", reserve)
		if x.status != 200 || fields(t, x.header, "RateLimit")["tokens"]["r"] != max(wantField, 0) || x.vars["remaining"] != strconv.FormatInt(max(wantAfter, 0), 10) {
			t.Fatalf("reserve %s, usage %q: %d RateLimit %q placeholders %v, want r=%d and %d left once settled", reserve, usage, x.status, x.header.Get("RateLimit"), x.vars, wantField, wantAfter)
		}
	}
	step("100", "40", 960, 960)  // 100 reserved, 60 given back
	step("100", "160", 800, 800) // 60 more charged
	before := lost()
	step("100", "", 640, 640) // no usage: the reservation stands, 160 (what the last used)
	step("100", "abc", 480, 480)
	if lost()-before != 2 {
		t.Fatalf("%v settles counted lost, want 2", lost()-before)
	}
	step("100", "999999", -120, -120) // 160 reserved, the usage capped at max 600
	if x := serveWith([]*Handler{h}, nil, upstreamAnswering(200), "X-Api-Key", "k", "X-Max-Tokens", "1"); x.status != 429 {
		t.Fatalf("an empty bucket: %d, want 429", x.status)
	}
}

// TestServeHTTPNoPolicyMatched: a request no policy matches passes
// untouched: no fields, and empty placeholders.
func TestServeHTTPNoPolicyMatched(t *testing.T) {
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Policies: []*Policy{{Name: "posts", Key: "global", Rate: "1/1h",
		MatchRaw: caddy.ModuleMap{"method": json.RawMessage(`["POST"]`)}}}}, newMemoryStore(c.now))
	for range 3 {
		x := serve([]*Handler{h}, nil)
		if x.status != 200 || !x.passed || x.header.Get("RateLimit") != "" || x.vars["decision"] != "" || x.vars["policy"] != "" {
			t.Fatalf("a GET that no policy matches: %d %v placeholders %v", x.status, x.header, x.vars)
		}
	}
}
