package integration_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Concurrency limits when things go wrong: an operator's reset while
// requests run, Redis paused while holders finish, Redis flushed under
// running requests, a round trip of a third of the lease; and the outcome
// counted for requests that waited for their slot.

// slotsInUse is what `caddy rate-limit inspect` says of a concurrency
// policy's key.
func slotsInUse(t *testing.T, in *instance, policy, identity string) int64 {
	t.Helper()
	var b struct {
		InUse int64 `json:"in_use"`
	}
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, "inspect", policy, identity, "--json")), &b); err != nil {
		t.Fatal(err)
	}
	return b.InUse
}

// holders starts n requests of key held hold by the upstream and waits
// until all are in it; the returned wait waits for them to end.
func holders(t *testing.T, in *instance, up *holdingUpstream, key string, n int, hold time.Duration) (wait func()) {
	t.Helper()
	var wg sync.WaitGroup
	before := up.now(key)
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, _ = send(context.Background(), in, key, hold)
		}()
	}
	waitFor(t, "the holders at the upstream", func() bool { return up.now(key) >= before+n })
	return wg.Wait
}

// TestConcurrentResetKeepsRunning: a reset of `concurrent 3` while 3
// requests run and 3 wait never lets more than 3 run: the running
// requests keep their leases, and the answer says so.
func TestConcurrentResetKeepsRunning(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	// fail_closed, 1s: a call that times out on a loaded machine must not
	// admit past the slots (fail_open would, by design), nor fail the test.
	in := startCaddy(t, decidedByRedis(srv.Addr, slotsPolicy(3, "wait", "10s")), proxyTo(up.addr))
	done := holders(t, in, up, "busy", 3, 2*time.Second)
	var waiters sync.WaitGroup
	for range 3 {
		waiters.Add(1)
		go func() { defer waiters.Done(); _, _ = send(context.Background(), in, "busy", 0) }()
	}
	waitFor(t, "3 waiters", func() bool {
		return metricValue(t, in, "caddy_rate_limit_waiting", map[string]string{"policy": "exports"}) == 3
	})
	out := rateLimitCLI(t, in, "reset", "exports", "busy")
	time.Sleep(300 * time.Millisecond) // would a freed slot be taken, it is by now (hand-offs take ms)
	during := up.mostAtOnce("busy")
	done()
	waiters.Wait()
	t.Logf("reset with 3 running and 3 waiting: %q; most at the upstream %d", strings.TrimSpace(out), up.mostAtOnce("busy"))
	if !strings.Contains(out, "3 running, kept; 0 stale, dropped") {
		t.Errorf("the reset said %q, want 3 running kept", out)
	}
	if during > 3 || up.mostAtOnce("busy") > 3 {
		t.Errorf("the upstream saw %d at once after the reset (%d overall), want at most 3", during, up.mostAtOnce("busy"))
	}
}

// TestConcurrentReleaseAfterPause: holders that finish while Redis is
// paused (SIGSTOP, 600 ms) free their slots within a second or two of its
// return, not when their leases (30 s) run out: releases are sent again.
func TestConcurrentReleaseAfterPause(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"on_error": "fail_closed"}, slotsPolicy(3)), proxyTo(up.addr))
	done := holders(t, in, up, "paused", 3, 300*time.Millisecond)
	if err := syscall.Kill(srv.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	done() // the holders end while Redis is paused
	time.Sleep(600 * time.Millisecond)
	if err := syscall.Kill(srv.Pid(), syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	resumed := time.Now()
	waitFor(t, "the slots free", func() bool { return slotsInUse(t, in, "exports", "paused") == 0 })
	free := time.Since(resumed)
	retries := metricValue(t, in, "caddy_rate_limit_release_retries_total", map[string]string{"policy": "exports"})
	t.Logf("3 holders ended during a 600 ms pause: slots free %v after Redis came back (lease 30s); release retries %v", free.Round(time.Millisecond), retries)
	if free > 2*time.Second {
		t.Errorf("slots free %v after Redis came back, want within 2s", free)
	}
}

// TestConcurrentFlushAll: FLUSHALL while 3 long requests run under
// `concurrent 3`: new requests may get in until the next renewal puts the
// lost leases back; once a renewal interval has passed, the upstream never
// sees more than 3.
func TestConcurrentFlushAll(t *testing.T) {
	const lease = 3 * time.Second // renewed every second
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	// fail_closed, 1s: a call timed out under load must not admit past the
	// slots (as fail_open would) in what measures the renewals.
	in := startCaddy(t, decidedByRedis(srv.Addr, slotsPolicy(3, "lease", "3s")), proxyTo(up.addr))
	done := holders(t, in, up, "flushed", 3, 4*time.Second)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer client.Close()
	if err := client.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	flushed := time.Now()
	// Short requests from others, for 2.5 s.
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Since(flushed) < 2500*time.Millisecond {
				_, _ = send(context.Background(), in, "flushed", 50*time.Millisecond)
			}
		}()
	}
	wg.Wait()
	done()
	// A renewal interval (a third of the lease, looked for every 250 ms),
	// the restore's round trip, and one short request (50 ms) later.
	settled := flushed.Add(lease/3 + 250*time.Millisecond + 200*time.Millisecond)
	mostBefore, mostAfter := up.mostBetween("flushed", flushed, settled), up.mostBetween("flushed", settled, time.Now())
	t.Logf("FLUSHALL under 3 running requests: most at the upstream %d until the renewal, %d after it", mostBefore, mostAfter)
	if mostAfter > 3 {
		t.Errorf("the upstream saw %d at once after the renewal interval, want at most 3", mostAfter)
	}
}

