package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// The request path: which policies a request matches, their one decision
// (or, when the store cannot decide, their on_error), the 429 or 503 of a
// denial, the RateLimit fields and placeholders, and holding a request for
// the slot it reserved.

// ServeHTTP decides the request against every policy that matches it, in
// one atomic decision, then passes it on (after its reserved slot, with
// `wait`) or answers it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	h.storeUse.enter()
	defer h.storeUse.leave() // last: after the releases and charges
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	rs := requestStateOf(r, repl)
	res := reservations.Get().(*reservation)
	defer res.recycle()
	if err := h.match(r, repl, rs, res); err != nil {
		return err
	}
	if len(res.reqs) == 0 && len(res.adaptive) == 0 {
		return next.ServeHTTP(w, r)
	}
	if len(res.adaptive) > 0 {
		defer res.finishAdaptive() // before recycle
	}
	if p := h.decide(r, res); p != nil { // admit, traced (tracing.go)
		return h.shed(w, r, rs, p)
	}
	if res.clientGone {
		return nil // nobody to answer
	}
	if !res.admitted() {
		return h.deny(w, r, rs, res)
	}
	h.report(w, rs, res, 0)
	if !res.holdUntilDue(r) {
		return nil // the client went away; its slot stays consumed
	}
	res.passAdaptive()
	return h.serveWatched(w, r, next, rs, res)
}

// admit decides the request: shed policies' adaptive limits first, on
// this instance alone (a request they shed costs no store call: their
// policy is returned), then its one decision (reserve).
func (h *Handler) admit(r *http.Request, res *reservation) *Policy {
	if len(res.adaptive) > 0 {
		if p := res.admitAdaptive(); p != nil {
			return p
		}
	}
	h.reserve(r, res)
	return nil
}

// reservations are reused from request to request: a reservation and its
// inline buffers are a few KB, and nothing holds on to one once its request
// returns (what outlives it, the placeholders and response fields, are
// strings of their own).
var reservations = sync.Pool{New: func() any { return new(reservation) }}

// recycle releases what the request holds and returns the reservation to
// the pool.
func (res *reservation) recycle() {
	res.release()
	*res = reservation{}
	reservations.Put(res)
}

// reservation is one request's decision and what the request holds until
// it returns: its places among the requests each `wait` policy may hold
// and its concurrency leases, all released in one place (release).
type reservation struct {
	policies []*Policy
	reqs     []bucketRequest
	d        decision
	outcome  outcome
	// decidedBy is the store that decided the request, which holds its
	// slots and takes its charges after the response: the handler's, or the
	// `local` fallback while that failed; nil when nothing decided it.
	decidedBy store
	// shown are the policies the decision's verdicts are of, in order, and
	// their requests: all the policies, the `local` ones when the store
	// failed, none for fail_open.
	shown     []*Policy
	shownReqs []bucketRequest
	// identities are the resolved keys of policies, as sent (for top).
	identities []string
	// failClosed is the policy whose fail_closed answers 503.
	failClosed *Policy
	// clientGone: the client went away while its decision queued.
	clientGone bool
	places     []*Policy // `wait` places taken
	holding    []*Policy // of those, the policies holding the request now
	// after are the policies charged after the response (charge_if,
	// settle).
	after []afterCharge
	// The RateLimit fields of the handlers the request passed before, and
	// whether this one added its own (which a response may update).
	outerPolicyField, outerLimitField string
	fieldsSent                        bool

	// leases are the concurrency slots the request holds, in decidedBy.
	leases []lease

	pbuf, placebuf, holdbuf [4]*Policy
	rbuf                    [4]bucketRequest
	ibuf                    [4]string
	afterbuf                [4]afterCharge
	leasebuf                [4]lease

	// adaptive are the request's places under shed policies' adaptive
	// limits (shed_policy.go); passed: the request was passed on.
	adaptive    []shedAdmission
	adaptivebuf [2]shedAdmission
	passed      bool
}

// admitted reports whether the request goes on.
func (res *reservation) admitted() bool { return res.failClosed == nil && res.d.admitted }

