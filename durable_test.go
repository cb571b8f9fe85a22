package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// durableTake is one unit of a daily quota of n whose admissions wait for d.
func durableTake(key string, n int64, d durability) bucketRequest {
	q := &quotaSpec{periods: calendar.New(calendar.Day, time.UTC), durable: d, name: "durable"}
	return bucketRequest{key: key, limit: limit{burst: n}, op: opTake, cost: 1, quota: q}
}

// usedOn is the count a Redis holds for a quota key (0 for none).
func usedOn(t *testing.T, c *redis.Client, key string) int64 {
	t.Helper()
	v, err := c.Get(context.Background(), key).Result()
	if err == redis.Nil {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	_, used, ok := decodeQuota(v)
	if !ok {
		t.Fatalf("%s holds %q", key, v)
	}
	return used
}

// commandCalls reads INFO commandstats: calls per command.
func commandCalls(t *testing.T, c *redis.Client) map[string]int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	if err != nil {
		t.Fatal(err)
	}
	calls := map[string]int64{}
	for _, m := range regexp.MustCompile(`cmdstat_(\w+):calls=(\d+)`).FindAllStringSubmatch(info, -1) {
		calls[m[1]], _ = strconv.ParseInt(m[2], 10, 64)
	}
	return calls
}

// TestDurableQuota, with a real primary and replica: a durable quota's
// admission is confirmed by WAIT on the script's connection and its usage
// is on the replica when the request is answered; asking for more replicas
// than answer fails the request within the timeout (its on_error) and
// undoes its charge; durable aof on a Redis without WAITAOF (Debian's 7.0)
// or without an AOF fails with what to do; a call coalescing many durable
// requests sends one WAIT; requests that are not durable never wait for a
// confirmation; with the replica stopped, a durable request fails within
// the timeout.
func TestDurableQuota(t *testing.T) {
	// Long enough for a replica's acknowledgement on a loaded machine.
	const timeout = time.Second
	primary := testredis.Start(t)
	replica := testredis.StartReplica(t, primary)
	onPrimary := redis.NewClient(&redis.Options{Addr: primary.Addr})
	onReplica := redis.NewClient(&redis.Options{Addr: replica.Addr})
	t.Cleanup(func() { onPrimary.Close(); onReplica.Close() })
	rs := storeOn(t, primary.Addr, timeout)
	ctx := context.Background()
	one := durability{replicas: 1}

	// Admitted only if the replica acknowledged: a WAIT that ran out is a
	// denial (its time is the machine's: the first call also connects and
	// loads the script, beside a replica still syncing).
	start := time.Now()
	d, err := rs.decide(ctx, []bucketRequest{durableTake("rl:d:{a}", 100, one)})
	if took := time.Since(start); err != nil || !d.admitted {
		t.Fatalf("durable replicas 1 with a replica: %+v %v after %v", d, err, took)
	}
	if n := usedOn(t, onReplica, "rl:d:{a}"); n != 1 {
		t.Fatalf("the replica holds %d used once the request was admitted, want 1", n)
	}

	// Two replicas asked, one there: not confirmed; the charge is undone.
	start = time.Now()
	_, err = rs.decide(ctx, []bucketRequest{durableTake("rl:d:{a}", 100, durability{replicas: 2})})
	took := time.Since(start)
	var de *durabilityError
	if !errors.As(err, &de) || errorKind(err) != "not_durable" || took < timeout || took > 2*timeout {
		t.Fatalf("durable replicas 2 with one replica: %v (kind %s) after %v, want not_durable after the %v timeout", err, errorKind(err), took, timeout)
	}
	t.Logf("unconfirmed: %v, after %v", err, took.Round(time.Millisecond))
	waitUntil(t, "the unconfirmed charge undone", func() bool { return usedOn(t, onPrimary, "rl:d:{a}") == 1 })

	// durable aof: Debian's Redis 7.0 has no WAITAOF; 7.2 and later, run
	// here without an AOF, refuse it.
	_, err = rs.decide(ctx, []bucketRequest{durableTake("rl:d:{b}", 100, durability{aof: true})})
	if k := errorKind(err); k != "waitaof_unsupported" && k != "aof_disabled" || !strings.Contains(err.Error(), "durable aof") {
		t.Fatalf("durable aof: %v (kind %s)", err, k)
	}
	t.Logf("durable aof on this Redis: %v", err)
	waitUntil(t, "the aof request's charge undone", func() bool { return usedOn(t, onPrimary, "rl:d:{b}") == 0 })

	// 64 durable requests at once: coalesced calls, one WAIT each.
	onPrimary.ConfigResetStat(ctx)
	var wg sync.WaitGroup
	var admitted sync.Map
	gate := make(chan struct{})
	for i := range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			d, err := rs.decide(ctx, []bucketRequest{durableTake(fmt.Sprintf("rl:d:{c%d}", i), 100, one)})
			admitted.Store(i, err == nil && d.admitted)
		}()
	}
	close(gate)
	wg.Wait()
	for i := range 64 {
		if ok, _ := admitted.Load(i); ok != true {
			t.Fatalf("request %d of 64 not admitted", i)
		}
	}
	calls := commandCalls(t, onPrimary)
	scripts := calls["evalsha"] + calls["eval"]
	if calls["wait"] != scripts || scripts >= 64 {
		t.Fatalf("64 durable requests: %d script calls, %d WAITs; want one WAIT per call, fewer calls than requests", scripts, calls["wait"])
	}
	t.Logf("64 durable requests at once: %d script calls, %d WAITs", scripts, calls["wait"])

	// The replica frozen: a durable request waits the timeout; one that is
	// not durable, sent meanwhile, does not wait for it.
	if err := replica.Pause(); err != nil {
		t.Fatal(err)
	}
	durableDone := make(chan time.Duration, 1)
	go func() {
		start := time.Now()
		_, _ = rs.decide(ctx, []bucketRequest{durableTake("rl:d:{e}", 100, one)})
		durableDone <- time.Since(start)
	}()
	time.Sleep(20 * time.Millisecond)
	start = time.Now()
	d, err = rs.decide(ctx, []bucketRequest{{key: "rl:r:{e}", limit: limit{interval: 1000, burst: 10}, op: opTake, cost: 1}})
	plain := time.Since(start)
	if err != nil || !d.admitted || plain >= timeout { // it did not wait for the WAIT
		t.Fatalf("a rate request beside a durable one waiting: %+v %v after %v", d, err, plain)
	}
	if dt := <-durableDone; dt < timeout {
		t.Fatalf("the durable request with the replica frozen answered after %v, before the %v timeout", dt, timeout)
	}
	if err := replica.Resume(); err != nil {
		t.Fatal(err)
	}

	// The replica stopped: on_error within the timeout.
	replica.Stop()
	start = time.Now()
	_, err = rs.decide(ctx, []bucketRequest{durableTake("rl:d:{f}", 100, one)})
	took = time.Since(start)
	if errorKind(err) != "not_durable" || took < timeout || took > 2*timeout {
		t.Fatalf("durable replicas 1, replica stopped: %v after %v", err, took)
	}
	t.Logf("replica stopped: %v after %v", err, took.Round(time.Millisecond))
}

