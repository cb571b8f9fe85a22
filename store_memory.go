package ratelimit

import (
	"context"
	"hash/maphash"
	"slices"
	"sync"
	"time"
)

// memoryStore keeps buckets in this process: one Caddy instance only. It is
// the default without a redis block and the fallback of `on_error local`.
// It is process-wide, like a Redis server, so buckets survive config reloads.
type memoryStore struct {
	shards [memoryShards]memoryShard
	ids    bucketIDs
	now    func() int64 // µs on a monotonic clock; injectable for tests
}

const memoryShards = 64

type memoryShard struct {
	mu      sync.Mutex
	tats    map[bucketID]int64
	sweepAt int // sweep full buckets out when the map reaches this size
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

func newMemoryStore(now func() int64) *memoryStore {
	m := &memoryStore{ids: newBucketIDs(), now: now}
	for i := range m.shards {
		m.shards[i].tats = make(map[bucketID]int64)
		m.shards[i].sweepAt = minSweep
	}
	return m
}

// processMemory is the in-process store every handler of this process shares.
var processMemory = newMemoryStore(monotonicMicros)

const minSweep = 1024

func (m *memoryStore) decide(_ context.Context, reqs []bucketRequest) (decision, error) {
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
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = m.shards[shards[i]].tats[ids[i]]
	}
	d, next := decideBuckets(tats, now, reqs)
	for i := range reqs {
		if next[i] != tats[i] {
			m.shards[shards[i]].store(ids[i], next[i], now)
		}
	}
	return d, nil
}

// store writes a TAT, first dropping full buckets (TAT in the past) when the
// shard has doubled since its last sweep: memory stays proportional to the
// buckets that are not full, as Redis key expiry keeps it there.
func (s *memoryShard) store(id bucketID, tat, now int64) {
	if len(s.tats) >= s.sweepAt {
		for k, v := range s.tats {
			if v <= now {
				delete(s.tats, k)
			}
		}
		s.sweepAt = max(minSweep, 2*len(s.tats))
	}
	s.tats[id] = tat
}
