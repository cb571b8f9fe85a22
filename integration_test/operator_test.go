package integration_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The operator's handles, through real Caddy processes and a real Redis:
// "a customer says they are blocked".

// rateLimitCLI runs `caddy rate-limit <args>` against an instance's admin
// API, as an operator would, and returns what it printed.
func rateLimitCLI(t *testing.T, in *instance, args ...string) string {
	t.Helper()
	cmd := exec.Command(caddyBin, append(append([]string{"rate-limit"}, args...), "--address", strings.TrimPrefix(in.Admin, "http://"))...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("caddy rate-limit %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// bucketAnswer is the admin API's answer for a bucket.
type bucketAnswer struct {
	Policy    string  `json:"policy"`
	Kind      string  `json:"kind"`
	Burst     int64   `json:"burst"`
	Key       string  `json:"key"`
	Tokens    int64   `json:"tokens"`
	NextToken float64 `json:"next_token_seconds"`
	Full      float64 `json:"full_seconds"`
	Granted   int64   `json:"granted"`
	Announced *bool   `json:"announced"`
}

func inspect(t *testing.T, in *instance, policy, identity string) bucketAnswer {
	t.Helper()
	var b bucketAnswer
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, "inspect", policy, identity, "--json")), &b); err != nil {
		t.Fatal(err)
	}
	return b
}

// adminCall sends one admin API request and returns its status and body.
func adminCall(t *testing.T, in *instance, method, path, body string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest(method, in.Admin+path, strings.NewReader(body))
	if body != "" {
		req.Header.Set("Content-Type", "application/json")
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(raw)
}

// drainOn exhausts a customer's bucket through the fleet and warms every
// instance's deny cache: the last request to each is denied.
func drainOn(t *testing.T, fleet []*instance, identity string) {
	t.Helper()
	for i := 0; i < 40; i++ {
		get(t, fleet[i%len(fleet)].URL, "X-User", identity)
	}
	for _, in := range fleet {
		if r := get(t, in.URL, "X-User", identity); r.status != 429 {
			t.Fatalf("%s on %s after draining: %d, want 429", identity, in.URL, r.status)
		}
	}
}

// TestOperatorReset: two instances; a customer drained and denied on both.
// `caddy rate-limit reset` against one instance's admin API frees it on the
// other at once: the very next request there is admitted. A raw DEL in
// Redis takes effect on an instance that held the denial within 1 s.
func TestOperatorReset(t *testing.T) {
	srv := testredis.Start(t)
	policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "5/10m", "burst": 5}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), echo()))
	}

	drainOn(t, fleet, "carla")
	out := rateLimitCLI(t, fleet[0], "reset", "per_user", "carla")
	t.Logf("caddy rate-limit reset per_user carla: %s", strings.TrimSpace(out))
	if r := get(t, fleet[1].URL, "X-User", "carla"); r.status != 200 {
		t.Fatalf("the very next request on the other instance after the reset: %d, want 200", r.status)
	}
	if b := inspect(t, fleet[1], "per_user", "carla"); b.Tokens != 4 {
		t.Fatalf("after the reset and one request: %d tokens, want 4", b.Tokens)
	}

	// A raw DEL: the instance that held the denial admits within 1 s.
	drainOn(t, fleet, "dora")
	key := plainKey("per_user", "dora")
	if b := inspect(t, fleet[0], "per_user", "dora"); b.Key != key {
		t.Fatalf("inspect names the key %s, want %s (the hash, as the handler stores it)", b.Key, key)
	}
	if _, err := srv.Do("DEL", key); err != nil {
		t.Fatal(err)
	}
	deleted := time.Now()
	var admittedAfter time.Duration
	for time.Since(deleted) < 3*time.Second {
		if r := get(t, fleet[1].URL, "X-User", "dora"); r.status == 200 {
			admittedAfter = time.Since(deleted)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("after a raw DEL: admitted on the instance that held the denial %v later", admittedAfter.Round(time.Millisecond))
	if admittedAfter == 0 || admittedAfter > 1200*time.Millisecond {
		t.Fatalf("admitted %v after the DEL, want within 1 s", admittedAfter)
	}
}

// TestOperatorInspectAndGrant: inspect agrees with the RateLimit field of
// the last response; grant 3 gives exactly 3 more requests; errors are
// clear, with a non-2xx status, and change nothing. Also without Redis.
func TestOperatorInspectAndGrant(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "5/10m", "burst": 5}
		in := startCaddy(t, limiter(redisAddr, map[string]any{"jitter": 0}, policy), echo())
		var last response
		for range 3 {
			last = get(t, in.URL, "X-User", "eve")
		}
		lim := parseFields(t, last.header, "RateLimit")
		b := inspect(t, in, "per_user", "eve")
		t.Logf("last response RateLimit %+v; inspect %+v", lim, b)
		// t is the seconds to the next token rounded up, when the response
		// was made; inspect came after, so its wait may have crossed a whole
		// second since.
		if dt := lim[0].params["t"] - int64(b.NextToken+0.999); b.Tokens != lim[0].params["r"] || b.Kind != "rate" || b.Burst != 5 || dt < 0 || dt > 1 {
			t.Fatalf("inspect %+v disagrees with the last response's RateLimit %+v", b, lim)
		}
		drainOn(t, []*instance{in}, "eve")
		out := rateLimitCLI(t, in, "grant", "per_user", "eve", "3")
		t.Logf("caddy rate-limit grant per_user eve 3: %s", strings.TrimSpace(out))
		if !strings.Contains(out, "granted 3 tokens; 3 of 5") {
			t.Errorf("grant 3 to a drained bucket says %q, want granted 3 tokens; 3 of 5", strings.TrimSpace(out))
		}
		got := []int{}
		for range 4 {
			got = append(got, get(t, in.URL, "X-User", "eve").status)
		}
		if fmt.Sprint(got) != "[200 200 200 429]" {
			t.Fatalf("after grant 3: %v, want exactly 3 more admitted", got)
		}

		before := inspect(t, in, "per_user", "eve")
		for _, tc := range []struct {
			method, path, body string
			status             int
			says               string
		}{
			{"POST", "/rate_limit/inspect", `{"policy":"nope","identity":"eve"}`, 404, `policy \"nope\"`},
			{"GET", "/rate_limit/inspect?policy=per_user&identity=eve", "", 400, "never in the URL"},
			{"GET", "/rate_limit/inspect?policy=per_user", "", 400, "identity: required"},
			{"POST", "/rate_limit/grant", `{"policy":"per_user","identity":"eve","tokens":0}`, 400, "tokens: 0"},
			{"POST", "/rate_limit/grant", `{"policy":"per_user","identity":"eve","tokens":"3"}`, 400, "not {"},
			{"POST", "/rate_limit/reset", `{"policy":"per_user"}`, 400, "identity: required"},
			{"GET", "/rate_limit/reset", "", 405, "POST"},
			{"GET", "/rate_limit/unblock", "", 404, "inspect, reset, grant, top, format, fleet, override, overrides, apply or dry_run"},
		} {
			status, body := adminCall(t, in, tc.method, tc.path, tc.body)
			if status != tc.status || !strings.Contains(body, tc.says) {
				t.Errorf("%s %s %s: %d %s, want %d naming %q", tc.method, tc.path, tc.body, status, body, tc.status, tc.says)
			}
		}
		if after := inspect(t, in, "per_user", "eve"); after.Tokens != before.Tokens {
			t.Errorf("the refused calls changed the bucket: %d tokens, then %d", before.Tokens, after.Tokens)
		}
	})
}

