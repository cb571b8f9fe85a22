package ratelimit

import (
	"context"
	"fmt"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/shed"
)

// TestLuaShedClasses: shed { concurrent 4 } with the design's classes
// through lua/decide.lua on a real Redis: every class acquires in one set
// of slots, each checked against its own cap (shed.ClassLimit: batch 2, default
// 3, critical 4), so what batch holds counts against everyone and batch
// never takes the last slots. The Redis store checks each reply against
// the Go decision (decodeRequest), so Lua and Go agree on every step.
func TestLuaShedClasses(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	const key = "rl:capacity:{g}"
	caps := map[string]int64{}
	for i, class := range []string{"critical", "default", "batch"} {
		caps[class] = shed.ClassLimit(4, []int64{10000, 8000, 5000}[i], i == 0, 1)
	}
	if caps["critical"] != 4 || caps["default"] != 3 || caps["batch"] != 2 {
		t.Fatalf("caps %v", caps)
	}
	n := 0
	acquire := func(class string) (bucketRequest, bool) {
		t.Helper()
		n++
		rq := bucketRequest{key: key, limit: limit{interval: 30_000_000, burst: caps[class]}, op: opAcquire, cost: 1,
			lease: fmt.Sprintf("lease-%d", n), events: "rl:events"}
		d, err := rs.decide(ctx, []bucketRequest{rq})
		if err != nil {
			t.Fatal(err)
		}
		return rq, d.admitted
	}
	var heldBatch []bucketRequest
	for _, step := range []struct {
		class string
		want  bool
	}{
		{"batch", true}, {"batch", true}, {"batch", false}, // batch: 2 of 4
		{"default", true}, {"default", false}, // default: up to 3
		{"critical", true}, {"critical", false}, // critical: the last one
		{"batch", false},
	} {
		rq, ok := acquire(step.class)
		if ok != step.want {
			t.Fatalf("acquire %d (%s) with %d held: admitted %v, want %v", n, step.class, client.ZCard(ctx, key).Val(), ok, step.want)
		}
		if ok && step.class == "batch" {
			heldBatch = append(heldBatch, rq)
		}
	}
	if held := client.ZCard(ctx, key).Val(); held != 4 {
		t.Fatalf("%d leases in the set, want 4", held)
	}
	// A batch request ends: 3 held, so batch and default are still over
	// their caps, and critical has a slot again.
	rel := heldBatch[0]
	rel.op = opRelease
	if _, err := rs.decide(ctx, []bucketRequest{rel}); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		class string
		want  bool
	}{{"batch", false}, {"default", false}, {"critical", true}} {
		if _, ok := acquire(step.class); ok != step.want {
			t.Fatalf("after a release, %s: admitted %v, want %v", step.class, ok, step.want)
		}
	}
}
