package ratelimit

import (
	"context"
	"encoding/json"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// tryIt asks the admin API, in process, what the request would get now.
func tryIt(t *testing.T, body string) dryRunAnswer {
	t.Helper()
	status, out := adminDo(t, "POST", "/rate_limit/dry_run", body)
	if status != 200 {
		t.Fatalf("dry_run: %d %s", status, out)
	}
	var a dryRunAnswer
	if err := json.Unmarshal([]byte(out), &a); err != nil {
		t.Fatal(err)
	}
	return a
}

// TestDryRunInProcess: the dry run's prediction is what the next request
// gets, and asking changes nothing: asked a hundred times, the bucket
// admits as many as before.
func TestDryRunInProcess(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "dry_key", Key: "{http.request.header.X-User}", Rate: "3/1h"},
		{Name: "dry_cost", Key: "{http.request.header.X-User}", Rate: "100/1h", Cost: "{http.request.header.X-Cost}", MaxCost: 50},
		{Name: "dry_other", MatchRaw: map[string]json.RawMessage{"path": json.RawMessage(`["/other"]`)}, Key: "global", Rate: "1/1h"},
	}}, nil)
	ask := `{"method":"GET","url":"http://example.com/","headers":{"X-User":["acme"],"X-Cost":["40"]}}`
	for range 100 {
		tryIt(t, ask)
	}
	send := func() exchange { return serve([]*Handler{h}, nil, "X-User", "acme", "X-Cost", "40") }
	for i := range 3 {
		a := tryIt(t, ask)
		want := "admitted"
		if i == 2 {
			want = "denied" // dry_cost: 40 + 40 + 40 > 100
		}
		if a.Outcome != want || len(a.Handlers) != 1 || len(a.Handlers[0].Policies) != 2 || a.Handlers[0].NotMatched[0] != "dry_other" {
			t.Fatalf("request %d: %+v", i+1, a)
		}
		key := a.Handlers[0].Policies[0]
		remaining := int64(2 - i)
		if want == "denied" {
			remaining = 1 // all or nothing: not charged when another policy denies
		}
		if key.Key != h.Policies[0].storageKey(h.hasher, "acme") || key.Cost != 1 || *key.Remaining != remaining || a.Handlers[0].Policies[1].Cost != 40 {
			t.Fatalf("request %d: %+v", i+1, a.Handlers[0].Policies)
		}
		// The identity only when asked (show_keys), as top: the keyed
		// hash and its fingerprint otherwise.
		if key.Identity != "" || key.Fingerprint != fingerprintOf(key.Key) || len(key.Fingerprint) != fingerprintLen {
			t.Fatalf("request %d: identity %q, fingerprint %q of %s", i+1, key.Identity, key.Fingerprint, key.Key)
		}
		if shown := tryIt(t, strings.Replace(ask, `{`, `{"show_keys":true,`, 1)); shown.Handlers[0].Policies[0].Identity != "acme" {
			t.Fatalf("show_keys: %+v", shown.Handlers[0].Policies[0])
		}
		x := send()
		if got := map[bool]string{true: "admitted", false: "denied"}[x.status == 200]; got != want {
			t.Fatalf("request %d: predicted %s, got %d", i+1, want, x.status)
		}
		if want == "denied" {
			p := a.Handlers[0].Policies[1]
			if p.Decision != "denied" || p.RetryAfter == nil || a.DeniedBy[0] != "dry_cost" || a.Status != 429 {
				t.Fatalf("denial: %+v", a)
			}
			if ra := x.header.Get("Retry-After"); ra == "" || float64(atoi(t, ra)) < *p.RetryAfter-1 {
				t.Fatalf("Retry-After %q, predicted wait %v", ra, *p.RetryAfter)
			}
		}
	}
	// A bad description is refused, naming what is wrong without quoting
	// it: Caddy's admin API logs an error's message, and a URL's query or
	// a mistyped field may hold a credential.
	for body, says := range map[string]string{
		`{"url":"::?api_key=sk-secret-1"}`:         "not a URL",
		`{"url":"/","client_ip":"sk-secret-2"}`:    "client_ip",
		`{"url":"/","colour":"blue"}`:              "unknown field",
		`{"url":"/","body":"a","body_base64":"b"}`: "exclude each other",
	} {
		if status, out := adminDo(t, "POST", "/rate_limit/dry_run", body); status != 400 || !strings.Contains(out, says) || strings.Contains(out, "sk-secret") {
			t.Errorf("%s: %d %s", body, status, out)
		}
	}
}

func atoi(t *testing.T, s string) int64 {
	var n int64
	for _, c := range s {
		if c < '0' || c > '9' {
			t.Fatalf("%q is not a number", s)
		}
		n = n*10 + int64(c-'0')
	}
	return n
}

