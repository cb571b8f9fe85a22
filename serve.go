package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// ServeHTTP decides the request against every matching policy.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)

	var pbuf [4]*Policy
	var rbuf [4]bucketRequest
	policies, reqs := pbuf[:0], rbuf[:0]
	for _, p := range h.Policies {
		ok, err := p.matches(r)
		if err != nil {
			return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("rate_limit: policy %s: matching: %w", p.Name, err))
		}
		if !ok {
			continue
		}
		policies = append(policies, p)
		key := p.fixedKey
		if key == "" {
			key = p.storageKey(h.hasher, p.key(r, repl))
		}
		reqs = append(reqs, bucketRequest{
			key:    key,
			limit:  p.limit,
			cost:   p.cost(r, repl),
			shadow: p.shadow,
		})
	}
	if len(reqs) == 0 {
		return next.ServeHTTP(w, r)
	}
	o := outcomeOf(r, repl)
	// A policy with `wait` may reserve a future slot only while it has room
	// to hold the request until then.
	var hbuf [4]int
	held := hbuf[:0]
	for i, p := range policies {
		if p.hold() {
			reqs[i].wait = p.waitUS
			held = append(held, i)
		}
	}

	d, err := h.store.decide(r.Context(), reqs)
	if err != nil {
		for _, i := range held {
			policies[i].release()
		}
		h.warnStoreFailure(err)
		return h.serveWithoutStore(w, r, next, o, policies, reqs)
	}
	count(policies, d, outcomeAllowed, outcomeDenied)
	if !d.admitted {
		for _, i := range held {
			policies[i].release()
		}
		return h.deny(w, o, policies, d, outcomeDenied)
	}
	outcome := outcomeAllowed
	for i, v := range d.verdicts {
		if !v.allowed {
			outcome = outcomeShadowDenied
			h.logger.Debug("shadow policy would deny", zap.String("policy", policies[i].Name))
		}
	}
	if d.delay > 0 {
		outcome = outcomeDelayed
	}
	h.report(w, o, policies, d, outcome, 0)
	if !h.holdForSlot(r, policies, held, d) {
		return nil // the client went away; its slot stays consumed
	}
	return next.ServeHTTP(w, r)
}

// holdForSlot holds an admitted request until the slot it reserved, and
// frees the places it took in its policies. It returns false when the
// client went away first.
func (h *Handler) holdForSlot(r *http.Request, policies []*Policy, held []int, d decision) bool {
	var waiting []*Policy
	for _, i := range held {
		if d.verdicts[i].delay > 0 {
			waiting = append(waiting, policies[i])
			policies[i].waiting.Inc()
		} else {
			policies[i].release()
		}
	}
	if len(waiting) == 0 {
		return true
	}
	defer func() {
		for _, p := range waiting {
			p.waiting.Dec()
			p.release()
		}
	}()
	timer := time.NewTimer(time.Duration(d.delay) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// serveWithoutStore applies each policy's on_error when Redis could not
// decide: one fail_closed policy answers 503 for the request; local
// policies are decided by in-process buckets; fail_open policies admit.
func (h *Handler) serveWithoutStore(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, o *requestOutcome, policies []*Policy, reqs []bucketRequest) error {
	var local []bucketRequest
	var localPolicies []*Policy
	for i, p := range policies {
		switch {
		case p.onError == failClosed && !p.shadow:
			p.decisions[outcomeFailClosed].Inc()
			ra := retryAfter(time.Second.Microseconds(), h.jitter)
			*o = requestOutcome{decision: outcomeFailClosed, policy: p.Name, remaining: -1, retryAfter: ra}
			w.Header().Set("Retry-After", strconv.FormatInt(ra, 10))
			return writeProblem(w, reducedCapacity())
		case p.onError == failLocal:
			local = append(local, h.localRequest(reqs[i]))
			localPolicies = append(localPolicies, p)
		}
	}
	d := decision{admitted: true}
	outcome := outcomeFailOpen
	if len(local) > 0 {
		d, _ = processMemory.decide(r.Context(), local)
		count(localPolicies, d, outcomeLocalAllowed, outcomeLocalDenied)
		if !d.admitted {
			return h.deny(w, o, localPolicies, d, outcomeLocalDenied)
		}
		outcome = outcomeLocalAllowed
	}
	for _, p := range policies {
		if p.onError != failLocal {
			p.decisions[outcomeFailOpen].Inc()
		}
	}
	h.report(w, o, localPolicies, d, outcome, 0)
	return next.ServeHTTP(w, r)
}

// localRequest is a policy's request to its in-process fallback bucket,
// which holds 1/instances of the policy's budget. It never waits: while
// Redis is away, a request that does not fit now is denied.
func (h *Handler) localRequest(rq bucketRequest) bucketRequest {
	rq.wait = 0
	if n := int64(h.Instances); n > 1 {
		rq.limit.interval = min(rq.limit.interval, maxBucketSpan/n) * n
		rq.limit.burst = max(1, rq.limit.burst/n)
	}
	return rq
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
		case !v.allowed:
			policies[i].decisions[denied].Inc()
		case d.admitted && v.delay > 0:
			policies[i].decisions[outcomeDelayed].Inc()
		case d.admitted:
			policies[i].decisions[allowed].Inc()
		}
	}
}

