package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Concurrency slots. A `concurrent N` policy lets at most N requests with
// the same key run at once across all instances: each admitted request
// holds a lease on one of N slots, a member of a sorted set in Redis whose
// score is the Redis time the lease expires. The lease is taken in the
// request's one atomic decision, renewed while the request runs (one call
// per instance per interval for all its leases), and freed when the
// handler chain returns; the slots of an instance that died come back
// when their leases expire. A request that finds no free slot may wait
// for one (`wait`), woken when a slot is freed on any instance.

// leaseIDs names this process's leases: a random instance id and a count.
var leaseIDs = func() func() string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	instance := hex.EncodeToString(b[:])
	var n atomic.Uint64
	return func() string { return instance + ":" + strconv.FormatUint(n.Add(1), 10) }
}()

const (
	defaultLease = 30 * time.Second
	minLease     = time.Second
	// renewEvery is how often, at most, the renewer looks for leases due:
	// those whose last renewal was sent a third of their lease ago. A
	// shorter lease is looked at every twelfth of it, so that a renewal
	// sent up to a twelfth late, and a third of the lease on its way to
	// Redis, still lands before the lease runs out.
	renewEvery = 250 * time.Millisecond
	// slotPoll is how often a waiting request at the head of its queue
	// tries again without having been woken: a slot whose lease expired
	// (its holder vanished) frees no event.
	slotPoll = 250 * time.Millisecond
	// retryEvery is how soon a release that could not reach the store is
	// sent again: until it is made, or its lease has run out anyway.
	retryEvery = 100 * time.Millisecond
)

// lease is one slot a request holds.
type lease struct {
	policy *Policy
	rq     bucketRequest // its opAcquire
	// mirrored: taken in Redis, and counted in the `local` fallback's
	// slots too (see mirrorSlots).
	mirrored bool
}

// leaseBook is the leases a Redis connection's instance holds, renewed in
// the background while they are held, and the releases the store has not
// confirmed yet, sent again until it does.
type leaseBook struct {
	mu      sync.Mutex
	leases  map[string]*heldLease
	pending map[string]*pendingRelease
	tick    time.Duration // how often the renewer looks
	running bool
}

type heldLease struct {
	rq      bucketRequest
	policy  *Policy
	renewed time.Time // when its last renewal (or acquire) was sent
	// lost: a renewal found the lease gone from the store (a flush, a
	// failover, or expired): it is put back (opRestore), for its request
	// runs. restoring: that call is in flight, so a release must follow it
	// (released).
	lost, restoring, released bool
}

// pendingRelease is a release the store has not confirmed.
type pendingRelease struct {
	rq      bucketRequest // its opRelease
	policy  *Policy
	expires time.Time // after which the lease is free in the store anyway
	next    time.Time // when to send it again
}

// hold registers leases to renew, starting the renewer the first time.
func (c *redisConn) hold(leases []lease) {
	b := &c.leases
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.leases == nil {
		b.leases, b.pending, b.tick = map[string]*heldLease{}, map[string]*pendingRelease{}, renewEvery
	}
	now := time.Now()
	for _, l := range leases {
		b.leases[l.rq.lease] = &heldLease{rq: l.rq, policy: l.policy, renewed: now}
		b.tick = min(b.tick, leaseOf(l.rq)/12)
	}
	if !b.running {
		b.running = true
		go c.renew()
	}
}

func leaseOf(rq bucketRequest) time.Duration {
	return time.Duration(rq.limit.interval) * time.Microsecond
}

// release frees leases in the store, at once; a release that cannot reach
// it is kept and sent again (see renew).
func (c *redisConn) release(s store, leases []lease) {
	if rels, policies := c.releasing(leases); len(rels) > 0 {
		c.sendReleases(s, rels, policies)
	}
}

// releasing takes leases out of the book, no longer renewed: the requests
// that free them in the store, for the caller to send.
func (c *redisConn) releasing(leases []lease) (rels []bucketRequest, policies []*Policy) {
	b := &c.leases
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, l := range leases {
		if h := b.leases[l.rq.lease]; h != nil && h.restoring {
			// A restore in flight could land after this release: the renewer
			// releases the lease once the restore is back.
			h.released = true
			continue
		}
		delete(b.leases, l.rq.lease)
		rq := l.rq
		rq.op = opRelease
		rels, policies = append(rels, rq), append(policies, l.policy)
	}
	return rels, policies
}

// sendReleases frees slots in the store with the next call (or by itself
// when none is in flight); then the requests this instance has waiting try
// (those of other instances hear of it from Redis). A release that fails
// is kept, to send again.
func (c *redisConn) sendReleases(s store, rels []bucketRequest, policies []*Policy) {
	s.decideAfter(rels, func(_ decision, err error) {
		if err != nil {
			c.retryReleases(rels, policies)
			return
		}
		for _, rq := range rels {
			slotQueues.wake(rq.key)
		}
	})
}

