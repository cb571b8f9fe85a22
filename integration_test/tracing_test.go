package integration_test

import (
	"context"
	"encoding/hex"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	collectortrace "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// otlpReceiver is an OTLP trace collector over gRPC, in the test process:
// what Caddy's tracing exports to.
type otlpReceiver struct {
	collectortrace.UnimplementedTraceServiceServer
	addr  string
	mu    sync.Mutex
	spans []*tracepb.Span
}

func (o *otlpReceiver) Export(_ context.Context, req *collectortrace.ExportTraceServiceRequest) (*collectortrace.ExportTraceServiceResponse, error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, rs := range req.ResourceSpans {
		for _, ss := range rs.ScopeSpans {
			o.spans = append(o.spans, ss.Spans...)
		}
	}
	return &collectortrace.ExportTraceServiceResponse{}, nil
}

// startOTLPReceiver serves the receiver on a free loopback port until the
// test ends.
func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	o := &otlpReceiver{addr: l.Addr().String()}
	srv := grpc.NewServer()
	collectortrace.RegisterTraceServiceServer(srv, o)
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(srv.Stop)
	return o
}

// env is the OTLP exporter's configuration of Caddy's tracing: gRPC to the
// receiver, every span, exported within 100 ms.
func (o *otlpReceiver) env() []string {
	return []string{
		"OTEL_EXPORTER_OTLP_PROTOCOL=grpc",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + o.addr,
		"OTEL_EXPORTER_OTLP_INSECURE=true",
		"OTEL_TRACES_SAMPLER=always_on",
		"OTEL_BSP_SCHEDULE_DELAY=100",
		"OTEL_SERVICE_NAME=caddy-rate-limit-test",
	}
}

