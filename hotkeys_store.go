package ratelimit

import (
	"context"
	"hash/maphash"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/hotkey"
)

// Hot keys, the store's side: a layer in front of the Redis store's
// decisions (redisStore.decide) that decides a hot key's requests from
// blocks of its tokens, taken from the bucket in one script call each (an
// opTake of the block's size that may reserve up to hotkey.Horizon ahead:
// no script of its own, and nothing stored differently, so an instance of
// the previous release beside it reads the debited bucket and never
// over-admits). The pure parts, the schedule of a block, the ledger, the
// rates and the sizing, are internal/hotkey's.
//
// A request whose buckets are all hot and unspent is decided here; one with a
// hot bucket and others takes from the block tentatively, sends the others
// to Redis, and puts the tokens back if they deny it: all or nothing, as
// ever. Hotness is per instance: a key is hot on an instance that decides it
// more than its policy's hot_keys a second, or that Redis denies because
// other instances hold blocks of it (contended: so that a busy instance's
// blocks are never budget the others cannot reach). Blocks go back when the
// key cools, at reload, at shutdown and after hotkey.MaxAge, and at once on
// an event for the key (a reset, a grant, an override).

// hotKeys is one Redis connection's hot keys, shared by every config on it.
type hotKeys struct {
	store  blockStore // decides what blocks do not, fetches blocks and gives them back
	seed   maphash.Seed
	now    func() int64 // monotonic µs
	rates  hotkey.Rates
	shards [hotShards]hotShard
	// sweeping: the sweeper runs (while any key is hot); closed: the
	// connection is closing, and takes no more blocks.
	sweeping atomic.Bool
	closed   atomic.Bool
	stop     chan struct{}
	// wait bounds how long a request waits for a block in flight.
	wait time.Duration
}

const (
	hotShards = 16
	// hotShardMax bounds the hot keys of a shard: 1,024 per connection.
	hotShardMax = 64
	// hotIdle: a hot key without a decision for this long has cooled.
	hotIdle = 500_000 // µs
	// hotContended is how long a key Redis denied for others' blocks stays
	// hot on this instance whatever its rate.
	hotContended = 1_000_000 // µs
)

type hotShard struct {
	mu   sync.Mutex
	keys map[string]*hotKey
}

// hotKey is one hot key on this instance. Its shard's lock guards it.
type hotKey struct {
	ledger hotkey.Ledger
	rate   hotkey.Estimator
	policy *hotPolicy
	// rq is the request blocks are taken and given back with: the key, the
	// limit sent (a request with another, after a reload or under another
	// plan, drops the blocks) and the override rule.
	rq bucketRequest
	// decided is the limit the last block was decided under (an override's,
	// or the one sent); left the whole tokens the bucket unspent after it.
	decided limit
	left    int64
	// redisNow and received date the last reply, to estimate Redis's clock.
	redisNow, received int64
	block, lead        int64 // the sizing of the last decision
	// line: how long, in µs, the last block waited in the bucket's line
	// for its first token (see hotkey.LineTarget)
	line      int64
	lastSeen  int64 // local µs of the last decision
	contended int64 // local µs until which it stays hot whatever its rate
	// fetching: a block is on its way; landed is closed when it lands.
	fetching bool
	landed   chan struct{}
	// After a block was denied (at the local µs deniedAt): deniedUntil, the
	// local µs before which no token of the bucket can be had (Redis would
	// deny a request of cost 1), used for at most hotkey.MaxAge; retryAt,
	// before which no block can. After an error, failedUntil: until then
	// requests go to the store (which follows on_error).
	deniedAt, deniedUntil, retryAt, failedUntil int64
	// gone: dropped; a block landing for it is given back.
	gone bool
	// counted: the unspent tokens of its ledger the policy's gauge counts
	// (recount).
	counted int64
}

// blockStore is what the hot keys need of the store behind them (the
// Redis store; the simulation's, sim_test.go): a decision in one call, a
// block's take, and work sent with the next call.
type blockStore interface {
	decideShared(ctx context.Context, reqs []bucketRequest) (decision, error)
	takeBlock(rq bucketRequest, urgent bool, then func(blockReply))
	decideAfter(reqs []bucketRequest, then func(decision, error))
}

