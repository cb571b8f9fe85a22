package integration_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// policy20 is the fleet test's budget: burst 10, then 20 per second, per
// X-Api-Key.
func policy20(extra ...string) map[string]any {
	p := map[string]any{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "20/1s", "burst": 10}
	for i := 0; i+1 < len(extra); i += 2 {
		p[extra[i]] = extra[i+1]
	}
	return p
}

func redisLimiter(addr, timeout string, extra map[string]any, policies ...map[string]any) map[string]any {
	h := limiter("", extra, policies...)
	h["redis"] = map[string]any{"addresses": []string{addr}, "timeout": timeout}
	return h
}

// decidedByRedis is a limiter whose every request Redis decides: within a
// 1 s timeout no load reaches, and fail_closed, so that a call that still
// timed out answers 503 instead of admitting. Tests that count what was
// admitted on a loaded machine use it: at the default 100 ms, calls beside
// CPU hogs timed out and followed fail_open.
func decidedByRedis(addr string, policies ...map[string]any) map[string]any {
	return redisLimiter(addr, "1s", map[string]any{"on_error": "fail_closed"}, policies...)
}

// TestOutageFailureModes: with Redis gone, fail_closed answers only 503s,
// fail_open only 2xx, and local enforces its in-process budget.
func TestOutageFailureModes(t *testing.T) {
	srv := testredis.Start(t)
	closed := startCaddy(t, redisLimiter(srv.Addr, "100ms", map[string]any{"on_error": "fail_closed"}, policy20()), echo())
	open := startCaddy(t, redisLimiter(srv.Addr, "100ms", nil, policy20()), echo())
	local := startCaddy(t, redisLimiter(srv.Addr, "100ms", map[string]any{"on_error": "local"}, policy20()), echo())
	for _, in := range []*instance{closed, open, local} {
		if r := get(t, in.URL, "X-Api-Key", "k"); r.status != 200 || !strings.HasPrefix(string(r.body), "allowed ") {
			t.Fatalf("before the outage: %d %q", r.status, r.body)
		}
	}
	srv.Stop()
	// Caddy reloads while Redis is unreachable.
	open.reload(t, redisLimiter(srv.Addr, "100ms", map[string]any{"jitter": 0.5}, policy20()), echo())

	c := drive(t, []*instance{closed}, 4, 2*time.Second, "X-Api-Key", "k")
	st := c.statuses()
	t.Logf("fail_closed during the outage: %v", st)
	if st[503] == 0 || st[503] != len(c.shots) {
		t.Errorf("fail_closed: statuses %v, want only 503", st)
	}
	r := get(t, closed.URL, "X-Api-Key", "k")
	if p := r.problem(t); r.status != 503 || !strings.HasSuffix(p.Type, "#temporary-reduced-capacity") {
		t.Errorf("fail_closed: %d %+v", r.status, p)
	}
	r.retryAfter(t)

	o := drive(t, []*instance{open}, 4, 2*time.Second, "X-Api-Key", "k")
	t.Logf("fail_open during the outage: %v %v", o.statuses(), o.decisions())
	if st := o.statuses(); st[200] != len(o.shots) || o.decisions()["fail_open"] != len(o.shots) {
		t.Errorf("fail_open: statuses %v decisions %v, want only 200 fail_open", st, o.decisions())
	}

	l := drive(t, []*instance{local}, 4, 2*time.Second, "X-Api-Key", "k")
	st = l.statuses()
	budget := 10 + 20*l.elapsed.Seconds()
	t.Logf("local during the outage: %v %v, budget %.1f", st, l.decisions(), budget)
	if st[200]+st[429] != len(l.shots) || float64(st[200]) > budget+2 {
		t.Errorf("local: statuses %v, want %.1f ± 2 admitted and the rest 429", st, budget)
	}
	requireOver(t, "local", len(l.shots), budget, 2)
	if float64(st[200]) < budget-2 {
		t.Errorf("local: statuses %v, want %.1f ± 2 admitted and the rest 429", st, budget)
	}
	if d := l.decisions(); d["local_allowed"] != st[200] || d["quota-exceeded"] != st[429] {
		t.Errorf("local: decisions %v", d)
	}
}

