package ratelimit

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/redis/go-redis/v9"
)

// The Redis store: every request's operations in one call of
// lua/decide.lua, on Redis time, coalesced with the concurrent requests of
// this instance (coalesce.go), guarded by the circuit breaker, with the
// deny cache in front (denycache.go).

// decideLua is lua/decide.lua (script.go), or, in a build for make bench's
// scenario (z), a script that decides nothing (script_noop.go).
var decideSHA = redis.NewScript(decideLua).Hash()

// decideSHAArg is decideSHA as a call's argument, boxed once rather than
// once per call.
var decideSHAArg any = decideSHA

var (
	// errCircuitOpen: the request skipped Redis, which recently failed.
	errCircuitOpen = errors.New("rate limit store: circuit open after repeated Redis failures")
	// errScriptReply: the script's reply is not what bucket.go expects.
	errScriptReply = errors.New("rate limit script reply")
	// errCallAborted: the call ended (a panic) before it said anything.
	errCallAborted = errors.New("rate limit store: script call aborted")
)

// badBucketError is a request's own bucket holding what is not a bucket,
// or (kind clock) a quota bucket whose bounds Redis's clock is outside of:
// only that request (and those of the same key) fail, never the call.
type badBucketError struct {
	kind string // wrongtype, corrupt or clock
	key  string // the storage key (a hash, never an identity)
}

func (e *badBucketError) Error() string {
	if e.kind == "clock" {
		return "rate limit store: Redis's clock is more than a quota period away from this instance's (key " + e.key + "): check both clocks (NTP)"
	}
	if e.kind == "wrongtype" {
		return "rate limit store: WRONGTYPE: key " + e.key + " holds a value of another type, not a bucket"
	}
	return "rate limit store: key " + e.key + " holds a string that is not a bucket"
}

// redisStore decides against buckets in Redis.
type redisStore struct {
	conn *redisConn
}

func (s *redisStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.conn.hot.covers(reqs) { // hot keys' blocks first (hotkeys_store.go)
		return s.conn.hot.decide(ctx, reqs)
	}
	return s.decideShared(ctx, reqs)
}

