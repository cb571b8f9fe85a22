package ratelimit

import (
	"errors"
	"iter"
	"net/http"
	"sync"

	"go.uber.org/zap"
)

// A request's admission: the policies it matched, each with its part in
// the decision (its bucket request, its verdict, the identity it was
// keyed by), the decision's outcome, and what the request holds until it
// returns. decide makes it, the shed step first, then the one decision by
// the store (or, when the store cannot decide, the policies' on_error);
// the rest of the request path only reads it, through the few walks
// named here.

// part is one policy's part in a request's admission.
type part struct {
	policy *Policy
	// rq is its bucket request as sent to the store that decided it (the
	// `local` fallback: its share of the budget).
	rq bucketRequest
	// identity is the resolved key, as sent (for top).
	identity string
	// v is what the store said of its bucket, when decided.
	v verdict
	// decided: the store that decided the request decided this part: every
	// part, the `local` ones when the store failed, none for fail_open.
	decided bool
}

// denied reports whether the part's policy denied the request, enforced
// (not a shadow policy's denial).
func (pt *part) denied() bool { return pt.decided && !pt.v.allowed && !pt.policy.shadow }

// admission is one request's decision and what the request holds until
// it returns: its held places (among the MaxHeld requests each `wait`
// policy may hold) and its concurrency slots, all given back in one place
// (giveBack).
type admission struct {
	parts   []part
	d       decision // its verdicts are the decided parts'
	outcome outcome
	// shedBy is the shed policy whose adaptive limit turned the request
	// away, before anything else was decided (outcome shed).
	shedBy *Policy
	// decidedBy is the store that decided the request, which holds its
	// slots and takes its charges after the response: the handler's, or the
	// `local` fallback while that failed; nil when nothing decided it.
	decidedBy store
	// failClosed is the policy whose fail_closed answers 503.
	failClosed *Policy
	// unpriced is the money policy that has no price for the request's
	// model (money.go): refused before any decision.
	unpriced *Policy
	// clientGone: the client went away while its decision queued.
	clientGone bool
	heldPlaces []*Policy // `wait` policies whose held places it took
	heldNow    []*Policy // of those, the ones holding the request now
	// after are the policies charged after the response (charge_if,
	// settle).
	after []afterCharge
	// The RateLimit fields of the handlers the request passed before, and
	// whether this one added its own (which a response may update).
	outerPolicyField, outerLimitField string
	fieldsSent                        bool
	// allPolicyField is the handler's RateLimit-Policy when the request
	// matched every policy (report): the same for most requests.
	allPolicyField string

	// leases are the concurrency slots the request holds, in decidedBy.
	leases []lease

	partbuf                   [4]part
	reqbuf                    [4]bucketRequest // the store's view of the parts
	heldPlacesBuf, heldNowBuf [4]*Policy
	afterbuf                  [4]afterCharge
	leasebuf                  [4]lease

	// adaptive are the request's places under shed policies' adaptive
	// limits (shed_policy.go); passed: the request was passed on.
	adaptive    []shedAdmission
	adaptivebuf [2]shedAdmission
	passed      bool
}

// admissions are reused from request to request: an admission and its
// inline buffers are a few KB, and nothing holds on to one once its request
// returns (what outlives it, the placeholders and response fields, are
// strings of their own).
var admissions = sync.Pool{New: func() any { return new(admission) }}

// recycle gives back what the request holds and returns the admission to
// the pool.
func (res *admission) recycle() {
	res.giveBack()
	*res = admission{}
	admissions.Put(res)
}

// admitted reports whether the request goes on.
func (res *admission) admitted() bool { return res.failClosed == nil && res.d.admitted }

// The walks of the admission the request path needs.

// decidedParts are the parts the store that decided the request decided,
// in order, with their index among all parts.
func (res *admission) decidedParts() iter.Seq2[int, *part] {
	return func(yield func(int, *part) bool) {
		for i := range res.parts {
			if pt := &res.parts[i]; pt.decided && !yield(i, pt) {
				return
			}
		}
	}
}

