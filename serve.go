package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"go.uber.org/zap"
)

// The request path: which policies a request matches, their one decision
// (or, when the store cannot decide, their on_error), the 429 or 503 of a
// denial, the RateLimit fields and placeholders, and holding a request for
// the turn it reserved.

// ServeHTTP decides the request against every policy that matches it, in
// one atomic decision, then passes it on (after its reserved turn, with
// `wait`) or answers it.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	h.storeUse.enter()
	defer h.storeUse.leave() // last: after the releases and charges
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	rs := requestStateOf(r, repl)
	res := admissions.Get().(*admission)
	defer res.recycle()
	if err := h.match(r, repl, rs, res); err != nil {
		return err
	}
	if res.unpriced != nil { // a model with no price (money.go)
		return h.refuseUnpriced(w, rs, res)
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
	res.spendAtAdmission(rs) // money.go
	if !res.holdUntilDue(r) {
		return nil // the client went away; its slot stays consumed
	}
	res.passAdaptive()
	res.askUsage(r, rs) // money.go
	return h.serveWatched(w, r, next, rs, res)
}

// admit decides the request in two steps: the shed step, shed policies'
// adaptive limits on this instance alone (a request they shed costs no
// store call: their policy is returned), then its one decision by the
// store (reserve).
func (h *Handler) admit(r *http.Request, res *admission) *Policy {
	if p := res.admitAdaptive(); p != nil {
		return p
	}
	h.reserve(r, res)
	return nil
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

// admission is one request's decision and what the request holds until
// it returns: its held places (among the MaxHeld requests each `wait`
// policy may hold) and its concurrency slots, all given back in one place
// (giveBack).
type admission struct {
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

	pbuf, heldPlacesBuf, heldNowBuf [4]*Policy
	rbuf                            [4]bucketRequest
	ibuf                            [4]string
	afterbuf                        [4]afterCharge
	leasebuf                        [4]lease

	// adaptive are the request's places under shed policies' adaptive
	// limits (shed_policy.go); passed: the request was passed on.
	adaptive    []shedAdmission
	adaptivebuf [2]shedAdmission
	passed      bool
}

// admitted reports whether the request goes on.
func (res *admission) admitted() bool { return res.failClosed == nil && res.d.admitted }

// match finds the policies the request matches (skipping those a rate_limit
// handler it passed through already decided) and their bucket requests.
func (h *Handler) match(r *http.Request, repl *caddy.Replacer, rs *requestState, res *admission) error {
	res.policies, res.reqs, res.identities, res.adaptive = res.pbuf[:0], res.rbuf[:0], res.ibuf[:0], res.adaptivebuf[:0]
	for _, p := range h.Policies {
		ok, err := p.matches(r)
		if err != nil {
			return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("rate_limit: policy %s: matching: %w", p.Name, err))
		}
		if !ok || rs.wasDecided(p.Name) {
			continue
		}
		if p.kind == kindShed {
			class := p.shed.classOf(p, r, repl)
			p = p.shed.byClass[class] // the policy as the request's priority class limits it
			if p.shed.limiter != nil {
				// A place under the adaptive limit, which the shed step takes
				// (admitAdaptive) before the store decides.
				res.adaptive = append(res.adaptive, shedAdmission{policy: p, class: class})
			}
			if p.Shed.Concurrent == 0 {
				continue // nothing for the store to decide
			}
		}
		p = p.planned(r, repl) // the policy as the request's plan limits it
		if p.keyModel || p.pricesModels() {
			// The model, in the key or priced: a money policy refuses a
			// model with no price before anything is decided (money.go).
			rs.prices = p.prices
			if p.pricesModels() && p.unpricedModel(requestBodyOf(r, rs)) && !p.shadow {
				res.unpriced = p
				return nil
			}
			requestBodyOf(r, rs)
		}
		key, identity := p.fixedKey, p.keyTmpl.text
		if key == "" {
			identity = p.key(r, repl)
			key = p.storageKey(h.hasher, identity)
			p.emptyKey.note(p, identity, h.logger) // credential.go
		}
		res.policies = append(res.policies, p)
		res.identities = append(res.identities, identity)
		rq := bucketRequest{key: key, op: p.admissionOp(), limit: p.limit, cost: p.cost(r, repl), shadow: p.shadow, givesBack: p.givesBack(), learns: p.learns(), hot: p.hot.use}
		rq.quota = p.quota // nil unless a quota
		if rq.op == opAcquire {
			rq.lease, rq.events, rq.leasesExpired = leaseIDs(), h.events, p.slots.expired
		}
		p.markOverridable(&rq, false)
		res.reqs = append(res.reqs, rq)
	}
	for _, p := range res.policies {
		rs.policies = append(rs.policies, p.Name)
	}
	for _, a := range res.adaptive {
		if a.policy.Shed.Concurrent == 0 { // not among res.policies
			rs.policies = append(rs.policies, a.policy.Name)
		}
	}
	return nil
}

