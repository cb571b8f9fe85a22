package ratelimit

import (
	"math/bits"
	"slices"
	"strconv"
	"strings"
	"time"
)

// Learned usage: what a key's requests used beyond what they reserved.
// A request's reservation is an estimate (the body's max_tokens and its
// prompt at 4 bytes a token); a key whose requests keep using more (dense
// prompts, input the body does not show that no rule recognises) would
// otherwise have a whole wave of them admitted against a budget they then
// overrun. So each key of a `settle` rate policy remembers, for its last
// learnRecords settles, how much each used beyond its own reservation
// (its excess: 0 within it) and the class of that reservation (its size,
// by powers of two: requests alike in size, and those that hide input,
// which all reserve max, are one class). A request reserves its own cost
// plus a high percentile of the excess its class remembers (the largest
// while few are remembered, the second largest from five on), at most the
// burst: what like requests used, not the worst any request did. One
// honest large call does not raise the small ones after it, nor a single
// outlier its class for long; a class whose requests stay within their
// reservations remembers nothing, and pays nothing for it. A key forgets
// within learnRecords settles within their reservations, or learnTTL after
// its last.
//
// The memory is kept beside the bucket, under <bucket key>:usage, in the
// bucket's Redis Cluster hash slot (its hash tag), as "l2 <class>:<excess> ..."
// newest first: written by the script call that settles, read by the call
// that reserves (no round trip of its own), expiring learnTTL after it was
// last written. The release before this one (v0.4.0) wrote "l1 <usage>
// ...", the usage of each settle, a reservation raised to at least the
// largest: this one reads that as a floor until its next settle writes l2;
// that one reads l2 as nothing learned, and writes l1 again on its next
// settle. In process, the store keeps the same records
// (memoryShard.learned), bounded.

// learnRecords is how many settles a key remembers.
const learnRecords = 8

// learnTTL is how long a key's learned usage outlives its last settle.
const learnTTL = 24 * time.Hour

// learnedSuffix names the key of a bucket's learned usage.
const learnedSuffix = ":usage"

// learnedKey is the key of the learned usage of the bucket under
// bucketKey.
func learnedKey(bucketKey string) string { return bucketKey + learnedSuffix }

// learnedRecord is one settle remembered: the class of its reservation
// (reservationClass) and what it used beyond it.
type learnedRecord struct{ class, excess int64 }

// learnedUsage is a key's last settles, newest first, and the floor the
// previous release's records ("l1") set.
type learnedUsage struct {
	records [learnRecords]learnedRecord
	n       int
	floor   int64
}

// reservationClass is the class of a reservation of cost tokens: its size
// by powers of two (1 for 1, 2 for 2 and 3, 3 for 4 to 7, …).
func reservationClass(cost int64) int64 { return int64(bits.Len64(uint64(max(cost, 0)))) }

// raise is what a take of class, reserving cost, is raised by: a high
// percentile of its class's excess (percentileOf), or to the previous
// release's floor when that is more.
func (l *learnedUsage) raise(class, cost int64) int64 {
	r := l.percentileOf(class)
	if l.floor > cost+r {
		r = l.floor - cost
	}
	return r
}

// percentileOf is the excess a take of class reserves beyond its cost: of
// the records of its class, the largest while there are fewer than five,
// the second largest from five on (a high percentile: one outlier among
// several does not set it); 0 for none.
func (l *learnedUsage) percentileOf(class int64) int64 {
	var buf [learnRecords]int64
	e := buf[:0]
	for _, r := range l.records[:l.n] {
		if r.class == class {
			e = append(e, r.excess)
		}
	}
	if len(e) == 0 {
		return 0
	}
	slices.Sort(e)
	return e[len(e)-1-len(e)/5]
}

// most is the largest a take is raised to or by, for inspect: the largest
// excess remembered, or the previous release's floor.
func (l *learnedUsage) most() int64 {
	m := l.floor
	for _, r := range l.records[:l.n] {
		m = max(m, r.excess)
	}
	return m
}

// of is what rq is decided with from what the key learned: for a take,
// what it is raised by (raise, in its own class); otherwise the most
// remembered, which inspect shows.
func (l *learnedUsage) of(rq bucketRequest) int64 {
	if rq.op == opTake {
		return l.raise(reservationClass(rq.cost), rq.cost)
	}
	return l.most()
}

