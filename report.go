package ratelimit

import "net/http"

// What a decision tells: the placeholders (set in one place, decidedAs)
// and the RateLimit fields (set in one place, writeFields), when the
// request is decided and again when a response charged after it updates
// them.

// decidedAs sets the placeholders of the request's decision: its outcome,
// the policy that tells it and that policy's storage key, the whole tokens
// that policy has left (-1: nothing to tell) and the Retry-After sent.
func (rs *requestState) decidedAs(o outcome, policy, key string, remaining, retryAfter int64) {
	rs.decided, rs.outcome, rs.policy, rs.key, rs.remaining, rs.retryAfter = true, o, policy, key, remaining, retryAfter
}

// report sets the placeholders and the RateLimit fields. Every placeholder
// is set (possibly empty), so access logs never show a raw placeholder. A
// request that passed through rate_limit handlers before keeps their
// fields: this one's members are added.
func (h *Handler) report(w http.ResponseWriter, rs *requestState, res *admission, retryAfter int64) {
	res.outerPolicyField, res.outerLimitField = rs.policyField, rs.limitField
	if len(res.d.verdicts) == len(h.Policies) {
		res.allPolicyField = h.allPolicyHdr // every policy matched
	}
	if enforced := res.setPlaceholders(rs, retryAfter); enforced && h.headers {
		res.writeFields(w.Header(), rs, false)
		res.fieldsSent = true
	}
}

// setPlaceholders sets the placeholders from the decision, and reports
// whether an enforced (not shadow) policy took part in it.
func (res *admission) setPlaceholders(rs *requestState, retryAfter int64) (enforced bool) {
	// The tightest enforced policy; among shadow ones only when no policy is
	// enforced, so a dry run still says which policy would deny.
	var tightest *part
	for _, pt := range res.decidedParts() {
		if pt.v.allowed && pt.policy.kind == kindShed {
			continue // the service's capacity, not a budget left to the caller
		}
		e := !pt.policy.shadow
		// The first verdict; else an enforced one over a shadow one; else,
		// between two alike, the tighter.
		if tightest == nil || (e && !enforced) || (e == enforced && tighter(pt.v, tightest.v)) {
			tightest, enforced = pt, e
		}
	}
	if tightest == nil { // fail_open: nothing was decided
		rs.decidedAs(res.outcome, "", "", -1, retryAfter)
		return false
	}
	rs.decidedAs(res.outcome, tightest.policy.Name, tightest.rq.key, max(0, tightest.v.remaining), retryAfter)
	return enforced
}

// writeFields sets RateLimit-Policy and RateLimit: the members of the
// handlers the request passed before, then this one's enforced policies.
// With charged, a policy charged after the response reports what its
// bucket holds once this response's own charge is made, as far as it is
// known when the headers are written.
func (res *admission) writeFields(hdr http.Header, rs *requestState, charged bool) {
	// Most requests match every policy: their RateLimit-Policy is fixed.
	var pbuf, lbuf [256]byte
	pol, lim := pbuf[:0], lbuf[:0]
	all := res.allPolicyField != "" && res.outerPolicyField == "" && !res.overridden()
	if res.outerPolicyField != "" {
		pol, lim = append(pol, res.outerPolicyField...), append(lim, res.outerLimitField...)
	}
	for i, pt := range res.decidedParts() {
		p, v := pt.policy, pt.v
		if p.shadow || p.kind == kindShed { // see docs/load-shedding.md: no caller's budget
			continue
		}
		if len(lim) > 0 {
			pol = append(pol, ", "...)
			lim = append(lim, ", "...)
		}
		if !all {
			if q := pt.rq.quota; q != nil {
				pol = append(pol, q.policyMember(pt.decidedQuota(), v.period)...)
			} else {
				pol = pt.appendPolicyMember(pol)
			}
		}
		remaining, until := v.remaining, v.untilFits
		if charged {
			remaining, until = res.predicted(i)
		}
		if pt.rq.kind() == quotaBucket {
			until = v.untilFits // a quota's t is its boundary's, charged or not
		}
		if p.kind == kindConcurrent {
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
		policyField, both = res.allPolicyField, string(lim)
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
