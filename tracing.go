package ratelimit

import (
	"net/http"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"
)

// Traces: with Caddy's `tracing` directive on the route, each decision is
// a child span of the request's, named rate_limit.decide, with the policies
// decided, the outcome, what each left and cost, the store that decided it
// and the coalesced Redis call it rode (requests in the call, its round
// trip). Names and numbers only: never an identity or a storage key.
// OpenTelemetry has no convention for rate limiting yet; the attributes
// are this module's own, under rate_limit.*.

// spanName is the decision's span.
const spanName = "rate_limit.decide"

// tracerName is the instrumentation scope of the spans: the module.
const tracerName = "github.com/ratelimit-caddy/caddy-ratelimit"

// decideTraced makes the request's decision (decide, admission.go), in a
// rate_limit.decide span when the request is traced: the span only reads
// the admission.
func (h *Handler) decideTraced(r *http.Request, res *admission) outcome {
	parent := trace.SpanFromContext(r.Context())
	if !parent.IsRecording() {
		return h.decide(r, res)
	}
	_, span := parent.TracerProvider().Tracer(tracerName, trace.WithInstrumentationVersion(Version)).
		Start(r.Context(), spanName, trace.WithSpanKind(trace.SpanKindInternal))
	o := h.decide(r, res)
	h.traceDecision(span, res)
	span.End()
	return o
}

// traceDecision sets the span's attributes from the decision.
func (h *Handler) traceDecision(span trace.Span, res *admission) {
	if res.shedBy != nil { // an adaptive limit, on this instance alone
		span.SetAttributes(
			attribute.StringSlice("rate_limit.policies", []string{res.shedBy.Name}),
			attribute.String("rate_limit.outcome", outcomeNames[outcomeShed]),
			attribute.Bool("rate_limit.admitted", false),
			attribute.String("rate_limit.store", "adaptive"),
		)
		return
	}
	n := len(res.parts)
	names, costs, remaining := make([]string, n), make([]int64, n), make([]int64, n)
	var deniedBy []string
	for i := range res.parts {
		pt := &res.parts[i]
		names[i], costs[i], remaining[i] = pt.policy.Name, pt.rq.cost, -1
		if res.decidedBy == localFallback && pt.rq.learns {
			costs[i] = pt.rq.asked // the cost the store was asked, not the fallback's reservation
		}
		if pt.decided { // all, the local ones, or none (fail_open)
			remaining[i] = pt.v.remaining
		}
	}
	for pt := range res.denials() {
		deniedBy = append(deniedBy, pt.policy.Name)
	}
	outcome := res.outcome
	attrs := []attribute.KeyValue{
		attribute.StringSlice("rate_limit.policies", names),
		attribute.String("rate_limit.outcome", outcomeNames[outcome]),
		attribute.Bool("rate_limit.admitted", res.admitted()),
		attribute.Int64Slice("rate_limit.remaining", remaining),
		attribute.Int64Slice("rate_limit.cost", costs),
		attribute.String("rate_limit.store", h.storeKind(res)),
	}
	if len(deniedBy) > 0 {
		attrs = append(attrs, attribute.StringSlice("rate_limit.denied_by", deniedBy))
	}
	if res.d.delay > 0 {
		attrs = append(attrs, attribute.Int64("rate_limit.delay_us", res.d.delay))
	}
	if c := res.d.call; c.calls > 0 {
		attrs = append(attrs,
			attribute.Int("rate_limit.call.count", c.calls),
			attribute.Int("rate_limit.call.requests", c.requests),
			attribute.Int64("rate_limit.call.redis_us", c.redisUS))
	} else if c.cached {
		attrs = append(attrs, attribute.Bool("rate_limit.deny_cache", true))
	} else if c.hot {
		attrs = append(attrs, attribute.Bool("rate_limit.hot_key", true))
	}
	span.SetAttributes(attrs...)
	switch outcome {
	case outcomeFailOpen, outcomeFailClosed, outcomeLocalAllowed, outcomeLocalDenied:
		span.SetStatus(codes.Error, "the store could not decide: the policies followed on_error")
	}
}

// storeKind names the store that decided: redis, in_process, local (the
// on_error local fallback) or none (fail_open, fail_closed).
func (h *Handler) storeKind(res *admission) string {
	switch {
	case res.decidedBy == nil:
		return "none"
	case res.decidedBy == localFallback:
		return "local"
	case h.Redis != nil:
		return "redis"
	}
	return "in_process"
}
