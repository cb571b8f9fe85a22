package ratelimit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// What a request holds: its concurrency slots and its held places.
//
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
	// slotPoll is how often a waiting request at the head of its queue
	// tries again without having been woken: a slot whose lease expired
	// (its holder vanished) frees no event.
	slotPoll = 250 * time.Millisecond
)

// lease is one slot a request holds.
type lease struct {
	policy *Policy
	rq     bucketRequest // its opAcquire
	// mirrored: taken in Redis, and counted in the `local` fallback's
	// slots too (see mirrorSlots).
	mirrored bool
}

// leaseKeeper is how a store keeps the slots it admitted until their
// requests end: the lease interface of both stores. In Redis, a slot is a
// lease that runs out, because the instance holding one may die
// (lease_book.go): renewed while its request runs, released after the
// response, a release that fails sent again until it lands or its lease has
// run out anyway. In process, a slot lasts until it is freed, which never
// fails: nothing to renew, nothing to send again.
type leaseKeeper interface {
	// renewLeases keeps leases an admitted request took renewed until they
	// are released.
	renewLeases(leases []lease)
	// releasing stops renewing leases: the requests that free them, for
	// the caller to send (sendReleases).
	releasing(leases []lease) (rels []bucketRequest, policies []*Policy)
	// sendReleases frees slots with the store's next call, and wakes this
	// instance's requests waiting for them once they are free; a release
	// that fails is kept, to send again.
	sendReleases(rels []bucketRequest, policies []*Policy)
	// retryReleases keeps releases the store did not take, to send again.
	retryReleases(rels []bucketRequest, policies []*Policy)
	// leased reports whether the slots are leases in a store that may go
	// away while their requests run: the `local` fallback then counts them
	// too (mirrorSlots).
	leased() bool
}

// slotStore is a store that keeps its slots its own way: it names its
// lease interface. Both stores are; a store that is not (a test's) keeps
// them as the in-process one does.
type slotStore interface {
	slotLeases() leaseKeeper
}

var (
	_ slotStore = (*redisStore)(nil)
	_ slotStore = (*memoryStore)(nil)
)

// leasesOf is the lease interface of the store s.
func leasesOf(s store) leaseKeeper {
	if ss, ok := s.(slotStore); ok {
		return ss.slotLeases()
	}
	return freedAtOnce{s}
}

// freedAtOnce keeps slots in a store whose slots last until they are
// freed, which never fails: the in-process one.
type freedAtOnce struct{ s store }

func (freedAtOnce) renewLeases([]lease) {}

func (freedAtOnce) releasing(leases []lease) (rels []bucketRequest, policies []*Policy) {
	for _, l := range leases {
		rq := l.rq
		rq.op = opRelease
		rels, policies = append(rels, rq), append(policies, l.policy)
	}
	return rels, policies
}

func (f freedAtOnce) sendReleases(rels []bucketRequest, _ []*Policy) {
	_, _ = f.s.decide(context.Background(), rels)
	for _, rq := range rels {
		slotQueues.wake(rq.key)
	}
}

func (freedAtOnce) retryReleases([]bucketRequest, []*Policy) {}

func (freedAtOnce) leased() bool { return false }

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
	for _, pt := range res.decidedParts() {
		if pt.rq.op != opAcquire {
			continue
		}
		if !pt.v.allowed {
			continue // a shadow policy's slot, not taken
		}
		res.leases = append(res.leases, lease{policy: pt.policy, rq: pt.rq})
		pt.policy.slots.inFlight.Inc()
	}
	if len(res.leases) == 0 {
		return
	}
	if lk := leasesOf(res.decidedBy); lk.leased() {
		lk.renewLeases(res.leases)
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
	rels, policies := res.slotReleases(func(lease) bool { return true })
	if len(rels) > 0 {
		leasesOf(res.decidedBy).sendReleases(rels, policies)
	}
}

// callerSlotReleases takes the request's slots of a caller's budget off its
// hands (a shed policy's it keeps until its handler chain returns): the
// requests that free them, for finish to send with the charges.
func (res *admission) callerSlotReleases() (rels []bucketRequest, policies []*Policy) {
	return res.slotReleases(func(l lease) bool { return l.policy.kind.caller() })
}

