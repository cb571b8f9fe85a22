package ratelimit

import (
	"context"
	"fmt"
	"slices"
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

// TestLuaBadKeys: a bucket key holding a hash (WRONGTYPE) or a string that
// is not a bucket fails only the requests that touch it; the other requests
// of the same call are decided and charged as usual, and the bad keys are
// left as they are. A key holding a concurrency policy's slots (a sorted
// set, from a config that gave the name to another kind of policy) is
// replaced.
func TestLuaBadKeys(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	// Buckets that live long enough to be read back on a loaded machine.
	l := limit{interval: 1_000_000, burst: 5}
	client.HSet(ctx, "rl:p:{hash}", "debug", "1")
	client.Set(ctx, "rl:p:{garbage}", "not a bucket", 0)
	client.ZAdd(ctx, "rl:p:{slots}", redis.Z{Score: 1, Member: "lease"})
	take := func(key string) []bucketRequest {
		return []bucketRequest{{key: key, limit: l, op: opTake, cost: 1}}
	}
	res, err := evalDecide(ctx, client, take("rl:p:{a}"), take("rl:p:{hash}"), append(take("rl:p:{b}"), take("rl:p:{garbage}")...), take("rl:p:{slots}"), take("rl:p:{b}"))
	if err != nil {
		t.Fatalf("a call with bad keys failed as a whole: %v", err)
	}
	// Each request: status, then 2 numbers per bucket.
	statuses := []int64{res[1], res[4], res[7], res[12], res[15]}
	want := []int64{scriptAdmitted, scriptWrongType, scriptCorrupt, scriptAdmitted, scriptAdmitted}
	if fmt.Sprint(statuses) != fmt.Sprint(want) {
		t.Fatalf("statuses %v, want %v (reply %v)", statuses, want, res)
	}
	if res[10] != scriptCorrupt || res[8] != 1 {
		t.Fatalf("the bad bucket of a two-bucket request: reply %v", res[7:11])
	}
	// {b} was charged once: by the last request, not by the one whose other
	// bucket was bad.
	if v := client.Get(ctx, "rl:p:{b}").Val(); v == "" {
		t.Fatal("{b} not charged")
	} else if b := parseStored(t, v, formatV1); b.tat-res[0] != l.interval {
		t.Fatalf("{b} charged %d µs, want one token (%d)", b.tat-res[0], l.interval)
	}
	if typ := client.Type(ctx, "rl:p:{hash}").Val(); typ != "hash" {
		t.Fatalf("the hash was replaced by a %s", typ)
	}
	if v := client.Get(ctx, "rl:p:{garbage}").Val(); v != "not a bucket" {
		t.Fatalf("the bad string became %q", v)
	}
	if typ := client.Type(ctx, "rl:p:{slots}").Val(); typ != "string" {
		t.Fatalf("the old slots are a %s, want replaced by a bucket", typ)
	}
	p := &pending{reqs: take("rl:p:{hash}")}
	if err := decodeReply([]int64{res[0], res[4], res[5], res[6]}, []*pending{p}); err != nil || p.err == nil || errorKind(p.err) != "wrongtype" || !strings.Contains(p.err.Error(), "rl:p:{hash}") {
		t.Fatalf("a WRONGTYPE request: call error %v, request error %v (kind %s)", err, p.err, errorKind(p.err))
	}
}

// TestLuaLargeCall: one call of 64 requests of five buckets each (1,984
// numbers, which the script unpacks 1,000 at a time) decides each request
// in order, as the calls of one request would, and names each lease by its
// own string.
func TestLuaLargeCall(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000_000, burst: 3}
	var batch []*pending
	for r := range 64 {
		var reqs []bucketRequest
		for j := range 4 { // request r's keys are those of r+16, r+32 and r+48
			reqs = append(reqs, bucketRequest{key: fmt.Sprintf("rl:big:{%d}:%d", r%16, j), limit: rate, op: opTake, cost: 1})
		}
		reqs = append(reqs, bucketRequest{key: "rl:big-slots", limit: limit{interval: 60_000_000, burst: 100}, op: opAcquire, cost: 1,
			lease: fmt.Sprintf("lease-%d", r), events: "rl:events"})
		batch = append(batch, &pending{reqs: reqs})
	}
	rs.conn.call(batch)
	var want []string
	for r, p := range batch {
		if p.err != nil {
			t.Fatalf("request %d: %v", r, p.err)
		}
		// Each key's 3 tokens go to the first three requests that take it.
		if p.d.admitted != (r < 48) || p.d.verdicts[0].allowed != (r < 48) || !p.d.verdicts[4].allowed {
			t.Fatalf("request %d: %+v, want admitted iff it is among the first 48", r, p.d)
		}
		if r < 48 {
			want = append(want, fmt.Sprintf("lease-%d", r))
		}
	}
	held, err := client.ZRange(ctx, "rl:big-slots", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(held)
	slices.Sort(want)
	if !slices.Equal(held, want) {
		t.Fatalf("leases held %v, want those of the 48 admitted requests %v", held, want)
	}
}