// TestBreakerAndRecovery: with Redis hanging and a 500ms timeout, the
// breaker opens and requests stop waiting; when Redis returns, limiting
// resumes by itself within 2 s, with the fleet test's budget arithmetic.
func TestBreakerAndRecovery(t *testing.T) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, redisLimiter(srv.Addr, "500ms", nil, policy20()), echo()))
	}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	paused := true
	defer func() {
		if paused {
			_ = srv.Resume()
		}
	}()

	// Trip each instance's breaker: a few requests that wait the timeout.
	var wg sync.WaitGroup
	for _, in := range fleet {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 6 {
				get(t, in.URL, "X-Api-Key", "outage")
			}
		}()
	}
	wg.Wait()
	open := drive(t, fleet, 1, 2*time.Second, "X-Api-Key", "outage")
	median := open.medianLatency(func(shot) bool { return true })
	t.Logf("breaker open, 500ms timeout: %d requests, median latency %v, statuses %v", len(open.shots), median, open.statuses())
	if median >= 5*time.Millisecond {
		t.Errorf("median latency %v with the breaker open, want < 5ms", median)
	}
	if st := open.statuses(); st[200] != len(open.shots) {
		t.Errorf("fail_open with the breaker open: %v", st)
	}

	// Redis returns. A new tenant key, so that scripts Redis still held from
	// timed-out requests (it runs them on resuming) charge another bucket.
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	paused = false
	rec := drive(t, fleet, 8, 5*time.Second, "X-Api-Key", "recovered")
	decided := func(s shot) bool { return s.decision == "allowed" || s.decision == "denied" }
	first := -1
	for i, s := range rec.shots {
		if decided(s) {
			first = i
			break
		}
	}
	if first < 0 {
		t.Fatalf("no decision from Redis in 5s after it returned: %v", rec.decisions())
	}
	back := rec.shots[first].at
	// Every instance must be back, not only the first.
	lastOpen := time.Duration(0)
	for _, s := range rec.shots {
		if s.decision == "fail_open" {
			lastOpen = s.at
		}
	}
	admitted := rec.count(func(s shot) bool { return s.decision == "allowed" })
	budget := 10 + 20*(rec.elapsed-back).Seconds()
	t.Logf("Redis back: first Redis decision after %v, last fail_open after %v; then admitted %d of a budget of %.1f; %v",
		back, lastOpen, admitted, budget, rec.decisions())
	if lastOpen > 2*time.Second {
		t.Errorf("an instance still failed open %v after Redis returned, want < 2s", lastOpen)
	}
	if st := rec.statuses(); st[200]+st[429] != len(rec.shots) {
		t.Errorf("statuses %v: want only 200 and 429", st)
	}
	if float64(admitted) > budget+2 {
		t.Errorf("after recovery: admitted %d, want %.1f ± 2", admitted, budget)
	}
	requireOver(t, "after recovery", len(rec.shots)-first, budget, 2)
	if float64(admitted) < budget-2 {
		t.Errorf("after recovery: admitted %d, want %.1f ± 2", admitted, budget)
	}
}