// slotReleases takes the request's slots that free says off its hands:
// the requests that free them in the store that decided it, for the
// caller to send.
func (res *admission) slotReleases(free func(lease) bool) (rels []bucketRequest, policies []*Policy) {
	kept := res.leases[:0]
	var freed []lease
	for _, l := range res.leases {
		if !free(l) {
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
	return leasesOf(res.decidedBy).releasing(freed)
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
		if l.policy.kind.caller() {
			return true
		}
	}
	return false
}

// releasesSent follows up releases of the request's slots sent with other
// work (finish.go): the requests this instance has waiting for them try
// once they are free; a release the store did not take (err) is kept, to
// send again (Redis; in process, a release never fails).
func (res *admission) releasesSent(rels []bucketRequest, policies []*Policy, err error) {
	if err != nil {
		if len(rels) > 0 {
			leasesOf(res.decidedBy).retryReleases(rels, policies)
		}
		return
	}
	for _, rq := range rels {
		slotQueues.wake(rq.key)
	}
}

// Held places: a policy with `wait` holds at most MaxHeld requests at once
// on this instance, those waiting for a reserved turn or a free slot.

// takeHeldPlace takes one of the policy's places for a held request: false when all
// MaxHeld are taken, or when the policy never waits.
func (p *Policy) takeHeldPlace() bool {
	if p.Wait == 0 || p.shadow {
		return false
	}
	if p.held.n.Add(1) > int64(p.MaxHeld) {
		p.held.n.Add(-1)
		return false
	}
	return true
}

// giveHeldPlace gives back a place taken by hold.
func (p *Policy) giveHeldPlace() { p.held.n.Add(-1) }

// waitForSlot holds a request denied only for want of concurrency slots,
// on policies that `wait`, until its decision admits it (taking the slot as
// soon as one is freed, in arrival order among this instance's waiters),
// the wait runs out, or the client goes away. It returns the last
// decision.
func (h *Handler) waitForSlot(r *http.Request, res *admission, reqs []bucketRequest, d decision) (decision, error) {
	var key string
	var wait time.Duration
	for i, v := range d.verdicts {
		p := res.parts[i].policy
		if v.allowed || p.shadow {
			continue
		}
		if reqs[i].op != opAcquire || p.Wait == 0 {
			return d, nil // denied by more than a full set of slots
		}
		if key == "" {
			key = reqs[i].key
		}
		wait = max(wait, time.Duration(p.Wait))
	}
	// A place among the requests each policy holds at once, for the wait.
	var held []*Policy
	defer func() {
		for _, p := range held {
			p.held.gauge.Dec()
			p.giveHeldPlace()
		}
	}()
	for i, v := range d.verdicts {
		if p := res.parts[i].policy; !v.allowed && !p.shadow {
			if !p.takeHeldPlace() {
				return d, nil
			}
			held = append(held, p)
			p.held.gauge.Inc()
		}
	}
	w := slotQueues.join(key)
	defer slotQueues.leave(key, w)
	deadline := time.NewTimer(wait)
	defer deadline.Stop()
	poll := time.NewTicker(slotPoll)
	defer poll.Stop()
	for {
		select {
		case <-w:
		case <-poll.C:
		case <-deadline.C:
			return d, nil
		case <-r.Context().Done():
			return d, nil
		}
		if !slotQueues.first(key, w) {
			continue
		}
		next, err := h.store.decide(r.Context(), reqs)
		if err != nil || next.admitted {
			return next, err
		}
		d = next
	}
}

// holdUntilDue holds an admitted request until the time its `wait`
// reserved. It returns false when the client went away first.
func (res *admission) holdUntilDue(r *http.Request) bool {
	res.heldNow = res.heldNowBuf[:0]
	for _, p := range res.heldPlaces {
		for _, pt := range res.decidedParts() {
			if pt.policy == p && pt.v.delay > 0 {
				res.heldNow = append(res.heldNow, p)
				p.held.gauge.Inc()
			}
		}
	}
	if res.d.delay <= 0 {
		return true
	}
	timer := time.NewTimer(time.Duration(res.d.delay) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// giveBack gives back what the request holds: its `wait` places and its
// concurrency slots. It is safe to call more than once.
func (res *admission) giveBack() {
	for _, p := range res.heldNow {
		p.held.gauge.Dec()
	}
	for _, p := range res.heldPlaces {
		p.giveHeldPlace()
	}
	res.heldNow, res.heldPlaces = nil, nil
	res.freeSlots()
}
