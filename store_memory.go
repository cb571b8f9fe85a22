package ratelimit

import (
	"context"
	"hash/maphash"
	"slices"
	"sort"
	"sync"
	"time"
)

// memoryStore keeps buckets in this process: one Caddy instance only. It is
// the store without a redis block, and (a separate one) the fallback of
// `on_error local`. It is process-wide, like a Redis server, so buckets
// survive config reloads.
//
// Its memory is bounded whatever clients send: at most memoryMaxBuckets
// buckets. A full bucket is the same as a missing one, so full buckets are
// swept out as the store grows; when it holds memoryMaxBuckets buckets
// that are not full, it forgets those nearest to full (a forgotten bucket
// is full again: the least budget a forgotten client can gain).
type memoryStore struct {
	shards [memoryShards]memoryShard
	ids    bucketIDs
	now    func() int64 // µs on a monotonic clock; injectable for tests
	// overrides are the operators' overrides of its buckets' limits (the
	// in-process store's; nil for the `local` fallback, which decides under
	// the policies' own limits).
	overrides *overrideTable
}

const (
	memoryShards = 64
	// memoryMaxBuckets bounds the buckets of one in-process store: about
	// 130 bytes each (the map's slots included), so at most 32 MiB (see
	// TestMemoryStoreBound).
	memoryMaxBuckets = 1 << 18
	shardMaxBuckets  = memoryMaxBuckets / memoryShards
	minSweep         = 1024
)

type memoryShard struct {
	mu      sync.Mutex
	buckets map[bucketID]storedBucket // pointer-free: nothing for the GC to scan
	sweepAt int                       // sweep when the map reaches this size
	// slots are the leases held on concurrency policies' slots: in this
	// process they last until released (the process that would hold them
	// is this one), so there are only as many as requests in flight.
	slots map[bucketID]map[string]struct{}
	// quotas are quota policies' counts (quota_memory.go), bounded as
	// buckets are.
	quotas       map[bucketID]storedQuota
	quotaSweepAt int
	// learned is the usage the keys of settle policies learned
	// (learned_usage.go), bounded by learnedMaxKeys.
	learned map[bucketID]storedLearned
}

// storedBucket is a bucket as the store holds it: its TAT and the interval
// that TAT was written under (see limit.rebase).
type storedBucket struct {
	tat, interval int64
}

// bucketID stands for a storage key in the in-process store: 128 bits of
// two keyed hashes (seeded per process), kept inline in the map, so that a
// lookup reads no separately allocated string and the garbage collector
// has no pointers to scan in maps of up to millions of buckets.
type bucketID [2]uint64

// bucketIDs derives bucketIDs from storage keys, with its own seeds.
type bucketIDs struct{ seed1, seed2 maphash.Seed }

func newBucketIDs() bucketIDs { return bucketIDs{maphash.MakeSeed(), maphash.MakeSeed()} }

func (b bucketIDs) of(key string) bucketID {
	return bucketID{maphash.String(b.seed1, key), maphash.String(b.seed2, key)}
}

// epoch anchors the monotonic clock of in-process buckets.
var epoch = time.Now()

func monotonicMicros() int64 { return int64(time.Since(epoch)/time.Microsecond) + 1 }

// epochUnix is epoch in Unix µs.
var epochUnix = epoch.UnixMicro()

// unixMicros is the in-process stores' clock: Unix µs, as Redis's, which
// quotas' calendars read; monotonic since the process started (it follows
// the wall clock's rate, never its steps), so a bucket never moves back.
func unixMicros() int64 { return epochUnix + monotonicMicros() }

func newMemoryStore(now func() int64) *memoryStore {
	m := &memoryStore{ids: newBucketIDs(), now: now}
	for i := range m.shards {
		m.shards[i].buckets = make(map[bucketID]storedBucket)
		m.shards[i].sweepAt = minSweep
	}
	return m
}

// processMemory is the in-process store every handler without a redis
// block shares; localFallback holds the buckets of `on_error local`.
var (
	processMemory = newMemoryStore(unixMicros)
	localFallback = newMemoryStore(unixMicros)
)

