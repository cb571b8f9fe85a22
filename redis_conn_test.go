package ratelimit

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestDestructFinishesAfterWork: a connection closed (Caddy stopping, or a
// reload to another Redis) first sends what its requests left to do after
// their responses, and the releases Redis did not confirm: the next
// instance finds the slots free and the charge made, rather than slots
// taken until their leases run out and a settle lost. The work after
// responses here would wait an hour for a decision to ride with; apart,
// each goes in a call of its own at once (as in cluster mode).
func TestDestructFinishesAfterWork(t *testing.T) {
	for _, apart := range []bool{false, true} {
		name := "coalesced"
		if apart {
			name = "apart"
		}
		t.Run(name, func(t *testing.T) { testDestructFinishesLaterWork(t, apart) })
	}
}

func testDestructFinishesLaterWork(t *testing.T, apart bool) {
	srv := testredis.Start(t)
	cfg := RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved()
	conn, err := newRedisStore(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	if apart {
		conn.coalescer = nil
	} else {
		conn.coalescer.wait = time.Hour
	}
	rs := conn
	ctx := context.Background()

	slots := limit{interval: 30_000_000, burst: 2} // 2 slots, leases of 30 s
	var held []lease
	for range 2 {
		rq := bucketRequest{key: "rl:c:{slots}", limit: slots, op: opAcquire, lease: leaseIDs()}
		d, err := rs.decide(ctx, []bucketRequest{rq})
		if err != nil || !d.verdicts[0].allowed {
			t.Fatalf("acquire: %+v, %v", d, err)
		}
		held = append(held, lease{rq: rq})
	}
	conn.leases.hold(held)
	// One slot's request ends: its release is queued. The other's release
	// failed once, and waits to be sent again.
	conn.leases.sendReleases(conn.leases.releasing(held[:1]))
	unconfirmed := held[1].rq
	unconfirmed.op = opRelease
	conn.leases.mu.Lock()
	delete(conn.leases.leases, unconfirmed.lease)
	conn.leases.mu.Unlock()
	conn.leases.retryReleases([]bucketRequest{unconfirmed}, []*Policy{nil})
	// A settle's charge of 3 more tokens, queued.
	rate := limit{interval: 60_000_000, burst: 10} // 10 a minute: no refill to speak of
	charged := make(chan error, 1)
	rs.decideAfter([]bucketRequest{{key: "rl:p:{settled}", limit: rate, op: opTake, cost: 3}}, func(_ decision, err error) { charged <- err })

	if err := conn.Destruct(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-charged:
		if err != nil {
			t.Fatalf("the queued charge: %v", err)
		}
	default:
		t.Fatal("Destruct returned before the queued charge was made")
	}

	// The next instance.
	next, err := newRedisStore(cfg, zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { next.Destruct() })
	ns := next
	admitted := 0
	for range 3 {
		d, err := ns.decide(ctx, []bucketRequest{{key: "rl:c:{slots}", limit: slots, op: opAcquire, lease: leaseIDs()}})
		if err != nil {
			t.Fatal(err)
		}
		if d.verdicts[0].allowed {
			admitted++
		}
	}
	if admitted != 2 {
		t.Fatalf("after the first connection closed, %d of 3 acquires got a slot, want 2: its releases were not sent", admitted)
	}
	d, err := ns.decide(ctx, []bucketRequest{{key: "rl:p:{settled}", limit: rate, op: opTake, cost: 1}})
	if err != nil {
		t.Fatal(err)
	}
	if got := d.verdicts[0].remaining; got != 6 {
		t.Fatalf("after the charge of 3 and a take of 1, %d of 10 tokens left, want 6", got)
	}
}
