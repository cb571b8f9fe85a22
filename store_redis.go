package ratelimit

import (
	"context"
	"errors"
	"strings"
	"sync/atomic"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/breaker"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
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

// redisStore is the Redis store: one Redis client, which every config
// connecting the same way shares (redisStores), with its services, each
// holding what it needs: the circuit breaker, the coalescing of calls, the
// deny cache, the events between instances, the lease book, the format,
// durable calls, overrides, the fleet and hot keys.
type redisStore struct {
	client redis.UniversalClient
	// lone and loneDown make the calls of a request the instance serves
	// alone (store_lone.go).
	lone     *loneConn
	loneDown atomic.Bool
	name     string // the addresses, for logs
	// coalescer merges concurrent requests into one script call (see
	// coalesce.go); nil in cluster mode, where a call reaches one slot only.
	coalescer *coalescer
	breaker   *breaker.Breaker
	// denials is shared by every config on this Redis: what one learned of
	// a bucket holds for all. Nil in cluster mode, whose cross-hash-slot refunds
	// move TATs back.
	denials *denyCache
	// cluster: a Redis Cluster, where a script call reaches one slot, so
	// requests whose buckets span slots take one call per slot.
	cluster bool
	// callTimeout bounds a call as a whole: waiting for a connection,
	// connecting, and EVALSHA then EVAL when Redis lost the script.
	callTimeout time.Duration
	logger      *zap.Logger
	reported    redisReports
	events      redisEvents
	leases      *leaseBook // concurrency slots held (lease_book.go)
	// format is the format buckets are written in (format.go), from the
	// fleet markers (upgrade.go).
	format storageFormat
	closed chan struct{}
	// timeout is the redis block's, which durable quotas' WAIT and WAITAOF
	// wait at most; durable coalesces their calls (durable.go).
	timeout time.Duration
	durable durableCalls
	// overrides say which buckets may have overrides in this Redis
	// (override_redis.go).
	overrides overrideFlags
	// afterApart counts the work after responses on its way in calls of
	// its own: in cluster mode, which has no coalescer to ride.
	afterApart callCount
	// db is the database its buckets are in; fleet its part in the fleet
	// (fleet.go).
	db    int
	fleet fleetView
	// hot decides hot keys from blocks of their tokens (hotkeys_store.go).
	hot *hotKeys
	// server is who the server said it is, last asked (redis_server.go).
	server atomic.Pointer[redisinfo.Server]
}

// noCoalescing sends every request in its own script call, for benchmarks
// comparing.
var noCoalescing = false

func newRedisStore(c RedisConfig, logger *zap.Logger) (*redisStore, error) {
	client, err := c.newClient()
	if err != nil {
		return nil, err
	}
	lone, err := c.newLone()
	if err != nil {
		_ = client.Close()
		return nil, err
	}
	conn := &redisStore{
		client:      client,
		lone:        lone,
		name:        strings.Join(c.Addresses, ","),
		cluster:     c.Cluster,
		callTimeout: c.dialTimeout() + 3*time.Duration(c.Timeout),
		logger:      logger,
		timeout:     time.Duration(c.Timeout),
		db:          c.DB,

		closed: make(chan struct{}),
	}
	conn.format = storageFormat{client: client, name: conn.name, logger: logger, callTimeout: conn.callTimeout, closed: conn.closed,
		prefixes: conn.events.prefixes, changed: make(chan struct{}, 1)}
	conn.format.writes.Store(formatV1)
	conn.fleet = fleetView{client: client, name: conn.name, db: c.DB, logger: logger, callTimeout: conn.callTimeout, closed: conn.closed,
		format: func() string { return formatName(conn.format.current()) }, prefixes: conn.events.prefixes, probe: conn.probeStarted,
		nudge: make(chan struct{}, 1)}
	conn.breaker = breaker.New(func(from, to breaker.State) {
		switch {
		case to == breaker.Open && from == breaker.Closed:
			circuitOpen.Inc()
			logger.Warn("Redis unavailable: calls failed for "+breaker.Span.String()+"; requests follow on_error until a probe succeeds",
				zap.String("redis", conn.name), zap.Duration("probe_every", breaker.Cooldown))
		case to == breaker.Closed:
			circuitOpen.Dec()
			logger.Info("Redis available again: circuit closed", zap.String("redis", conn.name))
		default:
			logger.Debug("circuit breaker", zap.String("redis", conn.name), zap.Stringer("from", from), zap.Stringer("to", to))
		}
	})
	if !c.Cluster {
		conn.denials = newDenyCache(monotonicMicros)
		if !noCoalescing {
			conn.coalescer = &coalescer{call: conn.call, maxCalls: c.poolSize()}
		}
	}
	conn.overrides.client, conn.overrides.callTimeout, conn.overrides.closed = client, conn.callTimeout, conn.closed
	conn.leases = &leaseBook{call: conn.call, cluster: c.Cluster, decideAfter: conn.decideAfter, closed: conn.closed}
	conn.hot = newHotKeys(conn)
	go conn.checkEviction()
	go conn.format.followFormat()
	go conn.fleet.followFleet()
	if lone != nil {
		conn.loneDown.Store(true) // until it is open (store_lone.go)
		go conn.loneBack()
	}
	return conn, nil
}

// Destruct closes the connection once no handler uses it: Caddy stopped,
// after its requests ended, or the last request of a config reloaded to
// other connection settings ended (storeUse). What those requests left to
// do after their responses (releases, settles, charges) is sent first, and
// the releases not yet confirmed once more, waited for at most
// callTimeout: else a stopped instance's last slots stay taken until their
// leases run out, and its last settles are lost.
func (c *redisStore) Destruct() error {
	c.hot.close() // its blocks' unspent tokens go back with the work below
	c.finishAfterWork(time.Now().Add(c.callTimeout))
	c.events.close()
	close(c.closed)
	c.fleet.leaveFleet(time.Now().Add(c.callTimeout))
	if c.lone != nil {
		_ = c.lone.Close()
	}
	return c.client.Close()
}

// finishAfterWork sends what requests left to do after their responses,
// and the releases the store has not confirmed once more, and waits for
// them until deadline.
func (c *redisStore) finishAfterWork(deadline time.Time) {
	if rels, policies := c.leases.unconfirmed(); len(rels) > 0 {
		c.leases.sendReleases(rels, policies)
	}
	var done <-chan struct{}
	if c.coalescer != nil {
		done = c.coalescer.drained()
	} else {
		done = c.afterApart.drained()
	}
	wait := time.Until(deadline)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		c.logger.Warn("closing: Redis did not answer the work after the last responses (releases, settles, charges) in time; their slots come back when their leases run out",
			zap.String("redis", c.name), zap.Duration("waited", wait))
	}
}

