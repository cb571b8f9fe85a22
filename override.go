package ratelimit

import (
	"strconv"
	"strings"
)

// Overrides: one identity's limit, set by an operator, in place of the
// limit its plan (or its policy) gives it. An override is stored beside the
// identity's bucket, under the same hash and in the same Redis Cluster hash slot
// (<key_prefix><policy>:{<hash>}:override), and read by the same script call
// that decides: a bucket whose request has the overridable bit reads its
// override key and, when an override of its kind is there, is decided under
// the override's limit instead of the one sent, which the reply carries
// back so that Go computes the verdict (tokens left, waits) under it. Like
// a plan change, an override keeps the bucket's state (rebase).
//
// The bit costs a GET per bucket, so it is set only for the buckets that
// may have one: each instance keeps, per policy, the keys the store's
// index of overrides lists (see override_store.go). A policy without any
// pays nothing for the feature; one with overrides pays for its overridden
// identities' requests only.
//
// This file is the functional core: the stored value, and the limit an
// override gives a bucket, which lua/decide.lua computes the same way.
//
// The release before this one (v0.2) has no overrides: it never sets the
// bit nor reads an override key, and its configs, which have no plans nor
// overrides, never meet one. An instance of it on the same Redis decides a
// bucket under its own config's limit, as across a reload.

// override is an override's limit as the script reads it.
type override struct {
	kind     byte  // overrideRate, overrideSlots or overrideQuota
	interval int64 // µs per token (rate)
	burst    int64 // capacity in tokens, slots, or a quota's N
}

// Override kinds, in the stored value.
const (
	overrideRate  = 'r'
	overrideSlots = 'c'
	overrideQuota = 'q'
)

// overrideTag starts every override value: a format of its own, which no
// bucket value (digits and a colon) has.
const overrideTag = "o1 "

// encode is the override's stored value: "o1 r <interval> <burst>",
// "o1 c 0 <slots>" or "o1 q 0 <N>".
func (o override) encode() string {
	return overrideTag + string(o.kind) + " " + strconv.FormatInt(o.interval, 10) + " " + strconv.FormatInt(o.burst, 10)
}

// decodeOverride reads a stored override; ok is false for a value that is
// not one (the script then ignores it, as it does here).
func decodeOverride(v string) (o override, ok bool) {
	rest, found := strings.CutPrefix(v, overrideTag)
	if !found || len(rest) < 2 || rest[1] != ' ' {
		return override{}, false
	}
	a, b, found := strings.Cut(rest[2:], " ")
	if !found {
		return override{}, false
	}
	interval, ok1 := digits(a)
	burst, ok2 := digits(b)
	o = override{kind: rest[0], interval: interval, burst: burst}
	return o, ok1 && ok2 && o.valid()
}