// match finds the policies the request matches (skipping those a rate_limit
// handler it passed through already decided) and their bucket requests.
func (h *Handler) match(r *http.Request, repl *caddy.Replacer, rs *requestState, res *reservation) error {
	res.policies, res.reqs, res.identities = res.pbuf[:0], res.rbuf[:0], res.ibuf[:0]
	for _, p := range h.Policies {
		ok, err := p.matches(r)
		if err != nil {
			return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("rate_limit: policy %s: matching: %w", p.Name, err))
		}
		if !ok || rs.wasDecided(p.Name) {
			continue
		}
		if p.Shed != nil {
			if p = res.matchShed(p, r, repl, rs); p == nil {
				continue // decided on this instance alone (shed { latency })
			}
		}
		p = p.planned(r, repl) // the policy as the request's plan limits it
		key, identity := p.fixedKey, p.keyTmpl.text
		if key == "" {
			identity = p.key(r, repl)
			key = p.storageKey(h.hasher, identity)
			p.emptyKey.note(p, identity, h.logger) // credential.go
		}
		res.policies = append(res.policies, p)
		res.identities = append(res.identities, identity)
		rq := bucketRequest{key: key, op: p.admissionOp(), limit: p.limit, cost: p.cost(r, repl), shadow: p.shadow, refundable: p.refundable(), learns: p.learns(), hot: p.hot}
		rq.quota = p.quota // nil unless a quota
		if rq.op == opAcquire {
			rq.lease, rq.events, rq.leasesExpired = leaseIDs(), h.events, p.leasesExpired
		}
		p.markOverridable(&rq, false)
		res.reqs = append(res.reqs, rq)
	}
	for _, p := range res.policies {
		rs.policies = append(rs.policies, p.Name)
	}
	return nil
}

// reserve makes the request's one decision, taking the `wait` places it
// may hold, or, when the store cannot decide, applies each policy's
// on_error.
func (h *Handler) reserve(r *http.Request, res *reservation) {
	// A policy with `wait` may reserve a future slot only while it has room
	// to hold the request until then.
	res.places = res.placebuf[:0]
	if len(res.reqs) == 0 { // only shed policies' adaptive limits, which admitted it
		res.d, res.outcome = decision{admitted: true}, outcomeAllowed
		return
	}
	for i, p := range res.policies {
		if p.Concurrent == 0 && p.hold() {
			res.reqs[i].wait = p.waitUS
			res.places = append(res.places, p)
		}
	}
	d, err := h.store.decide(r.Context(), res.reqs)
	waited := false
	if err == nil && !d.admitted {
		// Denied for want of a concurrency slot, by policies that wait.
		d, err = h.waitForSlot(r, res, d)
		waited = d.admitted
	}
	if errors.Is(err, errClientGone) {
		res.clientGone = true
		return
	}
	if err != nil {
		res.release() // a request decided without the store is never held
		h.withoutStore(r, res)
		return
	}
	res.d, res.shown, res.shownReqs, res.decidedBy = d, res.policies, res.reqs, h.store
	reserved(res.reqs, d) // what each learning bucket reserved
	notePeriods(res.reqs, d)
	admitted := outcomeAllowed
	if waited {
		admitted = outcomeDelayed // it waited for a concurrency slot
	}
	count(res.policies, d, admitted, outcomeDenied)
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
		for i, v := range d.verdicts {
			if !v.allowed {
				res.outcome = outcomeShadowDenied
				h.logger.Debug("shadow policy would deny", zap.String("policy", res.policies[i].Name))
			}
		}
	}
}

