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
	// renewEvery is how often the renewer looks for leases due: those
	// renewed more than a third of their lease ago.
	renewEvery = 250 * time.Millisecond
	// slotPoll is how often a waiting request at the head of its queue
	// tries again without having been woken: a slot whose lease expired
	// (its holder vanished) frees no event.
	slotPoll = 250 * time.Millisecond
)

// lease is one slot a request holds.
type lease struct {
	policy *Policy
	rq     bucketRequest // its opAcquire
}

// leaseBook is the leases a Redis connection's instance holds, renewed in
// the background while they are held.
type leaseBook struct {
	mu      sync.Mutex
	leases  map[string]*heldLease
	running bool
}

type heldLease struct {
	rq      bucketRequest
	renewed time.Time
}

// hold registers leases to renew, starting the renewer the first time.
func (c *redisConn) hold(leases []lease) {
	b := &c.leases
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.leases == nil {
		b.leases = map[string]*heldLease{}
	}
	now := time.Now()
	for _, l := range leases {
		b.leases[l.rq.lease] = &heldLease{rq: l.rq, renewed: now}
	}
	if !b.running {
		b.running = true
		go c.renew()
	}
}

// drop stops renewing leases.
func (c *redisConn) drop(leases []lease) {
	b := &c.leases
	b.mu.Lock()
	for _, l := range leases {
		delete(b.leases, l.rq.lease)
	}
	b.mu.Unlock()
}

// renew renews the leases due, every renewEvery, in one script call (one
// per slot in cluster mode), until the connection closes.
func (c *redisConn) renew() {
	t := time.NewTicker(renewEvery)
	defer t.Stop()
	for range t.C {
		if c.events.isClosed() {
			return
		}
		now := time.Now()
		var due []bucketRequest
		c.leases.mu.Lock()
		for _, l := range c.leases.leases {
			if now.Sub(l.renewed) >= time.Duration(l.rq.limit.interval)*time.Microsecond/3 {
				l.renewed = now
				rq := l.rq
				rq.op = opRenew
				due = append(due, rq)
			}
		}
		c.leases.mu.Unlock()
		if len(due) == 0 {
			continue
		}
		groups := [][]bucketRequest{due}
		if c.cluster {
			groups = nil
			for _, idx := range slotGroups(due) {
				groups = append(groups, pick(due, idx))
			}
		}
		for _, g := range groups {
			// Each lease its own request, so that one bad key fails alone.
			batch := make([]*pending, len(g))
			for i := range g {
				batch[i] = newPending(g[i:i+1], nil)
			}
			c.call(batch)
			for _, p := range batch {
				p.release()
			}
		}
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

// waitForSlot holds a request denied only for want of concurrency slots,
// on policies that `wait`, until its decision admits it (taking the slot as
// soon as one is freed, in arrival order among this instance's waiters),
// the wait runs out, or the client goes away. It returns the last
// decision.
func (h *Handler) waitForSlot(r *http.Request, res *reservation, d decision) (decision, error) {
	var key string
	var wait time.Duration
	for i, v := range d.verdicts {
		p := res.policies[i]
		if v.allowed || p.shadow {
			continue
		}
		if res.reqs[i].op != opAcquire || p.Wait == 0 {
			return d, nil // denied by more than a full set of slots
		}
		if key == "" {
			key = res.reqs[i].key
		}
		wait = max(wait, time.Duration(p.Wait))
	}
	// A place among the requests each policy holds at once, for the wait.
	var held []*Policy
	defer func() {
		for _, p := range held {
			p.waiting.Dec()
			p.release()
		}
	}()
	for i, p := range res.policies {
		if !d.verdicts[i].allowed && !p.shadow {
			if !p.hold() {
				return d, nil
			}
			held = append(held, p)
			p.waiting.Inc()
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
		next, err := h.store.decide(r.Context(), res.reqs)
		if err != nil || next.admitted {
			return next, err
		}
		d = next
	}
}

// takeSlots records the slots an admitted request holds in the store that
// decided it: renewed while it runs, freed by release.
func (res *reservation) takeSlots() {
	res.leases = res.leasebuf[:0]
	for i, p := range res.shown {
		rq := res.shownReqs[i]
		if rq.op != opAcquire {
			continue
		}
		v := res.d.verdicts[i]
		if v.expired > 0 {
			p.leasesExpired.Add(float64(v.expired))
		}
		if !v.allowed {
			continue // a shadow policy's slot, not taken
		}
		res.leases = append(res.leases, lease{policy: p, rq: rq})
		p.inFlight.Inc()
	}
	if len(res.leases) == 0 {
		return
	}
	if rs, ok := res.decidedBy.(*redisStore); ok {
		rs.conn.hold(res.leases)
	}
}

// freeSlots frees the request's slots, in one store call, and wakes the
// requests this instance has waiting for them.
func (res *reservation) freeSlots() {
	if len(res.leases) == 0 {
		return
	}
	var rels []bucketRequest
	for _, l := range res.leases {
		rq := l.rq
		rq.op = opRelease
		rels = append(rels, rq)
		l.policy.inFlight.Dec()
	}
	if rs, ok := res.decidedBy.(*redisStore); ok {
		rs.conn.drop(res.leases)
	}
	// A slot not freed (the store unreachable) comes back when its lease
	// expires.
	_, _ = res.decidedBy.decide(context.Background(), rels)
	for _, rq := range rels {
		slotQueues.wake(rq.key)
	}
	res.leases = nil
}
