package ratelimit

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	dto "github.com/prometheus/client_model/go"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestFleetScript: lua/fleet.lua on a real Redis, and on a Redis Cluster:
// records written, read back (with their records when asked), an expired
// one dropped with its record, one left, and a read that writes nothing.
func TestFleetScript(t *testing.T) {
	srv := testredis.Start(t)
	single := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { single.Close() })
	cluster := testredis.StartCluster(t, 3, false)
	cc := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cluster.Addrs()})
	t.Cleanup(func() { cc.Close() })

	for _, tc := range []struct {
		name string
		c    redis.UniversalClient
	}{{"single", single}, {"cluster", cc}} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			c := tc.c
			call := func(id, digest, record string, with bool) (int64, []fleetEntry) {
				t.Helper()
				var raw []byte
				if record != "" {
					raw = []byte(record)
				}
				now, live, err := fleetCall(ctx, c, id, digest, raw, with)
				if err != nil {
					t.Fatalf("fleetCall(%q): %v", id, err)
				}
				return now, live
			}
			ids := func(live []fleetEntry) string {
				var s []string
				for _, e := range live {
					s = append(s, e.id+"="+e.digest+":"+e.record)
				}
				return strings.Join(s, " ")
			}
			call("a", "da", `{"id":"a"}`, false)
			now, live := call("b", "db", `{"id":"b"}`, false)
			if got := ids(live); got != "a=da: b=db:" && got != "b=db: a=da:" {
				t.Fatalf("after a and b wrote: %s", got)
			}
			for _, e := range live {
				if left := e.expiry - now; left <= fleetTTL.Milliseconds()-1000 || left > fleetTTL.Milliseconds() {
					t.Errorf("%s expires in %d ms, want about %d", e.id, left, fleetTTL.Milliseconds())
				}
			}
			// A record whose instance stopped writing it is dropped, with
			// its record, by the next call.
			if err := c.HSet(ctx, fleetIndexKey, "dead", "1 dx").Err(); err != nil {
				t.Fatal(err)
			}
			c.HSet(ctx, fleetRecordsKey, "dead", "{}")
			_, live = call("", "", "", true)
			if got := ids(live); got != `a=da:{"id":"a"} b=db:{"id":"b"}` && got != `b=db:{"id":"b"} a=da:{"id":"a"}` {
				t.Errorf("a read: %s", got)
			}
			if n, _ := c.HLen(ctx, fleetRecordsKey).Result(); n != 2 {
				t.Errorf("%d records after the dead one expired, want 2", n)
			}
			_, live = call("a", "", "", false) // a leaves
			if got := ids(live); got != "b=db:" {
				t.Errorf("after a left: %s", got)
			}
			if ttl, _ := c.PTTL(ctx, fleetIndexKey).Result(); ttl <= 0 || ttl > fleetTTL {
				t.Errorf("the index's TTL is %s, want at most %s", ttl, fleetTTL)
			}
		})
	}
}

func TestParseFleetReply(t *testing.T) {
	for _, tc := range []struct {
		res  []any
		with bool
		ok   bool
	}{
		{[]any{int64(5)}, false, true},
		{[]any{int64(5), "a", int64(9), "d"}, false, true},
		{[]any{int64(5), "a", int64(9), "d", "{}"}, true, true},
		{nil, false, false},
		{[]any{"5"}, false, false},
		{[]any{int64(5), "a", int64(9)}, false, false},
	} {
		_, _, err := parseFleetReply(tc.res, tc.with)
		if (err == nil) != tc.ok || err != nil && !errors.Is(err, errScriptReply) {
			t.Errorf("%v: %v", tc.res, err)
		}
	}
}

