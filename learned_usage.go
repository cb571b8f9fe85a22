package ratelimit

import (
	"strconv"
	"strings"
	"time"
)

// Learned usage: what a key's requests used beyond what they reserved.
// A request's reservation is an estimate (the body's max_tokens and its
// prompt at 4 bytes a token); a key whose requests keep using more (dense
// prompts, input the body does not show that no rule recognises) would
// otherwise have a whole wave of them admitted against a budget they then
// overrun. So each key of a `settle` rate policy remembers the usage of its
// last learnRecords settles that used more than their own reservation (a
// settle within it is remembered as 0), and a request reserves at least
// the largest of them, at most the burst (so that it can still pass, alone).
// A key whose requests stay within their reservations remembers nothing,
// and pays nothing for it; one that changed its ways forgets within
// learnRecords settles, or learnTTL after its last.
//
// The memory is kept beside the bucket, under <bucket key>:usage, in the
// bucket's Redis Cluster hash slot (its hash tag), as "l1 <u1> <u2> ..." newest
// first: written by the script call that settles, read by the call that
// reserves (no round trip of its own), expiring learnTTL after it was last
// written. The release before this one never reads it. In process, the
// store keeps the same records (memoryShard.learned), bounded.

// learnRecords is how many settles a key remembers.
const learnRecords = 8

// learnTTL is how long a key's learned usage outlives its last settle.
const learnTTL = 24 * time.Hour

// learnedSuffix names the key of a bucket's learned usage.
const learnedSuffix = ":usage"

// learnedUsage is a key's last settles' usage, newest first.
type learnedUsage struct {
	records [learnRecords]int64
	n       int
}

// max is the largest usage remembered, 0 for none.
func (l *learnedUsage) max() int64 {
	m := int64(0)
	for _, u := range l.records[:l.n] {
		m = max(m, u)
	}
	return m
}

// push remembers a settle's usage (0: within its own reservation), and
// reports whether it changed anything: a 0 to remember among nothing but
// 0s changes nothing, and once all are 0 the key has forgotten.
func (l *learnedUsage) push(u int64) bool {
	if u <= 0 && l.max() == 0 {
		return false
	}
	copy(l.records[1:], l.records[:learnRecords-1])
	l.records[0], l.n = u, min(l.n+1, learnRecords)
	if l.max() == 0 {
		*l = learnedUsage{}
	}
	return true
}

// encodeLearned is the value Redis holds for l ("l1 <u1> <u2> ...");
// empty when it remembers nothing worth keeping (the key is deleted).
func encodeLearned(l learnedUsage) string {
	if l.max() == 0 {
		return ""
	}
	b := []byte("l1")
	for _, u := range l.records[:l.n] {
		b = append(b, ' ')
		b = strconv.AppendInt(b, u, 10)
	}
	return string(b)
}

// decodeLearned reads a value as the script reads it: anything that is
// not "l1" followed by whole numbers below 2^53 is no memory; more than
// learnRecords numbers keep the first ones.
func decodeLearned(v string) learnedUsage {
	var l learnedUsage
	rest, ok := strings.CutPrefix(v, "l1")
	if !ok || strings.Trim(rest, " 0123456789") != "" {
		return l
	}
	for _, n := range strings.Fields(rest) {
		if len(n) > 16 {
			return learnedUsage{}
		}
		if l.n < learnRecords {
			u, _ := strconv.ParseInt(n, 10, 64)
			l.records[l.n] = u
			l.n++
		}
	}
	return l
}

// learns reports whether the policy's keys learn their usage: a rate
// policy that settles. (A quota's count is charged in full within its
// period, and starts again from 0.)
func (p *Policy) learns() bool {
	return p.kind == kindRate && p.charging() == chargedBySettle
}

// learnedCost is the cost a take of rq is decided with when its key has
// learned the usage learned: at least that, at most the burst of the limit
// it is decided under (a cost that never fits stays as it is).
func (rq bucketRequest) learnedCost(learned int64) int64 {
	if !rq.learns || rq.op != opTake {
		return rq.cost
	}
	return max(rq.cost, min(learned, rq.limit.burst))
}

// withLearned is reqs with the takes of the buckets that learn raised to
// what their keys learned (learned[i], for reqs[i]): reqs itself when none
// changes.
func withLearned(reqs []bucketRequest, learned []int64) []bucketRequest {
	out := reqs
	for i, rq := range reqs {
		c := rq.learnedCost(learned[i])
		if c == rq.cost {
			continue
		}
		out = ownCopy(out, reqs)
		out[i].cost = c
	}
	return out
}

// reserved updates a request of a decision with what it reserved: the
// cost a bucket that learns was decided with (raised to what its key
// learned, v.cost), keeping the request's own in asked; a settle then
// charges what it used against what was reserved, and remembers a usage
// beyond asked.
func (rq *bucketRequest) reserved(v verdict) {
	if rq.learns {
		rq.asked = rq.cost
		if v.cost > rq.cost {
			rq.cost = v.cost
		}
	}
}

// remember sets the usage a settle of rq (an adjust) remembers: the usage,
// when it is more than the request's own reservation, 0 otherwise.
func (rq *bucketRequest) remember(usage int64) {
	rq.record = 0
	if usage > rq.asked {
		rq.record = usage
	}
}

// learnedOf is the usage the key of the bucket id remembers at now (in
// process), for a request that learns.
func (s *memoryShard) learnedOf(id bucketID, now int64) learnedUsage {
	l, ok := s.learned[id]
	if !ok || l.expires <= now {
		return learnedUsage{}
	}
	return l.usage
}

// storedLearned is a key's learned usage in process, and when it expires.
type storedLearned struct {
	usage   learnedUsage
	expires int64
}

// learnedMaxKeys bounds the learned usage one shard of an in-process
// store keeps; beyond it, it forgets the expired ones, then any quarter.
const learnedMaxKeys = shardMaxBuckets / 4

// applyLearned remembers (opAdjust) or forgets (opReset) usage for the key
// of the bucket id, after a decision.
func (s *memoryShard) applyLearned(id bucketID, rq bucketRequest, now int64) {
	switch rq.op {
	case opReset:
		delete(s.learned, id)
	case opAdjust:
		l := s.learnedOf(id, now)
		if !l.push(rq.record) {
			return
		}
		if l.max() == 0 {
			delete(s.learned, id)
			return
		}
		if s.learned == nil {
			s.learned = map[bucketID]storedLearned{}
		}
		if _, ok := s.learned[id]; !ok && len(s.learned) >= learnedMaxKeys {
			s.sweepLearned(now)
		}
		s.learned[id] = storedLearned{usage: l, expires: now + int64(learnTTL/time.Microsecond)}
	}
}

// sweepLearned drops the expired learned usage and, if the shard is still
// at its bound, a quarter of the rest.
func (s *memoryShard) sweepLearned(now int64) {
	for id, l := range s.learned {
		if l.expires <= now {
			delete(s.learned, id)
		}
	}
	drop := len(s.learned) - learnedMaxKeys*3/4
	for id := range s.learned {
		if drop <= 0 {
			break
		}
		delete(s.learned, id)
		drop--
	}
}
