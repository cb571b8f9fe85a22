package ratelimit

import (
	"context"
	"errors"
	"strings"
	"sync"
)

// Decisions across Redis Cluster hash slots. A script call can only touch
// keys of one hash slot. The policies of one identity share a hash slot (the
// hash tag in their
// keys), but policies keyed on different identities, such as a global
// guardrail beside a per-user limit, do not. Such a request is decided with
// one script call per hash slot, all at once; if any denies it (or fails),
// the hash slots that admitted and charged it are refunded. Charging before
// knowing never admits beyond any budget; its cost is transient
// over-denial: between a charge and its refund, other requests see those
// tokens gone.

const hashSlots = 16384

// hashSlotOf is the Redis Cluster hash slot of a key: CRC16 (XMODEM) of its hash
// tag, the text between the first { and the next }.
func hashSlotOf(key string) int {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			key = key[i+1 : i+1+j]
		}
	}
	var crc uint16
	for k := 0; k < len(key); k++ {
		crc ^= uint16(key[k]) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % hashSlots
}

// hashSlotGroups splits a request's buckets by hash slot, as indexes into
// reqs, in the order the hash slots first appear.
func hashSlotGroups(reqs []bucketRequest) [][]int {
	var groups [][]int
	var seen []int
	for i, rq := range reqs {
		hs := hashSlotOf(rq.key)
		found := false
		for g, s := range seen {
			if s == hs {
				groups[g] = append(groups[g], i)
				found = true
				break
			}
		}
		if !found {
			seen = append(seen, hs)
			groups = append(groups, []int{i})
		}
	}
	return groups
}

// pick is the requests of one hash slot group.
func pick(reqs []bucketRequest, idx []int) []bucketRequest {
	out := make([]bucketRequest, len(idx))
	for k, i := range idx {
		out[k] = reqs[i]
	}
	return out
}

// decideAcrossHashSlots decides a request whose buckets span several hash
// slots.
func (s *redisStore) decideAcrossHashSlots(ctx context.Context, reqs []bucketRequest, groups [][]int) (decision, error) {
	parts := make([]decision, len(groups))
	errs := make([]error, len(groups))
	var wg sync.WaitGroup
	for g, idx := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			parts[g], errs[g] = s.decideInOneCall(ctx, pick(reqs, idx))
		}()
	}
	wg.Wait()

	d := decision{admitted: true, verdicts: make([]verdict, len(reqs))}
	failed := errors.Join(errs...)
	for g, idx := range groups {
		if errs[g] != nil {
			continue
		}
		d.admitted = d.admitted && parts[g].admitted
		d.now = max(d.now, parts[g].now)
		d.delay = max(d.delay, parts[g].delay)
		d.call = d.call.merge(parts[g].call)
		for k, i := range idx {
			d.verdicts[i] = parts[g].verdicts[k]
		}
	}
	if failed == nil && d.admitted {
		return d, nil
	}
	// Not admitted everywhere: give back what the admitting hash slots charged,
	// as any refund is given (opAdjust).
	var refundErrs []error
	for g, idx := range groups {
		if errs[g] != nil || !parts[g].admitted {
			continue
		}
		var refunds []bucketRequest
		for k, i := range idx {
			rq := reqs[i]
			if !parts[g].verdicts[k].allowed {
				continue
			}
			v := &d.verdicts[i]
			switch rq.op {
			case opTake:
				refunds = append(refunds, bucketRequest{key: rq.key, limit: rq.limit, op: opAdjust, delta: -max(rq.cost, parts[g].verdicts[k].cost), // raised to what its key learned
					quota: rq.quota, period: parts[g].verdicts[k].period, // a quota's, in the period it was charged in
					overridable: rq.overridable, overrideWait: rq.overrideWait, overrideDebt: rq.overrideDebt})
				v.remaining = min(v.remaining+max(rq.cost, parts[g].verdicts[k].cost), v.limit.burst)
				v.delay = 0
			case opAcquire: // the concurrency slot taken is freed
				rel := rq
				rel.op = opRelease
				refunds = append(refunds, rel)
				v.remaining = min(v.remaining+1, v.limit.burst)
			}
		}
		if len(refunds) > 0 {
			_, err := s.decideInOneCall(context.WithoutCancel(ctx), refunds)
			refundErrs = append(refundErrs, err)
		}
	}
	d.admitted, d.delay = false, 0
	if failed != nil {
		// A refund that failed leaves tokens charged: over-denial until the
		// bucket refills, never over-admission.
		return decision{}, errors.Join(failed, errors.Join(refundErrs...))
	}
	return d, nil
}