// digits parses 1 to 16 decimal digits (an integer below 2^53, which Lua
// holds exactly).
func digits(s string) (int64, bool) {
	if len(s) == 0 || len(s) > 16 {
		return 0, false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '9' {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	return n, err == nil
}

// valid reports whether the override is one a bucket can be decided under:
// a rate's burst × interval within maxBucketSpan, slots or a quota's N
// from one to below 2^53 (16 digits above it, which a Lua double rounds
// down to 2^53, must not pass there as 2^53).
func (o override) valid() bool {
	switch o.kind {
	case overrideRate:
		return o.interval >= 1 && o.burst >= 1 && o.burst <= maxBucketSpan/o.interval
	case overrideSlots, overrideQuota:
		return o.burst >= 1 && o.burst < maxJSONInteger
	}
	return false
}

// limitFor is the limit a bucket is decided under when o is the override in
// force and sent the limit its request carries: a rate override's interval
// and burst, with the slack the policy's rule gives them (waitUS for
// `wait` and hot keys' blocks, see Policy.reach, and debt tokens: debt itself when debt >= 0, -debt × burst
// otherwise), at most what keeps tau + slack within maxBucketSpan; a slots
// override's count, the lease unchanged. An override of another kind than
// the bucket's leaves sent as it is.
func (o override) limitFor(sent limit, slots bool, waitUS, debt int64) limit {
	switch {
	case slots && o.kind == overrideSlots:
		return limit{interval: sent.interval, burst: o.burst, slack: sent.slack}
	case slots || o.kind != overrideRate:
		return sent
	}
	tokens := debt
	if debt < 0 {
		tokens = -debt * o.burst
	}
	room := maxBucketSpan - o.interval*o.burst
	slack := room
	if waitUS < room && tokens <= (room-waitUS)/o.interval {
		slack = waitUS + tokens*o.interval
	}
	return limit{interval: o.interval, burst: o.burst, slack: slack}
}

// quotaLimitFor is the limit a quota bucket is decided under when o is the
// override in force and sent the limit its request carries: a quota
// override's N, with the room beyond it the policy's debt rule gives a
// settle (debt units when debt >= 0, -debt × N otherwise), at most what
// keeps N + slack within 2^53 (as checkQuota); any other kind leaves sent
// as it is.
func (o override) quotaLimitFor(sent limit, debt int64) limit {
	if o.kind != overrideQuota {
		return sent
	}
	units := debt
	if debt < 0 {
		units = -debt * o.burst
	}
	return limit{burst: o.burst, slack: min(units, maxJSONInteger-o.burst)}
}

// ownCopy is out, or a copy of reqs when out is still reqs: the requests
// a store decides under changed limits or costs, without writing over the
// caller's.
func ownCopy(out, reqs []bucketRequest) []bucketRequest {
	if &out[0] == &reqs[0] {
		return append([]bucketRequest(nil), reqs...)
	}
	return out
}

// debtRule is the policy's rule for the debt of an override's limit (see
// limitFor): a rate policy's settle may owe the tokens it owes under its
// own limit (debt.go); a quota's, twice the override's N by default (-2),
// or its own `debt`.
func (p *Policy) debtRule() int64 {
	switch {
	case p.charging() != chargedBySettle:
		return 0
	case p.kind == kindQuota && p.Settle.Debt == 0:
		return -2
	}
	return p.after.debt
}

// markOverridable sets the overridable bit of the policy's bucket request
// when the store may hold overrides of the policy (always, for the admin
// API, which shows the override in force), with the policy's slack rule.
func (p *Policy) markOverridable(rq *bucketRequest, always bool) {
	if !always && (p.overrides == nil || !p.overrides.may(rq.key)) {
		return
	}
	rq.overridable, rq.overrideWait, rq.overrideDebt = true, p.hot.reach, p.debtRule()
}

// applyOverride is rq as decided under the override o in force (see
// limitFor, quotaLimitFor).
func (rq bucketRequest) applyOverride(o override) bucketRequest {
	if rq.kind() == quotaBucket {
		rq.limit = o.quotaLimitFor(rq.limit, rq.overrideDebt)
		return rq
	}
	rq.limit = o.limitFor(rq.limit, rq.kind() == slotsBucket, rq.overrideWait, rq.overrideDebt)
	return rq
}

// decidedLimit is the limit the part's bucket was decided under: an
// override's when one was in force, or the policy's (its plan's), as
// configured (a `local` bucket holds a share of it).
func (pt *part) decidedLimit() limit {
	if pt.overridden() {
		return pt.v.limit
	}
	return pt.policy.limit
}

// decidedQuota is the N the part's quota bucket was decided under: an
// override's when one was in force, or the one sent (its plan's, or a
// `local` share of it).
func (pt *part) decidedQuota() int64 {
	if pt.overridden() {
		return pt.v.limit.burst
	}
	return pt.rq.limit.burst
}

// overridden reports whether the part's bucket was decided under an
// override: a limit other than the one sent.
func (pt *part) overridden() bool {
	return pt.v.limit != pt.rq.limit && pt.v.limit != (limit{})
}

// overridden reports whether a bucket of the decision was decided under an
// override, whose RateLimit-Policy member is not the policy's.
func (res *admission) overridden() bool {
	for _, pt := range res.decidedParts() {
		if pt.overridden() {
			return true
		}
	}
	return false
}

// appendPolicyMember appends the RateLimit-Policy member of the part's
// bucket: the policy's (its plan's), or, under an override, the override's
// limit per the policy's window, and its burst (`burst`) when it is not the
// policy's: the limit in force, of which a burst is part (a concurrency
// policy's: its slots).
func (pt *part) appendPolicyMember(b []byte) []byte {
	p, l := pt.policy, pt.decidedLimit()
	if l == p.limit {
		return append(b, p.policyHdr...)
	}
	if p.kind == kindConcurrent {
		return slotsMember(b, p.Name, l.burst)
	}
	_, w := fieldQuota(p.rate.n, p.rate.per)
	b = policyMember(b, p.Name, min(w*1_000_000/l.interval, maxSFInteger), w, p.unit)
	if l.burst != p.limit.burst {
		b = append(b, ";burst="...)
		b = strconv.AppendInt(b, min(l.burst, maxSFInteger), 10)
	}
	return b
}