// trace returns the spans of one trace, once want of them are in (at most
// 10 s).
func (o *otlpReceiver) trace(t *testing.T, traceID string, want int) []*tracepb.Span {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var got []*tracepb.Span
		o.mu.Lock()
		for _, s := range o.spans {
			if hex.EncodeToString(s.TraceId) == traceID {
				got = append(got, s)
			}
		}
		o.mu.Unlock()
		if len(got) >= want {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("trace %s: %d spans exported within 10s, want %d", traceID, len(got), want)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// spanAttrs is a span's attributes by key, as strings (a list as its
// values joined by commas).
func spanAttrs(s *tracepb.Span) map[string]string {
	m := map[string]string{}
	var str func(v *commonpb.AnyValue) string
	str = func(v *commonpb.AnyValue) string {
		switch x := v.Value.(type) {
		case *commonpb.AnyValue_StringValue:
			return x.StringValue
		case *commonpb.AnyValue_IntValue:
			return fmt.Sprint(x.IntValue)
		case *commonpb.AnyValue_BoolValue:
			return fmt.Sprint(x.BoolValue)
		case *commonpb.AnyValue_DoubleValue:
			return fmt.Sprint(x.DoubleValue)
		case *commonpb.AnyValue_ArrayValue:
			var parts []string
			for _, e := range x.ArrayValue.Values {
				parts = append(parts, str(e))
			}
			return strings.Join(parts, ",")
		}
		return v.String()
	}
	for _, kv := range s.Attributes {
		m[kv.Key] = str(kv.Value)
	}
	return m
}

// TestTracing: with Caddy's tracing handler before rate_limit, each
// decision is exported (OTLP over gRPC, as the OTEL_* variables say) as a
// child span of the request's, rate_limit.decide, in the trace the client
// started (traceparent), with the policies, the outcome, what each left and
// cost, the store, and the coalesced Redis call it rode: the requests in
// it and its round trip. No span of the trace holds the identity.
func TestTracing(t *testing.T) {
	srv := testredis.Start(t)
	otlp := startOTLPReceiver(t)
	tracing := map[string]any{"handler": "tracing", "span": "request"}
	in := startCaddyEnv(t, otlp.env(), nil, tracing,
		decidedByRedis(srv.Addr,
			map[string]any{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "2/1m"},
			map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "100/1m", "cost": "{http.request.header.X-Cost}", "max_cost": 10},
		),
		respond())

	send := func(i int, apiKey string) (string, int) {
		traceID := fmt.Sprintf("%032x", 0x41_0000+i)
		req, _ := http.NewRequest("GET", in.URL+"/", nil)
		req.Header.Set("traceparent", "00-"+traceID+"-00f067aa0ba902b7-01")
		req.Header.Set("X-Api-Key", apiKey)
		req.Header.Set("X-User", secretUserID)
		req.Header.Set("X-Cost", "3")
		resp, err := newClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return traceID, resp.StatusCode
	}

	var statuses []int
	for i := range 3 {
		traceID, status := send(i, secretAPIKey)
		statuses = append(statuses, status)
		spans := otlp.trace(t, traceID, 2)
		var decide, request *tracepb.Span
		for _, s := range spans {
			switch s.Name {
			case "rate_limit.decide":
				decide = s
			case "request":
				request = s
			}
			for _, kv := range s.Attributes {
				if v := kv.Value.String(); strings.Contains(v, secretAPIKey) || strings.Contains(v, secretUserID) {
					t.Errorf("span %s, attribute %s holds an identity: %s", s.Name, kv.Key, v)
				}
			}
		}
		if decide == nil || request == nil {
			t.Fatalf("trace %s: spans %v, want rate_limit.decide and request", traceID, spans)
		}
		if string(decide.ParentSpanId) != string(request.SpanId) {
			t.Errorf("rate_limit.decide's parent is %x, the request's span is %x", decide.ParentSpanId, request.SpanId)
		}
		a := spanAttrs(decide)
		t.Logf("request %d (%d): rate_limit.decide %v", i, status, a)
		want := map[string]string{
			"rate_limit.policies":  "per_key,per_user",
			"rate_limit.cost":      "1,3",
			"rate_limit.store":     "redis",
			"rate_limit.admitted":  fmt.Sprint(status == 200),
			"rate_limit.remaining": []string{"1,97", "0,94", "0,94"}[i],
			"rate_limit.outcome":   []string{"allowed", "allowed", "denied"}[i],
		}
		if i == 2 {
			want["rate_limit.denied_by"] = "per_key"
		}
		for k, v := range want {
			if a[k] != v {
				t.Errorf("request %d: %s = %q, want %q", i, k, a[k], v)
			}
		}
		// The call it rode, unless the deny cache answered the denial.
		requests, _ := strconv.Atoi(a["rate_limit.call.requests"])
		redisUS, _ := strconv.Atoi(a["rate_limit.call.redis_us"])
		if a["rate_limit.deny_cache"] != "true" && (requests != 1 || redisUS <= 0) {
			t.Errorf("request %d: rode a call of %d requests taking %d µs, want 1 (alone) and its round trip", i, requests, redisUS)
		}
	}
	if statuses[0] != 200 || statuses[1] != 200 || statuses[2] != 429 {
		t.Fatalf("statuses %v, want 200 200 429", statuses)
	}

	// Concurrent requests (each its own API key) ride calls together: each
	// span names the requests of its call, so that a call of k requests
	// is named by k spans.
	const concurrent = 32
	ids := make([]string, concurrent)
	var wg sync.WaitGroup
	for i := range ids {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ids[i], _ = send(100+i, secretAPIKey+strconv.Itoa(i))
		}()
	}
	wg.Wait()
	bySize := map[int]int{}
	for _, id := range ids {
		for _, s := range otlp.trace(t, id, 2) {
			if s.Name == "rate_limit.decide" {
				n, err := strconv.Atoi(spanAttrs(s)["rate_limit.call.requests"])
				if err != nil || n < 1 || n > concurrent {
					t.Errorf("rate_limit.call.requests = %q", spanAttrs(s)["rate_limit.call.requests"])
				}
				bySize[n]++
			}
		}
	}
	for size, n := range bySize {
		if n%size != 0 {
			t.Errorf("%d spans say their call carried %d requests: not whole calls (%v)", n, size, bySize)
		}
	}
	t.Logf("%d concurrent requests: spans by the requests of their call %v", concurrent, bySize)
}