// deny writes the 429 response of a denied request.
func (h *Handler) deny(w http.ResponseWriter, o *requestOutcome, policies []*Policy, d decision, outcome outcome) error {
	var violated []string
	var wait int64
	var denier *Policy // the last policy that denied
	for i, v := range d.verdicts {
		if v.allowed || policies[i].shadow {
			continue
		}
		denier = policies[i]
		violated = append(violated, policies[i].Name)
		if v.wait == neverWait || wait == neverWait {
			wait = neverWait
		} else {
			wait = max(wait, v.wait)
		}
	}
	var ra int64
	if wait != neverWait {
		ra = retryAfter(wait, h.jitter)
		w.Header().Set("Retry-After", strconv.FormatInt(ra, 10))
	}
	h.report(w, o, policies, d, outcome, ra)
	if ce := h.logger.Check(zap.DebugLevel, "rate limit exceeded"); ce != nil {
		ce.Write(zap.Strings("policies", violated), zap.Int64("retry_after", ra))
	}
	if len(violated) == 1 {
		return writeProblemBody(w, http.StatusTooManyRequests, denier.deniedBody)
	}
	return writeProblem(w, quotaExceeded(violated))
}

// report sets the placeholders and the RateLimit fields. Every placeholder
// is set (possibly empty), so access logs never show a raw placeholder.
func (h *Handler) report(w http.ResponseWriter, o *requestOutcome, policies []*Policy, d decision, outcome outcome, retryAfter int64) {
	o.decision, o.retryAfter, o.policy, o.remaining = outcome, retryAfter, "", -1
	// The tightest enforced policy; among shadow ones only when no policy is
	// enforced, so a dry run still says which policy would deny.
	tightest, enforced := -1, false
	for i, v := range d.verdicts {
		e := !policies[i].shadow
		if tightest < 0 || e && !enforced || e == enforced && tighter(v, d.verdicts[tightest]) {
			tightest, enforced = i, e
		}
	}
	if tightest < 0 { // fail_open: nothing was decided
		return
	}
	o.policy, o.remaining = policies[tightest].Name, d.verdicts[tightest].remaining
	if !h.headers || !enforced { // shadow policies never show in responses
		return
	}
	// Most requests match every policy: their RateLimit-Policy is fixed.
	var pbuf, lbuf [256]byte
	pol, lim := pbuf[:0], lbuf[:0]
	all := len(d.verdicts) == len(h.Policies) && h.allPolicyHdr != ""
	for i, v := range d.verdicts {
		if policies[i].shadow {
			continue
		}
		if len(lim) > 0 {
			pol = append(pol, ", "...)
			lim = append(lim, ", "...)
		}
		if !all {
			pol = append(pol, policies[i].policyHdr...)
		}
		lim = limitMember(lim, policies[i].Name, v.remaining, v.wait)
	}
	policyHdr := h.allPolicyHdr
	if !all {
		policyHdr = string(pol)
	}
	hdr := w.Header()
	hdr["Ratelimit-Policy"] = []string{policyHdr}
	hdr["Ratelimit"] = []string{string(lim)}
}

// tighter orders verdicts for {http.rate_limit.policy}: a denial before an
// admission, then the longer wait, then the fewer tokens left.
func tighter(a, b verdict) bool {
	if a.allowed != b.allowed {
		return !a.allowed
	}
	if !a.allowed {
		return a.wait == neverWait || (b.wait != neverWait && a.wait > b.wait)
	}
	return a.remaining < b.remaining
}

// warnStoreFailure logs a store failure at most once every 10 seconds:
// when Redis is down every request fails the same way.
func (h *Handler) warnStoreFailure(err error) {
	if errors.Is(err, errCircuitOpen) { // the breaker logs its own transitions
		return
	}
	now := time.Now().UnixNano()
	last := h.lastWarn.Load()
	if now-last < int64(10*time.Second) || !h.lastWarn.CompareAndSwap(last, now) {
		return
	}
	h.logger.Warn("rate limit store unavailable; policies follow on_error", zap.Error(err))
}