// TestConcurrentSlowRedis: `lease 1s` behind a round trip of 300 ms (a
// third of the lease): renewals still land in time, and no probe gets in
// while 3 requests hold `concurrent 3`.
func TestConcurrentSlowRedis(t *testing.T) {
	srv := testredis.Start(t)
	proxy := testredis.StartProxy(t, srv.Addr, 150*time.Millisecond)
	up := startHoldingUpstream(t)
	in := startCaddy(t, redisLimiter(proxy.Addr, "2s", map[string]any{"on_error": "fail_closed"}, slotsPolicy(3, "lease", "1s")), proxyTo(up.addr))
	done := holders(t, in, up, "slow", 3, 3500*time.Millisecond)
	probes, admitted := 0, 0
	for up.now("slow") == 3 && probes < 20 {
		if status, _ := send(context.Background(), in, "slow", 0); status == 200 {
			admitted++
		}
		probes++
	}
	done()
	t.Logf("lease 1s, 300 ms round trip, 3 of 3 slots held for 3.5 s: %d of %d probes admitted, most at the upstream %d", admitted, probes, up.mostAtOnce("slow"))
	if admitted != 0 || up.mostAtOnce("slow") > 3 || probes < 5 {
		t.Errorf("%d of %d probes admitted, most at once %d: want none, at most 3", admitted, probes, up.mostAtOnce("slow"))
	}
}

// TestConcurrentGracefulStop: an instance stopped (SIGTERM, as `caddy
// stop` and service managers do) while its two requests hold both slots of
// `concurrent 2`, and Redis stalls as they end (the link to it paused: a
// failover, a slow network): the first release is on the wire, the second
// queued behind it, and each response waits for its own release to reach
// Redis (a finished request is finished everywhere). The instance lets
// both requests finish, and exits only once both releases have reached
// Redis, when it answers again: another instance gets both slots at once,
// not when the 30 s leases run out.
func TestConcurrentGracefulStop(t *testing.T) {
	srv := testredis.Start(t)
	link := testredis.StartProxy(t, srv.Addr, 0)
	up := startHoldingUpstream(t)
	// 5s: the stall below must not time the releases out.
	stopping := startCaddy(t, redisLimiter(link.Addr, "5s", map[string]any{"on_error": "fail_closed"}, slotsPolicy(2, "lease", "30s")), proxyTo(up.addr))
	other := startCaddy(t, redisLimiter(srv.Addr, "1s", map[string]any{"on_error": "fail_closed", "jitter": 0}, slotsPolicy(2, "lease", "30s")), proxyTo(up.addr))
	statuses := make(chan int, 2)
	for _, hold := range []time.Duration{400 * time.Millisecond, 600 * time.Millisecond} {
		go func() {
			status, _ := send(context.Background(), stopping, "held", hold)
			statuses <- status
		}()
	}
	waitFor(t, "2 requests at the upstream", func() bool { return up.now("held") == 2 })
	if err := link.Pause(); err != nil {
		t.Fatal(err)
	}
	if status, _ := send(context.Background(), other, "held", 0); status != 429 {
		t.Fatalf("with both slots held: %d, want 429", status)
	}
	exited := make(chan struct{})
	go func() { stopping.Stop(); close(exited) }()
	// The requests leave the upstream within 600 ms; their responses wait
	// for their releases, which wait for Redis. Caddy notices its last
	// request is done within about 500 ms of its end (its server's shutdown
	// polls): an instance that does not wait for its releases has exited by
	// 1.5 s. One that waits does not exit while Redis stalls, and 1.5 s is
	// well inside the 5 s its calls may take and the 5 s Stop gives it.
	select {
	case status := <-statuses:
		t.Errorf("a response ended (%d) while its release could not reach Redis", status)
		statuses <- status
	case <-exited:
	case <-time.After(1500 * time.Millisecond):
	}
	resumed := time.Now()
	if err := link.Resume(); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if status := <-statuses; status != 200 {
			t.Fatalf("a request running when its instance was stopped: %d, want 200", status)
		}
	}
	<-exited
	after := time.Since(resumed)
	var wg sync.WaitGroup
	got := make([]int, 2)
	for i := range got {
		wg.Add(1)
		go func() { defer wg.Done(); got[i], _ = send(context.Background(), other, "held", 100*time.Millisecond) }()
	}
	wg.Wait()
	t.Logf("stopped with 2 of 2 slots held and Redis stalled as they ended: exited %v after Redis answered again; the other instance then got %v", after.Round(time.Millisecond), got)
	if got[0] != 200 || got[1] != 200 {
		t.Fatalf("right after the stopped instance exited, 2 requests on the other got %v, want [200 200]: a release was lost, its slot held until the lease runs out", got)
	}
}

