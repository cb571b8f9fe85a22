package ratelimit

import (
	"context"
	"errors"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// Reading a request's buckets without changing them, for a dry run
// (dryrun.go): what each store holds for them is read, and the decision
// the request would get now is computed from it by decideBuckets, the
// algorithm lua/decide.lua runs (lua_test.go holds the two to each other),
// under the override in force and raised to what the key learned, as the
// store's decision would. Nothing is written: no bucket, slot, lease,
// learned usage or hot-key block changes, and no expired lease is
// dropped.

// peeker is a store that can read a request's buckets without deciding.
// Implemented by redisStore and memoryStore.
type peeker interface {
	// peek is the decision reqs would get now, changing nothing.
	peek(ctx context.Context, reqs []bucketRequest) (decision, error)
}

// peek reads the buckets in this process.
func (m *memoryStore) peek(_ context.Context, reqs []bucketRequest) (decision, error) {
	if m.overrides != nil {
		reqs = m.overrides.decidedUnder(reqs)
	}
	reqs = append([]bucketRequest(nil), reqs...)
	ids := make([]bucketID, len(reqs))
	tats := make([]int64, len(reqs))
	learned := make([]int64, len(reqs))
	for i, rq := range reqs {
		ids[i] = m.ids.of(rq.key)
		s := &m.shards[ids[i][0]%memoryShards]
		s.mu.Lock()
		now := m.now()
		switch {
		case rq.quota != nil:
			tats[i] = s.quotaUsed(ids[i], rq, now)
		case rq.op.slots():
			tats[i] = int64(len(s.slots[ids[i]]))
		default:
			b := s.buckets[ids[i]]
			tats[i] = rq.limit.rebase(b.tat, b.interval, now)
		}
		if rq.learns {
			l := s.learnedOf(ids[i], now)
			learned[i] = l.of(rq)
		}
		s.mu.Unlock()
	}
	reqs = withLearned(reqs, learned)
	d, _ := decideBuckets(tats, m.now(), reqs)
	for i := range d.verdicts {
		d.verdicts[i].learned = learned[i]
	}
	return d, nil
}

// errOtherKind: a key holds a value of another type than its policy's
// (an earlier config gave the name to another kind of policy).
var errOtherKind = errors.New("holds a value of another kind of policy, which its next decision replaces")

// peek reads the buckets in Redis, in one pipeline of reads (GET, ZRANGE,
// TIME), past the circuit breaker and the coalescer: a dry run asks the
// truth now, and a store that does not answer says so.
func (c *redisStore) peek(ctx context.Context, reqs []bucketRequest) (decision, error) {
	p := c.client.Pipeline()
	clock := p.Time(ctx)
	values := make([]*redis.StringCmd, len(reqs))
	slots := make([]*redis.ZSliceCmd, len(reqs))
	overrides := make([]*redis.StringCmd, len(reqs))
	usage := make([]*redis.StringCmd, len(reqs))
	for i, rq := range reqs {
		if rq.op.slots() && rq.quota == nil {
			slots[i] = p.ZRangeWithScores(ctx, rq.key, 0, -1)
		} else {
			values[i] = p.Get(ctx, rq.key)
		}
		if rq.overridable {
			overrides[i] = p.Get(ctx, overrideKey(rq.key))
		}
		if rq.learns {
			usage[i] = p.Get(ctx, learnedKey(rq.key))
		}
	}
	if _, err := p.Exec(ctx); err != nil && !errors.Is(err, redis.Nil) {
		var wrongType bool
		for _, cmd := range append(toCmders(values), toCmders(slots)...) {
			if cmd != nil && cmd.Err() != nil && redis.HasErrorPrefix(cmd.Err(), "WRONGTYPE") {
				wrongType = true
			}
		}
		if !wrongType || clock.Err() != nil {
			return decision{}, err
		}
	}
	nowT, err := clock.Result()
	if err != nil {
		return decision{}, err
	}
	now := nowT.UnixMicro()
	out := append([]bucketRequest(nil), reqs...)
	tats := make([]int64, len(out))
	learned := make([]int64, len(out))
	for i := range out {
		if overrides[i] != nil {
			if v, err := overrides[i].Result(); err == nil {
				if o, ok := decodeOverride(v); ok {
					out[i] = out[i].applyOverride(o)
				}
			}
		}
		rq := out[i]
		if usage[i] != nil {
			if v, err := usage[i].Result(); err == nil {
				l := decodeLearned(v)
				learned[i] = l.of(rq)
			}
		}
		if slots[i] != nil {
			zs, err := slots[i].Result()
			if err != nil {
				return decision{}, fmt.Errorf("%s %w", rq.key, errOtherKind)
			}
			for _, z := range zs {
				if int64(z.Score) > now { // expired leases are not held
					tats[i]++
				}
			}
			continue
		}
		v, err := values[i].Result()
		switch {
		case errors.Is(err, redis.Nil):
			continue // none: a full bucket, nothing used
		case err != nil:
			return decision{}, fmt.Errorf("%s %w", rq.key, errOtherKind)
		}
		if rq.quota != nil {
			p, used, ok := decodeQuota(v)
			cur, _ := rq.quota.periodAt(now)
			if ok && p.Start == cur.Start && p.End == cur.End {
				tats[i] = used
			}
			continue
		}
		if _, _, ok := decodeQuota(v); ok {
			continue // a quota's count under a rate's key: replaced
		}
		tat, interval, ok := decodeBucket(v, rq.limit.interval)
		if !ok {
			return decision{}, fmt.Errorf("%s holds %q, not a bucket", rq.key, v)
		}
		tats[i] = rq.limit.rebase(tat, interval, now)
	}
	out = withLearned(out, learned)
	d, _ := decideBuckets(tats, now, out)
	for i := range d.verdicts {
		d.verdicts[i].learned = learned[i]
	}
	return d, nil
}

func toCmders[C redis.Cmder](cmds []C) []redis.Cmder {
	out := make([]redis.Cmder, 0, len(cmds))
	for _, c := range cmds {
		var zero C
		if any(c) != any(zero) {
			out = append(out, c)
		}
	}
	return out
}

// The capabilities they have.
var (
	_ peeker = (*redisStore)(nil)
	_ peeker = (*memoryStore)(nil)
)
