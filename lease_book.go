package ratelimit

import (
	"sync"
	"time"
)

// The Redis lease book: the concurrency slots an instance holds in Redis
// are leases that run out, because the instance holding one may die. The
// book renews them while their requests run (one call per instance per
// interval for all its leases), puts back those Redis lost (a flush, a
// failover), and sends again the releases Redis did not confirm, until it
// does or their leases have run out anyway. It is the lease interface
// (leaseKeeper, slots.go) of the Redis store.

const (
	// renewEvery is how often, at most, the renewer looks for leases due:
	// those whose last renewal was sent a third of their lease ago. A
	// shorter lease is looked at every twelfth of it, so that a renewal
	// sent up to a twelfth late, and a third of the lease on its way to
	// Redis, still lands before the lease runs out.
	renewEvery = 250 * time.Millisecond
	// retryEvery is how soon a release that could not reach the store is
	// sent again: until it is made, or its lease has run out anyway.
	retryEvery = 100 * time.Millisecond
)

// leaseBook is the leases a Redis connection's instance holds, renewed in
// the background while they are held, and the releases the store has not
// confirmed yet, sent again until it does.
type leaseBook struct {
	// What it needs of its connection: a script call past the circuit
	// breaker (one slot's requests in a Cluster), the store's work after
	// responses (decideAfter), and the end of the connection.
	call        func(batch []*pending)
	cluster     bool
	decideAfter func(reqs []bucketRequest, then func(decision, error))
	closed      <-chan struct{}

	mu      sync.Mutex
	leases  map[string]*bookedLease
	pending map[string]*pendingRelease
	tick    time.Duration // how often the renewer looks
	running bool
}

type bookedLease struct {
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

// The lease interface (leaseKeeper) of the Redis store.

func (b *leaseBook) renewLeases(leases []lease) { b.hold(leases) }

func (b *leaseBook) leased() bool { return true }

var _ leaseKeeper = (*leaseBook)(nil)

// hold registers leases to renew, starting the renewer the first time.
func (b *leaseBook) hold(leases []lease) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.leases == nil {
		b.leases, b.pending, b.tick = map[string]*bookedLease{}, map[string]*pendingRelease{}, renewEvery
	}
	now := time.Now()
	for _, l := range leases {
		b.leases[l.rq.lease] = &bookedLease{rq: l.rq, policy: l.policy, renewed: now}
		b.tick = min(b.tick, leaseOf(l.rq)/12)
	}
	if !b.running {
		b.running = true
		go b.renew()
	}
}

func leaseOf(rq bucketRequest) time.Duration {
	return time.Duration(rq.limit.interval) * time.Microsecond
}

// releasing takes leases out of the book, no longer renewed: the requests
// that free them in the store, for the caller to send.
func (b *leaseBook) releasing(leases []lease) (rels []bucketRequest, policies []*Policy) {
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
func (b *leaseBook) sendReleases(rels []bucketRequest, policies []*Policy) {
	b.decideAfter(rels, func(_ decision, err error) {
		if err != nil {
			b.retryReleases(rels, policies)
			return
		}
		for _, rq := range rels {
			slotQueues.wake(rq.key)
		}
	})
}

// retryReleases keeps releases that failed, to send again.
func (b *leaseBook) retryReleases(rels []bucketRequest, policies []*Policy) {
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
func (b *leaseBook) renew() {
	for {
		b.mu.Lock()
		tick := b.tick
		b.mu.Unlock()
		select {
		case <-b.closed:
			return
		case <-time.After(tick):
		}
		var due []*bookedLease
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
			go b.renewNow(due, reqs, retries)
		}
	}
}

// renewNow sends the renewals, restores and retried releases of one tick
// (due's first, then retries'), each its own request so that one bad key
// fails alone, in one script call (one per slot in cluster mode), and
// records what the store said.
func (b *leaseBook) renewNow(due []*bookedLease, reqs []bucketRequest, retries []*pendingRelease) {
	results := make([]*pending, len(reqs))
	groups := [][]int{nil}
	for i := range reqs {
		results[i] = newPending(reqs[i:i+1], nil)
		groups[0] = append(groups[0], i)
	}
	if b.cluster {
		groups = hashSlotGroups(reqs)
	}
	for _, g := range groups {
		batch := make([]*pending, len(g))
		for k, i := range g {
			batch[k] = results[i]
		}
		b.call(batch)
	}
	var rels []bucketRequest
	var relPolicies []*Policy
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
	var restores []*bookedLease
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
		b.retryReleases(rels, relPolicies)
	}
	if len(restores) > 0 {
		b.renewNow(restores, restoreReqs, nil)
	}
}
