package ratelimit

// The token bucket, stored GCRA-style as one number per bucket: the
// theoretical arrival time (TAT), in integer microseconds. A bucket of
// capacity burst that gains one token every interval µs holds
// (now + burst·interval − TAT) / interval tokens, capped at burst; a request
// of cost k takes k tokens by moving TAT forward k·interval.
//
// Everything is integer arithmetic on values below 2^53, so the Lua script
// (whose numbers are doubles) computes bit-for-bit what this file computes.
// lua/decide.lua is the same algorithm; bucket_lua_test.go holds them to it.

// maxBucketSpan bounds burst·interval (and so every TAT offset) well inside
// the 2^53 range in which a double holds every integer exactly, even when
// added to a Unix time in µs (≈1.8e15).
const maxBucketSpan = 1 << 51

// neverWait is the wait of a request whose cost exceeds the bucket's
// capacity: no amount of waiting lets it pass.
const neverWait = -1

// limit is a bucket's shape: one token every interval µs, at most burst.
type limit struct {
	interval int64 // µs per token
	burst    int64 // capacity in tokens
}

// tau is the time the bucket takes to refill from empty, in µs.
func (l limit) tau() int64 { return l.interval * l.burst }

// bucketRequest asks one bucket for cost tokens.
type bucketRequest struct {
	key    string // storage key (see key.go)
	limit  limit
	cost   int64
	shadow bool // decided apart: never changes whether the request is admitted
	// wait: µs a request may be held for its reserved slot (policy `wait`);
	// 0 for a policy that admits now or never.
	wait int64
}

// verdict is one policy's part of a decision.
type verdict struct {
	// allowed: this bucket alone would admit the request.
	allowed bool
	// remaining: whole tokens left after the decision (after charging, if the
	// request was admitted and this bucket charged).
	remaining int64
	// wait in µs: on a bucket that would deny, until its cost fits (neverWait
	// when it never can); otherwise until one more token, 0 when full.
	wait int64
	// delay in µs: until the slot this request reserved (policy `wait`);
	// 0 when it passes now.
	delay int64
}

// decision is the outcome of one request across all its buckets.
type decision struct {
	admitted bool
	now      int64 // the store's clock, µs
	delay    int64 // µs to hold an admitted request: the latest reserved slot
	verdicts []verdict
}

// start is the TAT from which a request is judged: a TAT in the past means a
// full bucket, which holds no more than burst tokens.
func start(tat, now int64) int64 {
	if tat < now {
		return now
	}
	return tat
}

// fits reports whether cost tokens are in the bucket at now, or will be
// within wait µs, given the starting TAT base (see start).
func (l limit) fits(base, now, cost, wait int64) bool {
	return cost <= l.burst && base+cost*l.interval-now <= l.tau()+wait
}

// tokens returns the whole tokens in the bucket at now and the µs until one
// more (0 when full).
func (l limit) tokens(base, now int64) (n, next int64) {
	avail := now + l.tau() - base
	if avail < 0 { // TAT ahead of a clock that went backwards
		return 0, l.interval - avail
	}
	n = avail / l.interval
	if n >= l.burst {
		return l.burst, 0
	}
	return n, l.interval - avail%l.interval
}

// decideBuckets is the whole decision, given each bucket's stored TAT (0 for
// a missing key) at now: every non-shadow bucket must fit for the request to
// be admitted; if it is, every bucket that fits is charged. It returns the
// TATs to store (equal to the input where nothing was charged).
func decideBuckets(tats []int64, now int64, reqs []bucketRequest) (decision, []int64) {
	d := decision{admitted: true, now: now, verdicts: make([]verdict, len(reqs))}
	for i, rq := range reqs {
		d.verdicts[i].allowed = rq.limit.fits(start(tats[i], now), now, rq.cost, rq.wait)
		if !d.verdicts[i].allowed && !rq.shadow {
			d.admitted = false
		}
	}
	next := append([]int64(nil), tats...)
	for i, rq := range reqs {
		v := &d.verdicts[i]
		base := start(tats[i], now)
		if d.admitted && v.allowed {
			base += rq.cost * rq.limit.interval
			next[i] = base
			// A slot beyond the bucket's capacity now is a reservation: the
			// request is held until then.
			v.delay = max(0, base-rq.limit.tau()-now)
			d.delay = max(d.delay, v.delay)
		}
		v.remaining, v.wait = rq.limit.tokens(base, now)
		if !v.allowed {
			v.wait = denialWait(rq, base, now)
		}
	}
	return d, next
}

// denialWait is how long a denied request must wait until its cost fits in
// the bucket whose starting TAT is base.
func denialWait(rq bucketRequest, base, now int64) int64 {
	if rq.cost > rq.limit.burst {
		return neverWait
	}
	return base + rq.cost*rq.limit.interval - rq.limit.tau() - now
}
