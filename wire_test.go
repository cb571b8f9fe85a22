package ratelimit

import (
	"context"

	"github.com/redis/go-redis/v9"
)

// evalDecide runs lua/decide.lua for requests in one call, with EVAL (as
// after NOSCRIPT).
func evalDecide(ctx context.Context, client redis.UniversalClient, requests ...[]bucketRequest) ([]int64, error) {
	return evalScript(ctx, client, decideLua, requests...)
}

// evalScript is evalDecide with another version of the script.
func evalScript(ctx context.Context, client redis.UniversalClient, script string, requests ...[]bucketRequest) ([]int64, error) {
	return evalScriptFormat(ctx, client, script, formatV1, requests...)
}

// evalScriptFormat is evalScript writing buckets in the given format.
func evalScriptFormat(ctx context.Context, client redis.UniversalClient, script string, format int, requests ...[]bucketRequest) ([]int64, error) {
	batch := make([]*pending, len(requests))
	for i, r := range requests {
		batch[i] = &pending{reqs: r}
	}
	args := encodeCall(batch, format)
	args[0], args[1] = "eval", script
	return client.Do(ctx, args...).Int64Slice()
}