// denials are the parts whose enforced policies denied the request, shed
// policies' included.
func (res *admission) denials() iter.Seq[*part] {
	return func(yield func(*part) bool) {
		for i := range res.parts {
			if pt := &res.parts[i]; pt.denied() && !yield(pt) {
				return
			}
		}
	}
}

// callerDenials are the denials of a caller's budget: not a shed policy's,
// which protects the service.
func (res *admission) callerDenials() iter.Seq[*part] {
	return func(yield func(*part) bool) {
		for i := range res.parts {
			if pt := &res.parts[i]; pt.denied() && pt.policy.kind.caller() && !yield(pt) {
				return
			}
		}
	}
}

// requests are the parts' bucket requests, for the store.
func (res *admission) requests() []bucketRequest {
	reqs := res.reqbuf[:0]
	for i := range res.parts {
		reqs = append(reqs, res.parts[i].rq)
	}
	return reqs
}

// decided records the store's decision of the parts that sent it reqs
// (all of them, or those of local), by decidedBy.
func (res *admission) decided(by store, d decision, sent []int, reqs []bucketRequest) {
	res.d, res.decidedBy = d, by
	for j, i := range sent {
		pt := &res.parts[i]
		pt.rq, pt.v, pt.decided = reqs[j], d.verdicts[j], true
		pt.rq.reserved(pt.v) // what a learning bucket reserved (learned_usage.go)
		pt.rq.notePeriod(pt.v)
	}
}

// decide makes the request's decision and returns its outcome, final: the
// shed step, shed policies' adaptive limits on this instance alone (a
// request they shed costs no store call: outcome shed, res.shedBy), then
// its one decision by the store (reserve); a request that only shed
// policies' slots denied is shed too.
func (h *Handler) decide(r *http.Request, res *admission) outcome {
	if p := res.admitAdaptive(); p != nil {
		res.shedBy, res.outcome = p, outcomeShed
		return res.outcome
	}
	h.reserve(r, res)
	if res.failClosed == nil && !res.clientGone && !res.d.admitted && res.shedOnly() {
		res.outcome = outcomeShed // the service is at capacity: 503
	}
	return res.outcome
}

// reserve makes the request's one decision by the store, taking the
// `wait` places it may hold, or, when the store cannot decide, applies each
// policy's on_error.
func (h *Handler) reserve(r *http.Request, res *admission) {
	// A policy with `wait` may reserve a future turn only while it has room
	// to hold the request until then.
	res.heldPlaces = res.heldPlacesBuf[:0]
	if len(res.parts) == 0 { // only shed policies' adaptive limits, which admitted it
		res.d, res.outcome = decision{admitted: true}, outcomeAllowed
		return
	}
	for i := range res.parts {
		if p := res.parts[i].policy; p.kind != kindConcurrent && p.takeHeldPlace() {
			res.parts[i].rq.wait = p.held.wait
			res.heldPlaces = append(res.heldPlaces, p)
		}
	}
	reqs := res.requests()
	d, err := h.store.decide(r.Context(), reqs)
	waited := false
	if err == nil && !d.admitted {
		// Denied for want of a concurrency slot, by policies that wait.
		d, err = h.waitForSlot(r, res, reqs, d)
		waited = d.admitted
	}
	if errors.Is(err, errClientGone) {
		res.clientGone = true
		return
	}
	if err != nil {
		res.giveBack() // a request decided without the store is never held
		h.withoutStore(r, res)
		return
	}
	res.decided(h.store, d, allParts(len(res.parts)), reqs)
	admitted := outcomeAllowed
	if waited {
		admitted = outcomeDelayed // it waited for a concurrency slot
	}
	res.count(admitted, outcomeDenied)
	if d.admitted {
		res.takeSlots()
	}
	switch {
	case !d.admitted:
		res.outcome = outcomeDenied
	case d.delay > 0 || waited:
		res.outcome = outcomeDelayed
	default:
		res.outcome = outcomeAllowed
		for _, pt := range res.decidedParts() {
			if !pt.v.allowed {
				res.outcome = outcomeShadowDenied
				h.logger.Debug("shadow policy would deny", zap.String("policy", pt.policy.Name))
			}
		}
	}
}

