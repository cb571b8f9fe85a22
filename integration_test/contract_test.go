package integration_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// field is one member of RateLimit-Policy or RateLimit, parsed as an RFC
// 9651 structured field, as a client would.
type field struct {
	name   string
	params map[string]int64
}

func parseFields(t *testing.T, h http.Header, name string) []field {
	t.Helper()
	values := h.Values(name)
	if len(values) == 0 {
		return nil
	}
	list, err := httpsfv.UnmarshalList(values)
	if err != nil {
		t.Fatalf("%s: %q is not a structured-field list: %v", name, values, err)
	}
	var out []field
	for _, m := range list {
		item, ok := m.(httpsfv.Item)
		if !ok {
			t.Fatalf("%s: member %#v is not an item", name, m)
		}
		s, ok := item.Value.(string)
		if !ok {
			t.Fatalf("%s: member %#v is not an sf-String", name, item.Value)
		}
		f := field{name: s, params: map[string]int64{}}
		for _, k := range item.Params.Names() {
			v, _ := item.Params.Get(k)
			n, ok := v.(int64)
			if !ok {
				t.Fatalf("%s: %s;%s=%v is not an integer", name, s, k, v)
			}
			f.params[k] = n
		}
		out = append(out, f)
	}
	return out
}

type problemBody struct {
	Type             string   `json:"type"`
	Title            string   `json:"title"`
	Status           int      `json:"status"`
	Detail           string   `json:"detail"`
	ViolatedPolicies []string `json:"violated-policies"`
}

type response struct {
	status int
	header http.Header
	body   []byte
}

func get(t *testing.T, url string, headers ...string) response {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := newClient().Do(req)
	if err != nil {
		// Once: a connection accepted while a config reload hands the
		// listener over can be cut.
		resp, err = newClient().Do(req)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return response{resp.StatusCode, resp.Header, body}
}

func (r response) problem(t *testing.T) problemBody {
	t.Helper()
	if ct := r.header.Get("Content-Type"); ct != "application/problem+json" {
		t.Fatalf("Content-Type %q, want application/problem+json", ct)
	}
	if cc := r.header.Get("Cache-Control"); cc != "no-store" {
		t.Fatalf("Cache-Control %q, want no-store", cc)
	}
	var p problemBody
	if err := json.Unmarshal(r.body, &p); err != nil {
		t.Fatalf("body %q is not JSON: %v", r.body, err)
	}
	if p.Status != r.status {
		t.Fatalf("problem status %d on a %d response", p.Status, r.status)
	}
	return p
}

func (r response) retryAfter(t *testing.T) int64 {
	t.Helper()
	v := r.header.Get("Retry-After")
	n, err := strconv.ParseInt(v, 10, 64)
	if err != nil || n < 1 {
		t.Fatalf("Retry-After %q is not whole seconds ≥ 1", v)
	}
	return n
}

// leastWait is the least seconds a wait of full seconds, counted from a
// decision made after some start, can show in an answer elapsed after that
// start: full less the whole seconds elapsed (rounding up makes up the
// part). On a quiet machine it is full; beside CPU hogs the steps before
// the answer can take a second or two.
func leastWait(full int64, elapsed time.Duration) int64 {
	return full - int64(elapsed/time.Second)
}

func limiter(redisAddr string, extra map[string]any, policies ...map[string]any) map[string]any {
	h := map[string]any{"handler": "rate_limit", "policies": policies}
	if redisAddr != "" {
		h["redis"] = map[string]any{"addresses": []string{redisAddr}}
	}
	for k, v := range extra {
		h[k] = v
	}
	return h
}

// echo answers 200 with the placeholders the handler sets.
func echo() map[string]any {
	return map[string]any{"handler": "static_response", "status_code": 200,
		"body": "{http.rate_limit.decision} {http.rate_limit.policy} {http.rate_limit.remaining}"}
}

// stores runs a subtest against Redis and against the in-process store:
// the HTTP contract is the same.
func stores(t *testing.T, test func(t *testing.T, redisAddr string)) {
	t.Run("redis", func(t *testing.T) { test(t, testredis.Start(t).Addr) })
	t.Run("in-process", func(t *testing.T) { test(t, "") })
}

func TestDenialContract(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		h := limiter(redisAddr, map[string]any{"jitter": 0},
			map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "10/1m", "burst": 3})
		if redisAddr != "" {
			// 1s: a call timed out on a loaded machine would follow the
			// default fail_open, which this test is not about.
			h["redis"].(map[string]any)["timeout"] = "1s"
		}
		in := startCaddy(t, h, echo())

		// The next token is 6 s after the first decision, which came after
		// start: an answer elapsed after start says t from 6 - elapsed
		// (rounded up) to 6. On a quiet machine that is 6.
		start := time.Now()
		for i := 2; i >= 0; i-- {
			r := get(t, in.URL, "X-User", "alice")
			if r.status != 200 {
				t.Fatalf("request %d: status %d, want 200", 3-i, r.status)
			}
			if want := "allowed per_user " + strconv.Itoa(i); string(r.body) != want {
				t.Fatalf("placeholders %q, want %q", r.body, want)
			}
			pol := parseFields(t, r.header, "RateLimit-Policy")
			if len(pol) != 1 || pol[0].name != "per_user" || pol[0].params["q"] != 10 || pol[0].params["w"] != 60 {
				t.Fatalf("RateLimit-Policy %+v, want \"per_user\";q=10;w=60", pol)
			}
			lim := parseFields(t, r.header, "RateLimit")
			if least := leastWait(6, time.Since(start)); len(lim) != 1 || lim[0].name != "per_user" || lim[0].params["r"] != int64(i) || lim[0].params["t"] < least || lim[0].params["t"] > 6 {
				t.Fatalf("RateLimit %+v, want \"per_user\";r=%d;t=6 (at least %d, %v after the first request)", lim, i, least, time.Since(start).Round(time.Millisecond))
			}
		}

		r := get(t, in.URL, "X-User", "alice")
		if r.status != http.StatusTooManyRequests {
			t.Fatalf("4th request: status %d, want 429", r.status)
		}
		p := r.problem(t)
		if p.Type != "https://iana.org/assignments/http-problem-types#quota-exceeded" || p.Title != "Quota Exceeded" ||
			len(p.ViolatedPolicies) != 1 || p.ViolatedPolicies[0] != "per_user" || !strings.Contains(p.Detail, "per_user") {
			t.Fatalf("problem %+v", p)
		}
		lim := parseFields(t, r.header, "RateLimit")
		if least := leastWait(6, time.Since(start)); len(lim) != 1 || lim[0].params["r"] != 0 || lim[0].params["t"] < least || lim[0].params["t"] > 6 {
			t.Fatalf("RateLimit on 429: %+v, want r=0 and t of the 6s wait (at least %d, %v after the first request)", lim, least, time.Since(start).Round(time.Millisecond))
		}
		// jitter 0: Retry-After is exactly the true wait, rounded up.
		if ra := r.retryAfter(t); ra != lim[0].params["t"] {
			t.Fatalf("Retry-After %d with jitter 0, want t=%d", ra, lim[0].params["t"])
		}

		// Another identity has its own bucket.
		if r := get(t, in.URL, "X-User", "bob"); r.status != 200 {
			t.Fatalf("another user: status %d", r.status)
		}
	})
}