func newHotKeys(conn *redisStore) *hotKeys {
	return newHotKeysOn(conn, monotonicMicros, conn.callTimeout)
}

// newHotKeysOn is the hot keys of a store, on a clock of µs, waiting at
// most wait for a block on its way.
func newHotKeysOn(store blockStore, now func() int64, wait time.Duration) *hotKeys {
	h := &hotKeys{store: store, seed: maphash.MakeSeed(), now: now, stop: make(chan struct{}), wait: wait}
	for i := range h.shards {
		h.shards[i].keys = map[string]*hotKey{}
	}
	return h
}

// hotEligible reports whether a bucket may be decided from blocks: a rate
// take of a policy with hot keys, not a shadow (decided and charged apart),
// nor one whose key learns its usage (a settle's: the script raises each
// reservation to what the key learned, which blocks would not).
func (rq *bucketRequest) hotEligible() bool {
	return rq.hot != nil && rq.op == opTake && rq.kind() != quotaBucket && !rq.shadow && !rq.learns && rq.cost <= rq.limit.burst
}

// covers reports whether any bucket of reqs may be decided from blocks.
func (h *hotKeys) covers(reqs []bucketRequest) bool {
	if h == nil || h.closed.Load() {
		return false
	}
	for i := range reqs {
		if reqs[i].hotEligible() {
			return true
		}
	}
	return false
}

// hotAnswer is what a bucket's blocks say of a request.
type hotAnswer int8

const (
	hotCold   hotAnswer = iota // not hot, or nothing to say: Redis decides
	hotTook                    // its tokens are taken (tentatively) from blocks
	hotDenied                  // none can be had for a while: denied
	hotWait                    // a block is on its way: wait for it
)

// hotPart is one bucket's part of a request decided through the layer.
type hotPart struct {
	answer hotAnswer
	id     uint64
	e      *hotKey
	taken  hotkey.Taken
	v      verdict
	landed <-chan struct{}
	// returned: its tokens went back (putBack).
	returned bool
	// redisNow: Redis's clock now, at least, as the key's last reply says.
	redisNow int64
}

// rateMark is what counted a request in the rates that make a key hot,
// to take it back when another policy denies the request (notAdmitted).
type rateMark struct {
	observed bool    // h.rates (a key not hot)
	key      *hotKey // its hot key's rate
}

// decide decides reqs, some of whose buckets are hot keys: from their
// blocks alone when all are; with Redis deciding the others otherwise.
func (h *hotKeys) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	var buf [4]hotPart
	var mbuf [4]rateMark
	parts, marks := buf[:0], mbuf[:0]
	if len(reqs) > len(mbuf) {
		marks = make([]rateMark, len(reqs))
	} else {
		marks = mbuf[:len(reqs)]
	}
	for attempt := 0; ; attempt++ {
		now := h.now()
		parts = parts[:0]
		var wait <-chan struct{}
		denied, cold := false, false
		for i := range reqs {
			pt := hotPart{}
			if reqs[i].hotEligible() {
				h.try(&reqs[i], now, &pt, attempt == 0, &marks[i])
			}
			switch pt.answer {
			case hotCold:
				cold = true
			case hotDenied:
				denied = true
			case hotWait:
				wait = pt.landed
			}
			parts = append(parts, pt)
		}
		if wait != nil || denied {
			h.putBack(parts)
		}
		if wait != nil {
			if err := h.waitFor(ctx, wait); err != nil {
				return decision{}, err
			}
			continue // once: a second wait goes to Redis (hotWait is not answered then)
		}
		took := false
		for i := range parts {
			took = took || parts[i].answer == hotTook
		}
		switch {
		case denied && !cold:
			d := h.localDecision(parts, now, false)
			h.notAdmitted(reqs, marks, d, nil, now)
			return d, nil
		case denied || !took:
			// Redis decides it all (a hot bucket denied too, unless a token
			// came back meanwhile).
			d, err := h.store.decideShared(ctx, reqs)
			h.noteContention(reqs, parts, d, err, now)
			h.notAdmitted(reqs, marks, d, err, now)
			return d, err
		case !cold:
			return h.localDecision(parts, now, true), nil
		}
		d, err := h.decideRest(ctx, reqs, parts, now)
		h.notAdmitted(reqs, marks, d, err, now)
		return d, err
	}
}

