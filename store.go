package ratelimit

import (
	"context"
	"hash/maphash"
	"slices"
	"sync"
	"time"
)

// store holds the buckets and decides requests against them atomically.
type store interface {
	// decide evaluates every bucket of one request at once: all are charged
	// or none is (see decideBuckets).
	decide(ctx context.Context, reqs []bucketRequest) (decision, error)
}

// memoryStore keeps buckets in this process: one Caddy instance only. It is
// the default without a redis block and the fallback of `on_error local`.
// It is process-wide, like a Redis server, so buckets survive config reloads.
type memoryStore struct {
	shards [memoryShards]memoryShard
	seed   maphash.Seed
	now    func() int64 // µs on a monotonic clock; injectable for tests
}

const memoryShards = 64

type memoryShard struct {
	mu      sync.Mutex
	tats    map[string]int64
	sweepAt int // sweep full buckets out when the map reaches this size
}

// epoch anchors the monotonic clock of in-process buckets.
var epoch = time.Now()

func monotonicMicros() int64 { return int64(time.Since(epoch)/time.Microsecond) + 1 }

func newMemoryStore(now func() int64) *memoryStore {
	m := &memoryStore{seed: maphash.MakeSeed(), now: now}
	for i := range m.shards {
		m.shards[i].tats = make(map[string]int64)
		m.shards[i].sweepAt = minSweep
	}
	return m
}

// processMemory is the in-process store every handler of this process shares.
var processMemory = newMemoryStore(monotonicMicros)

const minSweep = 1024

func (m *memoryStore) shardOf(key string) int {
	return int(maphash.String(m.seed, key) % memoryShards)
}

func (m *memoryStore) decide(_ context.Context, reqs []bucketRequest) (decision, error) {
	// Lock every shard involved, in order, so that decisions touching the
	// same buckets serialise and never deadlock.
	var idx [8]int
	shards := idx[:0]
	for _, rq := range reqs {
		shards = append(shards, m.shardOf(rq.key))
	}
	slices.Sort(shards)
	shards = slices.Compact(shards)
	for _, s := range shards {
		m.shards[s].mu.Lock()
	}
	defer func() {
		for _, s := range shards {
			m.shards[s].mu.Unlock()
		}
	}()

	now := m.now()
	tats := make([]int64, len(reqs))
	for i, rq := range reqs {
		tats[i] = m.shards[m.shardOf(rq.key)].tats[rq.key]
	}
	d, next := decideBuckets(tats, now, reqs)
	for i, rq := range reqs {
		if next[i] != tats[i] {
			m.shards[m.shardOf(rq.key)].store(rq.key, next[i], now)
		}
	}
	return d, nil
}

// store writes a TAT, first dropping full buckets (TAT in the past) when the
// shard has doubled since its last sweep: memory stays proportional to the
// buckets that are not full, as Redis key expiry keeps it there.
func (s *memoryShard) store(key string, tat, now int64) {
	if len(s.tats) >= s.sweepAt {
		for k, v := range s.tats {
			if v <= now {
				delete(s.tats, k)
			}
		}
		s.sweepAt = max(minSweep, 2*len(s.tats))
	}
	s.tats[key] = tat
}
