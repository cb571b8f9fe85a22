package ratelimit

import (
	"math"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// The token bucket, stored GCRA-style as one number per bucket: the
// theoretical arrival time (TAT), in integer microseconds. A bucket of
// capacity burst that gains one token every interval µs holds
// (now + burst·interval − TAT) / interval tokens, capped at burst; a request
// of cost k takes k tokens by moving TAT forward k·interval. A TAT in the
// past is a full bucket, as is a missing one (TAT 0).
//
// A bucket is stored with the interval its TAT was written under, and read
// against the limit of the current config (rebase): what it keeps across a
// change of limit is the tokens it owes, not the time until it is full.
//
// Everything is integer arithmetic on values below 2^53 (and one float64
// expression that Lua evaluates the same way), so the Lua script computes
// bit-for-bit what this file computes. lua/decide.lua is the same
// algorithm; lua_test.go holds them to it.

// maxBucketSpan bounds burst·interval (and so every TAT offset) well inside
// the 2^53 range in which a double holds every integer exactly, even when
// added to a Unix time in µs (≈1.8e15).
const maxBucketSpan = 1 << 51

// neverFits is the wait of a request whose cost exceeds the bucket's
// capacity: no amount of waiting lets it pass.
const neverFits = -1

// limit is a bucket's shape under the current config.
type limit struct {
	interval int64 // µs per token
	burst    int64 // capacity in tokens
	// slack is how far, in µs, a TAT may run beyond a full refill (tau):
	// turns reserved by `wait`, and debt from charges made after the
	// response. A stored state beyond tau + slack is read as tau + slack.
	slack int64
}

// tau is the time the bucket takes to refill from empty, in µs.
func (l limit) tau() int64 { return l.interval * l.burst }

// bucketOp is what a bucketRequest does to its bucket.
type bucketOp int8

const (
	// opTake admits the request when its cost fits (now, or within its
	// wait: a reserved turn) and charges it if the request is admitted.
	opTake bucketOp = iota + 1
	// opCheck admits the request when its cost fits, and charges nothing:
	// `charge_if` charges once the response is known.
	opCheck
	// opAdjust charges delta tokens (possibly into debt, at most slack) or
	// gives -delta back (never beyond a full bucket), whatever the bucket
	// holds: charges after the response, refunds, grants.
	opAdjust
	// opInspect reads the bucket.
	opInspect
	// opReset makes the bucket full.
	opReset
	// opAcquire takes one of a concurrency policy's slots (a lease timed by
	// the store's clock) when one is free and the request is admitted.
	opAcquire
	// opRelease frees the request's slot; opRenew extends its lease, when
	// it is still held.
	opRelease
	opRenew
	// opCount reads the slots held; opFree frees those not renewed lately
	// (stale), keeping the leases of running requests.
	opCount
	opFree
	// opRestore puts back the lease of a running request that the store
	// lost (a flush, a failover).
	opRestore
)

// admits reports whether the op takes part in an admission decision.
func (op bucketOp) admits() bool { return op == opTake || op == opCheck || op == opAcquire }

// slots reports whether the op is on a concurrency policy's slots.
func (op bucketOp) slots() bool { return op >= opAcquire && op <= opRestore }

// bucketKind is the kind of bucket a request is to: a rate's (a TAT, this
// file), a quota's (the units used in a period, quota.go) or a concurrency
// policy's slots (leases, slots.go). The script (lua/decide.lua) and the
// in-process store (decideBuckets) each decide a kind in one place.
type bucketKind uint8

const (
	rateBucket bucketKind = iota
	quotaBucket
	slotsBucket
)

// kind is the kind of bucket the request is to: a quota's when it carries
// a quota, slots when its op is a slot's, a rate's otherwise.
func (rq *bucketRequest) kind() bucketKind {
	switch {
	case rq.quota != nil:
		return quotaBucket
	case rq.op.slots():
		return slotsBucket
	}
	return rateBucket
}

// bucketRequest is one operation on one bucket.
type bucketRequest struct {
	key   string // storage key (see key.go)
	limit limit
	op    bucketOp
	// cost: tokens the request needs (opTake, opCheck).
	cost int64
	// delta: tokens opAdjust charges (> 0) or gives back (< 0); for
	// opFree, the µs a lease must have left to be kept.
	delta int64
	// due, for an opAdjust that gives tokens back: the store's µs at which
	// the last of them is due (the TAT the take of them left, verdict.due).
	// Only those still due when the store applies it go back: the bucket
	// has refilled through the others, and giving them back would hand them
	// out twice. 0: all of them (a grant). Negative, -due: a hot key's
	// block (hotkeys_store.go), given back only while no token was taken
	// after its own, as blocks held elsewhere are spent on the schedule of
	// the TAT they were taken at (see givenBack).
	due int64
	// shadow: decided apart; never changes whether the request is admitted.
	shadow bool
	// overridable: the store may hold an operator's override of this
	// bucket's limit, which the store reads in the same decision.
	overridable bool
	// givesBack: the bucket may be given tokens back after the response
	// (settle), so what a decision said of it is not a lower bound on its
	// state: the deny cache leaves it alone.
	givesBack bool
	// wait: µs ahead an opTake may reserve a turn (policy `wait`, while the
	// policy has room to hold the request); 0: now or never.
	wait int64
	// lease names the request's slot (opAcquire, opRelease, opRenew,
	// opRestore); events is the channel that freeing slots is announced on.
	lease, events string
	// leasesExpired counts the leases a slot op finds expired, of holders
	// that vanished (nil for rate buckets).
	leasesExpired counter
	// quota makes this a quota bucket (quota.go): its calendar and
	// durability; nil for rate buckets and slots.
	quota *quotaSpec
	// period: for a quota bucket's opAdjust, the period the charge belongs
	// to (the one its admission was counted in); zero: the current one.
	period calendar.Period
	// hot: the policy's use of hot keys (hotkeys.go), nil when off: the
	// Redis store may decide the bucket from blocks of its tokens.
	hot *hotPolicy
	// overrideWait and overrideDebt are the policy's rule for the slack of
	// an override's limit (override.limitFor), sent with an overridable
	// bucket.
	overrideWait, overrideDebt int64
	// learns: the bucket's key learns its usage (learned_usage.go): an
	// opTake is raised by what its key learned of requests of its class,
	// an opAdjust remembers record (the usage beyond asked, the request's
	// own reservation: 0 within it) in class (asked's), an opReset forgets.
	learns               bool
	asked, record, class int64
}

// counter is a metric that counts (a Prometheus counter).
type counter interface{ Add(float64) }

// verdict is one bucket's part of a decision.
type verdict struct {
	// allowed: this bucket alone would admit the request.
	allowed bool
	// remaining: whole tokens left after the decision (after charging, if
	// the request was admitted and this bucket charged); negative in debt.
	remaining int64
	// untilFits in µs: on a bucket that would deny, until the cost fits
	// (neverFits when it never can); otherwise until one more token, 0 when
	// full.
	untilFits int64
	// delay in µs: until the turn this request reserved (policy `wait`);
	// 0 when it passes now.
	delay int64
	// expired: a concurrency policy's leases the store reclaimed from
	// holders that vanished.
	expired int64
	// period: a quota bucket's period, on the store's clock (untilFits is
	// the µs to its end).
	period calendar.Period
	// limit is the limit the bucket was decided under: the request's, or
	// an operator's override of it (see override.go).
	limit limit
	// cost: the tokens a take or check was decided with (raised to what
	// its key learned, for a bucket that learns); learned: the largest
	// usage the key remembered before the request (learned_usage.go).
	cost, learned int64
	// due: for a take that charged, the store's µs at which the last token
	// it took is due (the TAT it left): what a give-back of them carries
	// (bucketRequest.due).
	due int64
}

// decision is the outcome of one request across all its buckets.
type decision struct {
	admitted bool
	now      int64 // the store's clock, µs
	delay    int64 // µs to hold an admitted request: the latest reserved turn
	verdicts []verdict
	call     callStats // the store call that made it, for its trace (tracing.go)
}

// start is the TAT from which a request is judged: a TAT in the past means a
// full bucket, which holds no more than burst tokens.
func start(tat, now int64) int64 {
	if tat < now {
		return now
	}
	return tat
}

// rebase reads a stored TAT, written when the bucket gained a token every
// storedInterval µs, against l at now: the tokens it owes are kept (a limit
// raised frees a throttled client, one lowered applies at once), but never
// more than l lets a bucket owe (burst, reserved turns and debt).
func (l limit) rebase(tat, storedInterval, now int64) int64 {
	if tat <= now {
		return tat
	}
	ahead := tat - now
	if storedInterval != l.interval && storedInterval > 0 {
		// The tokens owed, ahead/storedInterval, at the current interval,
		// rounded up: a µs rounded away at each change of limit would let
		// a token go early (found by the simulation: instances on two
		// limits during a reload read each other's writes, each rounding).
		// Lua evaluates this double expression the same way.
		ahead = int64(math.Ceil(float64(ahead) * float64(l.interval) / float64(storedInterval)))
	}
	return now + min(ahead, l.tau()+l.slack)
}

// fits reports whether cost tokens are in the bucket at now, or will be
// within wait µs, given the starting TAT base (see start).
func (l limit) fits(base, now, cost, wait int64) bool {
	return cost <= l.burst && base+cost*l.interval-now <= l.tau()+wait
}

// tokens returns the whole tokens in the bucket at now (negative when it
// owes: debt, or turns reserved beyond its capacity) and the µs until it
// holds one token more than max(n, 0), 0 when full.
func (l limit) tokens(base, now int64) (n, next int64) {
	avail := now + l.tau() - base
	if avail < 0 {
		return -((-avail + l.interval - 1) / l.interval), l.interval - avail
	}
	n = avail / l.interval
	if n >= l.burst {
		return l.burst, 0
	}
	return n, l.interval - avail%l.interval
}

// adjust is the TAT after charging delta tokens (delta > 0, into debt up to
// slack) or giving -delta back (never beyond a full bucket, which is now),
// of tokens the last of which is due at due (0: any; see givenBack).
func (l limit) adjust(tat, now, delta, due int64) int64 {
	delta = l.givenBack(delta, start(tat, now), now, due)
	next := start(tat, now) + delta*l.interval
	return max(now, min(next, now+l.tau()+l.slack))
}

// givenBack is the delta an adjust applies at now to a bucket whose TAT is
// base (start): a charge as it is; a give-back of tokens the last of which
// is due at due (0: any) only of those still due, one every interval
// before it. A token past its due was refilled by the bucket already:
// given back, it would be handed out twice, and a give-back that reached
// the store late (a long response's refund, a block's unspent tokens)
// would forgive what the window spent. A block's give-back (due < 0, its
// tokens due by -due) goes back only while its tokens end the bucket's
// line (base is -due): no token was taken after them, as a block held
// elsewhere is spent on the schedule of the TAT it was taken at, and
// moving its tokens forward in the line would let its holder and a new
// take spend the same due times; nor did the line move back since (a
// reset, a grant, another limit), which gave them back already. Lua
// evaluates the same double expression.
func (l limit) givenBack(delta, base, now, due int64) int64 {
	if delta >= 0 || due == 0 {
		return delta
	}
	if due < 0 {
		if due = -due; base != due {
			return 0 // not the end of the line: they stay, and lapse
		}
	}
	left := int64(0)
	if due > now {
		left = int64(math.Ceil(float64(due-now) / float64(l.interval)))
	}
	return -min(-delta, left)
}

// decideBuckets is the whole decision of one request, given each bucket's
// TAT at now as rebase read it (for slots, the leases held; tats is written
// over with what it returns): every
// non-shadow bucket of an admitting op must fit (a slot be free) for the
// request to be admitted; if it is, every opTake bucket that fits is
// charged and every opAcquire takes its slot. Other ops are applied
// whatever the decision. It returns the TATs to store where applied says
// the bucket changed (for slots, the leases held after).
func decideBuckets(tats []int64, now int64, reqs []bucketRequest) (decision, []int64) {
	d := decision{admitted: true, now: now, verdicts: make([]verdict, len(reqs))}
	for i := range reqs {
		rq, v := &reqs[i], &d.verdicts[i]
		v.limit = rq.limit
		switch rq.kind() {
		case quotaBucket: // tats[i]: the units used in the period
			v.allowed = quotaAdmits(tats[i], *rq)
		case slotsBucket: // tats[i]: the leases held
			v.allowed = rq.op != opAcquire || tats[i] < rq.limit.burst
		default:
			v.allowed = rateAdmits(v, tats[i], now, *rq)
		}
		if !v.allowed && !rq.shadow {
			d.admitted = false
		}
	}
	// next is tats, written over: each bucket reads only its own TAT, before
	// writing it.
	next := tats
	for i := range reqs {
		rq, v := &reqs[i], &d.verdicts[i]
		switch rq.kind() {
		case quotaBucket:
			next[i] = decideQuota(v, tats[i], now, *rq, d.admitted)
		case slotsBucket:
			next[i] = decideSlots(v, tats[i], *rq, d.admitted)
		default:
			next[i] = decideRate(&d, v, tats[i], now, *rq)
		}
	}
	return d, next
}

// rateAdmits reports whether a rate bucket whose TAT is tat admits the
// request (an op that decides nothing admits), recording the cost it is
// decided with.
func rateAdmits(v *verdict, tat, now int64, rq bucketRequest) bool {
	if !rq.op.admits() {
		return true
	}
	wait := rq.wait
	if rq.op == opCheck {
		wait = 0
	}
	v.cost = rq.cost
	return rq.limit.fits(start(tat, now), now, rq.cost, wait)
}

// decideRate applies the decision to a rate bucket whose TAT is tat: its
// next TAT, and what the verdict tells (the delay of a reserved turn, in
// d's too).
func decideRate(d *decision, v *verdict, tat, now int64, rq bucketRequest) (next int64) {
	base := start(tat, now)
	next = tat
	switch {
	case rq.op == opTake && d.admitted && v.allowed:
		base += rq.cost * rq.limit.interval
		next = base
		v.due = base
		// A turn beyond the bucket's capacity now is reserved: the
		// request is held until then.
		v.delay = max(0, base-rq.limit.tau()-now)
		d.delay = max(d.delay, v.delay)
	case rq.op == opAdjust:
		base = rq.limit.adjust(tat, now, rq.delta, rq.due)
		next = base
	case rq.op == opReset:
		base, next = now, 0
	}
	v.remaining, v.untilFits = rq.limit.tokens(base, now)
	if !v.allowed {
		v.untilFits = untilFits(rq, base, now)
	}
	return next
}

// decideSlots applies the decision to slots of which inUse are in use:
// the slots in use after, and what the verdict tells.
func decideSlots(v *verdict, inUse int64, rq bucketRequest, admitted bool) int64 {
	switch {
	case rq.op == opAcquire && admitted && v.allowed:
		inUse++
	case rq.op == opRelease:
		inUse = max(0, inUse-1)
	}
	// Free slots after the decision; a denied request waits a second, as
	// long as anyone can say.
	v.remaining = rq.limit.burst - inUse
	if !v.allowed {
		v.untilFits = slotWait
	}
	return inUse
}

// Quota buckets: the units used in the period holding now (quota.go).

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

// slotWait is the wait reported to a request denied a concurrency slot:
// slots come free when other requests end, which nobody can tell.
const slotWait = 1_000_000

// applied reports whether the decision d changed the bucket of reqs[i]:
// the store then writes next[i] under the request's limit (deleting the
// bucket when next[i] is not ahead of now: full).
func applied(reqs []bucketRequest, d decision, i int) bool {
	switch reqs[i].op {
	case opTake, opAcquire:
		return d.admitted && d.verdicts[i].allowed
	case opAdjust, opReset, opRelease, opRenew, opFree, opRestore:
		return true
	}
	return false
}

// untilFits is how long a denied request must wait until its cost fits in
// the bucket whose starting TAT is base.
func untilFits(rq bucketRequest, base, now int64) int64 {
	if rq.cost > rq.limit.burst {
		return neverFits
	}
	return base + rq.cost*rq.limit.interval - rq.limit.tau() - now
}

// callStats is what a decision knows of the store call that made it, for
// its span.
type callStats struct {
	// calls: the script calls that decided it (several across Redis
	// Cluster slots); 0 when none did (in process, or the deny cache).
	calls int
	// requests: the requests that rode the call (the largest of several),
	// decisions and work after responses: 1 when it went alone.
	requests int
	// redisUS: the call's round trip, from sending it to its reply, µs
	// (the longest of several).
	redisUS int64
	// cached: the deny cache answered, with no call; hot: blocks of hot
	// keys this instance holds answered, with no call (hotkeys_store.go).
	cached, hot bool
}

// merge adds another call's stats (a decision across slots).
func (c callStats) merge(o callStats) callStats {
	return callStats{calls: c.calls + o.calls, requests: max(c.requests, o.requests), redisUS: max(c.redisUS, o.redisUS), cached: c.cached && o.cached, hot: c.hot && o.hot}
}