// notAdmitted takes back, from the rates that make keys hot and size their
// blocks, the requests of a decision another policy denied: they asked
// nothing of these buckets. A key kept busy only by requests that other
// policies deny is then not hot (it takes no block), and one that was
// cools and gives back what it holds: its blocks would sit unspent while
// the bucket refills behind them.
func (h *hotKeys) notAdmitted(reqs []bucketRequest, marks []rateMark, d decision, err error, now int64) {
	if err != nil || d.admitted {
		return
	}
	for i := range marks {
		m := marks[i]
		if i >= len(d.verdicts) || !d.verdicts[i].allowed || !m.observed && m.key == nil {
			continue // this bucket denied it: the request asked it for tokens
		}
		id := maphash.String(h.seed, reqs[i].key)
		if m.observed {
			h.rates.Unobserve(id, reqs[i].cost, now)
		}
		if m.key != nil {
			sh := &h.shards[id%hotShards]
			sh.mu.Lock()
			m.key.rate.Remove(reqs[i].cost, now)
			sh.mu.Unlock()
		}
	}
}

// waitFor waits for a block on its way, bounded by the store's call
// timeout; errClientGone when the client went away first.
func (h *hotKeys) waitFor(ctx context.Context, landed <-chan struct{}) error {
	timer := time.NewTimer(h.wait)
	defer timer.Stop()
	select {
	case <-landed:
	case <-timer.C:
	case <-ctx.Done():
		return errClientGone
	}
	return nil
}

// decideRest sends the buckets the blocks could not decide to Redis, with
// the hot ones' tokens taken: kept if Redis admits the request, put back
// if it denies it (or cannot decide).
func (h *hotKeys) decideRest(ctx context.Context, reqs []bucketRequest, parts []hotPart, now int64) (decision, error) {
	var rest []bucketRequest
	for i, pt := range parts {
		if pt.answer != hotTook {
			rest = append(rest, reqs[i])
		}
	}
	rd, err := h.store.decideShared(ctx, rest)
	if err != nil || !rd.admitted {
		h.putBack(parts)
	}
	if err != nil {
		return rd, err
	}
	d := decision{admitted: rd.admitted, now: rd.now, delay: rd.delay, verdicts: make([]verdict, len(reqs))}
	j := 0
	for i, pt := range parts {
		if pt.answer == hotTook {
			d.verdicts[i] = pt.v
			if rd.admitted {
				d.delay = max(d.delay, pt.v.delay)
			} else {
				d.verdicts[i].delay = 0
			}
			continue
		}
		d.verdicts[i] = rd.verdicts[j]
		j++
	}
	h.noteContention(reqs, parts, d, nil, now)
	return d, nil
}

// localDecision is the decision of a request whose buckets the blocks
// decided: admitted (their tokens kept), or denied.
func (h *hotKeys) localDecision(parts []hotPart, now int64, admitted bool) decision {
	d := decision{admitted: admitted, verdicts: make([]verdict, len(parts)), call: callStats{hot: true}}
	for i, pt := range parts {
		v := pt.v
		if !admitted && v.allowed {
			v.delay = 0
		}
		d.verdicts[i] = v
		d.delay = max(d.delay, v.delay)
		d.now = max(d.now, pt.redisNow)
	}
	return d
}