// withoutStore applies each policy's on_error when the store could not
// decide: one fail_closed policy answers 503 for the request; local
// policies are decided by in-process buckets; fail_open policies admit.
func (h *Handler) withoutStore(r *http.Request, res *reservation) {
	var local []bucketRequest
	var localPolicies []*Policy
	var localIdentities []string
	for i, p := range res.policies {
		switch {
		case p.onError == failClosed && !p.shadow:
			p.decisions[outcomeFailClosed].Inc()
			res.failClosed, res.outcome = p, outcomeFailClosed
			return
		case p.onError == failLocal:
			local = append(local, h.localRequest(res.reqs[i]))
			localPolicies = append(localPolicies, p)
			localIdentities = append(localIdentities, res.identities[i])
		}
	}
	res.d, res.shown, res.shownReqs, res.outcome = decision{admitted: true}, nil, nil, outcomeFailOpen
	if len(local) > 0 {
		res.d, _ = localFallback.decide(r.Context(), local)
		reserved(local, res.d)
		notePeriods(local, res.d)
		res.shown, res.shownReqs, res.identities, res.decidedBy = localPolicies, local, localIdentities, localFallback
		count(localPolicies, res.d, outcomeLocalAllowed, outcomeLocalDenied)
		res.outcome = outcomeLocalAllowed
		if !res.d.admitted {
			res.outcome = outcomeLocalDenied
		} else {
			res.takeSlots()
		}
	}
	for _, p := range res.policies {
		if p.onError != failLocal {
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
		if !rq.op.slots() { // a slot's interval is its lease
			rq.limit.interval = min(rq.limit.interval, maxBucketSpan/n) * n
		}
		rq.limit.burst = max(1, rq.limit.burst/n)
	}
	return rq
}

// holdUntilDue holds an admitted request until the time its `wait`
// reserved. It returns false when the client went away first.
func (res *reservation) holdUntilDue(r *http.Request) bool {
	res.holding = res.holdbuf[:0]
	for _, p := range res.places {
		for i, q := range res.policies {
			if q == p && res.d.verdicts[i].delay > 0 {
				res.holding = append(res.holding, p)
				p.waiting.Inc()
			}
		}
	}
	if res.d.delay <= 0 {
		return true
	}
	timer := time.NewTimer(time.Duration(res.d.delay) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// release gives back what the request holds: its `wait` places and its
// concurrency slots. It is safe to call more than once.
func (res *reservation) release() {
	for _, p := range res.holding {
		p.waiting.Dec()
	}
	for _, p := range res.places {
		p.release()
	}
	res.holding, res.places = nil, nil
	res.freeSlots()
}

// count adds a decision to each policy's decisions_total: a policy that
// denied counts as denied (shadow_denied for a shadow policy); one that
// admitted counts as allowed when the request was admitted and it was
// charged, and not at all when another policy denied the request.
func count(policies []*Policy, d decision, allowed, denied outcome) {
	for i, v := range d.verdicts {
		switch {
		case !v.allowed && policies[i].shadow:
			policies[i].decisions[outcomeShadowDenied].Inc()
		case !v.allowed && policies[i].Shed != nil:
			policies[i].decisions[outcomeShed].Inc()
		case !v.allowed:
			policies[i].decisions[denied].Inc()
		case d.admitted && v.delay > 0:
			policies[i].decisions[outcomeDelayed].Inc()
		case d.admitted:
			policies[i].decisions[allowed].Inc()
		}
	}
}

// errRateLimited is the error of a denial handed to a site's handle_errors.
var errRateLimited = errors.New("rate limit exceeded")

// deny answers a denied request: 429 when a policy denied it, 503 when a
// fail_closed policy could not be decided. A site with handle_errors routes
// for the request gets the denial as a Caddy error instead, with the
// Retry-After and RateLimit fields and the placeholders set, to render its
// own page.
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, rs *requestState, res *reservation) error {
	if res.failClosed != nil {
		ra := retryAfter(time.Second.Microseconds(), h.jitter)
		rs.decided, rs.decision, rs.policy, rs.remaining, rs.retryAfter = true, outcomeFailClosed, res.failClosed.Name, -1, ra
		setRetryFields(w.Header(), ra, true)
		if handlesErrors(r, http.StatusServiceUnavailable) {
			return caddyhttp.Error(http.StatusServiceUnavailable, errStoreUnavailable)
		}
		return writeProblem(w, reducedCapacity())
	}
	if res.shedOnly() {
		return h.denyShed(w, r, rs, res)
	}

	// The policies that denied, and the longest of their waits.
	var violated []string
	var wait, stride int64
	var key string
	var boundary period // the period of the quota whose wait is the longest
	var denier *Policy  // the last policy that denied
	for i, v := range res.d.verdicts {
		p := res.shown[i]
		if v.allowed || p.shadow || p.Shed != nil { // a shed policy protects the service: it is no caller's budget
			continue
		}
		denier = p
		violated = append(violated, p.Name)
		k := res.shownReqs[i].key
		p.top.record(topIDs.of(k), k, res.identities[i])
		switch {
		case v.untilFits == neverFits || wait == neverFits:
			wait = neverFits
		case v.untilFits >= wait:
			wait, key = v.untilFits, res.shownReqs[i].key
			stride = res.shownReqs[i].cost * res.decidedLimit(i, p).interval * int64(max(1, h.Instances))
			if res.shownReqs[i].op.slots() {
				key = "" // slots come free when requests end: nothing to pace
			}
			boundary = period{}
			if res.shownReqs[i].quota != nil {
				boundary = v.period // a quota comes back whole at its boundary
			}
		}
	}
	var ra int64
	if wait != neverFits { // a request that can never fit gets no Retry-After
		if boundary.end != 0 {
			ra = boundaryRetryAfter(wait, boundarySpread(boundary, h.jitter))
		} else if key == "" {
			ra = retryAfter(wait, h.jitter)
		} else {
			ra = res.paced(r, key, wait, stride, h.jitter)
		}
	}
	setRetryFields(w.Header(), ra, res.retryable(wait, ra)) // denial_shape.go
	h.report(w, rs, res, ra)
	if ce := h.logger.Check(zap.DebugLevel, "rate limit exceeded"); ce != nil {
		ce.Write(zap.Strings("policies", violated), zap.Int64("retry_after", ra))
	}
	if handlesErrors(r, http.StatusTooManyRequests) {
		return caddyhttp.Error(http.StatusTooManyRequests, errRateLimited)
	}
	return h.writeDenial(w, res, violated, denier, ra) // denial_shape.go
}

// paced is the Retry-After of a denial on the bucket under key, from its
// calendar (see pacing.go), once the response has been held the fraction
// of a second that puts the client's return on its turn. The waits the
// RateLimit field reports are shorter by that hold.
func (res *reservation) paced(r *http.Request, key string, wait, stride int64, jitter float64) int64 {
	ra, hold := pacing.pace(r.RemoteAddr, key, wait, stride, jitter)
	if hold > 0 {
		pacing.holdDenial(r, hold)
		for i := range res.d.verdicts {
			if v := &res.d.verdicts[i]; !v.allowed && v.untilFits != neverFits {
				v.untilFits = max(0, v.untilFits-hold.Microseconds())
			}
		}
	}
	return ra
}

// errStoreUnavailable is the error of a fail_closed 503 handed to a site's
// handle_errors.
var errStoreUnavailable = errors.New("rate limiter unavailable")

// handlesErrors reports whether the server has an error route that would
// take this request's error of the given status: a site's handle_errors.
func handlesErrors(r *http.Request, status int) bool {
	srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil || srv.Errors == nil || len(srv.Errors.Routes) == 0 {
		return false
	}
	// Match as Caddy will, with the error's placeholders set.
	er := srv.Errors.WithError(r, caddyhttp.Error(status, errRateLimited))
	for _, route := range srv.Errors.Routes {
		if len(route.MatcherSets) == 0 {
			return true
		}
		if ok, err := route.MatcherSets.AnyMatchWithError(er); ok && err == nil {
			return true
		}
	}
	return false
}

// report sets the placeholders and the RateLimit fields. Every placeholder
// is set (possibly empty), so access logs never show a raw placeholder. A
// request that passed through rate_limit handlers before keeps their
// fields: this one's members are added.
func (h *Handler) report(w http.ResponseWriter, rs *requestState, res *reservation, retryAfter int64) {
	res.outerPolicyField, res.outerLimitField = rs.policyField, rs.limitField
	if enforced := h.setPlaceholders(rs, res, retryAfter); enforced && h.headers {
		h.writeFields(w.Header(), rs, res, false)
		res.fieldsSent = true
	}
}

// setPlaceholders sets the placeholders from the decision, and reports
// whether an enforced (not shadow) policy took part in it.
func (h *Handler) setPlaceholders(rs *requestState, res *reservation, retryAfter int64) (enforced bool) {
	d := res.d
	rs.decided, rs.decision, rs.retryAfter, rs.policy, rs.remaining, rs.key = true, res.outcome, retryAfter, "", -1, ""
	// The tightest enforced policy; among shadow ones only when no policy is
	// enforced, so a dry run still says which policy would deny.
	tightest := -1
	for i, v := range d.verdicts {
		if v.allowed && res.shown[i].Shed != nil {
			continue // the service's capacity, not a budget left to the caller
		}
		e := !res.shown[i].shadow
		if tightest < 0 || e && !enforced || e == enforced && tighter(v, d.verdicts[tightest]) {
			tightest, enforced = i, e
		}
	}
	if tightest < 0 { // fail_open: nothing was decided
		return false
	}
	rs.policy, rs.remaining = res.shown[tightest].Name, max(0, d.verdicts[tightest].remaining)
	rs.key = res.shownReqs[tightest].key
	return enforced
}

// writeFields sets RateLimit-Policy and RateLimit: the members of the
// handlers the request passed before, then this one's enforced policies.
// With charged, a policy charged after the response reports what its
// bucket holds once this response's own charge is made, as far as it is
// known when the headers are written.
func (h *Handler) writeFields(hdr http.Header, rs *requestState, res *reservation, charged bool) {
	d := res.d
	// Most requests match every policy: their RateLimit-Policy is fixed.
	var pbuf, lbuf [256]byte
	pol, lim := pbuf[:0], lbuf[:0]
	all := len(d.verdicts) == len(h.Policies) && h.allPolicyHdr != "" && res.outerPolicyField == "" && !res.overridden()
	if res.outerPolicyField != "" {
		pol, lim = append(pol, res.outerPolicyField...), append(lim, res.outerLimitField...)
	}
	for i, v := range d.verdicts {
		p := res.shown[i]
		if p.shadow || p.Shed != nil { // see docs/load-shedding.md: no caller's budget
			continue
		}
		if len(lim) > 0 {
			pol = append(pol, ", "...)
			lim = append(lim, ", "...)
		}
		if !all {
			if q := res.shownReqs[i].quota; q != nil {
				pol = append(pol, q.policyMember(res.decidedQuota(i), v.period)...)
			} else {
				pol = res.appendPolicyMember(pol, i, p)
			}
		}
		remaining, until := v.remaining, v.untilFits
		if charged {
			remaining, until = res.predicted(i)
		}
		if res.shownReqs[i].quota != nil {
			until = v.untilFits // a quota's t is its boundary's, charged or not
		}
		if p.Concurrent > 0 {
			until = neverFits // free slots have no window
		}
		lim = limitMember(lim, p.Name, remaining, until)
	}
	if len(lim) == 0 {
		return // only shed policies: no fields
	}
	// Both fields in one string, and both values in one array: one
	// allocation for what the response keeps.
	var both string
	var policyField string
	if all {
		policyField, both = h.allPolicyHdr, string(lim)
	} else {
		both = string(append(pol, lim...))
		policyField = both[:len(pol)]
	}
	rs.policyField, rs.limitField = policyField, both[len(both)-len(lim):]
	// The first fields of a request live in its requestState, which
	// outlives the response as they must; later ones (a response updating
	// them) get their own, so that no header set before changes under it.
	values := &rs.fieldValues
	if rs.fieldsSet {
		values = new([2]string)
	}
	rs.fieldsSet = true
	values[0], values[1] = policyField, rs.limitField
	hdr["Ratelimit-Policy"] = values[0:1:1]
	hdr["Ratelimit"] = values[1:2:2]
}

// tighter orders verdicts for {http.rate_limit.policy}: a denial before an
// admission, then the longer wait, then the fewer tokens left.
func tighter(a, b verdict) bool {
	if a.allowed != b.allowed {
		return !a.allowed
	}
	if !a.allowed {
		return a.untilFits == neverFits || (b.untilFits != neverFits && a.untilFits > b.untilFits)
	}
	return a.remaining < b.remaining
}