// waitUntil polls cond every 10 ms for at most 5 s.
func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 5s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestDurableQuotaCluster: in a Redis Cluster the script and its WAIT go to
// the master of the quota's slot, on one connection, and are confirmed by
// that master's replica.
func TestDurableQuotaCluster(t *testing.T) {
	c := testredis.StartCluster(t, 3, true)
	for _, m := range c.Masters {
		if _, err := m.Do("CONFIG", "SET", "repl-diskless-sync-delay", "0"); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := newRedisStore(RedisConfig{Addresses: c.Addrs(), Cluster: true, Timeout: caddy.Duration(time.Second)}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	rs := conn
	ctx := context.Background()
	// The replicas may still be taking their first copy: a bounded wait
	// for the first confirmation.
	var d decision
	deadline := time.Now().Add(20 * time.Second)
	for i := 0; ; i++ {
		d, err = rs.decide(ctx, []bucketRequest{durableTake(fmt.Sprintf("rl:d:{warm%d}", i), 100, durability{replicas: 1})})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no confirmation from the cluster's replicas within 20s: %v", err)
		}
	}
	for _, id := range []string{"a", "b", "c", "d", "e", "f"} { // several slots, so several masters
		d, err = rs.decide(ctx, []bucketRequest{durableTake("rl:d:{"+id+"}", 100, durability{replicas: 1})})
		if err != nil || !d.admitted {
			t.Fatalf("durable replicas 1 in a cluster, key {%s} (slot %d): %+v %v", id, hashSlotOf("{"+id+"}"), d, err)
		}
	}
	if _, err := rs.decide(ctx, []bucketRequest{durableTake("rl:d:{a}", 100, durability{replicas: 2})}); errorKind(err) != "not_durable" {
		t.Fatalf("durable replicas 2 with one replica per master: %v", err)
	}
}

// TestDurableWithoutReplicaSaysWhatToDo: a durable quota on a Redis that
// has no replica is not "Redis unavailable": Redis answered. The log line
// (one per 10 s) names the policy, says what Redis confirmed, what its
// requests do meanwhile and what to change (add a replica, raise the
// timeout, or remove durable); durable aof on a Redis that cannot confirm
// it says so at ERROR, with its own fix.
func TestDurableWithoutReplicaSaysWhatToDo(t *testing.T) {
	const timeout = 200 * time.Millisecond
	srv := testredis.Start(t) // a primary with no replica
	core, logs := observer.New(zap.InfoLevel)
	rs, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: caddy.Duration(timeout)}.resolved(), zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rs.Destruct() })
	ctx := context.Background()

	monthly := func(key string, d durability) bucketRequest {
		rq := durableTake(key, 100, d)
		rq.quota.name = "monthly"
		return rq
	}
	for range 3 {
		if _, err := rs.decide(ctx, []bucketRequest{monthly("rl:monthly:{a}", durability{replicas: 1})}); errorKind(err) != "not_durable" {
			t.Fatalf("durable replicas 1 without a replica: %v (kind %s), want not_durable", err, errorKind(err))
		}
	}
	var lines []observer.LoggedEntry
	for _, e := range logs.All() {
		if strings.Contains(e.Message, "durable") || strings.Contains(e.Message, "unavailable") {
			lines = append(lines, e)
		}
	}
	if len(lines) != 1 {
		t.Fatalf("%d log lines for 3 unconfirmed requests, want 1: %v", len(lines), logs.All())
	}
	e := lines[0]
	t.Logf("%s: %s", e.Level, e.Message)
	for _, want := range []string{`policy "monthly"`, "Redis answered", "0 of 1 replicas had it", "on_error", "fail_closed answers 503",
		"connected_slaves", "add a replica", "raise the redis timeout", "remove durable from the policy"} {
		if !strings.Contains(e.Message, want) {
			t.Errorf("the log line does not say %q: %s", want, e.Message)
		}
	}
	if e.Level != zap.WarnLevel || strings.Contains(e.Message, "unavailable") || e.ContextMap()["kind"] != "not_durable" {
		t.Errorf("want a WARN of kind not_durable that does not call Redis unavailable: %s %v %s", e.Level, e.ContextMap(), e.Message)
	}

	// durable aof: Debian's Redis 7.0 has no WAITAOF; 7.2 and later, run
	// here without an AOF, refuse it. Either way an ERROR with its fix.
	logs.TakeAll()
	_, err = rs.decide(ctx, []bucketRequest{monthly("rl:monthly:{b}", durability{aof: true})})
	kind := errorKind(err)
	if kind != "waitaof_unsupported" && kind != "aof_disabled" {
		t.Fatalf("durable aof: %v (kind %s)", err, kind)
	}
	all := logs.All()
	if len(all) != 1 || all[0].Level != zap.ErrorLevel {
		t.Fatalf("durable aof (%s): want one ERROR, got %v", kind, all)
	}
	msg := all[0].Message
	t.Logf("%s: %s", all[0].Level, msg)
	for _, want := range []string{`policy "monthly"`, "durable aof", "use durable replicas <n> instead", "remove durable from the policy"} {
		if !strings.Contains(msg, want) {
			t.Errorf("the durable aof line does not say %q: %s", want, msg)
		}
	}
}
