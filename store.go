package ratelimit

import (
	"context"
)

// store holds the buckets and decides requests against them atomically.
type store interface {
	// decide evaluates every bucket of one request at once: all are charged
	// or none is (see decideBuckets).
	decide(ctx context.Context, reqs []bucketRequest) (decision, error)
}