// reserve makes the request's one decision, taking the `wait` places it
// may hold, or, when the store cannot decide, applies each policy's
// on_error.
func (h *Handler) reserve(r *http.Request, res *admission) {
	// A policy with `wait` may reserve a future turn only while it has room
	// to hold the request until then.
	res.heldPlaces = res.heldPlacesBuf[:0]
	if len(res.reqs) == 0 { // only shed policies' adaptive limits, which admitted it
		res.d, res.outcome = decision{admitted: true}, outcomeAllowed
		return
	}
	for i, p := range res.policies {
		if p.kind != kindConcurrent && p.takeHeldPlace() {
			res.reqs[i].wait = p.held.wait
			res.heldPlaces = append(res.heldPlaces, p)
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
		res.giveBack() // a request decided without the store is never held
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

// waitForSlot holds a request denied only for want of concurrency slots,
// on policies that `wait`, until its decision admits it (taking the slot as
// soon as one is freed, in arrival order among this instance's waiters),
// the wait runs out, or the client goes away. It returns the last
// decision.
func (h *Handler) waitForSlot(r *http.Request, res *admission, d decision) (decision, error) {
	var key string
	var wait time.Duration
	for i, v := range d.verdicts {
		p := res.policies[i]
		if v.allowed || p.shadow {
			continue
		}
		if res.reqs[i].op != opAcquire || p.Wait == 0 {
			return d, nil // denied by more than a full set of slots
		}
		if key == "" {
			key = res.reqs[i].key
		}
		wait = max(wait, time.Duration(p.Wait))
	}
	// A place among the requests each policy holds at once, for the wait.
	var held []*Policy
	defer func() {
		for _, p := range held {
			p.held.gauge.Dec()
			p.giveHeldPlace()
		}
	}()
	for i, p := range res.policies {
		if !d.verdicts[i].allowed && !p.shadow {
			if !p.takeHeldPlace() {
				return d, nil
			}
			held = append(held, p)
			p.held.gauge.Inc()
		}
	}
	w := slotQueues.join(key)
	defer slotQueues.leave(key, w)
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	poll := time.NewTicker(slotPoll)
	defer poll.Stop()
	for {
		select {
		case <-w:
		case <-poll.C:
		case <-deadline.C:
			return d, nil
		case <-r.Context().Done():
			return d, nil
		}
		if !slotQueues.first(key, w) {
			continue
		}
		next, err := h.store.decide(r.Context(), res.reqs)
		if err != nil || next.admitted {
			return next, err
		}
		d = next
	}
}

// withoutStore applies each policy's on_error when the store could not
// decide: one fail_closed policy answers 503 for the request; local
// policies are decided by in-process buckets; fail_open policies admit.
func (h *Handler) withoutStore(r *http.Request, res *admission) {
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
func (res *admission) holdUntilDue(r *http.Request) bool {
	res.heldNow = res.heldNowBuf[:0]
	for _, p := range res.heldPlaces {
		for i, q := range res.policies {
			if q == p && res.d.verdicts[i].delay > 0 {
				res.heldNow = append(res.heldNow, p)
				p.held.gauge.Inc()
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

// giveBack gives back what the request holds: its `wait` places and its
// concurrency slots. It is safe to call more than once.
func (res *admission) giveBack() {
	for _, p := range res.heldNow {
		p.held.gauge.Dec()
	}
	for _, p := range res.heldPlaces {
		p.giveHeldPlace()
	}
	res.heldNow, res.heldPlaces = nil, nil
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
		case !v.allowed && policies[i].kind == kindShed:
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
func (h *Handler) deny(w http.ResponseWriter, r *http.Request, rs *requestState, res *admission) error {
	if res.failClosed != nil {
		ra := retryAfter(time.Second.Microseconds(), h.jitter)
		rs.decidedAs(outcomeFailClosed, res.failClosed.Name, rs.key, -1, ra)
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
	var boundary calendar.Period // the period of the quota whose wait is the longest
	var denier *Policy           // the last policy that denied
	for i, v := range res.d.verdicts {
		p := res.shown[i]
		if v.allowed || p.shadow || p.kind == kindShed { // a shed policy protects the service: it is no caller's budget
			continue
		}
		denier = p
		violated = append(violated, p.Name)
		k := res.shownReqs[i].key
		p.top.Record(topIDs.of(k), k, res.identities[i])
		switch {
		case v.untilFits == neverFits || wait == neverFits:
			wait = neverFits
		case v.untilFits >= wait:
			wait, key = v.untilFits, res.shownReqs[i].key
			stride = res.shownReqs[i].cost * res.decidedLimit(i, p).interval * int64(max(1, h.Instances))
			if res.shownReqs[i].op.slots() {
				key = "" // slots come free when requests end: nothing to pace
			}
			boundary = calendar.Period{}
			if res.shownReqs[i].quota != nil {
				boundary = v.period // a quota comes back whole at its boundary
			}
		}
	}
	var ra int64
	if wait != neverFits { // a request that can never fit gets no Retry-After
		if boundary.End != 0 {
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
// calendar (see internal/pace), once the response has been held the fraction
// of a second that puts the client's return on its turn. The waits the
// RateLimit field reports are shorter by that hold.
func (res *admission) paced(r *http.Request, key string, wait, stride int64, jitter float64) int64 {
	ra, hold := pacing.Pace(r.RemoteAddr, key, wait, stride, jitter)
	if hold > 0 {
		pacing.HoldDenial(r, hold)
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
