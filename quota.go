package ratelimit

import (
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// Quotas: how much over a calendar period. A quota policy counts the units
// a key used in the current period of its calendar (internal/calendar), and a
// request of cost k is admitted iff used + k <= N, all-or-nothing with the
// request's other buckets. At the boundary usage starts again from 0, on
// every instance at the same instant, with no job or timer anywhere: a
// stored count records the period it belongs to, and a count of another
// period reads as 0.
//
// Redis has no time zones, so Go computes the period boundaries around its
// own clock (four of them: the period holding now, the one before and the
// one after) and the script picks, on Redis TIME, the period it is in. Two
// instances whose clocks disagree by less than a period therefore agree on
// the period: Redis's clock decides. A Redis clock outside the four bounds
// disagrees with this instance's by more than a period: that request fails
// (its policies' on_error), counted as store error kind "clock".
//
// This file is the Go reference of the quota's arithmetic, bucket by
// bucket, as decideBuckets applies it; lua/decide.lua (codes 12 and up) is
// the same, and TestLuaMatchesGoQuota holds the two together. A quota
// bucket is a bucketRequest whose quota is set: its op is one of the rate
// verbs (take, check, adjust, inspect, reset), its limit.burst is N (the
// quota's limit: a plan or an override replaces it there, as it replaces a
// rate's), its limit.slack the most a settle may charge beyond N, and its
// limit.interval unused (0).

// quotaSpec is what a quota policy's bucket requests carry beside their
// limit: where its periods come from and what confirms its decisions. It is
// shared by every request of the policy and never changes once provisioned.
type quotaSpec struct {
	periods periodSource
	unit    calendar.Unit
	loc     *time.Location
	durable durability
	// member is the policy's RateLimit-Policy member for the period last
	// shown: q is fixed, but w is the period's length, which months and
	// days across a daylight-saving change do not share. counts is the
	// policy's unit (its member's qu).
	name   string
	counts unit
	member atomic.Pointer[quotaMember]
	// used observes the share of the quota each decision found used
	// (caddy_rate_limit_quota_used_ratio).
	used prometheus.Observer
}

// periodSource gives a quota's bounds around an instant: a calendar, or in
// tests bounds placed anywhere.
type periodSource interface {
	Bounds(t time.Time) calendar.Bounds
}

// durability is what a quota's admissions wait for before they count:
// `durable replicas <n>` (WAIT) and/or `durable aof` (WAITAOF). See
// durable.go.
type durability struct {
	replicas int
	aof      bool
}

func (d durability) wanted() bool { return d.replicas > 0 || d.aof }

// periodAt is the period holding nowUS, as the script picks it from the
// bounds around it; false when nowUS is outside them (never for a
// calendar, whose bounds are taken around nowUS itself).
func (q *quotaSpec) periodAt(nowUS int64) (calendar.Period, bool) {
	b := q.periods.Bounds(time.UnixMicro(nowUS))
	i, ok := b.Pick(nowUS)
	if !ok {
		return calendar.Period{}, false
	}
	return b.Period(i), true
}

// quotaFits reports whether a request of cost fits a quota of n of which
// used are used (used may exceed n after a settle's debt, or a lowered
// quota). Compared as cost <= n - used so that no sum leaves the 2^53
// range in which Lua's doubles are exact.
func quotaFits(n, used, cost int64) bool { return cost <= n-used }

// quotaAdjusted is the units used after a charge (delta > 0) or a refund or
// grant (delta < 0) made in period cur, of a charge that belongs to period
// of (zero: the current one). A charge whose period is over changes
// nothing: a new period starts at 0, whatever the last one owed. A refund
// never takes used below 0; a charge never takes it beyond n + slack (the
// most a settle may charge beyond the quota), nor lowers it.
func quotaAdjusted(used, n, slack, delta int64, of, cur calendar.Period) int64 {
	if of != (calendar.Period{}) && of != cur {
		return used
	}
	next := used + delta
	if delta > 0 {
		next = min(next, max(used, n+slack))
	}
	return max(next, 0)
}

// decideQuota is a quota bucket's part of decideBuckets, once admitted says
// whether the request is admitted: it fills in the bucket's verdict (units
// left, the µs to the period's end, the period) and returns the units used
// once the decision is applied. used is the bucket's count in the period
// holding now (0 when it holds another period's).
func decideQuota(v *verdict, used, now int64, rq bucketRequest, admitted bool) int64 {
	p, _ := rq.quota.periodAt(now)
	n := rq.limit.burst
	next := used
	switch {
	case rq.op == opTake && admitted && v.allowed:
		next = used + rq.cost
	case rq.op == opAdjust:
		next = quotaAdjusted(used, n, rq.limit.slack, rq.delta, rq.period, p)
	case rq.op == opReset:
		next = 0
	}
	v.remaining, v.untilFits, v.period = n-next, p.End-now, p
	if !v.allowed && rq.cost > n {
		v.untilFits = neverFits // no period is long enough
	}
	return next
}

// quotaAdmits is a quota bucket's say in the admission (decideBuckets'
// first pass): whether its cost fits what the period has left.
func quotaAdmits(used int64, rq bucketRequest) bool {
	if !rq.op.admits() {
		return true
	}
	return quotaFits(rq.limit.burst, used, rq.cost)
}

// notePeriods records, in each quota bucket request, the period its
// decision counted it in: a charge after the response (settle, charge_if)
// belongs to that period, and is dropped if it is over by then.
func notePeriods(reqs []bucketRequest, d decision) {
	for i := range reqs {
		if reqs[i].quota != nil && i < len(d.verdicts) {
			reqs[i].period = d.verdicts[i].period
			observeQuotaUsed(reqs[i].quota.used, d.verdicts[i], reqs[i])
		}
	}
}

// What Redis holds for a quota: "q:<start>:<end>:<used>", the period's
// bounds in Unix µs and the units used in it (44 bytes or less, which Redis
// keeps in the key's object, up to 99,999,999 used), under <key_prefix><policy>:{<hash>} like any bucket, with a
// TTL that ends quotaKeyMargin after the period. Its tag sets it apart from
// every rate format (format.go: all digits, or "<tat>:<interval>"), and the
// release before this one (v0.2) reads it as a rate bucket whose TAT is not
// a number: a corrupt bucket, which never admits. v0.2 never reads a quota
// key anyway: its configs have no quota policies, and a key is named by its
// policy. A rate bucket found under a quota's key (an earlier config gave
// the name to a rate policy) is replaced, as are concurrency slots; and the
// rate reader replaces a quota's count.

// quotaKeyMargin is how long a quota's key outlives its period. A count of
// a past period reads as 0 whether or not its key is still there; the
// margin only keeps TTLs, whole milliseconds counted from the call's start
// on Redis's clock, from ever ending before the period.
const quotaKeyMargin = time.Second

// encodeQuota is a quota count as the script stores it.
func encodeQuota(p calendar.Period, used int64) string {
	return "q:" + strconv.FormatInt(p.Start, 10) + ":" + strconv.FormatInt(p.End, 10) + ":" + strconv.FormatInt(used, 10)
}

// decodeQuota reads a stored quota count; ok is false for a value that is
// not one.
func decodeQuota(v string) (p calendar.Period, used int64, ok bool) {
	rest, found := strings.CutPrefix(v, "q:")
	if !found {
		return calendar.Period{}, 0, false
	}
	f := strings.Split(rest, ":")
	if len(f) != 3 {
		return calendar.Period{}, 0, false
	}
	var n [3]int64
	for i, s := range f {
		x, err := strconv.ParseInt(s, 10, 64)
		if err != nil || x < 0 || strings.HasPrefix(s, "+") {
			return calendar.Period{}, 0, false
		}
		n[i] = x
	}
	return calendar.Period{Start: n[0], End: n[1]}, n[2], true
}

// The HTTP side of a quota.

// quotaMember is a cached RateLimit-Policy member, for one quota and period.
type quotaMember struct {
	n      int64
	p      calendar.Period
	member []byte
}

// policyMember is the RateLimit-Policy member of a quota of n units in
// period p: "name";q=n;w=<p's length in seconds>, built once a period.
func (q *quotaSpec) policyMember(n int64, p calendar.Period) []byte {
	if m := q.member.Load(); m != nil && m.p == p && m.n == n {
		return m.member
	}
	m := &quotaMember{n: n, p: p, member: policyMember(nil, q.name, min(n, maxSFInteger), min(p.Seconds(), maxSFInteger), q.counts)}
	q.member.Store(m)
	return m.member
}

// maxBoundarySpread bounds how far past a quota's boundary Retry-After
// sends the clients it denied.
const maxBoundarySpread = time.Hour

// boundarySpread is how far past its boundary a quota spreads the return
// of the clients it denied: jitter of the period's length (a minute's 12 s
// at 20%), at most maxBoundarySpread. Of the period rather than of each
// client's wait: clients denied in the period's last second would
// otherwise all come back in the next one's first.
func boundarySpread(p calendar.Period, jitter float64) int64 {
	return min(int64(float64(p.End-p.Start)*jitter), maxBoundarySpread.Microseconds())
}

func init() {
	errorFixes["clock"] = "Redis's clock and this instance's are more than a quota's period apart (a minute for quota N/minute): synchronise both with NTP; until then the requests of quota policies follow on_error"
}
