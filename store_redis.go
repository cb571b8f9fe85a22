package ratelimit

import (
	"context"
	"errors"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/breaker"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
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
// the circuit breaker, then one script call (one per hash slot in a Cluster).
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
	if s.conn.breaker.Skipping() {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	if s.conn.cluster {
		if groups := hashSlotGroups(reqs); len(groups) > 1 {
			return s.decideAcrossHashSlots(ctx, reqs, groups)
		}
	}
	return s.decideInOneCall(ctx, reqs)
}

// decideAfter sends reqs with the next script call of this instance, or
// by itself at once when none is in flight: work after a response rides
// with the decisions instead of making a call of its own, and no response
// waits for it.
func (s *redisStore) decideAfter(reqs []bucketRequest, then func(decision, error)) {
	if s.conn.coalescer == nil { // Cluster: a call per slot group, apart
		s.conn.afterApart.add(1)
		go func() {
			defer s.conn.afterApart.add(-1)
			then(s.decide(context.Background(), reqs))
		}()
		return
	}
	if s.conn.breaker.Skipping() {
		circuitOpenErrors.Inc()
		then(decision{}, errCircuitOpen)
		return
	}
	p := newPending(reqs, nil)
	p.then = func(p *pending) { then(p.d, p.err) }
	s.conn.coalescer.submitAfter(p)
}

// decideAwaited decides work after a response that the response waits for
// (finish.go): with the next call when calls are in flight, at once by
// itself when none is.
func (s *redisStore) decideAwaited(reqs []bucketRequest) (decision, error) {
	if s.conn.coalescer == nil { // Cluster: a call per slot group
		return s.decide(context.Background(), reqs)
	}
	if s.conn.breaker.Skipping() {
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
	p.recycle()
	return d, err
}

// What only Redis can do (store.go): its capabilities, each the
// connection's.

func (s *redisStore) renewLeases(leases []lease) { s.conn.hold(leases) }

func (s *redisStore) releasing(leases []lease) ([]bucketRequest, []*Policy) {
	return s.conn.releasing(leases)
}

func (s *redisStore) sendReleases(rels []bucketRequest, policies []*Policy) {
	s.conn.sendReleases(s, rels, policies)
}

func (s *redisStore) retryReleases(rels []bucketRequest, policies []*Policy) {
	s.conn.retryReleases(rels, policies)
}

func (s *redisStore) announce(ctx context.Context, prefix, key string) error {
	return s.conn.announce(ctx, prefix, key)
}

func (s *redisStore) announceOverride(ctx context.Context, prefix, key string) error {
	return s.conn.announceOverride(ctx, prefix, key)
}

func (s *redisStore) join(h *Handler) { s.conn.join(h) }

func (s *redisStore) part(h *Handler) { s.conn.part(h) }

func (s *redisStore) fleetRecord(hs []*Handler) fleet.Record { return s.conn.fleetRecord(hs) }

func (s *redisStore) readFleets(ctx context.Context) (fleetStore, error) {
	return s.conn.readFleets(ctx)
}

func (s *redisStore) liveRecords(ctx context.Context) (int, []fleet.Record, error) {
	return s.conn.liveRecords(ctx)
}

func (s *redisStore) fleetView() *fleetView { return &s.conn.fleet }

func (s *redisStore) probe(defs []definition) []probeResult { return s.conn.probe(defs) }

func (s *redisStore) serverInfo(ctx context.Context) (redisinfo.Server, error) {
	return s.conn.serverInfo(ctx)
}

func (s *redisStore) setFormat(ctx context.Context, prefix, marker string) error {
	if err := s.conn.setFormat(ctx, prefix, marker); err != nil {
		return err
	}
	s.conn.readFormat()
	return nil
}

func (s *redisStore) formatOf(ctx context.Context, prefix string) (marker, writes string, err error) {
	marker, err = s.conn.client.Get(ctx, formatMarker(prefix)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return "", "", err
	}
	if marker != markerV2 {
		marker = markerV1
	}
	return marker, formatName(int(s.conn.format.Load())), nil
}

func (s *redisStore) overridesKept() overrideStore { return s.conn }

func (s *redisStore) overrideFilter(prefix string) overrideFilter {
	return s.conn.overrideSet(prefix)
}

// The capabilities it has.
var (
	_ leaseStore     = (*redisStore)(nil)
	_ announcer      = (*redisStore)(nil)
	_ fleetMember    = (*redisStore)(nil)
	_ prober         = (*redisStore)(nil)
	_ formatStore    = (*redisStore)(nil)
	_ overrideKeeper = (*redisStore)(nil)
)

// call makes one script call for a batch, past the circuit breaker, and
// tells the breaker how it went.
func (c *redisConn) call(batch []*pending) {
	gen, ok := c.breaker.Allow()
	if !ok {
		for _, p := range batch {
			p.err = errCircuitOpen
		}
		circuitOpenErrors.Add(float64(len(batch)))
		return
	}
	result := breaker.Failed // unless the call returns: a panic is a failure
	defer func() { c.breaker.Done(gen, result) }()
	result = c.eval(batch)
}

// eval decides the requests of a batch, in order, in one call of
// lua/decide.lua.
func (c *redisConn) eval(batch []*pending) breaker.Result {
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
		return breaker.Answered
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
func resultOf(err error) breaker.Result {
	var redisErr redis.Error
	switch {
	case err == nil, errors.Is(err, errScriptReply), errors.As(err, &redisErr):
		return breaker.Answered
	case errors.Is(err, context.Canceled), errors.Is(err, errClientGone):
		return breaker.Ignored
	}
	return breaker.Failed
}