// TestOperatorRedisDown: with Redis unreachable, inspect, reset and grant
// answer 503 saying so.
func TestOperatorRedisDown(t *testing.T) {
	dead := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	in := startCaddy(t, limiter(dead, nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "5/10m"}), echo())
	for _, c := range []struct{ method, path, body string }{
		{"POST", "/rate_limit/inspect", `{"policy":"per_user","identity":"x"}`},
		{"POST", "/rate_limit/reset", `{"policy":"per_user","identity":"x"}`},
		{"POST", "/rate_limit/grant", `{"policy":"per_user","identity":"x","tokens":2}`},
	} {
		status, body := adminCall(t, in, c.method, c.path, c.body)
		if status != 503 || !strings.Contains(body, "store") {
			t.Errorf("%s %s with Redis down: %d %s, want 503", c.method, c.path, status, body)
		}
	}
}

// TestOperatorTop: the identities denied most on an instance, the abusive
// one first, from a sketch that stays bounded under 100,000 distinct
// identities (as many as this machine sends in 40 s, at least 10,000); audit lines name the policy and the key's hash, never the
// identity.
func TestOperatorTop(t *testing.T) {
	srv := testredis.Start(t)
	policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1/1h", "burst": 1}
	in := startCaddyTuned(t, infoLogs, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), echo())
	// 100,000 identities, each denied once (its second request, of a burst
	// of 1: a cost that never fits, which this test used, is refused at
	// load now), and one abuser denied 2,000 times, interleaved: as many of
	// them as this machine sends in 40 s (all 100,000 took 60 s beside two
	// CPU hogs, the client under the race detector), and at least 10,000,
	// thirty times what the sketch may keep.
	var wg sync.WaitGroup
	const workers, each = 32, 100_000 / 32
	var visitors, abuserDenied atomic.Int64
	stop := time.Now().Add(40 * time.Second)
	client := newClient()
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range each {
				if time.Now().After(stop) {
					return
				}
				visitors.Add(1)
				visitor := "visitor-" + strconv.Itoa(w*each+i)
				for _, id := range []string{visitor, visitor, "abuser"} {
					if id == "abuser" && i%50 != 0 {
						continue
					}
					req, _ := http.NewRequest("GET", in.URL, nil)
					req.Header.Set("X-User", id)
					resp, err := client.Do(req)
					if err != nil {
						t.Error(err)
						return
					}
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					if id == "abuser" && resp.StatusCode == 429 {
						abuserDenied.Add(1)
					}
				}
			}
		}()
	}
	wg.Wait()
	t.Logf("%d identities denied once, the abuser %d times", visitors.Load(), abuserDenied.Load())
	if visitors.Load() < 10_000 {
		t.Skipf("%d identities sent in 40 s: this machine is too slow to show the sketch bounded under 10,000", visitors.Load())
	}
	// By default, keyed fingerprints only: a listing is copied around, and
	// an identity may be an API key.
	hidden := rateLimitCLI(t, in, "top", "per_user", "5")
	t.Logf("caddy rate-limit top per_user 5:\n%s", hidden)
	fingerprint := hashPart(plainKey("per_user", "abuser"))[:12]
	if strings.Contains(hidden, "abuser") || !strings.Contains(hidden, fingerprint) {
		t.Errorf("top without --show-keys: want the abuser's fingerprint %s, never its identity:\n%s", fingerprint, hidden)
	}
	out := rateLimitCLI(t, in, "top", "per_user", "5", "--show-keys")
	t.Logf("caddy rate-limit top per_user 5 --show-keys:\n%s", out)
	var top struct {
		Identities []struct {
			Identity string `json:"identity"`
			Denials  int64  `json:"denials"`
		} `json:"identities"`
		Truncated bool `json:"truncated"`
	}
	status, body := adminCall(t, in, "GET", "/rate_limit/top?policy=per_user&n=1000&show_keys=true", "")
	if status != 200 || json.Unmarshal([]byte(body), &top) != nil {
		t.Fatalf("top: %d %s", status, body)
	}
	// Its denials less 15 (2,000 of 2,015 when all 100,000 are sent).
	if len(top.Identities) == 0 || top.Identities[0].Identity != "abuser" || top.Identities[0].Denials < abuserDenied.Load()-15 {
		t.Fatalf("top: %+v, want abuser first with its %d denials", top.Identities[:min(3, len(top.Identities))], abuserDenied.Load())
	}
	if len(top.Identities) > 5*64 {
		t.Fatalf("top kept %d identities for %d denied: not bounded", len(top.Identities), visitors.Load()+1)
	}
	if !top.Truncated {
		t.Errorf("top of %d identities denied, %d listed: not truncated", visitors.Load()+1, len(top.Identities))
	}
	// The first row is the abuser's, with the denials the admin API gave.
	first := strings.Split(out, "\n")[2]
	if !strings.HasPrefix(first, strconv.FormatInt(top.Identities[0].Denials, 10)+" ") || !strings.Contains(first, `"abuser"`) ||
		!strings.Contains(out, "(truncated: more identities were denied than listed)") {
		t.Errorf("the CLI's top does not list the abuser first, then say it is truncated:\n%s", out)
	}

	// Audit: a reset and a grant are logged at INFO with the policy and the
	// key's hash, never the identity.
	rateLimitCLI(t, in, "reset", "per_user", "abuser")
	rateLimitCLI(t, in, "grant", "per_user", "abuser", "1")
	raw := logText(t, in)
	if !strings.Contains(raw, `"msg":"rate limit bucket reset","policy":"per_user","key":"`+plainKey("per_user", "abuser")) ||
		!strings.Contains(raw, `"msg":"rate limit bucket grant"`) {
		t.Errorf("no INFO audit lines for the reset and the grant:\n%s", raw)
	}
	for _, line := range strings.Split(raw, "\n") {
		if strings.Contains(line, "rate limit bucket") && strings.Contains(line, "abuser") {
			t.Errorf("an audit line names the identity: %s", line)
		}
	}
}

// logText is an instance's log so far.
func logText(t *testing.T, in *instance) string {
	t.Helper()
	raw, err := os.ReadFile(in.Log)
	if err != nil {
		t.Fatal(err)
	}
	return string(raw)
}

// infoLogs logs at INFO, for the audit lines.
func infoLogs(cfg map[string]any) {
	cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": "INFO"}}}
}

// hashPart is the keyed hash of a storage key: what is between its braces.
func hashPart(key string) string {
	i, j := strings.IndexByte(key, '{'), strings.LastIndexByte(key, '}')
	if i < 0 || j < i {
		return key
	}
	return key[i+1 : j]
}
