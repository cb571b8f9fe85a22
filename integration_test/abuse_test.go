package integration_test

import (
	"bufio"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Hostile clients, through the real Caddy and a real Redis: whatever bytes
// a client sends as its identity or cost, the handler answers with its
// decision (200 or 429: no crash, no 5xx, no skipped policy), storage grows
// by at most one key per identity per policy, and no identity is stored,
// logged, exported or echoed.

// rawResponse is a response to bytes sent over a plain TCP connection.
type rawResponse struct {
	status int
	header http.Header
	body   string
}

// rawGet sends one request exactly as given (net/http refuses to send some
// of these bytes) on a new connection, and reads the response.
func rawGet(t *testing.T, in *instance, request string) rawResponse {
	t.Helper()
	c, err := net.DialTimeout("tcp", strings.TrimPrefix(in.URL, "http://"), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	// Write while reading: a server that refuses an oversized request
	// answers before it has read all of it, and then stops reading.
	go func() { _, _ = io.WriteString(c, request) }()
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("reading the response to %q: %v", abbrev(request), err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return rawResponse{resp.StatusCode, resp.Header, string(body)}
}

// request builds a GET / with the given header lines, CRLF-terminated.
func request(lines ...string) string {
	return "GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n" + strings.Join(append(lines, ""), "\r\n") + "\r\n"
}

func abbrev(s string) string {
	if len(s) > 120 {
		return s[:60] + fmt.Sprintf("...(%d bytes)...", len(s)-120) + s[len(s)-60:]
	}
	return s
}

// plainKey is the storage key of identity without key_secret, as
// design.md specifies it: <prefix><policy>:{unpadded base64url of SHA-256, 16 bytes}.
func plainKey(policy, identity string) string {
	sum := sha256.Sum256([]byte(identity))
	return "rl:" + policy + ":{" + base64.RawURLEncoding.EncodeToString(sum[:16]) + "}"
}

// secretKey is the storage key of identity with key_secret.
func secretKey(secret, policy, identity string) string {
	m := hmac.New(sha256.New, []byte(secret))
	m.Write([]byte(identity))
	return "rl:" + policy + ":{" + base64.RawURLEncoding.EncodeToString(m.Sum(nil)[:16]) + "}"
}

func redisClient(t *testing.T, addr string) *redis.Client {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	t.Cleanup(func() { c.Close() })
	return c
}

// fleetKeys are where the instances announce themselves (docs/redis.md,
// "The fleet"): the limiter's bookkeeping, one pair per database, not
// buckets.
var fleetKeys = []string{"rate_limit:{fleet}", "rate_limit:{fleet}:records"}

// allKeys lists every key but the fleet's, with SCAN.
func allKeys(t *testing.T, c *redis.Client) []string {
	t.Helper()
	var keys []string
	iter := c.Scan(context.Background(), 0, "*", 1000).Iterator()
	for iter.Next(context.Background()) {
		if !slices.Contains(fleetKeys, iter.Val()) {
			keys = append(keys, iter.Val())
		}
	}
	if err := iter.Err(); err != nil {
		t.Fatal(err)
	}
	sort.Strings(keys)
	return keys
}

// remainingOf returns the RateLimit r of each policy of a response.
func remainingOf(t *testing.T, h http.Header) map[string]int64 {
	t.Helper()
	out := map[string]int64{}
	for _, f := range parseFields(t, h, "RateLimit") {
		out[f.name] = f.params["r"]
	}
	return out
}

// TestAbuseHostileHeaders: identities of 64 KiB, invalid UTF-8, control
// bytes, bare-LF requests, placeholder-looking text, and no identity at
// all. The handler answers every request that reaches it with its
// decision and both policies' fields; placeholders in what a client sends
// are hashed as the literal text, never expanded.
func TestAbuseHostileHeaders(t *testing.T) {
	srv := testredis.Start(t)
	// Caddy reads at most 16 KiB of request header by default: allow 1 MiB
	// so that identities of 64 KiB reach the handler.
	bigHeaders := func(cfg map[string]any) {
		srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
		srv["max_header_bytes"] = 1 << 20
	}
	in := startCaddyTuned(t, bigHeaders, redisLimiter(srv.Addr, "1s", nil,
		map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1000/1h"},
		map[string]any{"name": "per_pair", "key": "{http.request.header.X-User}|{http.request.header.X-Team}", "rate": "1000/1h"},
	), echo())
	home := filepath.Dir(in.Log) // startCaddy runs Caddy with HOME there

	// Rejected by Go's HTTP server before any handler runs (RFC 9110
	// forbids these bytes in a field value or name): 400, never 5xx.
	const rejected, tooLarge = 400, 431
	for _, tc := range []struct {
		name   string
		req    string
		status int    // 200, rejected or tooLarge
		user   string // the identity per_user must have charged (fresh: r=999), when checked
	}{
		{"2 MiB value", request("X-User: " + strings.Repeat("C", 2<<20)), tooLarge, ""},
		{"64 KiB value", request("X-User: " + strings.Repeat("A", 64<<10)), 200, strings.Repeat("A", 64<<10)},
		{"64 KiB over 64 fields", request(repeatLines("X-User: "+strings.Repeat("B", 1<<10), 64)...), 200, strings.TrimSuffix(strings.Repeat(strings.Repeat("B", 1<<10)+",", 64), ",")},
		{"invalid UTF-8", request("X-User: \xff\xfe\xfd"), 200, "\xff\xfe\xfd"},
		{"truncated UTF-8", request("X-User: \xc3"), 200, "\xc3"},
		{"UTF-16 surrogate", request("X-User: \xed\xa0\x80"), 200, "\xed\xa0\x80"},
		{"tab inside", request("X-User: a\tb"), 200, "a\tb"},
		{"NUL", request("X-User: a\x00b"), rejected, ""},
		{"escape", request("X-User: \x1b[31mred"), rejected, ""},
		{"DEL", request("X-User: a\x7fb"), rejected, ""},
		{"bare CR", request("X-User: a\rb"), rejected, ""},
		{"bare LF line endings", "GET / HTTP/1.1\nHost: 127.0.0.1\nConnection: close\nX-User: bare-lf\n\n", 200, "bare-lf"},
		// Go's server unfolds obsolete line folding (RFC 9112 lets a server
		// replace it with spaces).
		{"obsolete line folding", request("X-User: fold", " ed"), 200, "fold ed"},
		{"non-token field name", request("X-Üser: a"), rejected, ""},
		{"env placeholder", request("X-User: {env.HOME}"), 200, "{env.HOME}"},
		{"HOME itself", request("X-User: " + home), 200, home},
		{"header placeholder", request("X-User: {http.request.header.X-Team}", "X-Team: t"), 200, "{http.request.header.X-Team}"},
		{"file placeholder", request("X-User: {file./etc/passwd}"), 200, "{file./etc/passwd}"},
		{"escaped braces", request(`X-User: \{env.HOME\}`), 200, `\{env.HOME\}`},
		{"many open braces", request("X-User: " + strings.Repeat("{", 500)), 200, strings.Repeat("{", 500)},
		{"nested braces", request("X-User: {{env.HOME}}"), 200, "{{env.HOME}}"},
		{"lone close brace", request("X-User: }"), 200, "}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rawGet(t, in, tc.req)
			if r.status != tc.status {
				t.Fatalf("status %d, want %d; body %q", r.status, tc.status, abbrev(r.body))
			}
			if r.status == rejected || r.status == tooLarge {
				if r.header.Get("RateLimit") != "" {
					t.Fatalf("a request Go's server rejects reached the limiter: %v", r.header)
				}
				return
			}
			rem := remainingOf(t, r.header)
			if _, ok := rem["per_pair"]; !ok || len(rem) != 2 {
				t.Fatalf("RateLimit %v: a policy was skipped", r.header.Values("RateLimit"))
			}
			if rem["per_user"] != 999 {
				t.Errorf("per_user r=%d, want 999: the identity shares a bucket with an earlier one", rem["per_user"])
			}
			if tc.user != "" {
				if n, err := srv.Do("EXISTS", plainKey("per_user", tc.user)); err != nil || n != "1" {
					t.Errorf("no bucket %s for the literal identity %q (EXISTS: %s %v)", plainKey("per_user", tc.user), abbrev(tc.user), n, err)
				}
			}
		})
	}

	// No identity at all: an absent header, an empty one and one of
	// blanks all resolve to "" and share one bucket, never an unlimited one.
	for i, req := range []string{request(), request("X-User:"), request("X-User:    ")} {
		r := rawGet(t, in, req)
		if rem := remainingOf(t, r.header); r.status != 200 || rem["per_user"] != int64(999-i) {
			t.Errorf("empty identity, request %d: %d r=%v, want 200 and per_user r=%d (one shared bucket)", i+1, r.status, rem, 999-i)
		}
	}
	if n, _ := srv.Do("EXISTS", plainKey("per_user", "")); n != "1" {
		t.Errorf("no bucket for the empty identity")
	}

	// Still serving, and nothing panicked.
	if r := get(t, in.URL, "X-User", "after"); r.status != 200 {
		t.Fatalf("after the hostile requests: %d", r.status)
	}
	logText, _ := os.ReadFile(in.Log)
	if strings.Contains(string(logText), "panic") {
		t.Errorf("the log mentions a panic:\n%s", logText)
	}
}

func repeatLines(line string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = line
	}
	return out
}

// TestAbuseKeyCardinality: 100,000 distinct identities (as many as this
// machine sends in 40 s, at least 10,000) against two policies keyed on
// them make exactly twice as many keys, each with an expiry, none holding
// the identity.
func TestAbuseKeyCardinality(t *testing.T) {
	const identities, workers = 100_000, 16
	srv := testredis.Start(t)
	// Slow rates, so that every key outlives the run: a key expires when
	// its bucket is full again, one interval after a single request (360 s
	// and 864 s here).
	in := startCaddy(t, redisLimiter(srv.Addr, "2s", nil,
		map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "10/1h"},
		map[string]any{"name": "per_user_daily", "key": "{http.request.header.X-User}", "rate": "100/1d"},
	), respond())

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: workers, DisableCompression: true}}
	// As many identities as this machine sends in 40 s, and at least
	// 10,000: all 100,000 took 21 s beside two CPU hogs, the client under
	// the race detector. A request that fails (a hang: 10 s) stops the run.
	const within = 40 * time.Second
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var next, sent atomic.Int64
	var mu sync.Mutex
	statuses := map[int]int{}
	start := time.Now()
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := map[int]int{}
			for ctx.Err() == nil && time.Since(start) < within {
				i := next.Add(1) - 1
				if i >= identities {
					break
				}
				sent.Add(1)
				req, _ := http.NewRequestWithContext(ctx, "GET", in.URL+"/", nil)
				req.Header.Set("X-User", fmt.Sprintf("ident-%06d-Zq9", i))
				resp, err := client.Do(req)
				if err != nil {
					local[0]++
					cancel()
					continue
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				local[resp.StatusCode]++
			}
			mu.Lock()
			for k, v := range local {
				statuses[k] += v
			}
			mu.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	n := int(sent.Load())
	t.Logf("%d identities in %v (%.0f requests/s) with %d workers: statuses %v", n, elapsed.Round(time.Millisecond), float64(n)/elapsed.Seconds(), workers, statuses)
	if statuses[200] != n {
		t.Fatalf("statuses %v, want %d × 200 (each identity's first request)", statuses, n)
	}
	if n < 10_000 {
		t.Skipf("%d identities sent in %v: this machine is too slow for a cardinality worth the name", n, within)
	}

	c := redisClient(t, srv.Addr)
	fleet, _ := c.Exists(context.Background(), fleetKeys...).Result()
	if size, err := srv.Do("DBSIZE"); err != nil || size != strconv.Itoa(2*n+int(fleet)) {
		t.Fatalf("DBSIZE %s (%v), want exactly %d and the fleet's %d: one key per identity per policy", size, err, 2*n, fleet)
	}
	keys := allKeys(t, c)
	shape := regexp.MustCompile(`^rl:(per_user|per_user_daily):\{[A-Za-z0-9_-]{22}\}$`)
	for _, k := range keys {
		if !shape.MatchString(k) || strings.Contains(k, "ident-") {
			t.Fatalf("key %q is not rl:<policy>:{<22 base64url>} or holds identity text", k)
		}
	}
	if len(keys) != 2*n {
		t.Fatalf("SCAN found %d keys, want %d", len(keys), 2*n)
	}
	// A sample of a few hundred, spread over the key space: every key
	// expires.
	pipe := c.Pipeline()
	var ttls []*redis.DurationCmd
	for i := 0; i < len(keys); i += len(keys) / 400 {
		ttls = append(ttls, pipe.PTTL(context.Background(), keys[i]))
	}
	if _, err := pipe.Exec(context.Background()); err != nil {
		t.Fatal(err)
	}
	lo, hi := time.Duration(1<<62), time.Duration(0)
	for i, cmd := range ttls {
		d := cmd.Val()
		if d <= 0 {
			t.Fatalf("key %s: PTTL %v, want a positive expiry", keys[i*(len(keys)/400)], d)
		}
		lo, hi = min(lo, d), max(hi, d)
	}
	t.Logf("DBSIZE %d; PTTL of %d sampled keys between %v and %v", len(keys), len(ttls), lo, hi)
}

