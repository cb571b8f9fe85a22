package ratelimit

import (
	"context"
	"net/http"
	"strings"
	"sync"
	"testing"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
)

// tracedServe sends one request through h as a child of a span of tp, as
// Caddy's tracing handler starts one, and returns the spans that ended.
func tracedServe(t *testing.T, tp *sdktrace.TracerProvider, rec *tracetest.SpanRecorder, h *Handler, header ...string) (exchange, []sdktrace.ReadOnlySpan) {
	t.Helper()
	before := len(rec.Ended())
	ctx, parent := tp.Tracer("caddy").Start(context.Background(), "handler")
	x := serveIn(ctx, []*Handler{h}, nil, func(w http.ResponseWriter, r *http.Request) error {
		w.WriteHeader(200)
		return nil
	}, header...)
	parent.End()
	return x, rec.Ended()[before:]
}

// attrs is a span's attributes by key.
func attrs(s sdktrace.ReadOnlySpan) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes() {
		m[kv.Key] = kv.Value
	}
	return m
}

// TestDecisionSpan: a traced request's decision is a child span of the
// request's, rate_limit.decide, with the policies, outcome, remaining,
// cost and store; the policy that denied; a failure mode marks it an
// error; no identity anywhere in it. An untraced request makes no span.
func TestDecisionSpan(t *testing.T) {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	const identity = "user-secret-4242"
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: "span-per-user", Key: "{http.request.header.X-User}", Rate: "1/1h", Burst: 2},
		{Name: "span-global", Key: "global", Rate: "100/1h", Cost: "3"},
		{Name: "span-dry", Key: "{http.request.header.X-User}", Rate: "1/1h", Shadow: true},
	}}, nil)

	var outcomes []string
	for i := range 3 {
		x, spans := tracedServe(t, tp, rec, h, "X-User", identity)
		if len(spans) != 2 || spans[0].Name() != spanName || spans[1].Name() != "handler" {
			t.Fatalf("request %d: spans %v, want rate_limit.decide then the request's", i, spans)
		}
		span, parent := spans[0], spans[1]
		if span.Parent().SpanID() != parent.SpanContext().SpanID() || span.SpanContext().TraceID() != parent.SpanContext().TraceID() {
			t.Errorf("request %d: rate_limit.decide is not a child of the request's span", i)
		}
		a := attrs(span)
		t.Logf("request %d (%d): %v", i, x.status, span.Attributes())
		outcomes = append(outcomes, a["rate_limit.outcome"].AsString())
		if got := strings.Join(a["rate_limit.policies"].AsStringSlice(), ","); got != "span-per-user,span-global,span-dry" {
			t.Errorf("request %d: policies %q", i, got)
		}
		if got := a["rate_limit.cost"].AsInt64Slice(); len(got) != 3 || got[0] != 1 || got[1] != 3 || got[2] != 1 {
			t.Errorf("request %d: cost %v, want [1 3 1]", i, got)
		}
		if a["rate_limit.store"].AsString() != "in_process" || a["rate_limit.admitted"].AsBool() != (x.status == 200) {
			t.Errorf("request %d: store %v, admitted %v, status %d", i, a["rate_limit.store"], a["rate_limit.admitted"], x.status)
		}
		if _, ok := a["rate_limit.call.requests"]; ok {
			t.Errorf("request %d: an in-process decision rode no call, but the span says %v", i, a["rate_limit.call.requests"])
		}
		for _, kv := range span.Attributes() {
			if strings.Contains(kv.Value.Emit(), identity) || strings.Contains(kv.Value.Emit(), "{") {
				t.Errorf("request %d: attribute %s = %s holds an identity or a key", i, kv.Key, kv.Value.Emit())
			}
		}
		switch i {
		case 0:
			if r := a["rate_limit.remaining"].AsInt64Slice(); r[0] != 1 || r[1] != 97 || r[2] != 0 {
				t.Errorf("first request: remaining %v, want [1 97 0]", r)
			}
		case 2:
			if got := a["rate_limit.denied_by"].AsStringSlice(); len(got) != 1 || got[0] != "span-per-user" {
				t.Errorf("third request: denied_by %v, want [span-per-user] (a shadow policy denies nothing)", got)
			}
		}
	}
	if got := strings.Join(outcomes, ","); got != "allowed,shadow_denied,denied" {
		t.Errorf("outcomes %s, want allowed,shadow_denied,denied", got)
	}

	// Not traced: no span.
	before := len(rec.Ended())
	serve([]*Handler{h}, nil, "X-User", "someone-else")
	if n := len(rec.Ended()) - before; n != 0 {
		t.Errorf("an untraced request made %d spans", n)
	}

	// The store down: fail_open, an error span.
	down := testHandler(t, &Handler{Policies: []*Policy{{Name: "span-down", Key: "global", Rate: "1/1s"}}}, failingStore{})
	x, spans := tracedServe(t, tp, rec, down)
	a := attrs(spans[0])
	if x.status != 200 || a["rate_limit.outcome"].AsString() != "fail_open" || a["rate_limit.store"].AsString() != "none" || spans[0].Status().Code != codes.Error {
		t.Errorf("store down: %d, %v, status %v", x.status, spans[0].Attributes(), spans[0].Status())
	}
	if r := a["rate_limit.remaining"].AsInt64Slice(); len(r) != 1 || r[0] != -1 {
		t.Errorf("store down: remaining %v, want [-1] (nothing decided)", r)
	}
}

// TestDecisionCarriesItsCall: a decision made in Redis knows the script
// call it rode, for its span: a lone one rode a call of 1; of concurrent
// ones, the requests per call they report account for exactly the calls
// Redis counted.
func TestDecisionCarriesItsCall(t *testing.T) {
	srv, _, rs := newTestRedis(t)
	rs.denials = nil // every decision reaches Redis
	reqs := []bucketRequest{{key: "rl:p:{call}", limit: limit{interval: 1, burst: 1_000_000}, op: opTake, cost: 1}}
	if _, err := rs.decide(context.Background(), reqs); err != nil { // loads the script
		t.Fatal(err)
	}
	d, err := rs.decide(context.Background(), reqs)
	if err != nil || d.call.calls != 1 || d.call.requests != 1 || d.call.redisUS <= 0 {
		t.Fatalf("a lone decision: %+v, %v; want 1 call of 1 request with its round trip", d.call, err)
	}

	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	const callers, each = 32, 20
	bySize := map[int]int{} // decisions by the requests of their call
	var mu sync.Mutex
	var wg sync.WaitGroup
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				d, err := rs.decide(context.Background(), reqs)
				mu.Lock()
				if err != nil || d.call.calls != 1 || d.call.requests < 1 || d.call.redisUS <= 0 {
					t.Errorf("%+v, %v", d.call, err)
				}
				bySize[d.call.requests]++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	calls := 0
	for size, n := range bySize {
		if n%size != 0 {
			t.Errorf("%d decisions say they rode a call of %d: not whole calls", n, size)
		}
		calls += n / size
	}
	if want := scriptCalls(t, srv); calls != want {
		t.Errorf("the decisions account for %d calls (%v), Redis made %d", calls, bySize, want)
	}
	t.Logf("%d decisions from %d callers in %d calls; decisions by call size %v", callers*each, callers, calls, bySize)
}