// retryReleases keeps releases that failed, to send again.
func (c *redisConn) retryReleases(rels []bucketRequest, policies []*Policy) {
	b := &c.leases
	now := time.Now()
	b.mu.Lock()
	for i, rq := range rels {
		b.pending[rq.lease] = &pendingRelease{rq: rq, policy: policies[i], expires: now.Add(leaseOf(rq)), next: now.Add(retryEvery)}
	}
	b.mu.Unlock()
}

// unconfirmed takes the releases the store has not confirmed whose leases
// have not run out yet: for a last try when the connection closes.
func (b *leaseBook) unconfirmed() (rels []bucketRequest, policies []*Policy) {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for id, p := range b.pending {
		if now.Before(p.expires) {
			rels, policies = append(rels, p.rq), append(policies, p.policy)
		}
		delete(b.pending, id)
	}
	return rels, policies
}

// renew, every tick until the connection closes: renews the leases due,
// puts back those the store lost, and sends again the releases it did not
// confirm.
func (c *redisConn) renew() {
	for {
		b := &c.leases
		b.mu.Lock()
		tick := b.tick
		b.mu.Unlock()
		select {
		case <-c.closed:
			return
		case <-time.After(tick):
		}
		var due []*heldLease
		var reqs []bucketRequest
		var retries []*pendingRelease
		now := time.Now()
		b.mu.Lock()
		for _, l := range b.leases {
			switch {
			case l.restoring:
			case l.lost:
				l.restoring, l.lost, l.renewed = true, false, now
				rq := l.rq
				rq.op = opRestore
				due, reqs = append(due, l), append(reqs, rq)
			case now.Sub(l.renewed) >= leaseOf(l.rq)/3:
				l.renewed = now
				rq := l.rq
				rq.op = opRenew
				due, reqs = append(due, l), append(reqs, rq)
			}
		}
		for id, p := range b.pending {
			switch {
			case now.After(p.expires):
				delete(b.pending, id) // free in the store by now
			case now.After(p.next):
				p.next = now.Add(retryEvery)
				retries = append(retries, p)
				reqs = append(reqs, p.rq)
			}
		}
		b.mu.Unlock()
		if len(reqs) > 0 {
			// Apart from the ticks: a slow Redis must not hold back the next
			// renewals.
			go c.renewNow(due, reqs, retries)
		}
	}
}

// renewNow sends the renewals, restores and retried releases of one tick
// (due's first, then retries'), each its own request so that one bad key
// fails alone, in one script call (one per slot in cluster mode), and
// records what the store said.
func (c *redisConn) renewNow(due []*heldLease, reqs []bucketRequest, retries []*pendingRelease) {
	results := make([]*pending, len(reqs))
	groups := [][]int{nil}
	for i := range reqs {
		results[i] = newPending(reqs[i:i+1], nil)
		groups[0] = append(groups[0], i)
	}
	if c.cluster {
		groups = hashSlotGroups(reqs)
	}
	for _, g := range groups {
		batch := make([]*pending, len(g))
		for k, i := range g {
			batch[k] = results[i]
		}
		c.call(batch)
	}
	var rels []bucketRequest
	var relPolicies []*Policy
	b := &c.leases
	b.mu.Lock()
	for i, l := range due {
		p := results[i]
		switch {
		case reqs[i].op == opRestore:
			l.restoring = false
			switch {
			case l.released: // its request ended meanwhile
				delete(b.leases, l.rq.lease)
				rq := l.rq
				rq.op = opRelease
				rels, relPolicies = append(rels, rq), append(relPolicies, l.policy)
			case p.err != nil:
				l.lost = true // try again next tick
			}
		case p.err == nil && !p.d.verdicts[0].allowed:
			l.lost = true // the store lost it: put it back next tick
		}
	}
	for k, r := range retries {
		if results[len(due)+k].err == nil {
			delete(b.pending, r.rq.lease)
		} else if r.policy != nil {
			r.policy.slots.retries.Inc()
		}
	}
	// The leases the store lost are put back now, not a tick later: until
	// then others may take the slots they look to leave free.
	var restores []*heldLease
	var restoreReqs []bucketRequest
	for _, l := range due {
		if l.lost && !l.released {
			l.restoring, l.lost = true, false
			rq := l.rq
			rq.op = opRestore
			restores, restoreReqs = append(restores, l), append(restoreReqs, rq)
		}
	}
	b.mu.Unlock()
	for _, p := range results {
		p.recycle()
	}
	if len(rels) > 0 {
		c.retryReleases(rels, relPolicies)
	}
	if len(restores) > 0 {
		c.renewNow(restores, restoreReqs, nil)
	}
}

// slotQueues are the requests waiting for a concurrency slot on this
// instance, by storage key, in arrival order: only the first tries, when a
// slot is freed (on any instance) or every slotPoll.
var slotQueues = waitQueues{queues: map[string][]chan struct{}{}}

type waitQueues struct {
	mu     sync.Mutex
	queues map[string][]chan struct{}
}

// join queues a waiter for key.
func (q *waitQueues) join(key string) chan struct{} {
	w := make(chan struct{}, 1)
	q.mu.Lock()
	q.queues[key] = append(q.queues[key], w)
	q.mu.Unlock()
	return w
}

