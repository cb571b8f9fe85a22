package ratelimit

import "time"

// What a settle may owe. Usage above a request's reservation is charged as
// debt: the bucket's TAT runs past a full refill, and the key is denied
// until the rate has paid it back. A wave of requests in flight may use far
// more than they reserved (input the body does not show, dense prompts), so
// the debt is kept in full, not forgiven at a small multiple of the burst:
// over any window a key's settled usage is at most burst + rate × window +
// the excess of one wave in flight, which it then pays back. Two bounds
// keep a broken upstream (the upstream is trusted; a bug may still report
// an absurd usage) from locking a key for ever: the debt a key may owe, by
// default what the rate refills in debtWindow, and the usage one response
// settles (`settle ... max`), by default all of it.

// debtWindow is how long, by default, the debt a rate policy's key may owe
// takes to pay back: the longest a broken upstream can lock a key out.
const debtWindow = 24 * time.Hour

// settleLimits are a settle's cap on one response's usage and on the debt a
// bucket may owe beyond empty, for a bucket of burst tokens refilled one
// every interval µs, of which room may be owed (what keeps its TAT within
// maxBucketSpan). A quota (interval 0) of burst units owes by default
// twice its N within a period, which starts again from 0.
func (s *Settle) settleLimits(burst, interval, room int64) (usageCap, debt int64, err error) {
	debt = s.debt
	switch {
	case debt > room:
		return 0, 0, fieldErr("settle", "settle: debt %s takes too long to pay back: at most %s", s.unit.number(debt), s.unit.number(room))
	case debt == 0 && interval == 0:
		debt = min(2*burst, room)
	case debt == 0:
		debt = min(max(2*burst, int64(debtWindow/time.Microsecond)/interval), room)
	}
	usageCap = s.max
	if usageCap == 0 {
		usageCap = burst + debt // a usage beyond what empties a full bucket and owes all the debt changes nothing
	}
	return usageCap, debt, nil
}

// maxAboveCapacity is the error of a `cost ... max` above what the bucket
// holds (a burst, a quota's N): a request charged max (a cost that does
// not resolve, an LLM body that does not say or hides input) could never
// pass, and would be denied without a Retry-After, for ever.
func maxAboveCapacity(u unit, maxCost int64, what string, capacity int64) error {
	return fieldErr("max_cost", "cost: max %s is more than the %s %s: a request charged max (a cost that does not resolve, "+
		"an LLM request whose body does not say, or hides input) could never pass; lower max or raise the %s",
		u.number(maxCost), what, u.number(capacity), what)
}