func (m *memoryStore) decide(_ context.Context, reqs []bucketRequest) (decision, error) {
	if m.overrides != nil {
		reqs = m.overrides.decidedUnder(reqs)
	}
	var idbuf [4]bucketID
	var shardbuf, lockbuf [4]int
	ids, shards := idbuf[:0], shardbuf[:0]
	for _, rq := range reqs {
		id := m.ids.of(rq.key)
		ids = append(ids, id)
		shards = append(shards, int(id[0]%memoryShards))
	}
	// Lock every shard involved, in order, so that decisions touching the
	// same buckets serialise and never deadlock.
	locked := append(lockbuf[:0], shards...)
	slices.Sort(locked)
	locked = slices.Compact(locked)
	for _, s := range locked {
		m.shards[s].mu.Lock()
	}
	defer func() {
		for _, s := range locked {
			m.shards[s].mu.Unlock()
		}
	}()

	now := m.now()
	var tatbuf [4]int64
	tats := tatbuf[:0]
	for range reqs {
		tats = append(tats, 0)
	}
	for i, rq := range reqs {
		if rq.kind() == quotaBucket {
			tats[i] = m.shards[shards[i]].quotaUsed(ids[i], rq, now)
			continue
		}
		if rq.kind() == slotsBucket {
			tats[i] = int64(len(m.shards[shards[i]].slots[ids[i]]))
			continue
		}
		// A request of an earlier one in the same decision reads what that
		// one left (a policy named twice is one bucket).
		b := m.shards[shards[i]].buckets[ids[i]]
		tats[i] = rq.limit.rebase(b.tat, b.interval, now)
	}
	var learned []int64 // what the keys of buckets that learn learned
	for i, rq := range reqs {
		if rq.learns {
			if learned == nil {
				learned = make([]int64, len(reqs))
			}
			l := m.shards[shards[i]].learnedOf(ids[i], now)
			learned[i] = l.of(rq)
		}
	}
	if learned != nil {
		reqs = withLearned(reqs, learned)
	}
	d, next := decideBuckets(tats, now, reqs)
	for i, rq := range reqs {
		if learned != nil {
			d.verdicts[i].learned = learned[i]
			if rq.learns && applied(reqs, d, i) {
				m.shards[shards[i]].applyLearned(ids[i], rq, now)
			}
		}
		if !applied(reqs, d, i) {
			continue
		}
		s := &m.shards[shards[i]]
		if rq.kind() == quotaBucket {
			s.storeQuota(ids[i], d.verdicts[i].period, next[i], now)
			continue
		}
		if rq.kind() == slotsBucket {
			d.verdicts[i].allowed = s.applySlots(ids[i], rq) || rq.op != opRenew
			continue
		}
		if next[i] <= now {
			delete(s.buckets, ids[i])
			continue
		}
		s.store(ids[i], storedBucket{next[i], rq.limit.interval}, now)
	}
	return d, nil
}

// announce: in process, an operator's change is this instance's own: it
// forgets what it remembered of the bucket (its pacing), as an instance
// hearing an announcement does (announce.go).
func (m *memoryStore) announce(_ context.Context, _, key string) error {
	pacing.Forget(key)
	return nil
}

// announceOverride: as announce; there is nobody else to confirm it.
func (m *memoryStore) announceOverride(ctx context.Context, prefix, key string) error {
	return m.announce(ctx, prefix, key)
}

// blocksOf: in process, every decision is local already: no blocks.
func (m *memoryStore) blocksOf(string) (blocks int, tokens int64) { return 0, 0 }

// slotLeases: a slot in process lasts until it is freed, which never fails.
func (m *memoryStore) slotLeases() leaseKeeper { return freedAtOnce{m} }

// decideAfter decides at once: in process, nothing is saved by waiting.
func (m *memoryStore) decideAfter(reqs []bucketRequest, then func(decision, error)) {
	then(m.decide(context.Background(), reqs))
}

// decideAwaited decides at once.
func (m *memoryStore) decideAwaited(reqs []bucketRequest) (decision, error) {
	return m.decide(context.Background(), reqs)
}

// applySlots takes, frees or renews a lease; for opRenew it reports
// whether the lease is still held. In this process a lease lasts until its
// request releases it (the process that holds it is this one), so none is
// ever stale: opFree keeps them all.
func (s *memoryShard) applySlots(id bucketID, rq bucketRequest) bool {
	leases := s.slots[id]
	switch rq.op {
	case opAcquire, opRestore:
		if leases == nil {
			if s.slots == nil {
				s.slots = map[bucketID]map[string]struct{}{}
			}
			leases = map[string]struct{}{}
			s.slots[id] = leases
		}
		leases[rq.lease] = struct{}{}
	case opRelease:
		delete(leases, rq.lease)
	case opRenew:
		_, held := leases[rq.lease]
		return held
	}
	if leases != nil && len(leases) == 0 {
		delete(s.slots, id)
	}
	return true
}

// store writes a bucket, first sweeping the shard when it has grown enough
// since its last sweep: memory stays proportional to the buckets that are
// not full, as Redis key expiry keeps it there, and below shardMaxBuckets.
func (s *memoryShard) store(id bucketID, b storedBucket, now int64) {
	if len(s.buckets) >= s.sweepAt {
		s.sweep(now)
	}
	s.buckets[id] = b
}

// sweep drops the full buckets and, if the shard is still at its bound,
// the quarter of its buckets nearest to full.
func (s *memoryShard) sweep(now int64) {
	for id, b := range s.buckets {
		if b.tat <= now {
			delete(s.buckets, id)
		}
	}
	if len(s.buckets) >= shardMaxBuckets {
		tats := make([]int64, 0, len(s.buckets))
		for _, b := range s.buckets {
			tats = append(tats, b.tat)
		}
		slices.Sort(tats)
		// The TATs nearest to now are the buckets nearest to full: drop a
		// quarter, those before the cut and, of those at it, as many as
		// make up the quarter.
		drop := len(tats) / 4
		cut := tats[drop]
		atCut := drop - sort.Search(drop, func(i int) bool { return tats[i] >= cut })
		for id, b := range s.buckets {
			switch {
			case b.tat < cut:
				delete(s.buckets, id)
			case b.tat == cut && atCut > 0:
				delete(s.buckets, id)
				atCut--
			}
		}
	}
	s.sweepAt = min(shardMaxBuckets, max(minSweep, 2*len(s.buckets)))
}

// len is the number of buckets the store holds.
func (m *memoryStore) len() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		n += len(s.buckets) + len(s.quotas)
		s.mu.Unlock()
	}
	return n
}
