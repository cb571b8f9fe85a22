package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Overrides through real Caddy processes and a real Redis (or a Redis
// Cluster): set through one instance's admin API or `caddy rate-limit
// override`, applied on the next request on every other.

// perUser is 5 per hour per X-User.
func perUser() map[string]any {
	return map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "5/1h"}
}

// policyQ is the q of a response's RateLimit-Policy member of per_user.
func policyQ(t *testing.T, r response) int64 {
	t.Helper()
	for _, f := range parseFields(t, r.header, "RateLimit-Policy") {
		if f.name == "per_user" {
			return f.params["q"]
		}
	}
	return -1
}

// overrideList decodes `caddy rate-limit overrides --json`.
type overrideList struct {
	Overrides []struct {
		Hash  string `json:"hash"`
		Key   string `json:"key"`
		Kind  string `json:"kind"`
		Rate  string `json:"rate"`
		Burst int64  `json:"burst"`
		Note  string `json:"note"`
	} `json:"overrides"`
}

func listOverrides(t *testing.T, in *instance, policy string) overrideList {
	t.Helper()
	var l overrideList
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, "overrides", policy, "--json")), &l); err != nil {
		t.Fatal(err)
	}
	return l
}

// TestOverrideFleet: 4 instances; a customer drained and denied on each.
// An override set through one instance's admin API applies to the very
// next request on another (this is the policy's first override: the other
// instances learn that it has any from the announcement); the bucket's
// state is kept; every instance applies it; the command line lists,
// inspects and deletes it; the logs name the hash, never the identity.
func TestOverrideFleet(t *testing.T) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddyTuned(t, infoLogs, limiter(srv.Addr, map[string]any{"jitter": 0}, perUser()), echo()))
	}
	drainOn(t, fleet, "acme")

	start := time.Now()
	status, body := adminCall(t, fleet[0], "POST", "/rate_limit/override", `{"policy":"per_user","identity":"acme","rate":"100/1h","burst":20,"note":"contract 123"}`)
	set := time.Since(start)
	if status != 200 || !strings.Contains(body, `"announced":true`) {
		t.Fatalf("setting the override: %d %s", status, body)
	}
	r := get(t, fleet[1].URL, "X-User", "acme")
	applied := time.Since(start)
	t.Logf("override set through instance 0 in %v (the call returns once every instance confirmed it); "+
		"the next request, on instance 1, answered %v after the call began, under the override: %d, RateLimit-Policy q=%d, r=%d",
		set.Round(time.Microsecond), applied.Round(time.Microsecond), r.status, policyQ(t, r), remainingOf(t, r.header)["per_user"])
	// 5 owed (of the policy's 5) are kept: 15 of 20 left, 14 after it.
	if r.status != 200 || policyQ(t, r) != 100 || remainingOf(t, r.header)["per_user"] != 14 {
		t.Fatalf("the next request on another instance: %d q=%d r=%d; want 200 under the override, q=100 r=14", r.status, policyQ(t, r), remainingOf(t, r.header)["per_user"])
	}
	for i, in := range []*instance{fleet[2], fleet[3], fleet[0]} {
		if r := get(t, in.URL, "X-User", "acme"); r.status != 200 || remainingOf(t, r.header)["per_user"] != int64(13-i) {
			t.Fatalf("instance %d under the override: %d r=%d, want 200 r=%d", (i+2)%4, r.status, remainingOf(t, r.header)["per_user"], 13-i)
		}
	}
	// Another customer through the command line, on another instance: the
	// policy has overrides now, and the next request on another instance is
	// decided under it too.
	drainOn(t, fleet, "bolt")
	out := rateLimitCLI(t, fleet[2], "override", "per_user", "bolt", "rate", "10/1h", "for", "72h", "note", "support", "ticket", "42")
	t.Logf("caddy rate-limit override per_user bolt rate 10/1h for 72h note support ticket 42: %s", strings.TrimSpace(out))
	if r := get(t, fleet[3].URL, "X-User", "bolt"); r.status != 200 || policyQ(t, r) != 10 || remainingOf(t, r.header)["per_user"] != 4 {
		t.Fatalf("bolt under its override: %d q=%d r=%d; want 200 q=10 r=4", r.status, policyQ(t, r), remainingOf(t, r.header)["per_user"])
	}

	l := listOverrides(t, fleet[1], "per_user")
	t.Logf("caddy rate-limit overrides per_user:\n%s", rateLimitCLI(t, fleet[1], "overrides", "per_user"))
	byKey := map[string]string{}
	for _, o := range l.Overrides {
		byKey[o.Key] = fmt.Sprintf("%s %s %d %q", o.Kind, o.Rate, o.Burst, o.Note)
		if !strings.Contains(o.Key, "{"+o.Hash+"}") {
			t.Errorf("override %+v: its key does not hold its hash", o)
		}
	}
	if len(l.Overrides) != 2 || byKey[plainKey("per_user", "acme")] != `rate 100/1h 20 "contract 123"` || byKey[plainKey("per_user", "bolt")] != `rate 10/1h 10 "support ticket 42"` {
		t.Fatalf("overrides listed: %v", byKey)
	}
	b := inspectOverride(t, fleet[3], "per_user", "acme")
	if b.Override == nil || b.Override.Note != "contract 123" || b.Burst != 20 || b.Rate != "100/1h" || b.Tokens != 11 {
		t.Fatalf("inspect under the override: %+v", b)
	}
	text := rateLimitCLI(t, fleet[3], "inspect", "per_user", "acme")
	if !strings.Contains(text, "override") || !strings.Contains(text, "rate 100/1h burst 20, until deleted") {
		t.Fatalf("caddy rate-limit inspect does not show the override:\n%s", text)
	}

	// Deleted through the command line on one instance: the next request on
	// another is decided under the policy's limit again, the 9 it owes
	// capped at the policy's 5: denied.
	out = rateLimitCLI(t, fleet[3], "override", "per_user", "acme", "delete")
	t.Logf("caddy rate-limit override per_user acme delete: %s", strings.TrimSpace(out))
	if r := get(t, fleet[0].URL, "X-User", "acme"); r.status != 429 || policyQ(t, r) != 5 {
		t.Fatalf("after the delete: %d q=%d, want 429 under the policy's 5", r.status, policyQ(t, r))
	}
	if l := listOverrides(t, fleet[0], "per_user"); len(l.Overrides) != 1 {
		t.Fatalf("after the delete: %d overrides listed, want bolt's", len(l.Overrides))
	}

	// Logged at INFO with the policy and the hash; no identity.
	for i, in := range fleet {
		raw, _ := os.ReadFile(in.Log)
		log := string(raw)
		for _, line := range strings.Split(log, "\n") {
			if strings.Contains(line, "http.handlers.rate_limit") && (strings.Contains(line, "acme") || strings.Contains(line, "bolt")) {
				t.Errorf("instance %d logged an identity: %s", i, line)
			}
		}
		if i == 0 && !(strings.Contains(log, `"msg":"rate limit override set"`) && strings.Contains(log, plainKey("per_user", "acme"))) {
			t.Errorf("instance 0 did not log the override set with its key")
		}
	}
}

