package integration_test

import (
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The redis block's timeout measures Redis, not the gateway (see
// redis_socket.go): a gateway too busy to read a reply that came in time
// still decides by Redis; a Redis that truly stalls still fails over
// within the timeout and a stated bound.

// TestFrozenGatewayDecidesByRedis: with the defaults (timeout 100ms,
// fail_open), one Caddy is frozen 20 times for 200 ms (SIGSTOP, SIGCONT:
// what a saturated host does to a process) while 16 clients send on one
// key through a 20 ms round trip to a Redis that answers at once: no
// decision follows on_error, and what is admitted stays within the budget.
func TestFrozenGatewayDecidesByRedis(t *testing.T) {
	srv := testredis.Start(t)
	proxy := testredis.StartProxy(t, srv.Addr, 10*time.Millisecond)
	in := startCaddy(t, limiter(proxy.Addr, nil, attackPolicy()), echo())
	get(t, in.URL, "X-Api-Key", "warm-up") // the connection pool is open
	frozen := make(chan time.Duration)
	go func() {
		var total time.Duration
		time.Sleep(300 * time.Millisecond) // the flood is under way
		for range 20 {
			start := time.Now()
			if err := syscall.Kill(in.Pid(), syscall.SIGSTOP); err != nil {
				t.Error(err)
				break
			}
			time.Sleep(200 * time.Millisecond)
			if err := syscall.Kill(in.Pid(), syscall.SIGCONT); err != nil {
				t.Error(err)
				break
			}
			total += time.Since(start)
			time.Sleep(100 * time.Millisecond)
		}
		frozen <- total
	}()
	f := flood(t, []*instance{in}, 16, 6500*time.Millisecond, func(int, int) string { return "attacker" })
	total := <-frozen
	got, most := f.admitted["attacker"], 10+20*f.lastAdmitted.Seconds()
	failOpen := metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "per_key", "outcome": "fail_open"})
	t.Logf("16 clients, one key, 20 ms round trip, frozen 20 times for %v in all over %v: %d requests (%d transport errors), admitted %d of a budget of %.1f by the last admission; decisions %v; fail_open %v; store errors %v",
		total.Round(time.Millisecond), f.elapsed.Round(time.Millisecond), f.sent, f.errors, got, most, f.decisions, failOpen, storeErrorKinds(t, in))
	if n := f.failures(); n != 0 || failOpen != 0 {
		t.Errorf("%d responses from a failure mode (decisions_total fail_open %v) while Redis answered at once: %v", n, failOpen, f.decisions)
	}
	if float64(got) > most {
		t.Errorf("admitted %d, over the budget of %.1f", got, most)
	}
	if got < 10 {
		t.Errorf("admitted %d: the flood did not run", got)
	}
}

// TestStalledRedisFailsOver: a Redis stopped (SIGSTOP) is still noticed:
// a request fails over to its on_error within the timeout (100 ms) and
// lookAgain (5 ms), plus this machine's delay in scheduling it.
func TestStalledRedisFailsOver(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "100ms", map[string]any{"on_error": "fail_closed"}, attackPolicy()), echo())
	get(t, in.URL, "X-Api-Key", "warm-up")
	if err := syscall.Kill(srv.Pid(), syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = syscall.Kill(srv.Pid(), syscall.SIGCONT) }()
	var took []time.Duration
	for i := range 5 { // the breaker opens after repeated failures: fewer
		start := time.Now()
		r := get(t, in.URL, "X-Api-Key", "k"+string(rune('a'+i)))
		took = append(took, time.Since(start))
		if r.status != 503 {
			t.Fatalf("request %d with Redis stopped: %d, want 503 (fail_closed)", i+1, r.status)
		}
	}
	slowest := took[0]
	for _, d := range took {
		slowest = max(slowest, d)
	}
	t.Logf("Redis stopped: 503 after %v", took)
	// The bound is the timeout and lookAgain; the rest is a loaded
	// machine's scheduling (CI's two cores beside other work).
	if slowest > 100*time.Millisecond+5*time.Millisecond+400*time.Millisecond {
		t.Errorf("a request waited %v for a stopped Redis, want about 105 ms", slowest)
	}
	if slowest < 100*time.Millisecond {
		t.Errorf("a request failed over after %v, before the 100 ms timeout", slowest)
	}
}