func (s *redisStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.hot.covers(reqs) { // hot keys' blocks first (hotkeys_store.go)
		return s.hot.decide(ctx, reqs)
	}
	return s.decideShared(ctx, reqs)
}

// decideShared decides reqs against the buckets in Redis: the deny cache,
// the circuit breaker, then one script call (one per hash slot in a Cluster).
func (s *redisStore) decideShared(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.denials != nil {
		d, answer, gate := s.denials.answer(reqs)
		switch answer {
		case denied:
			d.call.cached = true
			return d, nil
		case uncertain:
			// One flight at a time for this bucket: once the one in the air
			// lands, the cache knows what Redis said.
			f, after := s.denials.flights.board(gate)
			defer s.denials.flights.land(gate, f)
			if after != nil {
				<-after
				if d, answer, _ := s.denials.answer(reqs); answer == denied {
					return d, nil
				}
			}
		}
	}
	if s.breaker.Skipping() {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	if s.cluster {
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
	if s.coalescer == nil { // Cluster: a call per hash slot group, apart
		s.afterApart.add(1)
		go func() {
			defer s.afterApart.add(-1)
			then(s.decide(context.Background(), reqs))
		}()
		return
	}
	if s.breaker.Skipping() {
		circuitOpenErrors.Inc()
		then(decision{}, errCircuitOpen)
		return
	}
	p := newPending(reqs, nil)
	p.then = func(p *pending) { then(p.d, p.err) }
	s.coalescer.submitAfter(p)
}

// decideAwaited decides work after a response that the response waits for
// (finish.go): with the next call when calls are in flight, at once by
// itself when none is.
func (s *redisStore) decideAwaited(reqs []bucketRequest) (decision, error) {
	if s.coalescer == nil { // Cluster: a call per hash slot group
		return s.decide(context.Background(), reqs)
	}
	if s.breaker.Skipping() {
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
	s.coalescer.submitAwaited(p)
	<-done
	return d, err
}

// decideInOneCall decides buckets that one script call can reach: a single
// Redis, or one Redis Cluster hash slot.
func (s *redisStore) decideInOneCall(ctx context.Context, reqs []bucketRequest) (decision, error) {
	p := newPending(reqs, ctx)
	p.alone = serving.Load() <= 1
	if s.coalescer != nil {
		s.coalescerFor(reqs).submit(p) // durable requests apart
	} else {
		p.err = errCallAborted
		s.call(p.one[:])
	}
	d, err := p.d, p.err
	if err == nil && s.denials != nil {
		s.denials.learn(reqs, d, p.tats, p.sent, p.received)
	}
	p.recycle()
	return d, err
}

// What only Redis can do (the capabilities of store.go's note): each answered
// by the service that does it.

func (s *redisStore) slotLeases() leaseKeeper { return s.leases }

func (s *redisStore) fleetView() *fleetView { return &s.fleet }

func (s *redisStore) storage() *storageFormat { return &s.format }

func (s *redisStore) overridesKept() overrideStore { return &s.overrides }

func (s *redisStore) overrideFilter(prefix string) overrideFilter {
	return s.overrides.overrideSet(prefix)
}

// call makes one script call for a batch, past the circuit breaker, and
// tells the breaker how it went.
func (c *redisStore) call(batch []*pending) {
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
func (c *redisStore) eval(batch []*pending) breaker.Result {
	if want := batchConfirmation(batch); want.wanted() {
		return c.evalDurable(batch, want) // with its WAIT or WAITAOF
	}
	deadline := time.Now().Add(c.callTimeout)
	args := encodeCall(batch, c.format.current())
	sent := monotonicMicros()
	lone := c.loneFor(batch) // store_lone.go; nil: the pool
	var reply [8]int64       // a lone call's reply: one request's
	res, err := c.callOn(lone, deadline, args, reply[:0])
	if lone != nil && err != nil {
		if _, closed := err.(*errLoneClosed); closed {
			// Redis had closed the lone connection: the call did not
			// reach it, and is made on the pool.
			lone.mu.Unlock()
			c.loneAnswered(err)
			lone = nil
			res, err = c.callOn(nil, deadline, args, nil)
		}
	}
	if err != nil && redis.HasErrorPrefix(err, "NOSCRIPT") { // HasErrorPrefix allocates
		// A restarted or flushed Redis: EVAL loads the script again. The
		// script did not run, so nothing was charged twice.
		args[0], args[1] = "eval", decideLua
		res, err = c.callOn(lone, deadline, args, reply[:0])
	}
	if lone != nil {
		lone.mu.Unlock()
		c.loneAnswered(err)
	}
	received := monotonicMicros()
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

// callOn makes a script call on the lone connection, or on the pool when
// lone is nil.
func (c *redisStore) callOn(lone *loneConn, deadline time.Time, args []any, out []int64) ([]int64, error) {
	if lone != nil {
		return lone.call(deadline, args, out)
	}
	ctx := &callContext{Context: context.Background(), deadline: deadline}
	cmd := redis.NewIntSliceCmd(ctx, args...)
	_ = c.client.Process(ctx, cmd)
	return cmd.Result()
}

// callContext bounds a script call by its deadline alone, which go-redis
// puts on the socket's reads and writes (ContextTimeoutEnabled). Nobody
// cancels a call, so it needs no Done channel: context.WithTimeout would
// cost a timer, a channel and six allocations per call for a cancellation
// nobody makes. Without one, the wait for a free connection and for a new
// one being dialled keep their own bounds (PoolTimeout, DialTimeout):
// connecting may take up to max(timeout, 1 s), as docs/redis.md says.
type callContext struct {
	context.Context // Background: never done
	deadline        time.Time
}

func (c *callContext) Deadline() (time.Time, bool) { return c.deadline, true }

// reportBadBucket counts and reports err if it is a request's own bucket's
// (badBucketError). Apart from eval, so that what errors.As fills in is
// allocated only for an error, not for every request.
func (c *redisStore) reportBadBucket(err error) {
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