// TestOverrideExpires: an override set for 2s is in force on every
// instance until then, and gone after, by itself: the requests are decided
// under the policy's limit again, the list and inspect no longer show it.
func TestOverrideExpires(t *testing.T) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, perUser()), echo()))
	}
	before := time.Now()
	rateLimitCLI(t, fleet[0], "override", "per_user", "cleo", "rate", "1000/1h", "for", "2s")
	after := time.Now()
	ttl, err := redisClient(t, srv.Addr).PTTL(context.Background(), plainKey("per_user", "cleo")+":override").Result()
	if err != nil || ttl <= 0 || ttl > 2*time.Second {
		t.Fatalf("the override's key: PTTL %v (%v), want up to 2s", ttl, err)
	}
	// In force until 2 s after it was set, gone after: polled every 50 ms
	// through inspect (the admin API), a request each time.
	var lastIn, firstGone time.Time
	for time.Since(before) < 4*time.Second {
		status, body := adminCall(t, fleet[1], "POST", "/rate_limit/inspect", `{"policy":"per_user","identity":"cleo"}`)
		now := time.Now()
		var b inspectedOverride
		if err := json.Unmarshal([]byte(body), &b); status != 200 || err != nil {
			t.Fatalf("inspect: %d %s", status, body)
		}
		if b.Override == nil {
			firstGone = now
			break
		}
		lastIn = now
		// A request, unless so near the end that it might come after it.
		if r := get(t, fleet[1].URL, "X-User", "cleo"); now.Sub(after) < 1800*time.Millisecond && (r.status != 200 || policyQ(t, r) != 1000) {
			t.Fatalf("%v after the override was set: %d q=%d, want it in force", now.Sub(before), r.status, policyQ(t, r))
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Logf("override for 2s: last seen in force %v after the set began, gone %v after (the set took %v)",
		lastIn.Sub(before).Round(time.Millisecond), firstGone.Sub(before).Round(time.Millisecond), after.Sub(before).Round(time.Millisecond))
	if firstGone.IsZero() || firstGone.Sub(after) > 2500*time.Millisecond || lastIn.Sub(before) < 1700*time.Millisecond {
		t.Fatalf("override for 2s: in force until %v, gone at %v after the set began", lastIn.Sub(before), firstGone.Sub(before))
	}
	// Every request so far was admitted under the override; the next is
	// decided under the policy's 5, with what the bucket owes kept: denied.
	if r := get(t, fleet[0].URL, "X-User", "cleo"); policyQ(t, r) != 5 {
		t.Fatalf("after the override expired: q=%d, want the policy's 5", policyQ(t, r))
	}
	if l := listOverrides(t, fleet[0], "per_user"); len(l.Overrides) != 0 {
		t.Fatalf("after it expired, listed: %+v", l.Overrides)
	}
}

// TestOverrideConcurrent: a concurrency policy's override (concurrent 3
// instead of 1) lets 3 requests of the identity run at once across the
// instances, and a fourth is denied with the override's slots in its
// RateLimit-Policy.
func TestOverrideConcurrent(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"on_error": "fail_closed"}, slotsPolicy(1)), proxyTo(up.addr)))
	}
	rateLimitCLI(t, fleet[0], "override", "exports", "dana", "concurrent", "3")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan int, 3)
	for i := range 3 {
		go func() {
			st, _ := send(ctx, fleet[i%2], "dana", 3*time.Second)
			done <- st
		}()
	}
	deadline := time.Now().Add(5 * time.Second)
	for up.now("dana") < 3 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if n := up.now("dana"); n != 3 {
		t.Fatalf("%d of dana's requests running at once under concurrent 3, want 3", n)
	}
	r := get(t, fleet[1].URL, "X-User", "dana")
	if pol := r.header.Get("RateLimit-Policy"); r.status != 429 || pol != `"exports";q=3;qu="concurrent-requests"` {
		t.Fatalf("a fourth: %d RateLimit-Policy %s, want 429 with q=3", r.status, pol)
	}
	if r := get(t, fleet[0].URL, "X-User", "eli"); r.status != 200 {
		t.Fatalf("another identity: %d", r.status)
	}
	cancel()
	for range 3 {
		<-done
	}
	if n := up.mostAtOnce("dana"); n != 3 {
		t.Fatalf("dana: %d at once at most, want 3", n)
	}
}

