package ratelimit

import (
	"slices"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// Quotas in the in-process store: a count per bucket and the period it
// belongs to, read as 0 once another period holds the store's clock (Unix
// µs, see unixMicros), as lua/decide.lua reads them. Bounded as the store's
// buckets are: counts of past periods are swept out as the map grows, and
// when a shard holds shardMaxBuckets counts of the current periods, the
// quarter with the least used is forgotten (a forgotten count is 0 used:
// the least budget a forgotten client can gain).

// storedQuota is a quota count as the in-process store holds it.
type storedQuota struct {
	start, end, used int64 // the period, µs; the units used in it
}

// quotaUsed is the units the bucket used in the period holding now.
func (s *memoryShard) quotaUsed(id bucketID, rq bucketRequest, now int64) int64 {
	q, ok := s.quotas[id]
	if !ok {
		return 0
	}
	if p, _ := rq.quota.periodAt(now); q.start != p.Start || q.end != p.End {
		return 0 // another period's: over
	}
	return q.used
}

// storeQuota records that the bucket used used units in period p; none is
// the same as a missing count.
func (s *memoryShard) storeQuota(id bucketID, p calendar.Period, used, now int64) {
	if used <= 0 || p.End <= now {
		delete(s.quotas, id)
		return
	}
	if s.quotas == nil {
		s.quotas, s.quotaSweepAt = make(map[bucketID]storedQuota), minSweep
	}
	if _, found := s.quotas[id]; !found && len(s.quotas) >= s.quotaSweepAt {
		s.sweepQuotas(now)
	}
	s.quotas[id] = storedQuota{p.Start, p.End, used}
}

// sweepQuotas drops the counts of past periods and, if the shard is still
// at its bound, the quarter with the least used.
func (s *memoryShard) sweepQuotas(now int64) {
	for id, q := range s.quotas {
		if q.end <= now {
			delete(s.quotas, id)
		}
	}
	if len(s.quotas) >= shardMaxBuckets {
		used := make([]int64, 0, len(s.quotas))
		for _, q := range s.quotas {
			used = append(used, q.used)
		}
		slices.Sort(used)
		drop := len(used) / 4
		cut := used[drop]
		for id, q := range s.quotas {
			if q.used < cut || q.used == cut && drop > 0 {
				delete(s.quotas, id)
				drop--
			}
		}
	}
	s.quotaSweepAt = min(shardMaxBuckets, max(minSweep, 2*len(s.quotas)))
}