// allIndexes are 0, 1, 2…: the parts all sent, most requests' case.
var allIndexes = [...]int{0, 1, 2, 3, 4, 5, 6, 7}

// allParts is the indexes of n parts, all sent.
func allParts(n int) []int {
	if n <= len(allIndexes) {
		return allIndexes[:n]
	}
	all := make([]int, n)
	for i := range all {
		all[i] = i
	}
	return all
}

// withoutStore applies each policy's on_error when the store could not
// decide: one fail_closed policy answers 503 for the request; local
// policies are decided by in-process buckets; fail_open policies admit.
func (h *Handler) withoutStore(r *http.Request, res *admission) {
	var local []bucketRequest
	var sent []int
	for i := range res.parts {
		switch p := res.parts[i].policy; {
		case p.onError == failClosed && !p.shadow:
			p.decisions[outcomeFailClosed].Inc()
			res.failClosed, res.outcome = p, outcomeFailClosed
			return
		case p.onError == failLocal:
			local = append(local, h.localRequest(res.parts[i].rq))
			sent = append(sent, i)
		}
	}
	res.d, res.outcome = decision{admitted: true}, outcomeFailOpen
	if len(local) > 0 {
		d, _ := localFallback.decide(r.Context(), local)
		res.decided(localFallback, d, sent, local)
		res.count(outcomeLocalAllowed, outcomeLocalDenied)
		res.outcome = outcomeLocalAllowed
		if !res.d.admitted {
			res.outcome = outcomeLocalDenied
		} else {
			res.takeSlots()
		}
	}
	for i := range res.parts {
		if p := res.parts[i].policy; p.onError != failLocal {
			p.decisions[outcomeFailOpen].Inc()
		}
	}
}

// localRequest is a policy's request to its in-process fallback bucket,
// which holds 1/instances of the policy's budget. It never waits: while
// Redis is away, a request that does not fit now is denied.
func (h *Handler) localRequest(rq bucketRequest) bucketRequest {
	rq.wait = 0
	if n := int64(h.Instances); n > 1 {
		if rq.kind() != slotsBucket { // a slot's interval is its lease
			rq.limit.interval = min(rq.limit.interval, maxBucketSpan/n) * n
		}
		rq.limit.burst = max(1, rq.limit.burst/n)
	}
	return rq
}

// count adds a decision to each decided policy's decisions_total: a policy
// that denied counts as denied (shadow_denied for a shadow policy); one
// that admitted counts as allowed when the request was admitted and it was
// charged, and not at all when another policy denied the request.
func (res *admission) count(allowed, denied outcome) {
	for _, pt := range res.decidedParts() {
		p, v := pt.policy, pt.v
		switch {
		case !v.allowed && p.shadow:
			p.decisions[outcomeShadowDenied].Inc()
		case !v.allowed && p.kind == kindShed:
			p.decisions[outcomeShed].Inc()
		case !v.allowed:
			p.decisions[denied].Inc()
		case res.d.admitted && v.delay > 0:
			p.decisions[outcomeDelayed].Inc()
		case res.d.admitted:
			p.decisions[allowed].Inc()
		}
	}
}

// shedOnly reports whether every enforced policy that denied the request
// is a shed policy: the service is at capacity, and the caller broke no
// policy of its own (which, if it did, answers 429).
func (res *admission) shedOnly() bool {
	shed := false
	for pt := range res.denials() {
		if pt.policy.kind.caller() {
			return false
		}
		shed = true
	}
	return shed
}