// try decides rq's bucket from its key's blocks, filling in pt: hotCold
// when the key is not hot (or has nothing to say), hotTook, hotDenied, or
// hotWait (a block is on its way and mayWait: pt.landed). A first attempt
// (mayWait) counts the request in the key's rate, and says where in mark.
func (h *hotKeys) try(rq *bucketRequest, now int64, pt *hotPart, mayWait bool, mark *rateMark) {
	pt.id = maphash.String(h.seed, rq.key)
	sh := &h.shards[pt.id%hotShards]
	sh.mu.Lock()
	e := sh.keys[rq.key]
	if e != nil && (e.rq.limit != rq.limit || e.rq.overridable != rq.overridable || e.policy != rq.hot) {
		// Another limit (a reload, a plan), override rule or policy: the
		// blocks taken under the old go back.
		h.dropLocked(sh, rq.key, e, now)
		e = nil
	}
	if e == nil {
		sh.mu.Unlock()
		if !mayWait {
			return // counted by the first attempt, whose key went since
		}
		est, contended, tracked := h.rates.Observe(pt.id, rq.cost, now)
		if !tracked {
			return
		}
		mark.observed = true
		decisions, amount := est.Rate(now)
		if decisions < rq.hot.threshold && !contended {
			return
		}
		if block, _ := hotkey.Size(amount, rq.limit.interval, rq.limit.burst, 0); block == 0 || rq.cost > hotkey.Cap(rq.limit.interval, rq.limit.burst) {
			return
		}
		sh.mu.Lock()
		if e = sh.keys[rq.key]; e == nil {
			if len(sh.keys) >= hotShardMax || h.closed.Load() {
				sh.mu.Unlock()
				return
			}
			e = &hotKey{rate: est, policy: rq.hot, decided: rq.limit, lastSeen: now}
			e.rq = bucketRequest{key: rq.key, limit: rq.limit, op: opTake, hot: rq.hot,
				overridable: rq.overridable, overrideWait: rq.overrideWait, overrideDebt: rq.overrideDebt}
			if contended {
				e.contended = now + hotContended
			}
			sh.keys[rq.key] = e
			mark.key = e // its rate is the estimate's, this request counted
			h.sweep()
		}
	} else if mayWait {
		e.rate.Add(rq.cost, now)
		mark.key = e
	}
	defer func() {
		h.recount(e, now)
		sh.mu.Unlock()
	}()
	e.lastSeen = now
	_, amount := e.rate.Rate(now)
	e.block, e.lead = hotkey.Size(amount, e.decided.interval, e.decided.burst, e.line)
	h.giveBack(e, e.ledger.Expire(now, hotkey.MaxAge))
	pt.e, pt.redisNow = e, e.redisNow+(now-e.received)
	ok, at, taken := e.ledger.Take(rq.cost, now, rq.wait)
	switch {
	case ok:
		pt.answer, pt.taken = hotTook, taken
		pt.v = verdict{allowed: true, delay: at - now, limit: e.decided, cost: rq.cost, due: taken.Due()}
		pt.v.remaining = e.ledger.Ready(now) + max(0, e.left)
		if next, unspent := e.ledger.Next(now); unspent && pt.v.remaining < e.decided.burst {
			pt.v.untilFits = max(0, next-now)
		} else if !unspent {
			pt.v.untilFits = e.decided.interval
		}
		h.prefetch(e, now, 0)
	case at > 0: // unspent, but not ready in time: the bucket's schedule says no
		pt.answer = hotDenied
		pt.v = verdict{untilFits: at - now, limit: e.decided}
		h.prefetch(e, now, 0)
	case now < e.deniedUntil && now-e.deniedAt <= hotkey.MaxAge: // Redis denied a block: nothing to be had before then
		pt.answer = hotDenied
		pt.v = verdict{untilFits: e.deniedUntil - now, limit: e.decided}
		h.prefetch(e, now, 0) // a block may fit before then (retryAt)
	case now < e.failedUntil || !mayWait:
		pt.e = nil // Redis decides (or follows on_error)
	default:
		h.prefetch(e, now, rq.cost)
		if e.fetching {
			pt.answer, pt.landed = hotWait, e.landed
		} else {
			pt.e = nil
		}
	}
}

