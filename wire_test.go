package ratelimit

import (
	"context"
	"strings"
	"testing"

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

// TestDeclareTouched: a call declares, after its buckets' keys, each
// override and learned usage its script touches, once; a call of common
// buckets declares nothing more.
func TestDeclareTouched(t *testing.T) {
	plain := bucketRequest{key: "rl:a:{1}", op: opTake, cost: 1}
	settle := bucketRequest{key: "rl:b:{1}", op: opTake, cost: 1, overridable: true, learns: true}
	slots := bucketRequest{key: "rl:c:{2}", op: opAcquire, cost: 1, overridable: true, lease: "l", events: "rl:events"}
	keysOf := func(requests ...[]bucketRequest) []string {
		batch := make([]*pending, len(requests))
		for i, r := range requests {
			batch[i] = &pending{reqs: r}
		}
		args := encodeCall(batch, formatV2)
		var keys []string
		for _, a := range args[3 : 3+args[2].(int)] {
			keys = append(keys, a.(string))
		}
		return keys
	}
	for _, tc := range []struct {
		requests [][]bucketRequest
		want     string
	}{
		{[][]bucketRequest{{plain}, {plain}}, "rl:a:{1} rl:a:{1}"},
		{[][]bucketRequest{{plain, settle}, {settle}, {slots}},
			"rl:a:{1} rl:b:{1} rl:b:{1} rl:c:{2} rl:b:{1}:override rl:b:{1}:usage rl:c:{2}:override"},
	} {
		if got := strings.Join(keysOf(tc.requests...), " "); got != tc.want {
			t.Errorf("KEYS %q, want %q", got, tc.want)
		}
	}
}
