package integration_test

import (
	"context"
	"encoding/json"
	"net/http"
	"os/exec"
	"sort"
	"strings"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// tryAnswer is `caddy rate-limit try --json`'s answer, as much as the
// test reads.
type tryAnswer struct {
	Outcome      string   `json:"outcome"`
	Status       int      `json:"status"`
	DeniedBy     []string `json:"denied_by"`
	IfUnreadable string   `json:"if_unreadable"`
	Handlers     []struct {
		Unreadable string `json:"could_not_read"`
		Policies   []struct {
			Policy     string   `json:"policy"`
			Key        string   `json:"key"`
			Decision   string   `json:"decision"`
			Remaining  *int64   `json:"remaining"`
			RetryAfter *float64 `json:"retry_after_seconds"`
			OnError    string   `json:"on_error"`
		} `json:"policies"`
	} `json:"handlers"`
}

// keyDumps is every key of a Redis with its value: a dry run must leave it
// as it was.
func keyDumps(t *testing.T, c *redis.Client) map[string]string {
	t.Helper()
	ctx := context.Background()
	keys, err := c.Keys(ctx, "rl:*").Result()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]string{}
	for _, k := range keys {
		out[k], _ = c.Dump(ctx, k).Result()
	}
	return out
}

func sameDumps(a, b map[string]string) []string {
	var diff []string
	for k, v := range a {
		if b[k] != v {
			diff = append(diff, k)
		}
	}
	for k := range b {
		if _, ok := a[k]; !ok {
			diff = append(diff, k)
		}
	}
	sort.Strings(diff)
	return diff
}

// TestTryPredicts: `caddy rate-limit try` against a real Caddy and Redis
// predicts the allowance and the denial of the next request, which sending
// it confirms, and moves nothing in Redis (every key's value the same,
// asked twenty times); with Redis stopped it says it could not read, and
// what on_error would do, never "allowed". The admin route keeps the admin
// API's origin checks.
func TestTryPredicts(t *testing.T) {
	srv := testredis.Start(t)
	client := redisClient(t, srv.Addr)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0},
		map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"},
		map[string]any{"name": "slots", "key": "{http.request.header.X-User}", "concurrent": 2, "on_error": "fail_closed"}),
		echo())
	try := func() (tryAnswer, string) {
		t.Helper()
		var a tryAnswer
		raw := rateLimitCLI(t, in, "try", in.URL+"/v1/items", "-H", "X-User: acme", "--json")
		if err := json.Unmarshal([]byte(raw), &a); err != nil {
			t.Fatalf("try --json: %v\n%s", err, raw)
		}
		return a, raw
	}
	for i := range 4 {
		before := keyDumps(t, client)
		var a tryAnswer
		for range 20 {
			a, _ = try()
		}
		if diff := sameDumps(before, keyDumps(t, client)); len(diff) > 0 {
			t.Fatalf("request %d: asking moved %v in Redis", i+1, diff)
		}
		want := map[bool]string{true: "admitted", false: "denied"}[i < 3]
		if a.Outcome != want || len(a.Handlers) != 1 || len(a.Handlers[0].Policies) != 2 {
			t.Fatalf("request %d: predicted %+v, want %s", i+1, a, want)
		}
		p := a.Handlers[0].Policies[0]
		r := get(t, in.URL+"/v1/items", "X-User", "acme")
		if got := map[bool]string{true: "admitted", false: "denied"}[r.status == 200]; got != want {
			t.Fatalf("request %d: predicted %s, got %d", i+1, want, r.status)
		}
		if want == "admitted" && (p.Remaining == nil || *p.Remaining != remainingOf(t, r.header)["per_user"]) {
			t.Fatalf("request %d: predicted %v remaining, the response says %d", i+1, p.Remaining, remainingOf(t, r.header)["per_user"])
		}
		if want == "denied" && (p.RetryAfter == nil || float64(r.retryAfter(t)) < *p.RetryAfter-1 || a.DeniedBy[0] != "per_user" || a.Status != 429) {
			t.Fatalf("request %d: predicted %+v, the response's Retry-After %d", i+1, a, r.retryAfter(t))
		}
	}
	text := rateLimitCLI(t, in, "try", in.URL+"/v1/items", "-H", "X-User: acme")
	t.Logf("caddy rate-limit try %s/v1/items -H 'X-User: acme':\n%s", in.URL, text)
	if !strings.Contains(text, "DENIED now (429) by per_user") || !strings.Contains(text, "nothing was charged") {
		t.Errorf("try's text:\n%s", text)
	}

	// Foreign origins and hosts are refused, as by every admin route.
	for _, h := range [][2]string{{"Origin", "http://evil.example"}, {"Host", "evil.example"}, {"Sec-Fetch-Mode", "no-cors"}} {
		for _, path := range []string{"/rate_limit/dry_run", "/rate_limit/apply"} {
			req, _ := http.NewRequest("POST", in.Admin+path, strings.NewReader(`{"url":"http://x/","source":"x","overrides":[]}`))
			req.Header.Set(h[0], h[1])
			if h[0] == "Host" {
				req.Host = h[1]
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != 403 && resp.StatusCode != 400 {
				t.Errorf("%s with %s: %s: %d, want refused", path, h[0], h[1], resp.StatusCode)
			}
		}
	}

	// Redis stopped: it could not read, and says what on_error does.
	srv.Stop()
	a, _ := try()
	hd := a.Handlers[0]
	if a.Outcome != "unknown" || a.Status != 503 || hd.Unreadable == "" || !strings.HasPrefix(a.IfUnreadable, "503") {
		t.Fatalf("Redis stopped: %+v", a)
	}
	for _, p := range hd.Policies {
		if p.Decision != "could not read" || p.Remaining != nil || p.OnError == "" {
			t.Fatalf("Redis stopped: %+v", p)
		}
	}
	out, err := exec.Command(caddyBin, "rate-limit", "try", in.URL+"/", "-H", "X-User: acme", "--address", strings.TrimPrefix(in.Admin, "http://")).CombinedOutput()
	t.Logf("with Redis stopped:\n%s", out)
	if err != nil || !strings.Contains(string(out), "UNKNOWN: the store could not be read") || strings.Contains(string(out), "ADMITTED") {
		t.Errorf("try with Redis stopped: %v\n%s", err, out)
	}
}