// prefetch sends for the next block when the key's tokens in the bucket's
// line are below its lead, or when what it holds is below need, the cost of
// a request waiting for it (see hotkey.Next); e's shard is locked.
func (h *hotKeys) prefetch(e *hotKey, now, need int64) {
	if e.fetching || e.gone || e.block == 0 || now < e.retryAt || now < e.failedUntil || e.ledger.Blocks() == hotkey.MaxBlocks {
		return
	}
	unspent := e.ledger.Unspent(now)
	size, fetch := hotkey.Next(unspent, e.ledger.Ready(now), e.lead, e.block, need)
	if !fetch {
		return
	}
	e.fetching, e.landed = true, make(chan struct{})
	rq := e.rq
	rq.cost, rq.wait = size, hotkey.Horizon
	urgent := need > 0 || unspent == 0
	h.store.takeBlock(rq, urgent, func(r blockReply) { h.land(e, rq, r) })
}

// blockReply is what a block's take found.
type blockReply struct {
	err      error
	admitted bool
	// tat: the bucket's TAT after the take when admitted, as read (before)
	// when denied; redisNow: Redis's clock in the decision; sent: a local µs
	// at (or before) which the call was sent; received: the local µs at (or
	// after) which the reply came back.
	tat, redisNow, sent, received int64
	limit                         limit // decided under
	remaining                     int64
}

