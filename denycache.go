package ratelimit

import "sync"

// denyCache lets a Redis-backed store deny, without a round trip, a request
// that certainly cannot fit. After each decision Redis reports a bucket's
// TAT at its own time; decisions (on any instance) can only move a TAT
// forward, so that TAT is a lower bound on the bucket's state from then on.
// Redis's clock cannot have run ahead of ours by more than the time since
// we sent the request that learned it, so a request whose cost cannot be
// covered before that bound is one Redis would deny.
//
// What Redis holds is the truth, and an operator may change it (a DEL, a
// FLUSHALL, a reset or grant): nothing the cache learned is used after
// denyMaxAge. A reset or grant through the admin API also clears the
// bucket on every instance at once. (Refunds across Redis Cluster slots
// move TATs back, so the cache is off in cluster mode.)
//
// Only near-empty buckets are remembered: a bucket with tokens to spare
// cannot deny the next request, and so costs nothing here. Memory is
// bounded (denyMaxBuckets) whatever clients send.
type denyCache struct {
	shards  [denyShards]denyShard
	ids     bucketIDs
	now     func() int64 // µs on a monotonic clock
	flights flights
}

const (
	denyShards = 64
	// denyMaxAge is how long, in µs, what a decision said of a bucket is
	// used: a change made in Redis takes effect on every instance within it.
	denyMaxAge = 1_000_000
	// denyMaxBuckets bounds the buckets remembered (about 90 bytes each).
	denyMaxBuckets = 1 << 16
	denyShardMax   = denyMaxBuckets / denyShards
	denyMinSweep   = 64
)

type denyShard struct {
	mu      sync.Mutex
	known   map[bucketID]knownBucket // pointer-free: nothing for the GC to scan
	sweepAt int
	// forgotten are buckets an operator changed, and when: a reply to a
	// call sent before that says nothing of them any more.
	forgotten map[bucketID]int64
}

// knownBucket is what one Redis reply said of a bucket.
type knownBucket struct {
	limit    limit
	tat      int64 // the bucket's TAT after that decision, Redis µs
	redisNow int64 // Redis's clock in that decision
	sent     int64 // our clock when the request was sent
	received int64 // our clock when the reply came back
}

func newDenyCache(now func() int64) *denyCache {
	c := &denyCache{ids: newBucketIDs(), now: now, flights: flights{m: make(map[bucketID]*flight)}}
	for i := range c.shards {
		c.shards[i].known = make(map[bucketID]knownBucket)
		c.shards[i].sweepAt = denyMinSweep
	}
	return c
}

// bucket is where the cache keeps what it knows of the bucket stored
// under key (see bucketID).
func (c *denyCache) bucket(key string) (*denyShard, bucketID) {
	id := c.ids.of(key)
	return &c.shards[id[0]%denyShards], id
}

// denyAnswer is what the cache can say of a request.
type denyAnswer int

const (
	// unknown: some bucket is not remembered; the request goes to Redis.
	unknown denyAnswer = iota
	// denied: some bucket certainly cannot fit.
	denied
	// uncertain: every bucket is remembered but none certainly denies (a
	// token may have come, or what is known is too old). Requests for such
	// a bucket go to Redis one flight at a time (see flights): its answer
	// tells the cache about the others.
	uncertain
)

// deny answers a request from what the cache knows: with denied, a
// decision denying it (every non-shadow bucket known, one certainly unable
// to fit); with uncertain, the bucket to wait for.
func (c *denyCache) answer(reqs []bucketRequest) (d decision, answer denyAnswer, gate bucketID) {
	now := c.now()
	var vbuf [4]verdict
	verdicts := vbuf[:0]
	certain, gated := false, false
	latestRedisNow, earliestRedisNow := int64(0), int64(0)
	for _, rq := range reqs {
		if rq.shadow || !rq.op.admits() {
			verdicts = append(verdicts, verdict{allowed: true, limit: rq.limit}) // not reported on a denial
			continue
		}
		if rq.kind() == quotaBucket {
			// A count starts again from 0 at its boundary: not a lower bound.
			return decision{}, unknown, gate
		}
		if rq.cost > rq.limit.burst {
			certain = true
			verdicts = append(verdicts, verdict{untilFits: neverFits, limit: rq.limit})
			continue
		}
		if rq.givesBack || rq.kind() == slotsBucket || rq.overridable {
			// An override's limit is known only to the script: no denial is
			// decided on a limit that may be stale.
			return decision{}, unknown, gate
		}
		s, id := c.bucket(rq.key)
		s.mu.Lock()
		k, found := s.known[id]
		s.mu.Unlock()
		if !found || k.limit != rq.limit {
			return decision{}, unknown, gate
		}
		if now-k.received > denyMaxAge { // too old: Redis must say again
			return decision{}, uncertain, id
		}
		if !gated {
			gate, gated = id, true
		}
		latest := k.redisNow + (now - k.sent)       // Redis's clock can be no later
		earliest := k.redisNow + (now - k.received) // nor earlier, give or take drift
		latestRedisNow, earliestRedisNow = max(latestRedisNow, latest), max(earliestRedisNow, earliest)
		v := verdict{allowed: true, limit: rq.limit}
		wait := rq.wait
		if rq.op == opCheck {
			wait = 0
		}
		fitsAt := k.tat + rq.cost*rq.limit.interval - rq.limit.tau() // Redis time
		if latest < fitsAt-wait {
			certain = true
			v.allowed = false
			v.untilFits = fitsAt - earliest
		}
		v.remaining, _ = rq.limit.tokens(start(k.tat, earliest), earliest)
		if v.allowed {
			_, v.untilFits = rq.limit.tokens(start(k.tat, earliest), earliest)
		}
		verdicts = append(verdicts, v)
	}
	switch {
	case certain:
		return decision{now: earliestRedisNow, verdicts: append([]verdict(nil), verdicts...)}, denied, gate
	case gated:
		return decision{}, uncertain, gate
	}
	return decision{}, unknown, gate
}