// TestAbuseCost: cost values that are negative, zero, huge, fractional,
// hex, overflowing, non-numeric or absent are all charged at max_cost.
func TestAbuseCost(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "1s", nil,
		map[string]any{"name": "tokens", "key": "{http.request.header.X-User}", "rate": "1000/1h",
			"cost": "{http.request.header.X-Cost}", "max_cost": 7},
	), echo())
	const full, maxCost = 1000, 7
	for i, tc := range []struct {
		value   string // "<absent>": no X-Cost field
		charged int64
	}{
		{"1", 1}, {"3", 3}, {"7", 7}, // valid costs, as sent
		{"8", maxCost}, {"1000", maxCost}, {"9223372036854775807", maxCost}, // above max
		{"0", maxCost}, {"-0", maxCost}, {"-1", maxCost}, {"-9223372036854775808", maxCost},
		{"9223372036854775808", maxCost}, {"99999999999999999999999", maxCost}, {strings.Repeat("9", 4096), maxCost},
		{"1.5", maxCost}, {"2.0", maxCost}, {"1e3", maxCost}, {"3e0", maxCost},
		{"0x10", maxCost}, {"0x3", maxCost}, {"0b11", maxCost}, {"0o3", maxCost}, {"1_0", maxCost},
		{"abc", maxCost}, {"NaN", maxCost}, {"Infinity", maxCost}, {"", maxCost}, {"<absent>", maxCost},
		{"3 3", maxCost}, {"\xd9\xa3", maxCost} /* Arabic-Indic 3 */, {"\xef\xbc\x93", maxCost}, /* fullwidth 3 */
		{"{http.request.header.X-Other}", maxCost}, {"\xff", maxCost},
	} {
		var lines []string
		if tc.value != "<absent>" {
			lines = append(lines, "X-Cost: "+tc.value)
		}
		// Each value has its own full bucket.
		lines = append(lines, "X-User: cost-"+strconv.Itoa(i), "X-Other: 2")
		r := rawGet(t, in, request(lines...))
		rem := remainingOf(t, r.header)
		if r.status != 200 || rem["tokens"] != full-tc.charged {
			t.Errorf("X-Cost %q: %d r=%v, want 200 and r=%d (charged %d)", abbrev(tc.value), r.status, rem, full-tc.charged, tc.charged)
		}
	}
	// Two X-Cost fields resolve to "3,3": not an integer, so max.
	req, _ := http.NewRequest("GET", in.URL, nil)
	req.Header.Set("X-User", "cost-two-fields-2")
	req.Header.Add("X-Cost", "3")
	req.Header.Add("X-Cost", "3")
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if rem := remainingOf(t, resp.Header); resp.StatusCode != 200 || rem["tokens"] != full-maxCost {
		t.Errorf("two X-Cost fields: %d r=%v, want r=%d", resp.StatusCode, rem, full-maxCost)
	}
}

