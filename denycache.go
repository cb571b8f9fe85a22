package ratelimit

import "sync"

// denyCache lets a Redis-backed store deny, without a round trip, a request
// that certainly cannot fit. After each decision Redis reports a bucket's
// TAT at its own time; other requests (on any instance) can only move a TAT
// forward, so that TAT is a lower bound on the bucket's state from then on.
// Redis's clock cannot have run ahead of ours by more than the time since
// we sent the request that learned it, so a request whose cost cannot be
// covered before that bound is one Redis would deny: denying it locally is
// never wrong. (Refunds across Redis Cluster slots move TATs back, so the
// cache is off in cluster mode; FLUSHALL forgets buckets, and the cache
// keeps denying until the TAT it knew has passed: at most the wait it
// reported.)
//
// Only near-empty buckets are remembered: a bucket with tokens to spare
// cannot deny the next request, and so costs nothing here.
type denyCache struct {
	shards [denyShards]denyShard
	ids    bucketIDs
	now    func() int64 // µs on a monotonic clock
}

const denyShards = 64

type denyShard struct {
	mu      sync.Mutex
	known   map[bucketID]knownBucket // pointer-free: nothing for the GC to scan
	sweepAt int
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
	c := &denyCache{ids: newBucketIDs(), now: now}
	for i := range c.shards {
		c.shards[i].known = make(map[bucketID]knownBucket)
		c.shards[i].sweepAt = minSweep
	}
	return c
}

// bucket is where the cache keeps what it knows of the bucket stored
// under key (see bucketID).
func (c *denyCache) bucket(key string) (*denyShard, bucketID) {
	id := c.ids.of(key)
	return &c.shards[id[0]%denyShards], id
}

// deny returns a decision denying reqs when every non-shadow bucket is
// known and at least one certainly cannot fit; ok is false otherwise, and
// the request must go to Redis.
func (c *denyCache) deny(reqs []bucketRequest) (d decision, ok bool) {
	now := c.now()
	var vbuf [4]verdict
	verdicts := vbuf[:0]
	denied := false
	latestRedisNow, earliestRedisNow := int64(0), int64(0)
	for _, rq := range reqs {
		if rq.shadow {
			verdicts = append(verdicts, verdict{allowed: true}) // not reported on a denial
			continue
		}
		if rq.cost > rq.limit.burst {
			denied = true
			verdicts = append(verdicts, verdict{wait: neverWait})
			continue
		}
		s, id := c.bucket(rq.key)
		s.mu.Lock()
		k, found := s.known[id]
		s.mu.Unlock()
		if !found || k.limit != rq.limit {
			return decision{}, false
		}
		latest := k.redisNow + (now - k.sent)       // Redis's clock can be no later
		earliest := k.redisNow + (now - k.received) // nor earlier, give or take drift
		latestRedisNow, earliestRedisNow = max(latestRedisNow, latest), max(earliestRedisNow, earliest)
		v := verdict{allowed: true}
		fitsAt := k.tat + rq.cost*rq.limit.interval - rq.limit.tau() // Redis time
		if latest < fitsAt-rq.wait {
			denied = true
			v.allowed = false
			v.wait = fitsAt - earliest
		}
		v.remaining, _ = rq.limit.tokens(start(k.tat, earliest), earliest)
		if v.allowed {
			_, v.wait = rq.limit.tokens(start(k.tat, earliest), earliest)
		}
		verdicts = append(verdicts, v)
	}
	if !denied {
		return decision{}, false
	}
	return decision{now: earliestRedisNow, verdicts: append([]verdict(nil), verdicts...)}, true
}

// learn records what a Redis decision said of its buckets.
func (c *denyCache) learn(reqs []bucketRequest, d decision, tats []int64, sent, received int64) {
	for i, rq := range reqs {
		if rq.shadow {
			continue
		}
		s, id := c.bucket(rq.key)
		near := d.verdicts[i].remaining < rq.cost || !d.verdicts[i].allowed
		s.mu.Lock()
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

// sweep drops buckets that have certainly refilled to full since.
func (s *denyShard) sweep(now int64) {
	for key, k := range s.known {
		if k.redisNow+(now-k.received) >= k.tat {
			delete(s.known, key)
		}
	}
	s.sweepAt = max(minSweep, 2*len(s.known))
}