// first reports whether w is first in key's queue.
func (q *waitQueues) first(key string, w chan struct{}) bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	ws := q.queues[key]
	return len(ws) > 0 && ws[0] == w
}

// leave takes w out of key's queue; the next waiter, now first, tries.
func (q *waitQueues) leave(key string, w chan struct{}) {
	q.mu.Lock()
	ws := slices.DeleteFunc(q.queues[key], func(c chan struct{}) bool { return c == w })
	if len(ws) == 0 {
		delete(q.queues, key)
	} else {
		q.queues[key] = ws
	}
	q.mu.Unlock()
	q.wake(key)
}

// wake tells the first waiter for key that a slot may be free.
func (q *waitQueues) wake(key string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if ws := q.queues[key]; len(ws) > 0 {
		select {
		case ws[0] <- struct{}{}:
		default:
		}
	}
}

// takeSlots records the slots an admitted request holds in the store that
// decided it: renewed while it runs, freed by release.
func (res *admission) takeSlots() {
	res.leases = res.leasebuf[:0]
	for i, p := range res.shown {
		rq := res.shownReqs[i]
		if rq.op != opAcquire {
			continue
		}
		if !res.d.verdicts[i].allowed {
			continue // a shadow policy's slot, not taken
		}
		res.leases = append(res.leases, lease{policy: p, rq: rq})
		p.slots.inFlight.Inc()
	}
	if len(res.leases) == 0 {
		return
	}
	if ls, ok := res.decidedBy.(leaseStore); ok {
		ls.renewLeases(res.leases)
		res.mirrorSlots()
	}
}

// mirrorSlots counts the slots a request took in Redis, of policies whose
// on_error is local, in the local fallback's slots as well: when Redis
// goes away, the requests it admitted are still running, and the fallback
// admits only what fits beside them (its max(1, N / instances) counts them).
func (res *admission) mirrorSlots() {
	var reqs []bucketRequest
	for i := range res.leases {
		l := &res.leases[i]
		if l.policy.onError != failLocal {
			continue
		}
		rq := l.rq
		rq.op = opRestore // held whatever the fallback's limit: Redis admitted it
		reqs, l.mirrored = append(reqs, rq), true
	}
	if len(reqs) > 0 {
		_, _ = localFallback.decide(context.Background(), reqs)
	}
}

// freeSlots frees the request's slots, in one store call (with Redis,
// riding with the next call; a release that cannot reach Redis is sent
// again until it does, or its lease has run out), and wakes the requests
// this instance has waiting for them once they are free.
func (res *admission) freeSlots() {
	rels, policies := res.slotReleases(true)
	if len(rels) == 0 {
		return
	}
	if ls, ok := res.decidedBy.(leaseStore); ok {
		ls.sendReleases(rels, policies)
		return
	}
	_, _ = res.decidedBy.decide(context.Background(), rels)
	for _, rq := range rels {
		slotQueues.wake(rq.key)
	}
}

// slotReleases takes the request's slots (with shed, a shed policy's too)
// off its hands: the requests that free them in the store that decided it,
// for the caller to send.
func (res *admission) slotReleases(shed bool) (rels []bucketRequest, policies []*Policy) {
	kept := res.leases[:0]
	var freed []lease
	for _, l := range res.leases {
		if l.policy.kind == kindShed && !shed {
			kept = append(kept, l)
			continue
		}
		l.policy.slots.inFlight.Dec()
		freed = append(freed, l)
	}
	res.leases = kept
	unmirrorSlots(freed)
	if len(freed) == 0 {
		return nil, nil
	}
	if ls, ok := res.decidedBy.(leaseStore); ok {
		return ls.releasing(freed)
	}
	for _, l := range freed {
		rq := l.rq
		rq.op = opRelease
		rels, policies = append(rels, rq), append(policies, l.policy)
	}
	return rels, policies
}

// unmirrorSlots frees the local fallback's count of leases taken in Redis
// (mirrorSlots).
func unmirrorSlots(leases []lease) {
	var reqs []bucketRequest
	for _, l := range leases {
		if l.mirrored {
			rq := l.rq
			rq.op = opRelease
			reqs = append(reqs, rq)
		}
	}
	if len(reqs) > 0 {
		_, _ = localFallback.decide(context.Background(), reqs)
	}
}

// holdsClientSlots reports whether the request holds a concurrency slot of
// a caller's budget (a `concurrent` policy's, not a shed policy's), whose
// release the client must find done when its response ends (finish.go).
func (res *admission) holdsClientSlots() bool {
	for _, l := range res.leases {
		if l.policy.kind != kindShed {
			return true
		}
	}
	return false
}

// retryReleases keeps releases the store did not take, to send again
// (Redis; in process, a release never fails).
func (res *admission) retryReleases(rels []bucketRequest, policies []*Policy) {
	if ls, ok := res.decidedBy.(leaseStore); ok && len(rels) > 0 {
		ls.retryReleases(rels, policies)
	}
}
