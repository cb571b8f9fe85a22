package integration_test

import (
	"fmt"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// clusterLimiter is a per-user and a global policy on a Redis Cluster (or
// on sentinels), failing closed so that a failure shows as a 503.
func clusterLimiter(redis map[string]any, userRate string, userBurst int, globalRate string, globalBurst int) map[string]any {
	h := limiter("", map[string]any{"on_error": "fail_closed"},
		map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": userRate, "burst": userBurst},
		map[string]any{"name": "global", "key": "global", "rate": globalRate, "burst": globalBurst},
	)
	h["redis"] = redis
	return h
}

// driveUsers is drive with a fresh X-User per request, from a pool of n.
func driveUsers(t *testing.T, fleet []*instance, d time.Duration, prefix string, n int) *tally {
	var seq atomic.Int64
	return driveFunc(t, fleet, 8, d, func() []string {
		return []string{"X-User", prefix + strconv.FormatInt(seq.Add(1)%int64(n), 10)}
	})
}

// TestClusterBudgets: two Caddy instances on a three-master Redis Cluster,
// two policies per request whose keys live in different slots. Each budget
// holds within ±2, whichever policy binds.
func TestClusterBudgets(t *testing.T) {
	c := testredis.StartCluster(t, 3, false)
	redis := map[string]any{"addresses": c.Addrs(), "cluster": true, "timeout": "1s"}

	// One user: the per-user policy binds; the global one is refunded
	// whenever the per-user policy denies.
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, clusterLimiter(redis, "20/1s", 10, "1000/1s", 1000), echo()))
	}
	one := drive(t, fleet, 8, 4*time.Second, "X-User", "alice")
	st := one.statuses()
	budget := 10 + 20*one.elapsed.Seconds()
	t.Logf("one user: admitted %d of the per-user budget %.1f; %v", st[200], budget, st)
	if st[200]+st[429] != len(one.shots) || float64(st[200]) > budget+2 {
		t.Errorf("one user: %v, want %.1f ± 2 admitted and only 429 besides", st, budget)
	}
	requireOver(t, "one user", len(one.shots), budget, 2)
	if float64(st[200]) < budget-2 {
		t.Errorf("one user: %v, want %.1f ± 2 admitted and only 429 besides", st, budget)
	}

	// Many users: the global policy binds; per-user buckets are refunded.
	fleet = fleet[:0]
	for range 2 {
		fleet = append(fleet, startCaddy(t, clusterLimiter(redis, "20/1s", 10, "30/1s", 10), echo()))
	}
	many := driveUsers(t, fleet, 4*time.Second, "user-", 500)
	st = many.statuses()
	budget = 10 + 30*many.elapsed.Seconds()
	t.Logf("500 users: admitted %d of the global budget %.1f; %v", st[200], budget, st)
	if st[200]+st[429] != len(many.shots) || float64(st[200]) > budget+2 {
		t.Errorf("500 users: %v, want %.1f ± 2 admitted and only 429 besides", st, budget)
	}
	requireOver(t, "500 users", len(many.shots), budget, 2)
	if float64(st[200]) < budget-2 {
		t.Errorf("500 users: %v, want %.1f ± 2 admitted and only 429 besides", st, budget)
	}
}