// Identities of TestIdentitySafety: an API key, a user id, a client IP
// from X-Forwarded-For (trusted proxy).
const (
	abuseAPIKey = "sk_live_ABUSE_7f3a9c41"
	abuseUserID = "uid-abuse-559211"
	abuseIP     = "203.0.113.77"
)

// trustLoopback makes 127.0.0.1 a trusted proxy: X-Forwarded-For is the
// client IP.
func trustLoopback(cfg map[string]any) {
	srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
	srv["trusted_proxies"] = map[string]any{"source": "static", "ranges": []string{"127.0.0.1/32"}}
}

// TestIdentitySafety: after traffic keyed on an API key, a user id and a
// client IP (allowed, denied and shadow-denied), no raw identity is in
// Redis (keys or values), in the limiter's logs (DEBUG), in /metrics or in
// the responses; and another key_secret gives every identity other keys.
func TestIdentitySafety(t *testing.T) {
	srv := testredis.Start(t)
	policies := []map[string]any{
		{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "2/1m"},
		{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "100/1m"},
		{"name": "per_ip", "key": "{http.vars.client_ip}", "rate": "100/1m"},
		{"name": "dry", "key": "{http.request.header.X-User}", "rate": "1/1m", "shadow": true},
	}
	tune := func(cfg map[string]any) { debugWithAccessLog(cfg); trustLoopback(cfg) }
	secrets := []string{"secret-A-3b7", "secret-B-91c"}
	identities := map[string]string{"per_key": abuseAPIKey, "per_user": abuseUserID, "per_ip": abuseIP, "dry": abuseUserID}
	c := redisClient(t, srv.Addr)
	seen := map[string]bool{}
	for i, secret := range secrets {
		in := startCaddyTuned(t, tune, redisLimiter(srv.Addr, "1s", map[string]any{"key_secret": secret}, policies...), echo())
		var statuses []int
		for range 3 {
			r := get(t, in.URL, "X-Api-Key", abuseAPIKey, "X-User", abuseUserID, "X-Forwarded-For", abuseIP)
			statuses = append(statuses, r.status)
			var sent []string
			for k, vs := range r.header {
				sent = append(sent, k+": "+strings.Join(vs, ", "))
			}
			checkNoIdentity(t, "a response", strings.Join(sent, "\n")+"\n\n"+string(r.body))
		}
		if statuses[0] != 200 || statuses[1] != 200 || statuses[2] != 429 {
			t.Fatalf("key_secret %s: statuses %v, want 200 200 429 (this secret's own fresh buckets)", secret, statuses)
		}

		// Redis: exactly the keyed hashes of this secret, new ones.
		var fresh []string
		for _, k := range allKeys(t, c) {
			if !seen[k] {
				fresh = append(fresh, k)
				seen[k] = true
			}
			checkNoIdentity(t, "Redis key "+k, k)
			v, err := c.Get(context.Background(), k).Result()
			if err != nil {
				t.Fatal(err)
			}
			checkNoIdentity(t, "Redis value of "+k, v)
		}
		var want []string
		for p, id := range identities {
			want = append(want, secretKey(secret, p, id))
		}
		sort.Strings(want)
		if strings.Join(fresh, " ") != strings.Join(want, " ") {
			t.Errorf("key_secret %s: new keys\n\t%v\nwant (HMAC-SHA-256 of each identity, none of an earlier secret)\n\t%v", secret, fresh, want)
		}

		// The fleet's records: what each instance enforces, never an
		// identity or a secret. Each instance writes its own once its
		// config runs.
		for deadline := time.Now().Add(10 * time.Second); c.HLen(context.Background(), fleetKeys[1]).Val() < int64(i+1); time.Sleep(50 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("the instances did not announce themselves within 10 s")
			}
		}
		for _, k := range fleetKeys {
			records, err := c.HGetAll(context.Background(), k).Result()
			if err != nil || len(records) == 0 {
				t.Fatalf("the fleet's %s: %v, %v", k, records, err)
			}
			for _, r := range records {
				checkNoIdentity(t, "Redis value of "+k, r)
				for _, s := range secrets {
					if strings.Contains(r, s) {
						t.Errorf("the fleet's %s holds the key_secret %q: %s", k, s, r)
					}
				}
			}
		}

		// /metrics of the admin API.
		_, text := scrape(t, in)
		checkNoIdentity(t, "/metrics", text)

		// The log, at DEBUG: every line but the access log's, which records
		// the request's headers as sent.
		logText, _ := os.ReadFile(in.Log)
		limiterLines := 0
		for _, line := range strings.Split(string(logText), "\n") {
			if strings.Contains(line, `"logger":"http.log.access`) {
				continue
			}
			if strings.Contains(line, `"logger":"http.handlers.rate_limit`) {
				limiterLines++
			}
			checkNoIdentity(t, "log line "+line, line)
		}
		if limiterLines == 0 {
			t.Errorf("no log line from the limiter at DEBUG after a denial and a shadow denial:\n%s", logText)
		}
	}
}

