package ratelimit

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// A request the instance serves alone is decided on a connection that
// waits for Redis in a blocking system call (the lone client); requests
// served together go on the pool's, coalesced; both decide the same
// bucket alike.
func TestLoneRequestDecidesOnTheLoneConnection(t *testing.T) {
	if !blockingWaits {
		t.Skip("sockets to Redis wait in blocking calls only on Linux")
	}
	_, _, rs := newTestRedis(t)
	if rs.lone == nil {
		t.Fatal("a single Redis has no lone connection")
	}
	loneUp(t, rs)
	used := func() uint64 { return loneUsed(rs) }
	r := []bucketRequest{{key: "rl:p:{lone}", limit: limit{interval: 1_000_000, burst: 3}, op: opTake, cost: 1}}
	for _, tc := range []struct {
		serving int64
		lone    bool
		left    int64
	}{{1, true, 2}, {5, false, 1}, {1, true, 0}} {
		serving.Add(tc.serving)
		before := used()
		d, err := rs.decide(context.Background(), r)
		serving.Add(-tc.serving)
		if err != nil || !d.admitted || d.verdicts[0].remaining != tc.left {
			t.Fatalf("serving %d: %+v, %v; want admitted, %d left", tc.serving, d, err, tc.left)
		}
		if onLone := used() > before; onLone != tc.lone {
			t.Fatalf("serving %d: decided on the lone connection %v, want %v", tc.serving, onLone, tc.lone)
		}
	}
}

// Once Redis is back from an outage, the next request served alone is
// decided at once, on the pool's connections, while the lone connections
// (whose pool go-redis stops dialing for a second after as many failed
// dials as its size) come back behind it.
func TestLoneRequestAfterAnOutage(t *testing.T) {
	srv, rs, r := loneStore(t, "outage")
	ctx := context.Background()
	if _, err := rs.decide(ctx, r); err != nil {
		t.Fatal(err)
	}
	srv.Stop()
	for range 3 {
		if _, err := rs.decide(ctx, r); err == nil {
			t.Fatal("decided with Redis stopped")
		}
	}
	srv.Restart(t)
	if d, err := rs.decide(ctx, r); err != nil || !d.admitted {
		t.Fatalf("the first decision once Redis is back: %+v, %v", d, err)
	}
	decidesOnLoneOnceBack(t, rs, r)
}

// Whatever failure a lone call ends in, but Redis's error reply (here the
// refusal of a new connection after a password change), the pool's
// connections take the lone calls, until the lone connection answers
// again.
func TestLoneCallsGoToThePoolAfterAFailure(t *testing.T) {
	_, rs, r := loneStore(t, "refused")
	ctx := context.Background()
	rs.loneAnswered(errors.New("WRONGPASS invalid username-password pair or user is disabled."))
	before := loneUsed(rs)
	if _, err := rs.decide(ctx, r); err != nil || loneUsed(rs) != before {
		t.Fatalf("after a refused lone connection: %v, on the lone connection %v", err, loneUsed(rs) != before)
	}
	decidesOnLoneOnceBack(t, rs, r)
}

// decidesOnLoneOnceBack waits (10 s at most) for the lone connections to
// answer again, and checks a request alone is then decided on them.
func decidesOnLoneOnceBack(t *testing.T, rs *redisStore, r []bucketRequest) {
	t.Helper()
	loneUp(t, rs)
	before := loneUsed(rs)
	if _, err := rs.decide(context.Background(), r); err != nil || loneUsed(rs) == before {
		t.Fatalf("once back, a request alone: %v, on the lone connection %v", err, loneUsed(rs) != before)
	}
}

// loneUsed counts the calls made on the lone connection.
func loneUsed(rs *redisStore) uint64 { return rs.lone.calls.Load() }

// loneUp waits (10 s at most) for the lone connection to be open.
func loneUp(t *testing.T, rs *redisStore) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for rs.loneDown.Load() {
		if time.Now().After(deadline) {
			t.Fatal("the lone connection did not open within 10 s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// loneStore is a store on a Redis of its own, and a wide bucket's request
// under name; it skips where sockets cannot block.
func loneStore(t *testing.T, name string) (*testredis.Server, *redisStore, []bucketRequest) {
	t.Helper()
	if !blockingWaits {
		t.Skip("sockets to Redis wait in blocking calls only on Linux")
	}
	srv, _, rs := newTestRedis(t)
	loneUp(t, rs)
	return srv, rs, []bucketRequest{{key: "rl:p:{" + name + "}", limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
}

// A lone connection that answered within the last second is used without
// a look at its socket (loneFresh). When Redis closed it meanwhile (here
// CLIENT KILL), the call finds it closed before any reply, and is made on
// the pool: the request is decided, and charged once.
func TestLoneCallOnAClosedConnectionIsMadeOnThePool(t *testing.T) {
	srv, rs, _ := loneStore(t, "closed")
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{closed}", limit: limit{interval: 1_000_000_000, burst: 100}, op: opTake, cost: 1}}
	for round := range 3 {
		loneUp(t, rs)
		for range 5 {
			if _, err := rs.decide(ctx, r); err != nil {
				t.Fatal(err)
			}
		}
		before := loneUsed(rs)
		if killed, err := srv.Do("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes"); err != nil || killed == "0" {
			t.Fatalf("CLIENT KILL: %s, %v", killed, err)
		}
		d, err := rs.decide(ctx, r)
		if err != nil || !d.admitted {
			t.Fatalf("round %d: the decision after Redis closed the lone connection: %+v, %v", round, d, err)
		}
		if loneUsed(rs) != before+1 {
			t.Fatalf("round %d: %d calls tried on the lone connection, want 1 (taken without a look)", round, loneUsed(rs)-before)
		}
		if want := int64(100 - 6*(round+1)); d.verdicts[0].remaining != want {
			t.Fatalf("round %d: %d left, want %d: the request was charged %d times", round, d.verdicts[0].remaining, want, 100-int(d.verdicts[0].remaining)-6*round-5)
		}
	}
}
