package integration_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// A rolling upgrade: the previous release (testcaddy.PreviousRelease,
// v0.3.0, built from the repository's history) and this build on one
// Redis, with requests alternating between them, admit exactly what one
// build would, whichever goes first; and once the fleet marker says v2,
// both write and read the compact format.

// releases are the Caddy binaries of earlier releases the tests run,
// built once each, by commit.
var releases sync.Map // commit -> *release

type release struct {
	once sync.Once
	bin  string
	err  error
}

// releaseBin is the Caddy binary of an earlier release (its commit),
// built once from the repository's history, named name.
func releaseBin(t *testing.T, commit, name string) string {
	t.Helper()
	v, _ := releases.LoadOrStore(commit, new(release))
	r := v.(*release)
	r.once.Do(func() {
		r.bin = filepath.Join(filepath.Dir(caddyBin), name)
		r.err = testcaddy.BuildRelease(".", commit, r.bin)
	})
	if r.err != nil {
		t.Fatalf("building %s (%s): %v", name, commit, r.err)
	}
	return r.bin
}

// previousBin is the previous release's Caddy binary.
func previousBin(t *testing.T) string {
	t.Helper()
	return releaseBin(t, testcaddy.PreviousRelease, "caddy-previous")
}

// startBinary is startCaddy with another Caddy binary.
func startBinary(t *testing.T, bin string, handlers ...map[string]any) *instance {
	t.Helper()
	in := &instance{testcaddy.Start(t, bin, nil, handlers...)}
	t.Cleanup(func() {
		in.Stop()
		if t.Failed() {
			out, _ := os.ReadFile(in.Log)
			t.Logf("caddy log (%s, %s):\n%s", filepath.Base(bin), in.URL, out)
		}
	})
	return in
}

// mixedFleet is an instance of the previous release and one of this build
// with the same handlers.
func mixedFleet(t *testing.T, handlers ...map[string]any) (old, cur *instance) {
	t.Helper()
	return startBinary(t, previousBin(t), handlers...), startCaddy(t, handlers...)
}

