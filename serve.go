package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
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
		if rf := (*refusal)(nil); errors.As(err, &rf) {
			return h.refuse(w, rf) // refusal.go
		}
		return err
	}
	if res.unpriced != nil { // a model with no price (money.go)
		return h.refuseUnpriced(w, rs, res)
	}
	if len(res.parts) == 0 && len(res.adaptive) == 0 {
		return next.ServeHTTP(w, r)
	}
	if len(res.adaptive) > 0 {
		defer res.finishAdaptive() // before recycle
	}
	h.decideTraced(r, res) // decide (admission.go), in a span when traced (tracing.go)
	switch {
	case res.shedBy != nil:
		return h.shed(w, r, rs, res.shedBy)
	case res.clientGone:
		return nil // nobody to answer
	case !res.admitted():
		return h.deny(w, r, rs, res)
	}
	h.report(w, rs, res, 0)
	res.spendAtAdmission(rs) // money.go
	if !res.holdUntilDue(r) {
		return nil // the client went away; its turn stays consumed
	}
	res.passAdaptive()
	res.askUsage(r, rs) // money.go
	return h.serveWatched(w, r, next, rs, res)
}

// match finds the policies the request matches (skipping those a rate_limit
// handler it passed through already decided) and their bucket requests.
func (h *Handler) match(r *http.Request, repl *caddy.Replacer, rs *requestState, res *admission) error {
	res.parts, res.adaptive = res.partbuf[:0], res.adaptivebuf[:0]
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
			if p.capacity().has(adaptiveCapacity) {
				// A place under the adaptive limit, which the shed step takes
				// (admitAdaptive) before the store decides.
				res.adaptive = append(res.adaptive, shedAdmission{policy: p, class: class})
			}
			if !p.capacity().has(slotCapacity) {
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
		if key == "" && !p.shadow && p.keyTmpl.usesCredential() && twoCredentials(r.Header) != nil {
			return twoCredentialsRefusal(p, r.Header) // one credential a request (credential.go)
		}
		if p.costs.refuse && !p.shadow && requestBodyOf(r, rs).Unbounded() {
			return unboundedRefusal(p) // unbounded refuse (request_cost.go)
		}
		if key == "" {
			identity = p.key(r, repl)
			key = p.storageKey(h.hasher, identity)
			if !rs.dryRun {
				p.emptyKey.note(p, identity, h.logger) // credential.go
			}
		}
		rq := bucketRequest{key: key, op: p.admissionOp(), limit: p.limit, cost: p.cost(r, repl), shadow: p.shadow, givesBack: p.givesBack(), learns: p.learns(), hot: p.hot.use}
		rq.quota = p.quota // nil unless a quota
		if rq.op == opAcquire {
			rq.lease, rq.events, rq.leasesExpired = leaseIDs(), h.events, p.slots.expired
		}
		p.markOverridable(&rq, false)
		res.parts = append(res.parts, part{policy: p, rq: rq, identity: identity})
	}
	for i := range res.parts {
		rs.policies = append(rs.policies, res.parts[i].policy.Name)
	}
	for _, a := range res.adaptive {
		if !a.policy.capacity().has(slotCapacity) { // not among res.parts
			rs.policies = append(rs.policies, a.policy.Name)
		}
	}
	return nil
}

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
	if res.outcome == outcomeShed { // only shed policies' slots denied it
		return h.denyShed(w, r, rs, res)
	}

	// The policies that denied, and the longest of their waits.
	var violated []string
	var wait, stride int64
	var key string
	var boundary calendar.Period          // the period of the quota whose wait is the longest
	var denier *Policy                    // the last policy that denied
	for pt := range res.callerDenials() { // a shed policy protects the service: it is no caller's budget
		p, v, rq := pt.policy, pt.v, &pt.rq
		denier = p
		violated = append(violated, p.Name)
		p.top.Record(topIDs.of(rq.key), rq.key, pt.identity)
		switch {
		case v.untilFits == neverFits || wait == neverFits:
			wait = neverFits
		case v.untilFits >= wait:
			wait, key = v.untilFits, rq.key
			stride = rq.cost * pt.decidedLimit().interval * int64(max(1, h.Instances))
			if rq.kind() == slotsBucket {
				key = "" // slots come free when requests end: nothing to pace
			}
			boundary = calendar.Period{}
			if rq.kind() == quotaBucket {
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
	retry := res.retryable(wait, ra)
	if res.refundableWait() { // denial_shape.go
		ra, retry = min(ra, maxRetryWait), true
	}
	setRetryFields(w.Header(), ra, retry) // denial_shape.go
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
		for _, pt := range res.decidedParts() {
			if v := &pt.v; !v.allowed && v.untilFits != neverFits {
				v.untilFits = max(0, v.untilFits-hold.Microseconds())
			}
		}
	}
	return ra
}