// TestStoreSurprises: SCRIPT FLUSH, CLIENT KILL, a slow Redis (DEBUG SLEEP),
// FLUSHALL and a restart, mid-traffic, with fail_closed. Nothing but 200,
// 429 and 503; never more admitted than the budget, plus one burst for each
// time Redis lost its data (FLUSHALL, restart: the buckets are gone).
func TestStoreSurprises(t *testing.T) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, redisLimiter(srv.Addr, "100ms", map[string]any{"on_error": "fail_closed"}, policy20()), echo()))
	}
	events := []struct {
		at   time.Duration
		name string
		do   func() error
	}{
		{1 * time.Second, "SCRIPT FLUSH", func() error { _, err := srv.Do("SCRIPT", "FLUSH"); return err }},
		{2 * time.Second, "CLIENT KILL TYPE normal", func() error { _, err := srv.Do("CLIENT", "KILL", "TYPE", "normal"); return err }},
		{3 * time.Second, "DEBUG SLEEP 0.3", func() error { _, err := srv.Do("DEBUG", "SLEEP", "0.3"); return err }},
		{4500 * time.Millisecond, "FLUSHALL", func() error { _, err := srv.Do("FLUSHALL"); return err }},
		{6 * time.Second, "restart", func() error { srv.Restart(t); return nil }},
	}
	const wipes = 2
	done := make(chan []string)
	go func() {
		var log []string
		start := time.Now()
		for _, e := range events {
			time.Sleep(time.Until(start.Add(e.at)))
			err := e.do()
			log = append(log, fmt.Sprintf("%s at %v: %v", e.name, time.Since(start).Round(time.Millisecond), err))
		}
		done <- log
	}()
	tl := drive(t, fleet, 8, 9*time.Second, "X-Api-Key", "surprised")
	for _, l := range <-done {
		t.Log(l)
	}
	st := tl.statuses()
	admitted := st[200]
	budget := 10 + 20*tl.elapsed.Seconds()
	t.Logf("statuses %v, decisions %v; admitted %d, budget %.1f (+%d bursts for the wipes)", st, tl.decisions(), admitted, budget, wipes)
	if st[200]+st[429]+st[503] != len(tl.shots) {
		t.Errorf("statuses %v: want only 200, 429 and 503", st)
	}
	if float64(admitted) > budget+wipes*10+2 {
		t.Errorf("admitted %d, more than the budget %.1f + %d bursts", admitted, budget, wipes)
	}
	if tl.decisions()["allowed"] != admitted {
		t.Errorf("decisions %v: every 200 must be a Redis decision", tl.decisions())
	}
	late := tl.count(func(s shot) bool { return s.at > tl.elapsed-1500*time.Millisecond && s.status == 200 })
	if tl.elapsed < 8*time.Second || late < 20 {
		t.Errorf("%d admitted in the last 1.5 s of %v, want limiting back after the restart (about 30)", late, tl.elapsed)
	}
}

// TestReloadsKeepConnections: 50 config reloads leave Caddy's Redis
// connections as they were (no client, pool or subscription kept per
// reload), and a drained bucket drained.
func TestReloadsKeepConnections(t *testing.T) {
	srv := testredis.Start(t)
	policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"}
	// The pool opens what its busiest moment needs, up to pool_size, and
	// keeps it; how many that is depends on timing (2 idle beside those in
	// use, and the background reads of overrides and of the storage
	// format). pool_size bounds it whatever the timing: a pool kept per
	// reload would hold connections of its own beside it. A request served
	// alone has one connection of its own beside the pool (docs/redis.md).
	const poolSize, lone = 4, 1
	limiter := func(extra map[string]any) map[string]any {
		h := redisLimiter(srv.Addr, "1s", extra, policy)
		h["redis"].(map[string]any)["pool_size"] = poolSize
		return h
	}
	in := startCaddy(t, limiter(nil), echo())
	for range 3 {
		get(t, in.URL, "X-User", "erin")
	}
	before := redisClients(t, srv)
	for i := range 50 {
		in.reload(t, limiter(map[string]any{"jitter": float64(i%10) / 10}), echo())
		if r := get(t, in.URL, "X-User", "erin"); r.status != 429 {
			t.Fatalf("after reload %d: %d, want the bucket still drained", i+1, r.status)
		}
	}
	after := redisClients(t, srv)
	t.Logf("Caddy's Redis connections before 50 reloads: %+v; after: %+v", before, after)
	if after.commands > poolSize+lone {
		t.Errorf("%d connections for commands after 50 reloads (%d before), want at most pool_size %d and %d for requests served alone", after.commands, before.commands, poolSize, lone)
	}
	if after.subscribed != before.subscribed {
		t.Errorf("subscribed connections went from %d to %d over 50 reloads", before.subscribed, after.subscribed)
	}
}

// clients counts a Redis server's client connections, apart from the one
// that asks: those subscribed to a channel, and the others.
type clients struct{ commands, subscribed int }

func redisClients(t *testing.T, srv *testredis.Server) clients {
	t.Helper()
	list, err := srv.Do("CLIENT", "LIST")
	if err != nil {
		t.Fatal(err)
	}
	var c clients
	for _, line := range strings.Split(strings.TrimSpace(list), "\n") {
		fields := map[string]string{}
		for _, f := range strings.Fields(line) {
			if k, v, ok := strings.Cut(f, "="); ok {
				fields[k] = v
			}
		}
		subscribed := func(k string) bool { return fields[k] != "" && fields[k] != "0" }
		switch {
		case fields["cmd"] == "client|list" || fields["cmd"] == "client": // this one (6.2 names no subcommand)
		case subscribed("sub") || subscribed("psub") || subscribed("ssub"):
			c.subscribed++
		default:
			c.commands++
		}
	}
	return c
}