// land adds a block that came back to its key's ledger, or gives it back
// when the key was dropped meanwhile; it records a denial or a failure.
func (h *hotKeys) land(e *hotKey, rq bucketRequest, r blockReply) {
	id := maphash.String(h.seed, rq.key)
	sh := &h.shards[id%hotShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	e.fetching = false
	close(e.landed)
	switch {
	case r.err != nil:
		// Redis is away: the key's requests follow on_error once its blocks
		// are spent, and try again after a while.
		e.failedUntil = r.received + hotkey.Window
		return
	case !r.admitted:
		l := r.limit
		e.decided = l
		if rq.cost > l.burst {
			return // the override's burst is smaller: the next block is sized to it
		}
		// A request of cost 1 fits once the bucket's TAT is a token short of
		// tau ahead; this block, once it is within the horizon. The TAT can
		// only move back by a give-back or an operator, which an event
		// announces; what was learned is used for at most a second.
		e.deniedAt, e.deniedUntil = r.received, hotkey.Schedule(r.tat, r.redisNow, r.received, l.interval, l.tau())
		e.retryAt = min(hotkey.Schedule(r.tat, r.redisNow, r.received, l.interval, l.tau()+hotkey.Horizon)+(rq.cost-1)*l.interval, r.received+hotkey.MaxAge)
		return
	}
	l := r.limit
	first, last := hotkey.Spendable(r.tat-rq.cost*l.interval, r.redisNow, r.sent, r.received, l.interval, l.tau())
	if last < first {
		// The round trip took longer than the bucket takes to refill: no
		// token of the block could be spent while the bucket would still
		// have it. It goes back, and the key's requests go to Redis a while.
		h.giveBackRequest(rq, rq.cost, r.tat)
		e.failedUntil = r.received + hotkey.Window
		return
	}
	if e.gone || !e.ledger.Add(hotkey.Block{First: first, Last: last, Interval: l.interval, Size: rq.cost, Taken: r.received, End: r.tat}, r.received) {
		h.giveBackRequest(rq, rq.cost, r.tat)
		return
	}
	h.recount(e, r.received)
	e.policy.blocks.Inc()
	e.decided, e.left, e.redisNow, e.received = l, r.remaining, r.redisNow, r.received
	e.deniedUntil, e.retryAt, e.failedUntil = 0, 0, 0
	e.line = hotkey.Line(e.line, first-r.received)
	if first > r.received {
		// The block's tokens come after others' (the bucket owes beyond a
		// full refill): the key is contended, hot whatever its rate here.
		e.contended = r.received + hotContended
	}
}

// putBack puts the tokens the request took from blocks back (another of
// its buckets denied it).
func (h *hotKeys) putBack(parts []hotPart) {
	for i := range parts {
		pt := &parts[i]
		if pt.answer != hotTook || pt.returned {
			continue
		}
		sh := &h.shards[pt.id%hotShards]
		sh.mu.Lock()
		var gone []hotkey.Return
		if pt.e.gone {
			gone = []hotkey.Return{{Tokens: pt.taken.Tokens(), Due: pt.taken.Due()}} // dropped with its blocks: to Redis
		} else {
			gone = pt.e.ledger.PutBack(pt.taken)
			h.recount(pt.e, h.now())
		}
		for _, g := range gone {
			h.giveBackRequest(pt.e.rq, g.Tokens, g.Due)
		}
		sh.mu.Unlock()
		pt.returned = true
	}
}

// noteContention marks contended the hot-eligible keys Redis denied while
// their buckets owe beyond a full refill: other instances hold blocks of
// them, whose line this instance's requests join by taking blocks too. A
// bucket charged after its responses (charge_if, settle) owes for its
// debts as well: it is left alone.
func (h *hotKeys) noteContention(reqs []bucketRequest, parts []hotPart, d decision, err error, now int64) {
	if err != nil || d.admitted {
		return
	}
	for i, pt := range parts {
		if pt.answer == hotCold && reqs[i].hotEligible() && !reqs[i].givesBack && i < len(d.verdicts) {
			if v := d.verdicts[i]; !v.allowed && v.remaining < 0 {
				h.rates.Contend(pt.id, now+hotContended, now)
			}
		}
	}
}

// giveBack gives unspent tokens of e's blocks back to the bucket, with
// the next call; e's shard is locked (the caller recounts).
func (h *hotKeys) giveBack(e *hotKey, returned []hotkey.Return) {
	for _, r := range returned {
		h.giveBackRequest(e.rq, r.Tokens, r.Due)
	}
}

// giveBackRequest gives n tokens of a block, the last of which is due at
// the Redis µs due, back to rq's bucket (an adjust of -n under the limit
// blocks were taken with), with the next call: Redis gives back those still
// due when it applies it, and only while no token was taken after them
// (bucket.go, givenBack): otherwise they lapse, as blocks held elsewhere
// keep the schedule they were taken on.
func (h *hotKeys) giveBackRequest(rq bucketRequest, n, due int64) {
	if n <= 0 {
		return
	}
	rq.op, rq.delta, rq.cost, rq.wait, rq.due = opAdjust, -n, 0, 0, -due
	h.store.decideAfter([]bucketRequest{rq}, func(decision, error) {})
}

// recount sets the policy's gauge of unspent tokens to what e's ledger
// holds at now (its tokens lapse as time passes); e's shard is locked.
func (h *hotKeys) recount(e *hotKey, now int64) {
	if e == nil || e.gone {
		return
	}
	live := e.ledger.Unspent(now)
	if live != e.counted {
		e.policy.unspent.Add(float64(live - e.counted))
		e.counted = live
	}
}

// dropLocked drops a hot key, giving back what it holds; its shard is
// locked.
func (h *hotKeys) dropLocked(sh *hotShard, key string, e *hotKey, now int64) {
	h.giveBack(e, e.ledger.Drop(now))
	e.policy.unspent.Sub(float64(e.counted))
	e.counted = 0
	e.gone = true
	delete(sh.keys, key)
}

// forget drops the hot key under key, if any, giving back what it holds:
// an operator changed its bucket (a reset, a grant, an override), or a
// plan's or reload's new limit reached it.
func (h *hotKeys) forget(key string) {
	if h == nil {
		return
	}
	sh := &h.shards[maphash.String(h.seed, key)%hotShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.keys[key]; e != nil {
		h.dropLocked(sh, key, e, h.now())
	}
}

// releaseAll drops every hot key, giving back what they hold: at reload
// (the new config takes its own blocks) and when the connection closes.
func (h *hotKeys) releaseAll() {
	if h == nil {
		return
	}
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		now := h.now()
		for key, e := range sh.keys {
			h.dropLocked(sh, key, e, now)
		}
		sh.mu.Unlock()
	}
}

// close stops taking blocks and gives back those unspent: the connection
// closes (Caddy stops, or the last config using it went).
func (h *hotKeys) close() {
	if h == nil || h.closed.Swap(true) {
		return
	}
	close(h.stop)
	h.releaseAll()
}

// blocksOf is the blocks this instance holds of the bucket under key, and
// their unspent tokens (blockKeeper, for inspect).
func (s *redisStore) blocksOf(key string) (blocks int, tokens int64) {
	return s.hot.unspent(key)
}

// unspent is the blocks and unspent tokens this instance holds of the bucket
// under key.
func (h *hotKeys) unspent(key string) (blocks int, tokens int64) {
	if h == nil {
		return 0, 0
	}
	sh := &h.shards[maphash.String(h.seed, key)%hotShards]
	sh.mu.Lock()
	defer sh.mu.Unlock()
	if e := sh.keys[key]; e != nil {
		return e.ledger.Blocks(), e.ledger.Unspent(h.now())
	}
	return 0, 0
}

// sweep starts the sweeper unless it runs: every hotSweep, blocks past
// their age go back, and keys that cooled (no decision for hotIdle, or a
// rate below half their threshold and not contended) give back what they
// hold. It stops once no key is hot.
func (h *hotKeys) sweep() {
	if h.sweeping.Swap(true) {
		return
	}
	go func() {
		ticker := time.NewTicker(hotSweep)
		defer ticker.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-ticker.C:
			}
			if h.sweepOnce(h.now()) == 0 {
				h.sweeping.Store(false)
				// A key made hot after the count but before the flag went
				// down would have found the sweeper running.
				if h.count() == 0 || h.sweeping.Swap(true) {
					return
				}
			}
		}
	}()
}