// TestRetryAfterJitter: with jitter, Retry-After is spread upward and never
// below the true wait; denials of one bucket are given successive return
// slots (one per token, so the 20 denied clients do not all come back for
// the same token), within the minute the calendar looks ahead.
func TestRetryAfterJitter(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		in := startCaddy(t, limiter(redisAddr, map[string]any{"jitter": 1.0},
			map[string]any{"name": "slow", "key": "global", "rate": "1/1h", "burst": 1},
		), echo())
		if r := get(t, in.URL); r.status != 200 {
			t.Fatalf("first request: %d", r.status)
		}
		seen := map[int64]bool{}
		for range 20 {
			r := get(t, in.URL)
			if r.status != 429 {
				t.Fatalf("status %d, want 429", r.status)
			}
			ra := r.retryAfter(t)
			tt := parseFields(t, r.header, "RateLimit")[0].params["t"]
			if ra < tt || ra > 2*(tt+60)+1 {
				t.Fatalf("Retry-After %d outside [t, 2(t+60 s)] for t=%d and jitter 100%%", ra, tt)
			}
			seen[ra] = true
		}
		if len(seen) < 3 {
			t.Fatalf("20 denials gave Retry-After values %v: not spread", seen)
		}
	})
}

// TestAllOrNothing: a request denied by one policy is charged by none.
func TestAllOrNothing(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		in := startCaddy(t, limiter(redisAddr, nil,
			map[string]any{"name": "wide", "key": "global", "rate": "100/1h"},
			map[string]any{"name": "narrow", "key": "{http.request.header.X-User}", "rate": "2/1m"},
		), echo())
		for range 2 {
			if r := get(t, in.URL, "X-User", "a"); r.status != 200 {
				t.Fatalf("status %d", r.status)
			}
		}
		for range 5 {
			r := get(t, in.URL, "X-User", "a")
			if r.status != 429 {
				t.Fatalf("status %d, want 429", r.status)
			}
			if p := r.problem(t); len(p.ViolatedPolicies) != 1 || p.ViolatedPolicies[0] != "narrow" {
				t.Fatalf("violated %v, want [narrow]", p.ViolatedPolicies)
			}
		}
		r := get(t, in.URL, "X-User", "b")
		lim := parseFields(t, r.header, "RateLimit")
		if r.status != 200 || len(lim) != 2 || lim[0].name != "wide" || lim[0].params["r"] != 97 {
			t.Fatalf("after 5 denials: %d %+v, want wide r=97 (charged 3 times, never by a denied request)", r.status, lim)
		}
	})
}