// TestConcurrentReloadKeepsSlots: a reload that changes the redis block
// (here its timeout: another connection) while a request holds the one slot
// of `concurrent 1` with `lease 1s`: Caddy cleans the old config up while
// the request still runs on it, and the request keeps its slot (its lease
// renewed) until it ends, then frees it.
func TestConcurrentReloadKeepsSlots(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "1s", map[string]any{"on_error": "fail_closed", "jitter": 0}, slotsPolicy(1, "lease", "1s")), proxyTo(up.addr))
	done := make(chan int, 1)
	go func() {
		status, _ := send(context.Background(), in, "kept", 3*time.Second)
		done <- status
	}()
	waitFor(t, "the long request at the upstream", func() bool { return up.now("kept") == 1 })
	in.reload(t, redisLimiter(srv.Addr, "2s", map[string]any{"on_error": "fail_closed", "jitter": 0}, slotsPolicy(1, "lease", "1s")), proxyTo(up.addr))
	tries, admitted := probeWhileRunning(in, up, "kept")
	if status := <-done; status != 200 {
		t.Fatalf("the long request: %d", status)
	}
	// Each request is sent the instant the one before has its response; a
	// slot the reload lost stays held for the lease.
	after := 0
	for range 5 {
		if status, _ := send(context.Background(), in, "kept", 0); status == 200 {
			after++
		}
	}
	t.Logf("a request of 3 s, lease 1 s, the redis block changed by a reload as it ran: %d of %d others got in meanwhile, most at once %d; after it ended %d of 5", admitted, tries, up.mostAtOnce("kept"), after)
	if admitted != 0 || up.mostAtOnce("kept") != 1 || tries < 10 {
		t.Fatalf("%d of %d got in while the request of the old config ran (most at once %d), want none: its lease was not renewed", admitted, tries, up.mostAtOnce("kept"))
	}
	if after != 5 {
		t.Fatalf("after it ended, %d of 5 one after the other got in, want 5: its slot was not freed", after)
	}
}

// TestConcurrentWaitedCountsDelayed: a request that waited for its slot is
// counted delayed, as {http.rate_limit.decision} says.
func TestConcurrentWaitedCountsDelayed(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "1s", nil, slotsPolicy(1, "wait", "5s")), proxyTo(up.addr)) // a timeout would count fail_open
	done := holders(t, in, up, "turn", 1, 300*time.Millisecond)
	if status, _ := send(context.Background(), in, "turn", 0); status != 200 {
		t.Fatalf("the waiter: %d", status)
	}
	done()
	delayed := metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "exports", "outcome": "delayed"})
	allowed := metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "exports", "outcome": "allowed"})
	if delayed != 1 || allowed != 1 {
		t.Fatalf("decisions_total: delayed %v, allowed %v; want 1 and 1", delayed, allowed)
	}
}

// mostBetween is the most requests of key the upstream had in flight at
// once between from and to.
func (u *holdingUpstream) mostBetween(key string, from, to time.Time) int {
	most := 0
	for n := 1; n <= 64; n++ {
		if u.timeAt(key, n, from, to) > 0 {
			most = n
		}
	}
	return most
}