func checkNoIdentity(t *testing.T, where, text string) {
	t.Helper()
	for _, id := range []string{abuseAPIKey, abuseUserID, abuseIP} {
		if strings.Contains(text, id) {
			t.Errorf("%s contains the identity %q", abbrev(where), id)
		}
	}
}

// TestClientIPSpoofing: a policy keyed on {client_ip}
// ({http.vars.client_ip}) ignores X-Forwarded-For from a peer that is not
// a trusted proxy, and honours it, parsed as an IP, from one that is.
func TestClientIPSpoofing(t *testing.T) {
	policy := map[string]any{"name": "per_ip", "key": "{http.vars.client_ip}", "rate": "3/1h"}
	perIPKeys := func(t *testing.T, c *redis.Client) []string {
		t.Helper()
		var out []string
		for _, k := range allKeys(t, c) {
			if strings.HasPrefix(k, "rl:per_ip:") {
				out = append(out, k)
			}
		}
		return out
	}

	t.Run("untrusted peer", func(t *testing.T) {
		srv := testredis.Start(t)
		in := startCaddy(t, redisLimiter(srv.Addr, "1s", nil, policy), echo())
		var got []int
		for i := range 10 {
			got = append(got, get(t, in.URL, "X-Forwarded-For", fmt.Sprintf("198.51.100.%d", i+1)).status)
		}
		if fmt.Sprint(got) != "[200 200 200 429 429 429 429 429 429 429]" {
			t.Fatalf("statuses %v with a new X-Forwarded-For each time, want 3 × 200 then 429: the peer's one bucket", got)
		}
		if keys := perIPKeys(t, redisClient(t, srv.Addr)); len(keys) != 1 || keys[0] != plainKey("per_ip", "127.0.0.1") {
			t.Fatalf("keys %v, want only the bucket of 127.0.0.1", keys)
		}
	})

	t.Run("trusted proxy", func(t *testing.T) {
		srv := testredis.Start(t)
		in := startCaddyTuned(t, trustLoopback, redisLimiter(srv.Addr, "1s", nil, policy), echo())
		c := redisClient(t, srv.Addr)
		for i := range 10 {
			ip := fmt.Sprintf("198.51.100.%d", i+1)
			if r := get(t, in.URL, "X-Forwarded-For", ip); r.status != 200 {
				t.Fatalf("X-Forwarded-For %s: status %d, want 200 (its own bucket)", ip, r.status)
			}
		}
		if keys := perIPKeys(t, c); len(keys) != 10 {
			t.Fatalf("%d per_ip keys after 10 distinct X-Forwarded-For, want 10", len(keys))
		}
		// One client, however it spells its address, is one bucket: an
		// IPv6 address in any case or abbreviation, with a port or a zone.
		var got []int
		for _, xff := range []string{"2001:db8::7", "2001:DB8:0:0::7", "[2001:db8::7]:4433", "2001:0db8::0007", "2001:db8::7%eth0"} {
			got = append(got, get(t, in.URL, "X-Forwarded-For", xff).status)
		}
		if fmt.Sprint(got) != "[200 200 200 429 429]" {
			t.Errorf("spellings of 2001:db8::7: statuses %v, want one bucket of 3", got)
		}
		// Not an IP: the peer's address, one bucket, not one per string.
		got = nil
		for i := range 6 {
			got = append(got, get(t, in.URL, "X-Forwarded-For", fmt.Sprintf("not-an-ip-%d", i)).status)
		}
		if fmt.Sprint(got) != "[200 200 200 429 429 429]" {
			t.Errorf("X-Forwarded-For that is not an IP: statuses %v, want the peer's one bucket of 3", got)
		}
		// The IPv6 client's bucket is its /64's (ipv6_prefix, default 64).
		want := map[string]bool{plainKey("per_ip", "2001:db8::/64"): true, plainKey("per_ip", "127.0.0.1"): true}
		for i := range 10 {
			want[plainKey("per_ip", fmt.Sprintf("198.51.100.%d", i+1))] = true
		}
		keys := perIPKeys(t, c)
		for _, k := range keys {
			if !want[k] {
				t.Errorf("unexpected key %s", k)
			}
		}
		if len(keys) != len(want) {
			t.Errorf("%d per_ip keys, want %d (10 IPs, 2001:db8::/64, the peer)", len(keys), len(want))
		}

		// Caddy's default (not strict) takes the left-most IP: behind a
		// proxy that appends the address it saw, that is what the client
		// wrote. Each forged left-most entry is another bucket; see the
		// strict case below.
		got = nil
		for i := range 5 {
			got = append(got, get(t, in.URL, "X-Forwarded-For", fmt.Sprintf("192.0.2.%d, 198.51.100.200", i+1)).status)
		}
		if fmt.Sprint(got) != "[200 200 200 200 200]" {
			t.Errorf("forged left-most X-Forwarded-For, not strict: %v; Caddy's left-most rule changed?", got)
		}
	})

	t.Run("trusted proxy, strict", func(t *testing.T) {
		srv := testredis.Start(t)
		strict := func(cfg map[string]any) {
			trustLoopback(cfg)
			srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
			srv["trusted_proxies_strict"] = 1
		}
		in := startCaddyTuned(t, strict, redisLimiter(srv.Addr, "1s", nil, policy), echo())
		// The right-most untrusted address is the client, whatever it put
		// to the left.
		var got []int
		for i := range 5 {
			got = append(got, get(t, in.URL, "X-Forwarded-For", fmt.Sprintf("192.0.2.%d, 198.51.100.200", i+1)).status)
		}
		if fmt.Sprint(got) != "[200 200 200 429 429]" {
			t.Errorf("forged left-most X-Forwarded-For, strict: statuses %v, want one bucket of 3 (198.51.100.200's)", got)
		}
		if keys := perIPKeys(t, redisClient(t, srv.Addr)); len(keys) != 1 || keys[0] != plainKey("per_ip", "198.51.100.200") {
			t.Errorf("keys %v, want only the bucket of 198.51.100.200", keys)
		}
	})
}