// learn records what a Redis decision said of its buckets.
func (c *denyCache) learn(reqs []bucketRequest, d decision, tats []int64, sent, received int64) {
	for i, rq := range reqs {
		if rq.shadow || !rq.op.admits() || rq.givesBack || rq.kind() != rateBucket || rq.overridable {
			continue
		}
		s, id := c.bucket(rq.key)
		near := d.verdicts[i].remaining < rq.cost || !d.verdicts[i].allowed
		s.mu.Lock()
		if at, ok := s.forgotten[id]; ok {
			if sent <= at {
				s.mu.Unlock()
				continue
			}
			if received-at > denyMaxAge {
				delete(s.forgotten, id)
			}
		}
		if near {
			if len(s.known) >= s.sweepAt {
				s.sweep(received)
			}
			s.known[id] = knownBucket{limit: rq.limit, tat: tats[i], redisNow: d.now, sent: sent, received: received}
		} else if _, found := s.known[id]; found {
			delete(s.known, id)
		}
		s.mu.Unlock()
	}
}

// forget drops what the cache knows of the bucket under key: an operator
// changed it.
func (c *denyCache) forget(key string) {
	s, id := c.bucket(key)
	now := c.now()
	s.mu.Lock()
	delete(s.known, id)
	if s.forgotten == nil || len(s.forgotten) >= denyShardMax {
		s.forgotten = map[bucketID]int64{}
	}
	s.forgotten[id] = now
	s.mu.Unlock()
}

// sweep drops buckets that are too old to use or have certainly refilled
// since; if the shard is still at its bound, it forgets them all (the cache
// only saves round trips).
func (s *denyShard) sweep(now int64) {
	for key, k := range s.known {
		if now-k.received > denyMaxAge || k.redisNow+(now-k.received) >= k.tat {
			delete(s.known, key)
		}
	}
	if len(s.known) >= denyShardMax {
		clear(s.known)
	}
	s.sweepAt = min(denyShardMax, max(denyMinSweep, 2*len(s.known)))
}

// flights sends the requests for one uncertain bucket to Redis one flight
// at a time. A flight is the requests in one round trip for a bucket;
// requests that find one in the air board the next, which takes off, all
// its members together, when the one in the air lands: by then the cache
// knows what Redis said, and most of them are denied without a call. A
// flood on one bucket costs one round trip at a time, not one per request.
type flights struct {
	mu sync.Mutex
	m  map[bucketID]*flight
}

type flight struct {
	members int
	landed  chan struct{}
	next    *flight
}

// board returns the flight a request for bucket id flies with; when after
// is not nil, that flight takes off once after is closed.
func (fs *flights) board(id bucketID) (mine *flight, after <-chan struct{}) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	f := fs.m[id]
	if f == nil {
		f = &flight{members: 1, landed: make(chan struct{})}
		fs.m[id] = f
		return f, nil
	}
	if f.next == nil {
		f.next = &flight{landed: make(chan struct{})}
	}
	f.next.members++
	return f.next, f.landed
}

// land records that one member of flight f (for bucket id) is done; the
// last to land lets the next flight take off.
func (fs *flights) land(id bucketID, f *flight) {
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if f.members--; f.members > 0 {
		return
	}
	if f.next != nil {
		fs.m[id] = f.next
	} else {
		delete(fs.m, id)
	}
	close(f.landed)
}
