package ratelimit

import (
	"context"
	"fmt"
	"strconv"
	"testing"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

func TestSlotOfKnownValues(t *testing.T) {
	// From the Redis Cluster specification and CLUSTER KEYSLOT.
	for key, want := range map[string]int{"somekey": 11058, "foo{hash_tag}": 2515, "{user1000}.following": 3443, "foo{}{bar}": 8363, "123456789": 12739} {
		if got := hashSlotOf(key); got != want {
			t.Errorf("hashSlotOf(%q) = %d, want %d", key, got, want)
		}
	}
}

// TestClusterDecisions runs on a real three-master Redis Cluster: the slot
// computation agrees with CLUSTER KEYSLOT, and a request whose policies
// live in different slots is all-or-nothing: when one slot denies, the
// others are refunded.
func TestClusterDecisions(t *testing.T) {
	c := testredis.StartCluster(t, 3, false)
	for i := range 50 {
		key := fmt.Sprintf("rl:p:{%x}", i*7919)
		got, err := c.Masters[0].Do("CLUSTER", "KEYSLOT", key)
		if err != nil {
			t.Fatal(err)
		}
		if want, _ := strconv.Atoi(got); hashSlotOf(key) != want {
			t.Fatalf("hashSlotOf(%q) = %d, CLUSTER KEYSLOT says %d", key, hashSlotOf(key), want)
		}
	}

	conn, err := newRedisStore(RedisConfig{Addresses: c.Addrs(), Cluster: true, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Destruct()
	rs := conn
	kh := newKeyHasher("")
	user := &Policy{keyPrefix: "rl:user:"}
	global := &Policy{keyPrefix: "rl:global:"}
	userKey, globalKey := user.storageKey(kh, "alice"), global.storageKey(kh, "global")
	if hashSlotOf(userKey) == hashSlotOf(globalKey) {
		t.Fatalf("test keys share slot %d; pick others", hashSlotOf(userKey))
	}
	ctx := context.Background()
	ask := func() decision {
		t.Helper()
		d, err := rs.decide(ctx, []bucketRequest{
			{key: userKey, limit: limit{interval: 1_000_000, burst: 2}, op: opTake, cost: 1},
			{key: globalKey, limit: limit{interval: 1_000_000, burst: 100}, op: opTake, cost: 1},
		})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for i := range 2 {
		if d := ask(); !d.admitted || d.verdicts[1].remaining != int64(99-i) {
			t.Fatalf("request %d: %+v", i, d)
		}
	}
	for range 5 {
		d := ask()
		if d.admitted || d.verdicts[0].allowed || !d.verdicts[1].allowed {
			t.Fatalf("user bucket empty: %+v, want denied by the user policy only", d)
		}
		if d.verdicts[1].remaining != 98 {
			t.Fatalf("denied request reports global remaining %d, want 98 (refunded)", d.verdicts[1].remaining)
		}
	}
	// The global bucket was charged and refunded five times: 98 left.
	d, err := rs.decide(ctx, []bucketRequest{{key: globalKey, limit: limit{interval: 1_000_000, burst: 100}, op: opTake, cost: 1}})
	if err != nil || d.verdicts[0].remaining != 97 {
		t.Fatalf("global alone: %+v %v, want 97 left after the refunds", d, err)
	}

	// Settles after the response across slots: one adjustment per slot,
	// each applied (here a refund of 2 to the global bucket and a charge of
	// 1 into debt to the user's, whose limit allows a debt of a burst).
	userLimit := limit{interval: 1_000_000, burst: 2, slack: 2_000_000}
	d, err = rs.decide(ctx, []bucketRequest{
		{key: userKey, limit: userLimit, op: opAdjust, delta: 1},
		{key: globalKey, limit: limit{interval: 1_000_000, burst: 100}, op: opAdjust, delta: -2},
	})
	if err != nil || d.verdicts[0].remaining != -1 || d.verdicts[1].remaining != 99 {
		t.Fatalf("settles across slots: %+v %v, want the user's bucket at -1 and the global at 99", d, err)
	}

	// A concurrency slot in one slot, a rate bucket in another: a request
	// the rate bucket denies frees the slot it took.
	slots := (&Policy{keyPrefix: "rl:exports:"}).storageKey(kh, "global")
	if hashSlotOf(slots) == hashSlotOf(userKey) {
		t.Fatalf("test keys share slot %d; pick others", hashSlotOf(slots))
	}
	acquire := bucketRequest{key: slots, limit: limit{interval: 30_000_000, burst: 1}, op: opAcquire, cost: 1, lease: "lease-1"}
	d, err = rs.decide(ctx, []bucketRequest{acquire, {key: userKey, limit: userLimit, op: opTake, cost: 1}})
	if err != nil || d.admitted || !d.verdicts[0].allowed {
		t.Fatalf("slot free, user in debt: %+v %v, want denied by the user's bucket", d, err)
	}
	acquire.lease = "lease-2"
	if d, err := rs.decide(ctx, []bucketRequest{acquire}); err != nil || !d.admitted {
		t.Fatalf("the slot after a denied request: %+v %v, want free (the denied request's lease freed)", d, err)
	}
}