// redisSnapshot is every key of a Redis with its value and its TTL, to
// show that nothing changed.
type redisSnapshot map[string]struct {
	dump string
	ttl  time.Duration
}

func snapshotRedis(t *testing.T, c *redis.Client) redisSnapshot {
	t.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "*").Result()
	if err != nil {
		t.Fatal(err)
	}
	s := redisSnapshot{}
	for _, k := range keys {
		dump, _ := c.Dump(ctx, k).Result()
		ttl, _ := c.PTTL(ctx, k).Result()
		s[k] = struct {
			dump string
			ttl  time.Duration
		}{dump, ttl}
	}
	return s
}

// sameAs reports how s differs from before: a key added, gone or changed,
// or a TTL set again (it only runs down while nothing writes).
func (s redisSnapshot) differs(before redisSnapshot) string {
	var out []string
	for k, v := range s {
		b, ok := before[k]
		switch {
		case !ok:
			out = append(out, "added "+k)
		case v.dump != b.dump:
			out = append(out, "changed "+k)
		case v.ttl > b.ttl || v.ttl < b.ttl-time.Second:
			out = append(out, "TTL of "+k+" set again: "+b.ttl.String()+" then "+v.ttl.String())
		}
	}
	for k := range before {
		if _, ok := s[k]; !ok {
			out = append(out, "gone "+k)
		}
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// TestDryRunRedis: on Redis, the prediction holds for a rate, a quota, a
// concurrency policy and an override, no key moves, and with Redis stopped
// the answer says it could not read, and what on_error would do.
func TestDryRunRedis(t *testing.T) {
	srv, client, _ := newTestRedis(t)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Redis: &RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}, Policies: []*Policy{
		{Name: "dryr_rate", Key: "{http.request.header.X-User}", Rate: "2/1h", OnError: "fail_closed"},
		{Name: "dryr_quota", Key: "{http.request.header.X-User}", Quota: "5/day", OnError: "local"},
		{Name: "dryr_slots", Key: "{http.request.header.X-User}", Concurrent: 1},
	}}, nil)
	ask := `{"url":"http://example.com/","headers":{"X-User":["acme"]}}`
	send := func() exchange { return serve([]*Handler{h}, nil, "X-User", "acme") }
	send()
	before := snapshotRedis(t, client)
	a := tryIt(t, ask)
	if a.Outcome != "admitted" || len(a.Handlers[0].Policies) != 3 || *a.Handlers[0].Policies[0].Remaining != 0 || *a.Handlers[0].Policies[1].Remaining != 3 {
		t.Fatalf("second request: %+v", a)
	}
	if diff := snapshotRedis(t, client).differs(before); diff != "" || len(before) < 2 {
		t.Fatalf("a dry run changed Redis: %s (%d keys before)", diff, len(before))
	}
	if x := send(); x.status != 200 {
		t.Fatalf("predicted admitted, got %d", x.status)
	}
	a = tryIt(t, ask)
	if a.Outcome != "denied" || a.DeniedBy[0] != "dryr_rate" || a.Handlers[0].Policies[0].RetryAfter == nil {
		t.Fatalf("third request: %+v", a)
	}
	if x := send(); x.status != 429 {
		t.Fatalf("predicted denied, got %d", x.status)
	}
	// An override, set through the admin API, is read.
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"dryr_rate","identity":"acme","rate":"10/1h"}`); status != 200 {
		t.Fatal(status, body)
	}
	a = tryIt(t, ask)
	if a.Outcome != "admitted" || a.Handlers[0].Policies[0].Override == nil || a.Handlers[0].Policies[0].Limit != "rate 10/1h burst 10 (override)" {
		t.Fatalf("with an override: %+v", a)
	}
	if x := send(); x.status != 200 {
		t.Fatalf("predicted admitted under the override, got %d", x.status)
	}

	// Redis gone: never "allowed".
	srv.Stop()
	a = tryIt(t, ask)
	hd := a.Handlers[0]
	if a.Outcome != "unknown" || a.Status != 503 || hd.Unreadable == "" || hd.Policies[0].Decision != "could not read" ||
		!strings.Contains(hd.Policies[0].OnError, "fail_closed") || !strings.Contains(hd.Policies[1].OnError, "local") ||
		!strings.HasPrefix(a.IfUnreadable, "503") {
		t.Fatalf("Redis stopped: %+v", a)
	}
	for _, p := range hd.Policies {
		if p.Decision == "allowed" || p.Remaining != nil {
			t.Fatalf("Redis stopped, yet %+v", p)
		}
	}
}