// sweepOnce looks over every hot key once and returns how many remain.
func (h *hotKeys) sweepOnce(now int64) (left int) {
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		for key, e := range sh.keys {
			h.giveBack(e, e.ledger.Expire(now, hotkey.MaxAge))
			decisions, _ := e.rate.Rate(now)
			if now-e.lastSeen > hotIdle || decisions < e.policy.threshold/2 && now >= e.contended && !e.fetching {
				h.dropLocked(sh, key, e, now)
				continue
			}
			h.recount(e, now)
			left++
		}
		sh.mu.Unlock()
	}
	return left
}

// count is the hot keys unspent.
func (h *hotKeys) count() (n int) {
	for i := range h.shards {
		sh := &h.shards[i]
		sh.mu.Lock()
		n += len(sh.keys)
		sh.mu.Unlock()
	}
	return n
}

// takeBlock takes a block in one script call, rq an opTake of its size
// that may reserve up to its wait ahead: at once when urgent (a request
// waits for it), else with the next call (it rides). then is called with
// what Redis said, never before takeBlock returns.
func (s *redisStore) takeBlock(rq bucketRequest, urgent bool, then func(blockReply)) {
	asked := monotonicMicros() // before the call is sent
	reply := func(p *pending) {
		r := blockReply{err: p.err, sent: max(asked, p.sent), received: p.received}
		if p.received == 0 {
			r.received = monotonicMicros()
		}
		if p.err == nil {
			v := p.d.verdicts[0]
			r.admitted, r.tat, r.redisNow, r.limit, r.remaining = p.d.admitted, p.tats[0], p.d.now, v.limit, v.remaining
		}
		then(r)
	}
	p := newPending([]bucketRequest{rq}, nil)
	switch {
	case s.breaker.Skipping():
		circuitOpenErrors.Inc()
		p.err = errCircuitOpen
		go func() { reply(p); p.recycle() }()
	case s.coalescer == nil: // Cluster: a call of its own, to the key's shard
		s.afterApart.add(1)
		go func() {
			defer s.afterApart.add(-1)
			p.err = errCallAborted
			s.call(p.one[:])
			reply(p)
			p.recycle()
		}()
	case urgent:
		go func() {
			s.coalescer.submit(p)
			reply(p)
			p.recycle()
		}()
	default:
		p.then = reply
		s.coalescer.submitAfter(p)
	}
}