// checkRecovered checks limiting after a failover: 503s (fail_closed) end
// within 2 s, and the admitted count fits the budget of burst 10 and 20/s:
// at most the burst plus the rate since Redis first decided, at least the
// rate since the last failure.
func checkRecovered(t *testing.T, tl *tally) {
	t.Helper()
	first, lastFail := time.Duration(-1), time.Duration(0)
	for _, s := range tl.shots {
		switch s.status {
		case 200, 429:
			if first < 0 {
				first = s.at
			}
		case 503:
			lastFail = s.at
		default:
			t.Errorf("status %d: want only 200, 429 and 503", s.status)
			return
		}
	}
	st := tl.statuses()
	most := 10 + 20*(tl.elapsed-first).Seconds() + 2
	least := 20*(tl.elapsed-lastFail).Seconds() - 2
	t.Logf("after: %v; first Redis decision at %v, last 503 at %v; admitted %d, expected %.1f to %.1f",
		st, first.Round(time.Millisecond), lastFail.Round(time.Millisecond), st[200], least, most)
	if first < 0 || lastFail > 2*time.Second {
		t.Errorf("limiting not back within 2s: first decision %v, last 503 %v", first, lastFail)
	}
	if n := float64(st[200]); n > most {
		t.Errorf("admitted %d, want %.1f to %.1f", st[200], least, most)
	}
	requireOver(t, "after", st[200]+st[429], most, 2)
	if n := float64(st[200]); n < least {
		t.Errorf("admitted %d, want %.1f to %.1f", st[200], least, most)
	}
}

// TestClusterFailover: a CLUSTER FAILOVER of every master mid-traffic gives
// nothing but 200, 429 and the failure mode's 503, and limiting is correct
// again within a few seconds.
func TestClusterFailover(t *testing.T) {
	c := testredis.StartCluster(t, 3, true)
	redis := map[string]any{"addresses": c.Addrs(), "cluster": true, "timeout": "500ms"}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, clusterLimiter(redis, "20/1s", 10, "1000/1s", 1000), echo()))
	}
	done := make(chan string)
	go func() {
		time.Sleep(time.Second)
		var out string
		for _, r := range c.Replicas {
			_, err := r.Do("CLUSTER", "FAILOVER")
			out += fmt.Sprintf("CLUSTER FAILOVER on %s: %v; ", r.Addr, err)
		}
		done <- out
	}()
	during := drive(t, fleet, 8, 4*time.Second, "X-User", "failover")
	t.Log(<-done)
	st := during.statuses()
	t.Logf("during the failover: %v", st)
	if st[200]+st[429]+st[503] != len(during.shots) {
		t.Errorf("during the failover: %v, want only 200, 429 and 503", st)
	}
	for _, r := range c.Replicas {
		deadline := time.Now().Add(10 * time.Second)
		for role, _ := r.Role(); role != "master"; role, _ = r.Role() {
			if time.Now().After(deadline) {
				t.Fatalf("replica %s did not become master", r.Addr)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	checkRecovered(t, drive(t, fleet, 8, 4*time.Second, "X-User", "after-failover"))
}

// TestSentinelFailover: the master dies mid-traffic; the sentinels promote
// the replica; decisions follow the failure mode meanwhile and are correct
// again within a few seconds.
func TestSentinelFailover(t *testing.T) {
	sn := testredis.StartSentinels(t)
	redis := map[string]any{"addresses": sn.Addrs(), "sentinel": testredis.MasterName, "timeout": "500ms"}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, clusterLimiter(redis, "20/1s", 10, "1000/1s", 1000), echo()))
	}
	before := drive(t, fleet, 8, 2*time.Second, "X-User", "before")
	budget := 10 + 20*before.elapsed.Seconds()
	if st := before.statuses(); float64(st[200]) > budget+2 {
		t.Fatalf("before the failover: %v", st)
	}
	requireOver(t, "before the failover", len(before.shots), budget, 2)
	if st := before.statuses(); float64(st[200]) < budget-2 {
		t.Fatalf("before the failover: %v", st)
	}
	sn.Master.Stop()
	killed := time.Now()
	var back time.Duration
	for time.Since(killed) < 30*time.Second {
		if role, _ := sn.Replica.Role(); role == "master" {
			back = time.Since(killed)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if back == 0 {
		t.Fatal("the sentinels did not promote the replica within 30s")
	}
	t.Logf("replica promoted %v after the master died", back.Round(time.Millisecond))
	checkRecovered(t, drive(t, fleet, 8, 4*time.Second, "X-User", "after"))
}