// TestNoteSplits: a disagreement is logged once at WARN when it appears
// (naming the policy and what differs, never a secret's fingerprint),
// not again while it lasts, once at INFO when it is gone, and counted in
// the gauge meanwhile.
func TestNoteSplits(t *testing.T) {
	core, logs := observer.New(zap.InfoLevel)
	c := &fleetView{logger: zap.New(core), name: "redis:6379"}
	value := func() float64 {
		var m dto.Metric
		_ = fleetDisagreements.Write(&m)
		return m.GetGauge().GetValue()
	}
	before := value()
	gauge := func() float64 { return value() - before }

	secret := fleet.Split{Policy: "api", Prefix: "rl:", Differs: []string{fleet.PartSecret}, Variants: []fleet.Variant{
		{Limit: "rate 5/1m", Key: "{client_ip}", Secret: "FPmine00", Instances: []string{"me"}},
		{Limit: "rate 5/1m", Key: "{client_ip}", Secret: "FPtheirs", Instances: []string{"other"}},
	}}
	limit := fleet.Split{Policy: "login", Prefix: "rl:", Differs: []string{fleet.PartLimit}, Variants: []fleet.Variant{
		{Limit: "rate 5/1m", Key: "k", Secret: "S", Instances: []string{"me"}},
		{Limit: "rate 50/1m", Key: "k", Secret: "S", Instances: []string{"x", "y"}},
	}}

	c.noteSplits([]fleet.Split{secret})
	c.noteSplits([]fleet.Split{secret})
	c.noteSplits([]fleet.Split{secret, limit})
	if g := gauge(); g != 2 {
		t.Errorf("gauge %v with two policies in disagreement, want 2", g)
	}
	c.noteSplits([]fleet.Split{limit})
	c.noteSplits(nil)
	if g := gauge(); g != 0 {
		t.Errorf("gauge %v once the fleet agrees, want 0", g)
	}

	var lines []string
	for _, e := range logs.All() {
		lines = append(lines, e.Level.String()+" "+e.Message)
		for _, f := range e.Context {
			if strings.Contains(f.String, "FP") || strings.Contains(e.Message, "FP") {
				t.Errorf("a log line shows a key_secret fingerprint: %s %v", e.Message, e.Context)
			}
		}
	}
	want := []string{
		"warn policy api is enforced with another key_secret",
		"warn policy login is enforced with another limit (rate 50/1m there; rate 5/1m here) by 2 other live instances",
		"info the live instances of this fleet agree again on policy api",
		"info the live instances of this fleet agree again on policy login",
	}
	if len(lines) != len(want) {
		t.Fatalf("logged:\n%s\nwant lines starting:\n%s", strings.Join(lines, "\n"), strings.Join(want, "\n"))
	}
	for i := range want {
		if !strings.HasPrefix(lines[i], want[i]) {
			t.Errorf("line %d: %q, want it to start %q", i, lines[i], want[i])
		}
	}
}

// TestFleetRecord: what an instance announces of its policies: the limit,
// the key with its address mask, the key_prefix and the fingerprint of
// key_secret; never the secret; not a shed policy's adaptive limit.
func TestFleetRecord(t *testing.T) {
	srv := testredis.Start(t)
	h := testHandler(t, &Handler{
		Redis:     &RedisConfig{Addresses: []string{srv.Addr}, KeyPrefix: "app:"},
		KeySecret: "correct horse battery staple",
		Policies: []*Policy{
			{Name: "api", Key: "{client_ip}", Rate: "100/1m"},
			{Name: "slots", Key: "{http.request.header.X-User}", Concurrent: 3},
			{Name: "adaptive", Key: "global", Shed: &Shed{Latency: caddy.Duration(50 * time.Millisecond)}},
		},
	}, nil)
	c := h.store.(*redisStore)
	r := c.fleet.fleetRecord([]*Handler{h})
	raw, _ := fleet.Encode(r)
	if strings.Contains(string(raw), "horse") {
		t.Fatalf("the record holds the secret: %s", raw)
	}
	got := map[string]fleet.Policy{}
	for _, p := range r.Policies {
		got[p.Name] = p
	}
	if len(got) != 2 || got["adaptive"].Name != "" {
		t.Errorf("policies announced: %+v, want api and slots", r.Policies)
	}
	api := got["api"]
	if api.Prefix != "app:" || api.Limit != "kind rate, rate 100/1m, burst 100" || !strings.Contains(api.Key, "/64") ||
		api.Secret != fleet.SecretFingerprint("correct horse battery staple") {
		t.Errorf("api announced as %+v", api)
	}
	if r.ID != instanceID || r.Version != Version || r.Format != markerV1 || r.PID == 0 {
		t.Errorf("record %+v", r)
	}
}