// TestOverrideCluster: on a three-master Redis Cluster, overrides of 24
// identities (their slots on every master) apply to the next request on
// another instance; each lives in its bucket's slot; the list gathers them
// all; deleting them brings the policy's limit back.
func TestOverrideCluster(t *testing.T) {
	c := testredis.StartCluster(t, 3, false)
	redis := map[string]any{"addresses": c.Addrs(), "cluster": true, "timeout": "1s"}
	var fleet []*instance
	for range 2 {
		h := limiter("", map[string]any{"jitter": 0, "on_error": "fail_closed"}, perUser())
		h["redis"] = redis
		fleet = append(fleet, startCaddy(t, h, echo()))
	}
	slot := func(key string) string { v, _ := c.Masters[0].Do("CLUSTER", "KEYSLOT", key); return v }
	owner := func(key string) string { // the master that holds key
		for _, m := range c.Masters {
			if v, err := m.Do("EXISTS", key); err == nil && v == "1" {
				return m.Addr
			}
		}
		return ""
	}
	const n = 24
	nodes := map[string]bool{}
	for i := range n {
		id := "tenant-" + strconv.Itoa(i)
		for range 5 {
			get(t, fleet[0].URL, "X-User", id)
		}
		if status, body := adminCall(t, fleet[0], "POST", "/rate_limit/override", `{"policy":"per_user","identity":"`+id+`","rate":"60/1h","burst":10}`); status != 200 || !strings.Contains(body, `"announced":true`) {
			t.Fatalf("%s: setting the override: %d %s, want it confirmed by both instances", id, status, body)
		}
		if r := get(t, fleet[1].URL, "X-User", id); r.status != 200 || policyQ(t, r) != 60 || remainingOf(t, r.header)["per_user"] != 4 {
			t.Fatalf("%s on the other instance: %d q=%d r=%d; want 200 q=60 r=4", id, r.status, policyQ(t, r), remainingOf(t, r.header)["per_user"])
		}
		key := plainKey("per_user", id)
		okey := key + ":override"
		if slot(key) != slot(okey) || owner(key) == "" || owner(key) != owner(okey) {
			t.Fatalf("%s: the override %s (slot %s, on %s) is not beside its bucket (slot %s, on %s)", id, okey, slot(okey), owner(okey), slot(key), owner(key))
		}
		nodes[owner(key)] = true
	}
	if len(nodes) != 3 {
		t.Fatalf("the %d identities' buckets are on %d masters, want all 3", n, len(nodes))
	}
	// The confirmations are counted against PUBSUB NUMSUB of the master of
	// the events channel's slot: both instances subscribe there.
	for _, m := range c.Masters {
		node := redisClient(t, m.Addr)
		_, err := node.Exists(context.Background(), "rl:events").Result() // MOVED unless m serves the slot
		subs := node.PubSubNumSub(context.Background(), "rl:events").Val()["rl:events"]
		t.Logf("master %s: serves rl:events' slot: %v; PUBSUB NUMSUB rl:events: %d", m.Addr, err == nil, subs)
		if err == nil && subs != 2 {
			t.Errorf("the master of rl:events' slot counts %d subscribers, want both instances", subs)
		}
	}
	if l := listOverrides(t, fleet[1], "per_user"); len(l.Overrides) != n {
		t.Fatalf("%d overrides listed, want %d", len(l.Overrides), n)
	}
	for i := range n {
		id := "tenant-" + strconv.Itoa(i)
		rateLimitCLI(t, fleet[1], "override", "per_user", id, "delete")
		if r := get(t, fleet[0].URL, "X-User", id); r.status != 429 || policyQ(t, r) != 5 {
			t.Fatalf("%s after the delete: %d q=%d, want 429 under the policy's 5", id, r.status, policyQ(t, r))
		}
	}
	t.Logf("%d overrides on a 3-master cluster (buckets on %d masters): each applied on the other instance's next request, each deleted", n, len(nodes))
}