// TestCost: costs come from placeholders, capped at max (a max above the
// burst is refused at load: a request charged it could never pass); a
// request that can never fit (here, under an operator's override of the
// key's burst) is denied without a Retry-After, and told not to retry.
func TestCost(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		policy := map[string]any{"name": "tokens", "key": "{http.request.header.X-User}", "rate": "10/1m", "cost": "{http.request.header.X-Cost}"} // max: the burst
		in := startCaddy(t, limiter(redisAddr, nil, policy), echo())
		r := get(t, in.URL, "X-User", "u", "X-Cost", "4")
		if lim := parseFields(t, r.header, "RateLimit"); r.status != 200 || lim[0].params["r"] != 6 {
			t.Fatalf("cost 4 of 10: %d %+v", r.status, lim)
		}
		for _, bad := range []string{"-1", "0", "abc", "1.5", "0x10", "99999999999999999999999", "15"} {
			// Charged at max (10, of the 6 left): denied, until it fits.
			if r := get(t, in.URL, "X-User", "u", "X-Cost", bad); r.status != 429 || r.header.Get("Retry-After") == "" {
				t.Fatalf("cost %q: status %d, Retry-After %q, want 429 (charged at max 10)", bad, r.status, r.header.Get("Retry-After"))
			}
		}
		if lim := parseFields(t, get(t, in.URL, "X-User", "u", "X-Cost", "1").header, "RateLimit"); lim[0].params["r"] != 5 {
			t.Fatalf("after denials: %+v, want r=5", lim)
		}
		// An override of the burst below what a request costs.
		if status, body := adminCall(t, in, "POST", "/rate_limit/override", `{"policy":"tokens","identity":"v","rate":"10/1m","burst":3}`); status != 200 {
			t.Fatalf("override: %d %s", status, body)
		}
		r = get(t, in.URL, "X-User", "v", "X-Cost", "4")
		if r.status != 429 || r.header.Get("Retry-After") != "" || r.header.Get("X-Should-Retry") != "false" {
			t.Fatalf("cost 4 above a burst of 3: %d Retry-After %q x-should-retry %q, want 429 without Retry-After, told not to retry",
				r.status, r.header.Get("Retry-After"), r.header.Get("X-Should-Retry"))
		}
		r.problem(t)
	})
}

// TestShadowAndHeadersOff: shadow never rejects nor adds fields; headers off
// keeps Retry-After only.
func TestShadowAndHeadersOff(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		shadow := startCaddy(t, limiter(redisAddr, map[string]any{"shadow": true},
			map[string]any{"name": "dry", "key": "global", "rate": "1/1m"},
		), echo())
		for i := range 3 {
			r := get(t, shadow.URL)
			want := "allowed dry 0"
			if i > 0 {
				want = "shadow_denied dry 0"
			}
			if r.status != 200 || string(r.body) != want || r.header.Get("RateLimit") != "" || r.header.Get("RateLimit-Policy") != "" {
				t.Fatalf("shadow request %d: %d %q %v, want 200 %q and no fields", i, r.status, r.body, r.header, want)
			}
		}

		off := startCaddy(t, limiter(redisAddr, map[string]any{"headers": "off", "redis": nil},
			map[string]any{"name": "quiet", "key": "global-off", "rate": "1/1m"},
		), echo())
		get(t, off.URL)
		r := get(t, off.URL)
		if r.status != 429 || r.header.Get("RateLimit") != "" || r.header.Get("RateLimit-Policy") != "" {
			t.Fatalf("headers off: %d %v", r.status, r.header)
		}
		r.retryAfter(t)
	})
}

// TestRedisUnreachable: Caddy starts without Redis; fail_open admits,
// fail_closed answers 503 temporary-reduced-capacity, never 429.
func TestRedisUnreachable(t *testing.T) {
	dead := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	in := startCaddy(t, limiter(dead, nil,
		map[string]any{"name": "open", "key": "global", "rate": "1/1m"},
	), echo())
	for range 3 {
		if r := get(t, in.URL); r.status != 200 || string(r.body) != "fail_open  " {
			t.Fatalf("fail_open: %d %q", r.status, r.body)
		}
	}
	closed := startCaddy(t, limiter(dead, map[string]any{"on_error": "fail_closed"},
		map[string]any{"name": "closed", "key": "global", "rate": "1/1m"},
	), echo())
	r := get(t, closed.URL)
	if r.status != http.StatusServiceUnavailable {
		t.Fatalf("fail_closed: status %d, want 503", r.status)
	}
	if p := r.problem(t); p.Type != "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity" {
		t.Fatalf("fail_closed problem %+v", p)
	}
	r.retryAfter(t)
	local := startCaddy(t, limiter(dead, map[string]any{"on_error": "local"},
		map[string]any{"name": "local", "key": "global", "rate": "2/1m"},
	), echo())
	var got []int
	for range 3 {
		got = append(got, get(t, local.URL).status)
	}
	if got[0] != 200 || got[1] != 200 || got[2] != 429 {
		t.Fatalf("local: statuses %v, want 200 200 429", got)
	}
}