// getWith sends a GET with the given headers and returns the status.
func getWith(t *testing.T, c *http.Client, url string, hdr map[string]string) int {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	for k, v := range hdr {
		req.Header.Set(k, v)
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

// alternate sends n requests with hdr, alternating between the two
// instances (first goes first), and returns how many got 200.
func alternate(t *testing.T, first, second *instance, n int, hdr map[string]string) int {
	t.Helper()
	ok := 0
	alternateEach(t, first, second, n, hdr, func(_ *instance, status int) {
		if status == 200 {
			ok++
		}
	})
	return ok
}

// alternateEach is alternate with each request's instance and status
// given to each once its answer arrived.
func alternateEach(t *testing.T, first, second *instance, n int, hdr map[string]string, each func(in *instance, status int)) {
	t.Helper()
	c := newClient()
	for i := range n {
		in := first
		if i%2 == 1 {
			in = second
		}
		each(in, getWith(t, c, in.URL+"/", hdr))
	}
}

// orders runs a subtest with the previous release first, then with this
// build first.
func orders(t *testing.T, old, cur *instance, test func(t *testing.T, first, second *instance, id string)) {
	t.Run("previous first", func(t *testing.T) { test(t, old, cur, "a") })
	t.Run("this build first", func(t *testing.T) { test(t, cur, old, "b") })
}

// TestUpgradeMixedFleet: every request is decided by Redis
// (decidedByRedis): at the default 100 ms, one call beside four CPU hogs
// timed out and followed fail_open, a 6th failed login of 5.
func TestUpgradeMixedFleet(t *testing.T) {
	srv := testredis.Start(t)
	t.Run("rate", func(t *testing.T) {
		policy := map[string]any{"name": "per_key", "key": "{http.request.header.X-Key}", "rate": "5/1h", "burst": 5}
		old, cur := mixedFleet(t, decidedByRedis(srv.Addr, policy), respond())
		orders(t, old, cur, func(t *testing.T, first, second *instance, id string) {
			got := alternate(t, first, second, 12, map[string]string{"X-Key": "rate-" + id})
			t.Logf("12 requests alternating, burst 5: %d admitted", got)
			if got != 5 {
				t.Errorf("admitted %d, want exactly the burst, 5", got)
			}
			// The case: one build charges 3 of the burst, the other
			// admits exactly the 2 left.
			key := map[string]string{"X-Key": "part-" + id}
			c := newClient()
			n := 0
			var answers []string // each request's status and time, for a failure's message
			for i := range 7 {
				in := first
				if i >= 3 {
					in = second
				}
				start := time.Now()
				status := getWith(t, c, in.URL+"/", key)
				answers = append(answers, fmt.Sprintf("%d in %s", status, time.Since(start).Round(time.Millisecond)))
				if status == 200 {
					n++
				}
			}
			if n != 5 {
				// Once in some fifteen suite runs beside CPU hogs, 3: whether
				// those were 429s (a bucket read wrong) or 503s (a call past
				// its 1 s), and what each build decided, tells which.
				t.Errorf("3 then 4 requests on the two builds: %d admitted, want 5 (%v); tokens left %d; previous release: %s; this build: %s",
					n, answers, bucketTokens(t, cur, "per_key", key["X-Key"]), whyPassed(t, old), whyPassed(t, cur))
			}
		})
	})
	t.Run("concurrent", func(t *testing.T) {
		up := startHoldingUpstream(t)
		old, cur := mixedFleet(t, decidedByRedis(srv.Addr, slotsPolicy(2)), proxyTo(up.addr))
		orders(t, old, cur, func(t *testing.T, first, second *instance, id string) {
			key := "slots-" + id
			// Holders, alternating, until both slots are taken; then every
			// other request is denied on both builds.
			ctx, cancel := context.WithCancel(context.Background())
			var held sync.WaitGroup
			statuses := make(chan int, 2)
			for i, in := range []*instance{first, second} {
				held.Add(1)
				go func() {
					defer held.Done()
					status, _ := send(ctx, in, key, 30*time.Second)
					statuses <- status
				}()
				waitFor(t, fmt.Sprintf("holder %d at the upstream", i+1), func() bool { return up.now(key) == i+1 })
			}
			denied := 0
			for i := range 6 {
				in := first
				if i%2 == 1 {
					in = second
				}
				if status, _ := send(context.Background(), in, key, 0); status == 429 {
					denied++
				}
			}
			most := up.mostAtOnce(key)
			cancel()
			held.Wait()
			t.Logf("concurrent 2, two holders on the two builds: %d of 6 more denied, most at once %d", denied, most)
			if denied != 6 || most != 2 {
				t.Errorf("%d of 6 denied, most at once %d: want 6 and 2", denied, most)
			}
			// The slots are free again, for either build.
			waitFor(t, "the holders' slots free", func() bool {
				status, _ := send(context.Background(), second, key, 0)
				return status == 200
			})
		})
	})
	t.Run("charge_if", func(t *testing.T) {
		var seen atomic.Int64
		upstream := startCounting(t, &seen, func(w http.ResponseWriter) { w.WriteHeader(http.StatusUnauthorized) })
		policy := map[string]any{"name": "failed", "key": "{http.request.header.X-Key}", "rate": "5/15m", "burst": 5,
			"charge_if": map[string]any{"status_code": []int{401}}}
		old, cur := mixedFleet(t, decidedByRedis(srv.Addr, policy), proxyTo(upstream))
		orders(t, old, cur, func(t *testing.T, first, second *instance, id string) {
			before, key := seen.Load(), "login-"+id
			// Both builds reserve an attempt before it runs, and a 401
			// keeps it.
			alternateEach(t, first, second, 12, map[string]string{"X-Key": key}, func(*instance, int) {})
			got := seen.Load() - before
			t.Logf("12 failed logins alternating, burst 5: %d reached the upstream", got)
			if got != 5 {
				t.Errorf("%d reached the upstream, want exactly the burst, 5; previous release: %s; this build: %s",
					got, whyPassed(t, old), whyPassed(t, cur))
			}
		})
	})
	t.Run("settle", func(t *testing.T) {
		var seen atomic.Int64
		upstream := startCounting(t, &seen, func(w http.ResponseWriter) { w.Header().Set("X-Usage-Tokens", "5") })
		policy := map[string]any{"name": "tokens", "key": "{http.request.header.X-Key}", "rate": "50/1h", "burst": 50,
			"cost": "10", "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}}
		old, cur := mixedFleet(t, decidedByRedis(srv.Addr, policy), proxyTo(upstream))
		orders(t, old, cur, func(t *testing.T, first, second *instance, id string) {
			key := "llm-" + id
			got, settled := 0, int64(50)
			alternateEach(t, first, second, 14, map[string]string{"X-Key": key}, func(in *instance, status int) {
				if status != 200 {
					return
				}
				got++
				settled -= 5
				if in == old {
					// The previous release settles once its handler returned,
					// which may be after its client has the response (this
					// build settles before): wait, bounded, for it, so that
					// what is compared is how each build counts the other's
					// settles.
					waitFor(t, "the previous release's settle in Redis", func() bool { return bucketTokens(t, cur, "tokens", key) == settled })
				}
			})
			// Each admitted request reserves 10 and settles 5: admitted while
			// 50 - 5n >= 10, so 9.
			t.Logf("14 requests alternating, reserve 10, settle 5, burst 50: %d admitted", got)
			if got != 9 {
				t.Errorf("admitted %d, want 9", got)
			}
		})
	})
	t.Run("format v2", func(t *testing.T) {
		policy := map[string]any{"name": "per_key", "key": "{http.request.header.X-Key}", "rate": "100/1m", "burst": 5}
		old, cur := mixedFleet(t, decidedByRedis(srv.Addr, policy), respond())
		setFormat(t, cur, "v2")
		// Both builds read and write v2: alternating, they admit the burst
		// together, exactly.
		got := alternate(t, cur, old, 12, map[string]string{"X-Key": "compact"})
		t.Logf("after v2: 12 requests alternating, burst 5: %d admitted", got)
		if got != 5 {
			t.Errorf("admitted %d, want exactly the burst, 5", got)
		}
		setFormat(t, cur, "v1")
	})
}

// whyPassed is an instance's decisions by outcome and its lost charges,
// which say why a request passed that should not have (a call that timed
// out follows on_error; a lost charge leaves its token in the bucket).
func whyPassed(t *testing.T, in *instance) string {
	t.Helper()
	mfs, _ := scrape(t, in)
	return fmt.Sprintf("%v, charges lost %.0f", decisionCounts(mfs), metricSum(mfs, "caddy_rate_limit_charges_lost_total", nil))
}

// startCounting starts an upstream that counts its requests and answers
// with answer.
func startCounting(t *testing.T, seen *atomic.Int64, answer func(w http.ResponseWriter)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen.Add(1)
		answer(w)
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return l.Addr().String()
}

// setFormat sets the fleet marker through the admin API and waits until
// the instance writes in that format.
func setFormat(t *testing.T, in *instance, format string) {
	t.Helper()
	resp, err := http.Post(in.Admin+"/rate_limit/format", "application/json", strings.NewReader(`{"format":"`+format+`"}`))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var answer struct {
		Stores []struct{ Marker, Writes string }
	}
	if err := json.NewDecoder(resp.Body).Decode(&answer); err != nil || resp.StatusCode != 200 || len(answer.Stores) != 1 ||
		answer.Stores[0].Marker != format || answer.Stores[0].Writes != format {
		t.Fatalf("setting format %s: %d %+v (%v)", format, resp.StatusCode, answer, err)
	}
}

// waitFor polls cond every 10 ms for at most 10 s.
func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
