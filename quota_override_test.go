package ratelimit

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/redis/go-redis/v9"
)

// TestLuaMatchesGoQuotaOverrides drives random requests through
// lua/decide.lua on quota buckets that are all overridable, while an
// operator sets, changes and deletes their overrides between calls (quota
// overrides that raise or lower N below the units used, overrides of
// another kind and values that are not overrides, which a quota ignores),
// and through the Go algorithm under the same overrides (quotaLimitFor);
// it requires the same decisions, the same limits in the reply, the same
// verdicts and the same counts stored.
func TestLuaMatchesGoQuotaOverrides(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(23, 24))
	t0 := redisMicros(t, client)
	// One period, from half an hour before the test to an hour after it:
	// this test is about limits, TestLuaMatchesGoQuota about periods.
	spec := &quotaSpec{periods: fixedBounds{t0 - 3600*sec, t0 - 1800*sec, t0 + 3600*sec, t0 + 7200*sec}, name: "q"}
	shapes := []struct {
		l    limit
		debt int64 // the policy's debt rule (debtRule)
	}{
		{limit{burst: 6}, 0},
		{limit{burst: 4, slack: 8}, -2}, // settle: twice the quota
		{limit{burst: 10, slack: 3}, 3}, // settle max 3
	}
	values := []string{
		"o1 q 0 2", "o1 q 0 9", "o1 q 0 20", "o1 q 0 1", "o1 q 5 3",
		"o1 r 500 8", "o1 c 0 4", // another kind: ignored
		"o1 q 0 0", "garbage", "o1 q 0 12345678901234567", // not overrides: ignored
	}
	keyOf := func(si, id int) string { return fmt.Sprintf("rl:q%d:{id%d}", si, id) }
	model := map[string]int64{}        // units used in the period
	overrides := map[string]override{} // the valid ones in force
	ops := []bucketOp{opTake, opTake, opTake, opCheck, opAdjust, opInspect, opReset}
	var requests, under, ignored, lowered, admitted, denied int
	for step := range 2000 {
		if rng.IntN(3) == 0 {
			si, id := rng.IntN(len(shapes)), rng.IntN(2)
			okey := overrideKey(keyOf(si, id))
			if n := rng.IntN(len(values) + 2); n >= len(values) {
				client.Del(ctx, okey)
				delete(overrides, keyOf(si, id))
			} else {
				client.Set(ctx, okey, values[n], 0)
				if o, ok := decodeOverride(values[n]); ok && o.kind == overrideQuota {
					overrides[keyOf(si, id)] = o
				} else {
					delete(overrides, keyOf(si, id))
				}
			}
		}
		batch := make([][]bucketRequest, 1+rng.IntN(3))
		for r := range batch {
			op := ops[rng.IntN(len(ops))]
			n := 1 + rng.IntN(2)
			if !op.admits() {
				n = 1
			}
			used := map[string]bool{}
			for len(batch[r]) < n {
				si, id := rng.IntN(len(shapes)), rng.IntN(2)
				if used[keyOf(si, id)] {
					continue
				}
				used[keyOf(si, id)] = true
				rq := bucketRequest{key: keyOf(si, id), limit: shapes[si].l, op: op, cost: 1 + rng.Int64N(3), quota: spec,
					overridable: true, overrideDebt: shapes[si].debt}
				if op == opAdjust {
					rq.cost, rq.delta = 0, rng.Int64N(13)-6
				}
				batch[r] = append(batch[r], rq)
			}
		}
		res, err := evalDecide(ctx, client, batch...)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		now, off := res[0], 1
		for r, reqs := range batch {
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			eff := append([]bucketRequest(nil), reqs...)
			tats := make([]int64, len(reqs))
			for i, rq := range reqs {
				if o, ok := overrides[rq.key]; ok {
					eff[i] = rq.applyOverride(o)
					if model[rq.key] > o.burst {
						lowered++ // decided under an N below what it used
					}
				}
				tats[i] = model[rq.key]
			}
			want, next := decideBuckets(tats, now, eff)
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			if got.admitted != want.admitted {
				t.Fatalf("step %d, request %d: Lua admitted %v, Go %v", step, r, got.admitted, want.admitted)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s (override %+v): Lua verdict %+v, Go %+v", step, r, rq.key, overrides[rq.key], got.verdicts[i], want.verdicts[i])
				}
				if applied(eff, want, i) {
					model[rq.key] = next[i]
				}
				if _, ok := overrides[rq.key]; ok {
					under++
				} else if v, err := client.Get(ctx, overrideKey(rq.key)).Result(); err == nil && v != "" {
					ignored++
				}
			}
			if reqs[0].op.admits() {
				if want.admitted {
					admitted++
				} else {
					denied++
				}
			}
			requests += len(reqs)
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				v, err := client.Get(ctx, rq.key).Result()
				switch {
				case err == redis.Nil && model[rq.key] == 0:
				case err != nil:
					t.Fatalf("step %d: quota %s: %v, the model has %d used", step, rq.key, err, model[rq.key])
				default:
					_, stored, ok := decodeQuota(v)
					if !ok || stored != model[rq.key] {
						t.Fatalf("step %d: quota %s holds %q, the model %d used", step, rq.key, v, model[rq.key])
					}
				}
			}
		}
	}
	if under < 500 || ignored < 200 || lowered < 50 || admitted < 300 || denied < 300 {
		t.Fatalf("too little exercised: %d under an override (%d below the units used), %d beside a value ignored; %d admitted, %d denied", under, lowered, ignored, admitted, denied)
	}
	t.Logf("%d quota bucket operations: %d under an override (%d of them below the units used), %d beside a value a quota ignores; %d requests admitted, %d denied; identical in Lua and Go",
		requests, under, lowered, ignored, admitted, denied)
}