// TestOverrideBadInput: mistakes get a non-zero exit (400 from the admin
// API) with a clear message and change nothing; so does a misspelt
// subcommand. With Redis and in process.
func TestOverrideBadInput(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		in := startCaddy(t, limiter(redisAddr, map[string]any{"jitter": 0}, perUser(), slotsPolicy(2)), echo())
		for range 2 {
			get(t, in.URL, "X-User", "fay")
		}
		before := inspect(t, in, "per_user", "fay")
		fail := func(want string, args ...string) {
			t.Helper()
			cmd := exec.Command(caddyBin, append(append([]string{"rate-limit"}, args...), "--address", strings.TrimPrefix(in.Admin, "http://"))...)
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), want) {
				t.Errorf("caddy rate-limit %s: %v, %q; want a failure saying %q", strings.Join(args, " "), err, strings.TrimSpace(string(out)), want)
			}
		}
		fail(`unknown command "bogus"`, "bogus")
		fail(`unknown command "overide"`, "overide", "per_user", "fay", "rate", "10/1m")
		fail(`HTTP 400`, "override", "nope", "fay", "rate", "10/1m")
		fail(`is a rate limit: its overrides take rate`, "override", "per_user", "fay", "concurrent", "5")
		fail(`is a concurrency limit: its overrides take concurrent`, "override", "exports", "fay", "rate", "5/1s")
		fail(`N must be a positive integer`, "override", "per_user", "fay", "rate", "0/1m")
		fail(`for: 500ms must be from 1s`, "override", "per_user", "fay", "rate", "10/1m", "for", "500ms")
		fail(`for: 9600h0m0s must be from 1s to 8784h0m0s`, "override", "per_user", "fay", "rate", "10/1m", "for", "400d")
		fail(`note: 201 bytes, at most 200`, "override", "per_user", "fay", "rate", "10/1m", "note", strings.Repeat("x", 201))
		fail(`unknown "speed"`, "override", "per_user", "fay", "speed", "10")
		fail(`HTTP 404`, "override", "per_user", "fay", "delete")
		for _, c := range []struct{ method, path, body, says string }{
			{"POST", "/rate_limit/override", `{"policy":"per_user","identity":"fay","rate":"10/1m","limit":"x"}`, `unknown field`},
			{"POST", "/rate_limit/override", `{"policy":"per_user","identity":"fay","rate":"10/1m","note":"a\u0007b"}`, `note: one line`},
			{"GET", "/rate_limit/override", ``, `override takes POST`},
		} {
			if status, body := adminCall(t, in, c.method, c.path, c.body); status/100 != 4 || !strings.Contains(body, c.says) {
				t.Errorf("%s %s %s: %d %s, want 4xx saying %q", c.method, c.path, c.body, status, body, c.says)
			}
		}
		if l := listOverrides(t, in, "per_user"); len(l.Overrides) != 0 {
			t.Fatalf("refused overrides listed: %+v", l.Overrides)
		}
		if after := inspect(t, in, "per_user", "fay"); after.Tokens != before.Tokens || after.Burst != 5 {
			t.Fatalf("the refused calls changed the bucket: %+v then %+v", before, after)
		}
	})
}