// nothing reports whether nothing is remembered worth keeping.
func (l *learnedUsage) nothing() bool { return l.most() == 0 }

// push remembers a settle of class that used excess beyond its own
// reservation (0: within it), and reports whether it changed anything: a 0
// to remember among nothing but 0s changes nothing, and once all are 0 the
// key has forgotten. The previous release's floor goes: this release's
// records take over.
func (l *learnedUsage) push(class, excess int64) bool {
	excess = max(0, excess)
	if excess == 0 && l.nothing() {
		return false
	}
	l.floor = 0
	copy(l.records[1:], l.records[:learnRecords-1])
	l.records[0], l.n = learnedRecord{class, excess}, min(l.n+1, learnRecords)
	if l.nothing() {
		*l = learnedUsage{}
	}
	return true
}

// encodeLearned is the value Redis holds for l ("l2 <class>:<excess> ...");
// empty when it remembers nothing worth keeping (the key is deleted).
func encodeLearned(l learnedUsage) string {
	if l.nothing() {
		return ""
	}
	if l.n == 0 { // the previous release's floor alone, not yet replaced
		return "l1 " + strconv.FormatInt(l.floor, 10)
	}
	b := []byte("l2")
	for _, r := range l.records[:l.n] {
		b = append(b, ' ')
		b = strconv.AppendInt(b, r.class, 10)
		b = append(b, ':')
		b = strconv.AppendInt(b, r.excess, 10)
	}
	return string(b)
}

// decodeLearned reads a value as the script reads it: "l2" followed by
// <class>:<excess> pairs (class below 64, excess below 2^53), or the
// previous release's "l1" followed by whole numbers below 2^53 (the
// largest a floor); anything else is no memory; more than learnRecords
// records keep the first ones.
func decodeLearned(v string) learnedUsage {
	var l learnedUsage
	if rest, ok := strings.CutPrefix(v, "l1"); ok {
		if strings.Trim(rest, " 0123456789") != "" {
			return l
		}
		for _, n := range strings.Fields(rest) {
			if len(n) > 16 {
				return learnedUsage{}
			}
			u, _ := strconv.ParseInt(n, 10, 64)
			l.floor = max(l.floor, u)
		}
		return l
	}
	rest, ok := strings.CutPrefix(v, "l2")
	if !ok || strings.Trim(rest, " 0123456789:") != "" {
		return l
	}
	for _, f := range strings.Fields(rest) {
		c, e, ok := strings.Cut(f, ":")
		if !ok || c == "" || e == "" || len(c) > 2 || len(e) > 16 || strings.Contains(e, ":") {
			return learnedUsage{}
		}
		class, _ := strconv.ParseInt(c, 10, 64)
		excess, _ := strconv.ParseInt(e, 10, 64)
		if class > 63 {
			return learnedUsage{}
		}
		if l.n < learnRecords {
			l.records[l.n] = learnedRecord{class, excess}
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

// learnedCost is the cost a take of rq is decided with when its key raises
// requests like it by raise (learnedUsage.raise): its cost and that, at most
// the burst of the limit it is decided under (a cost that never fits stays
// as it is).
func (rq bucketRequest) learnedCost(raise int64) int64 {
	if !rq.learns || rq.op != opTake || rq.cost > rq.limit.burst {
		return rq.cost
	}
	return min(rq.cost+max(0, raise), rq.limit.burst)
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
// cost a bucket that learns was decided with (raised by what its key
// learned of requests like it, v.cost), keeping the request's own in
// asked; a settle then charges what it used against what was reserved,
// and remembers what it used beyond asked, in asked's class.
func (rq *bucketRequest) reserved(v verdict) {
	if rq.learns {
		rq.asked = rq.cost
		if v.cost > rq.cost {
			rq.cost = v.cost
		}
	}
}

// remember sets what a settle of rq (an adjust) remembers: what the usage
// was beyond the request's own reservation (0 within it), in the class of
// that reservation.
func (rq *bucketRequest) remember(usage int64) {
	rq.record, rq.class = max(0, usage-rq.asked), reservationClass(rq.asked)
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
		if !l.push(rq.class, rq.record) {
			return
		}
		if l.nothing() {
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