// TestAbuseRouteClasses: a policy with a match is one route class. Raw
// paths, however spelled, never make storage keys: any number of distinct
// paths under the class share its one bucket per identity, and spellings
// of the class's path that Caddy's own path matcher takes for it
// (case, escapes, dot segments, repeated slashes) are charged to it.
func TestAbuseRouteClasses(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "1s", nil,
		map[string]any{"name": "api", "match": map[string]any{"path": []string{"/api/*"}}, "key": "global", "rate": "1000/1000h"}, // no refill to speak of
	), echo())
	charged := 0
	for i := range 500 {
		r := rawGet(t, in, "GET /api/"+strconv.Itoa(i)+"/"+strings.Repeat("x", i%50)+"?q="+strconv.Itoa(i)+" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
		if r.status != 200 || r.header.Get("RateLimit") == "" {
			t.Fatalf("/api/%d: %d %v", i, r.status, r.header)
		}
		charged++
	}
	// Spellings that reach /api/x in a handler that cleans and decodes the
	// path must be charged; the others may be, or not.
	for _, tc := range []struct {
		path       string
		mustCharge bool
	}{
		{"/API/x", true}, {"/Api/x", true}, {"//api/x", true}, {"/api//x", true}, {"/./api/x", true},
		{"/x/../api/x", true}, {"/%61pi/x", true},
		{"/api%2Fx", false}, {"/%2561pi/x", false}, {"/api/x%00", false}, {"/api/%ff", false},
	} {
		r := rawGet(t, in, "GET "+tc.path+" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
		t.Logf("%-14s %d RateLimit=%q", tc.path, r.status, r.header.Get("RateLimit"))
		if r.status >= 500 {
			t.Errorf("%s: status %d", tc.path, r.status)
		}
		if r.header.Get("RateLimit") != "" {
			charged++
		} else if tc.mustCharge {
			t.Errorf("%s skipped the policy of /api/*", tc.path)
		}
	}
	keys := allKeys(t, redisClient(t, srv.Addr))
	if len(keys) != 1 || keys[0] != plainKey("api", "global") {
		t.Fatalf("keys %v, want the one bucket of the route class", keys)
	}
	r := get(t, in.URL+"/api/last")
	if rem := remainingOf(t, r.header); rem["api"] != int64(1000-charged-1) {
		t.Errorf("r=%d after %d charged requests, want %d", rem["api"], charged, 1000-charged-1)
	}
}