// decideShared decides reqs against the buckets in Redis: the deny cache,
// the circuit breaker, then one script call (one per slot in a Cluster).
func (s *redisStore) decideShared(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.conn.denials != nil {
		d, answer, gate := s.conn.denials.answer(reqs)
		switch answer {
		case denied:
			d.call.cached = true
			return d, nil
		case uncertain:
			// One flight at a time for this bucket: once the one in the air
			// lands, the cache knows what Redis said.
			f, after := s.conn.denials.flights.board(gate)
			defer s.conn.denials.flights.land(gate, f)
			if after != nil {
				<-after
				if d, answer, _ := s.conn.denials.answer(reqs); answer == denied {
					return d, nil
				}
			}
		}
	}
	if s.conn.breaker.skipping() {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	if s.conn.cluster {
		if groups := slotGroups(reqs); len(groups) > 1 {
			return s.decideAcrossSlots(ctx, reqs, groups)
		}
	}
	return s.decideInOneCall(ctx, reqs)
}

// decideLater sends reqs with the next script call of this instance, or
// by itself at once when none is in flight: work after a response rides
// with the decisions instead of making a call of its own, and no response
// waits for it.
func (s *redisStore) decideLater(reqs []bucketRequest, then func(decision, error)) {
	if s.conn.coalescer == nil { // Cluster: a call per slot group, apart
		s.conn.laterApart.add(1)
		go func() {
			defer s.conn.laterApart.add(-1)
			then(s.decide(context.Background(), reqs))
		}()
		return
	}
	if s.conn.breaker.skipping() {
		circuitOpenErrors.Inc()
		then(decision{}, errCircuitOpen)
		return
	}
	p := newPending(reqs, nil)
	p.then = func(p *pending) { then(p.d, p.err) }
	s.conn.coalescer.submitLater(p)
}

// decideAwaited decides work after a response that the response waits for
// (finish.go): with the next call when calls are in flight, at once by
// itself when none is.
func (s *redisStore) decideAwaited(reqs []bucketRequest) (decision, error) {
	if s.conn.coalescer == nil { // Cluster: a call per slot group
		return s.decide(context.Background(), reqs)
	}
	if s.conn.breaker.skipping() {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	var d decision
	var err error
	done := make(chan struct{}, 1)
	p := newPending(reqs, nil)
	p.then = func(p *pending) {
		d, err = p.d, p.err
		done <- struct{}{}
	}
	s.conn.coalescer.submitAwaited(p)
	<-done
	return d, err
}

// decideInOneCall decides buckets that one script call can reach: a single
// Redis, or one Redis Cluster slot.
func (s *redisStore) decideInOneCall(ctx context.Context, reqs []bucketRequest) (decision, error) {
	p := newPending(reqs, ctx)
	if s.conn.coalescer != nil {
		s.conn.coalescerFor(reqs).submit(p) // durable requests apart
	} else {
		p.err = errCallAborted
		s.conn.call(p.one[:])
	}
	d, err := p.d, p.err
	if err == nil && s.conn.denials != nil {
		s.conn.denials.learn(reqs, d, p.tats, p.sent, p.received)
	}
	p.release()
	return d, err
}

// call makes one script call for a batch, past the circuit breaker, and
// tells the breaker how it went.
func (c *redisConn) call(batch []*pending) {
	gen, ok := c.breaker.allow()
	if !ok {
		for _, p := range batch {
			p.err = errCircuitOpen
		}
		circuitOpenErrors.Add(float64(len(batch)))
		return
	}
	result := callFailed // unless the call returns: a panic is a failure
	defer func() { c.breaker.done(gen, result) }()
	result = c.eval(batch)
}

// eval decides the requests of a batch, in order, in one call of
// lua/decide.lua.
func (c *redisConn) eval(batch []*pending) callResult {
	if want := batchConfirmation(batch); want.wanted() {
		return c.evalDurable(batch, want) // with its WAIT or WAITAOF
	}
	ctx := &callContext{Context: context.Background(), deadline: time.Now().Add(c.callTimeout)}
	args := encodeCall(batch, int(c.format.Load()))
	sent := monotonicMicros()
	cmd := redis.NewIntSliceCmd(ctx, args...)
	_ = c.client.Process(ctx, cmd)
	if cmd.Err() != nil && redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		// A restarted or flushed Redis: EVAL loads the script again. The
		// script did not run, so nothing was charged twice.
		args[0], args[1] = "eval", decideLua
		cmd = redis.NewIntSliceCmd(ctx, args...)
		_ = c.client.Process(ctx, cmd)
	}
	received := monotonicMicros()
	res, err := cmd.Result()
	if err == nil {
		err = decodeReply(res, batch)
	}
	end := time.Now()
	for _, p := range batch {
		p.sent, p.received = sent, received
		p.d.call = callStats{calls: 1, requests: len(batch), redisUS: received - sent}
		if err != nil {
			p.err = err
		}
		if p.then == nil { // a request waited for it
			storeDuration.Observe(end.Sub(p.queued).Seconds())
		}
		if p.err != nil {
			c.reportBadBucket(p.err)
		}
	}
	if err == nil {
		return callAnswered
	}
	kind := errorKind(err)
	storeErrors.WithLabelValues(kind).Inc()
	c.report(kind, err)
	return resultOf(err)
}

// callContext bounds a script call by its deadline alone, which go-redis
// puts on the socket's reads and writes (ContextTimeoutEnabled), on the wait
// for a connection and on dialing. Nobody cancels a call, so it needs no
// Done channel: context.WithTimeout would cost a timer, a channel and six
// allocations per call for a cancellation nobody makes.
type callContext struct {
	context.Context // Background: never done
	deadline        time.Time
}

func (c *callContext) Deadline() (time.Time, bool) { return c.deadline, true }

// reportBadBucket counts and reports err if it is a request's own bucket's
// (badBucketError). Apart from eval, so that what errors.As fills in is
// allocated only for an error, not for every request.
func (c *redisConn) reportBadBucket(err error) {
	var bad *badBucketError
	if errors.As(err, &bad) {
		storeErrors.WithLabelValues(bad.kind).Inc()
		c.report(bad.kind, err)
	}
}

// resultOf is what a call's error says about Redis: a reply, even an error
// reply, is an answer; a timeout or a broken connection is a failure.
func resultOf(err error) callResult {
	var redisErr redis.Error
	switch {
	case err == nil, errors.Is(err, errScriptReply), errors.As(err, &redisErr):
		return callAnswered
	case errors.Is(err, context.Canceled), errors.Is(err, errClientGone):
		return callIgnored
	}
	return callFailed
}

// encodeCall is the EVALSHA of lua/decide.lua for the requests of a batch,
// whose buckets it writes in the given format (see format.go): the keys,
// the format, the numbers packed in one argument, then the strings.
func encodeCall(batch []*pending, format int) []any {
	n := 0
	for _, p := range batch {
		n += len(p.reqs)
	}
	args := make([]any, 3, 5+n)
	args[0], args[1], args[2] = "evalsha", decideSHAArg, n
	for _, p := range batch {
		for _, rq := range p.reqs {
			args = append(args, rq.key)
		}
	}
	args = append(args, format, nil) // the numbers, once packed
	argv := len(args) - 2            // ARGV[1]'s index in args
	nums := make(callNumbers, 0, 8*(len(batch)+8*n))
	now := time.Now() // quotas' bounds are taken around it
	for _, p := range batch {
		nums = nums.add(int64(len(p.reqs)))
		for _, rq := range p.reqs {
			op := 4 * int64(rq.op)
			if rq.quota != nil {
				op = 4 * quotaCode(rq.op)
			}
			if rq.overridable {
				op += 2
			}
			if rq.shadow {
				op++
			}
			if rq.learns {
				op += learnsOp
			}
			if rq.quota != nil {
				nums = quotaNumbers(nums.add(op), rq, now)
				if rq.overridable { // the policy's rule for an override's slack (override.go)
					nums = nums.add(rq.overrideWait).add(rq.overrideDebt)
				}
				continue
			}
			// A string goes after the numbers, which give its ARGV index.
			amount, wait := rq.cost, rq.wait
			switch {
			case rq.op == opAdjust:
				amount = rq.delta
			case rq.op == opFree:
				args = append(args, rq.events)
				amount, wait = rq.delta, int64(len(args)-argv)
			case rq.op.slots():
				args = append(args, rq.lease, rq.events)
				amount, wait = int64(len(args)-1-argv), int64(len(args)-argv)
			}
			nums = nums.add(op).add(rq.limit.interval).add(rq.limit.burst).add(rq.limit.slack).add(amount).add(wait)
			if rq.overridable { // the policy's rule for an override's slack (override.go)
				nums = nums.add(rq.overrideWait).add(rq.overrideDebt)
			}
			if rq.learns { // the usage a settle remembers (learned_usage.go)
				nums = nums.add(rq.record)
			}
		}
	}
	args[argv+1] = []byte(nums)
	return args
}

// callNumbers are a call's numbers as the script reads them: little-endian
// doubles in one argument, exact for every value it is sent (all below
// 2^53). Redis's handling of an argument cost more than what the script
// then does with a rate take (see lua/decide.lua).
type callNumbers []byte

func (c callNumbers) add(v int64) callNumbers {
	return binary.LittleEndian.AppendUint64(c, math.Float64bits(float64(v)))
}

// decodeReply reads the script's reply into each request's decision,
// computing the remaining tokens and waits from the stored state with the
// Go algorithm, and the TATs the script stored.
func decodeReply(res []int64, batch []*pending) error {
	if len(res) == 0 {
		return fmt.Errorf("%w: empty", errScriptReply)
	}
	now, off := res[0], 1
	for _, p := range batch {
		n := replyLen(p.reqs)
		if len(res) < off+n {
			return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
		}
		p.d, p.tats, p.err = decodeRequest(now, res[off:off+n], p.reqs)
		off += n
	}
	if off != len(res) {
		return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
	}
	return nil
}

// Statuses of a request in the script's reply.
const (
	scriptDenied    = 0
	scriptAdmitted  = 1
	scriptWrongType = -1
	scriptCorrupt   = -2
	// scriptClock: Redis's clock is outside a quota bucket's bounds (see
	// quota.go).
	scriptClock = -3
)

// replyWidth is the numbers per bucket in the script's reply: allowed and
// tat, and for slots, the leases held and those that expired.
func replyWidth(op bucketOp) int {
	if op.slots() {
		return 3
	}
	return 2
}

// replyLen is the numbers of a request's reply: its status, then each
// bucket's.
func replyLen(reqs []bucketRequest) int {
	n := 1
	for _, rq := range reqs {
		n += replyWidthOf(rq)
	}
	return n
}

// decodeRequest turns the script's reply for one request, {status, then
// per bucket: allowed, tat (or the leases held) [, expired leases]}, into
// its decision and the TATs the script stored.
func decodeRequest(now int64, res []int64, reqs []bucketRequest) (decision, []int64, error) {
	var allowedAt [8]int
	at := allowedAt[:0]
	for i, off := 0, 1; i < len(reqs); i++ {
		at = append(at, off)
		off += replyWidthOf(reqs[i])
	}
	switch res[0] {
	case scriptWrongType, scriptCorrupt, scriptClock:
		kind := "wrongtype"
		switch res[0] {
		case scriptCorrupt:
			kind = "corrupt"
		case scriptClock:
			kind = "clock"
		}
		key := reqs[0].key
		for i := range reqs {
			if res[at[i]] < 0 {
				key = reqs[i].key
			}
		}
		return decision{}, nil, &badBucketError{kind: kind, key: key}
	}
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = res[at[i]+1]
	}
	reqs = decidedUnder(res, at, reqs) // an override's limit, where the script found one
	var learned []int64
	for i, rq := range reqs {
		if rq.learns {
			if learned == nil {
				learned = make([]int64, len(reqs))
			}
			learned[i] = res[at[i]+replyWidthOf(rq)-1] // its last number
		}
	}
	if learned != nil {
		reqs = withLearned(reqs, learned) // a take raised to what its key learned, as the script raised it
	}
	d, next := decideBuckets(tats, now, reqs)
	for i := range learned {
		d.verdicts[i].learned = learned[i]
	}
	for i, rq := range reqs {
		if rq.op.slots() {
			d.verdicts[i].expired = res[at[i]+2]
			// Wherever a lease is found expired (an acquire admitted or
			// denied, a renewal, an inspect, a reset), it is counted.
			if n := d.verdicts[i].expired; n > 0 && rq.leasesExpired != nil {
				rq.leasesExpired.Add(float64(n))
			}
		}
		if rq.op == opRenew { // allowed says the lease was still held
			d.verdicts[i].allowed = res[at[i]] == 1
		}
		if rq.quota != nil && res[at[i]+2] != d.verdicts[i].period.start {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on the period of quota bucket %d (%d, %d)", errScriptReply, i, res[at[i]+2], d.verdicts[i].period.start)
		}
	}
	// Redis's own verdict is the one that was charged; the Go algorithm is the
	// same one, so they agree unless the script and bucket.go drift apart.
	if d.admitted != (res[0] == scriptAdmitted) {
		return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree (admitted %d); is lua/decide.lua in step with bucket.go?", errScriptReply, res[0])
	}
	for i := range reqs {
		if d.verdicts[i].allowed != (res[at[i]] == 1) {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on bucket %d", errScriptReply, i)
		}
	}
	return d, next, nil
}
