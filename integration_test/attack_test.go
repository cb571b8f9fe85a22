package integration_test

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The limiter under attack, with Redis healthy: floods of connections on
// one key and on many, through a Redis 20 ms away, a killed connection, a
// key of the wrong type. Redis answers every call in time, so no request
// may follow its policy's on_error: every admission is a decision, within
// budget.

// floodResult counts the responses of a flood, by key.
type floodResult struct {
	elapsed  time.Duration
	lastSent time.Duration // when the last request was sent, since the start
	// lastAdmitted is when the last admitted response arrived, since the
	// start: every admission was decided before it. On a loaded machine a
	// request sent before lastSent may wait in Caddy and be decided well
	// after it, with the tokens refilled by then.
	lastAdmitted time.Duration
	// firstAnswer is when the first response arrived, since the start: a
	// bucket's first decision (and its refill) began before it. On a loaded
	// machine 1,024 connections take a while to get their first requests
	// in.
	firstAnswer time.Duration
	sent        int
	errors      int // transport errors
	decisions   map[string]int
	admitted    map[string]int // per key sent
}

// failures is how many responses came from a failure mode.
func (f *floodResult) failures() int {
	n := 0
	for d, c := range f.decisions {
		switch d {
		case "allowed", "denied", "quota-exceeded", "delayed":
		default:
			n += c
		}
	}
	return n
}

// flood sends requests from conns clients at once, each on its own
// keep-alive connection, round-robin over the fleet, as fast as they are
// answered, for d (and at most maxShots requests in all). key gives the
// X-Api-Key of a client's i-th request.
func flood(t *testing.T, fleet []*instance, conns int, d time.Duration, key func(client, i int) string) *floodResult {
	t.Helper()
	res := &floodResult{decisions: map[string]int{}, admitted: map[string]int{}}
	var mu sync.Mutex
	var sent atomic.Int64
	var lastSent, lastAdmitted atomicDuration
	var firstAnswer atomic.Int64 // ns since the start; 0: none yet
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(d)
	for c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tr := &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}
			defer tr.CloseIdleConnections()
			client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
			local := map[string]int{}
			admitted := map[string]int{}
			errs := 0
			for i := 0; time.Now().Before(stop) && sent.Add(1) <= maxShots; i++ {
				k := key(c, i)
				if at := time.Since(start); at > lastSent.Load() {
					lastSent.Store(at)
				}
				req, _ := http.NewRequest("GET", fleet[(c+i)%len(fleet)].URL+"/", nil)
				req.Header.Set("X-Api-Key", k)
				resp, err := client.Do(req)
				if err != nil {
					errs++
					continue
				}
				firstAnswer.CompareAndSwap(0, int64(time.Since(start)))
				body, _ := io.ReadAll(resp.Body)
				resp.Body.Close()
				dec := decisionOf(resp.StatusCode, body)
				local[dec]++
				if resp.StatusCode == 200 {
					admitted[k]++
					lastAdmitted.Store(time.Since(start))
				}
			}
			mu.Lock()
			for k, v := range local {
				res.decisions[k] += v
			}
			for k, v := range admitted {
				res.admitted[k] += v
			}
			res.errors += errs
			mu.Unlock()
		}()
	}
	wg.Wait()
	res.elapsed = time.Since(start)
	res.lastSent, res.lastAdmitted = lastSent.Load(), lastAdmitted.Load()
	res.firstAnswer = time.Duration(firstAnswer.Load())
	res.sent = int(min(sent.Load(), maxShots))
	return res
}

// atomicDuration is the largest duration stored (races resolved upward).
type atomicDuration struct{ v atomic.Int64 }

func (a *atomicDuration) Load() time.Duration { return time.Duration(a.v.Load()) }
func (a *atomicDuration) Store(d time.Duration) {
	for old := a.v.Load(); int64(d) > old && !a.v.CompareAndSwap(old, int64(d)); old = a.v.Load() {
	}
}

// attackPolicy is the policy: burst 10, then 20 per second, per
// X-Api-Key.
func attackPolicy() map[string]any {
	return map[string]any{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "20/1s", "burst": 10}
}

// metricValue sums a metric's samples whose labels include want.
func metricValue(t *testing.T, in *instance, name string, want map[string]string) float64 {
	t.Helper()
	mfs, _ := scrape(t, in)
	return metricSum(mfs, name, want)
}

// metricSum sums, of scraped metrics, a metric's samples whose labels
// include want.
func metricSum(mfs map[string]*dto.MetricFamily, name string, want map[string]string) float64 {
	mf := mfs[name]
	if mf == nil {
		return 0
	}
	sum := 0.0
	for _, m := range mf.Metric {
		ok := true
		for k, v := range want {
			found := false
			for _, l := range m.Label {
				if l.GetName() == k && l.GetValue() == v {
					found = true
				}
			}
			ok = ok && found
		}
		if !ok {
			continue
		}
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		}
	}
	return sum
}

// storeErrorKinds reads caddy_rate_limit_store_errors_total by kind.
func storeErrorKinds(t *testing.T, in *instance) map[string]float64 {
	t.Helper()
	mfs, _ := scrape(t, in)
	out := map[string]float64{}
	if mf := mfs["caddy_rate_limit_store_errors_total"]; mf != nil {
		for _, m := range mf.Metric {
			for _, l := range m.Label {
				if l.GetName() == "kind" && m.GetCounter().GetValue() > 0 {
					out[l.GetValue()] = m.GetCounter().GetValue()
				}
			}
		}
	}
	return out
}

// logMentions reports whether the instance's log contains s.
func logMentions(t *testing.T, in *instance, s string) bool {
	t.Helper()
	raw, err := os.ReadFile(in.Log)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Contains(string(raw), s)
}

// redisPaths runs a subtest with Redis on loopback, the same with every
// core kept busy by other work, with Redis behind a proxy that adds 10 ms
// each way (a 20 ms round trip), and both.
func redisPaths(t *testing.T, test func(t *testing.T, srv *testredis.Server, addr string)) {
	t.Run("direct", func(t *testing.T) {
		srv := testredis.Start(t)
		test(t, srv, srv.Addr)
	})
	t.Run("busy-cores", func(t *testing.T) {
		srv := testredis.Start(t)
		stop := burnCores(t)
		t.Cleanup(stop)
		test(t, srv, srv.Addr)
	})
	t.Run("20ms-rtt", func(t *testing.T) {
		srv := testredis.Start(t)
		test(t, srv, testredis.StartProxy(t, srv.Addr, 10*time.Millisecond).Addr)
	})
	// Replies come in time while the gateway's cores are taken by others:
	// the timeout measures Redis, not the gateway (redis_socket.go).
	t.Run("20ms-rtt-busy-cores", func(t *testing.T) {
		srv := testredis.Start(t)
		addr := testredis.StartProxy(t, srv.Addr, 10*time.Millisecond).Addr
		stop := burnCores(t)
		t.Cleanup(stop)
		test(t, srv, addr)
	})
}

// burnCores keeps every core busy, as other processes on a shared machine
// do, with one busy-looping shell per core, until stop (which kills them by
// PID) is called.
func burnCores(t *testing.T) (stop func()) {
	t.Helper()
	var procs []*exec.Cmd
	for range runtime.NumCPU() {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		if err := cmd.Start(); err != nil {
			t.Fatalf("starting a busy loop: %v", err)
		}
		procs = append(procs, cmd)
	}
	var once sync.Once
	return func() {
		once.Do(func() {
			for _, p := range procs {
				_ = p.Process.Kill()
				_ = p.Wait()
			}
		})
	}
}

// TestFloodOneKey: 1,024 connections on one API key, with the defaults
// (timeout 100ms, fail_open), admit the key's budget ±2 and nothing
// through a failure mode; the breaker never opens.
func TestFloodOneKey(t *testing.T) {
	redisPaths(t, func(t *testing.T, srv *testredis.Server, addr string) {
		in := startCaddy(t, limiter(addr, nil, attackPolicy()), echo())
		get(t, in.URL, "X-Api-Key", "warm-up") // the connection pool is open
		f := flood(t, []*instance{in}, 1024, 3*time.Second, func(int, int) string { return "attacker" })
		// The bucket refills from its first decision, which came before the
		// first answer (and after the start), until the last decision:
		// requests sent within lastSent can be admitted; a denial's answer
		// may come later (see internal/pace). The last admission was decided
		// before its answer arrived: on a loaded machine, after lastSent.
		budget, most := 10+20*(f.lastSent-f.firstAnswer).Seconds(), 10+20*f.lastAdmitted.Seconds()
		got := f.admitted["attacker"]
		t.Logf("1,024 connections, one key, %v: %d requests (%d transport errors), first answer after %v, admitted %d of a budget of %.1f (%.1f by the last admission's answer, %v); decisions %v; store errors %v",
			f.elapsed.Round(time.Millisecond), f.sent, f.errors, f.firstAnswer.Round(time.Millisecond), got, budget, most, f.lastAdmitted.Round(time.Millisecond), f.decisions, storeErrorKinds(t, in))
		if n := f.failures(); n != 0 {
			t.Errorf("%d responses from a failure mode while Redis answered: %v", n, f.decisions)
		}
		if float64(got) > most+2 {
			t.Errorf("admitted %d, want from %.1f - 2 to %.1f + 2", got, budget, most)
		}
		if logMentions(t, in, "circuit open") {
			t.Errorf("the circuit breaker opened")
		}
		requireOver(t, "the flood", f.sent, most, 2)
		if float64(got) < budget-2 {
			t.Errorf("admitted %d, want from %.1f - 2 to %.1f + 2", got, budget, most)
		}
	})
}

// TestFloodManyKeys: 1,024 connections over 5,000 keys of burst 1 admit
// each key at most its budget, and nothing through a failure mode.
func TestFloodManyKeys(t *testing.T) {
	redisPaths(t, func(t *testing.T, srv *testredis.Server, addr string) {
		policy := map[string]any{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "1/1m", "burst": 1}
		in := startCaddy(t, limiter(addr, nil, policy), echo())
		get(t, in.URL, "X-Api-Key", "warm-up")
		f := flood(t, []*instance{in}, 1024, 3*time.Second, func(c, i int) string { return "k" + strconv.Itoa((c*7919+i*104729)%5000) })
		budget := 1 + f.lastAdmitted.Seconds()/60 // decided before its answer came
		over, total := 0, 0
		for _, n := range f.admitted {
			total += n
			if float64(n) > budget+2 {
				over++
			}
		}
		t.Logf("1,024 connections, 5,000 keys of burst 1, %v: %d requests (%d transport errors), admitted %d over %d keys (budget %.2f each, %.0f in all); decisions %v; store errors %v",
			f.elapsed.Round(time.Millisecond), f.sent, f.errors, total, len(f.admitted), budget, budget*5000, f.decisions, storeErrorKinds(t, in))
		if n := f.failures(); n != 0 {
			t.Errorf("%d responses from a failure mode while Redis answered: %v", n, f.decisions)
		}
		if over != 0 || float64(total) > budget*5000+2 {
			t.Errorf("%d keys admitted beyond their budget; %d admitted in all", over, total)
		}
		if logMentions(t, in, "circuit open") {
			t.Errorf("the circuit breaker opened")
		}
	})
}

// TestDistantRedis: a Redis 20 ms away, 64 connections, fail_closed and a
// policy that never denies: every request is admitted by a decision, none
// answered 503.
func TestDistantRedis(t *testing.T) {
	srv := testredis.Start(t)
	proxy := testredis.StartProxy(t, srv.Addr, 10*time.Millisecond)
	in := startCaddy(t, limiter(proxy.Addr, map[string]any{"on_error": "fail_closed"},
		map[string]any{"name": "roomy", "key": "{http.request.header.X-Api-Key}", "rate": "100000/1s"}), echo())
	f := flood(t, []*instance{in}, 64, 4*time.Second, func(c, _ int) string { return "client-" + strconv.Itoa(c) })
	t.Logf("20 ms round trip, 64 connections, %v: %d requests (%d transport errors); decisions %v",
		f.elapsed.Round(time.Millisecond), f.sent, f.errors, f.decisions)
	if f.failures() != 0 || f.decisions["allowed"] == 0 {
		t.Errorf("decisions %v: want only allowed", f.decisions)
	}
}

// TestClientKillUnderLoad: one CLIENT KILL under 64 connections costs at
// most the requests of the calls it cut (at most 64, one per connection),
// and the breaker stays closed.
func TestClientKillUnderLoad(t *testing.T) {
	for _, mode := range []string{"fail_closed", "fail_open"} {
		t.Run(mode, func(t *testing.T) {
			srv := testredis.Start(t)
			in := startCaddy(t, limiter(srv.Addr, map[string]any{"on_error": mode},
				map[string]any{"name": "roomy", "key": "{http.request.header.X-Api-Key}", "rate": "100000/1s"}), echo())
			killed := make(chan string, 1)
			go func() {
				time.Sleep(1500 * time.Millisecond)
				n, err := srv.Do("CLIENT", "KILL", "TYPE", "normal")
				if err != nil {
					t.Errorf("CLIENT KILL: %v", err)
				}
				killed <- n
			}()
			f := flood(t, []*instance{in}, 64, 3*time.Second, func(c, _ int) string { return "client-" + strconv.Itoa(c) })
			n := <-killed
			t.Logf("%s, CLIENT KILL (%s connections cut) under 64 connections, %v: %d requests; decisions %v", mode, n, f.elapsed.Round(time.Millisecond), f.sent, f.decisions)
			if n == "" || n == "0" {
				t.Errorf("CLIENT KILL cut no connection of the limiter's")
			}
			if lost := f.failures(); lost > 64 {
				t.Errorf("%d requests followed %s after one CLIENT KILL, want at most 64 (the calls in flight)", lost, mode)
			}
			if logMentions(t, in, "circuit open") {
				t.Errorf("the circuit breaker opened")
			}
		})
	}
}

// TestWrongTypeKey: one customer's bucket key holds a hash (an operator's
// HSET); that customer's requests follow on_error, every other customer's
// are decided, and the breaker stays closed.
func TestWrongTypeKey(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddy(t, limiter(srv.Addr, nil, attackPolicy()), echo())
	if _, err := srv.Do("HSET", plainKey("per_key", "customer-0"), "debug", "1"); err != nil {
		t.Fatal(err)
	}
	f := flood(t, []*instance{in}, 64, 3*time.Second, func(c, i int) string { return "customer-" + strconv.Itoa((c*131+i*7)%10000) })
	bad := floodKey(t, in, "customer-0", 20)
	t.Logf("64 connections over 10,000 customers, %v: %d requests; decisions %v; customer-0: %v", f.elapsed.Round(time.Millisecond), f.sent, f.decisions, bad)
	// customer-0 is one of them: its requests are the only failures.
	if n := f.failures(); n > f.sent/10000*3+20 {
		t.Errorf("%d failure-mode responses, more than customer-0's share", n)
	}
	if bad["fail_open"] != 20 {
		t.Errorf("customer-0 (a hash under its key): %v, want 20 fail_open", bad)
	}
	if others := floodKey(t, in, "customer-1", 5); others["allowed"] != 5 {
		t.Errorf("customer-1: %v, want 5 allowed", others)
	}
	if kind := metricValue(t, in, "caddy_rate_limit_store_errors_total", map[string]string{"kind": "wrongtype"}); kind == 0 {
		t.Errorf("store_errors_total{kind=wrongtype} is 0")
	}
	if logMentions(t, in, "circuit open") {
		t.Errorf("the circuit breaker opened")
	}
	if !logMentions(t, in, "WRONGTYPE") {
		t.Errorf("the log does not name WRONGTYPE")
	}
}

// floodKey sends n requests for one key, one at a time, and counts their
// decisions.
func floodKey(t *testing.T, in *instance, key string, n int) map[string]int {
	t.Helper()
	out := map[string]int{}
	for range n {
		r := get(t, in.URL, "X-Api-Key", key)
		out[decisionOf(r.status, r.body)]++
	}
	return out
}

// TestReloadRaisesLimit: a client drained at rate 1/1m burst 3 is admitted
// on its first request after a reload to 100/1h burst 100; a reload back
// to 1/1m burst 3 applies at once. The raised limit refills a token every
// 36 s, so the 7 tokens it owes are still owed after the reload back,
// however slow the machine (at 100/1s they were gone after 40 ms: a slow
// reload found a full bucket).
func TestReloadRaisesLimit(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		slow := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1/1m", "burst": 3}
		fast := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "100/1h", "burst": 100}
		in := startCaddy(t, limiter(redisAddr, nil, slow), echo())
		for i := range 4 {
			r := get(t, in.URL, "X-User", "frank")
			if want := []int{200, 200, 200, 429}[i]; r.status != want {
				t.Fatalf("request %d at 1/1m burst 3: %d, want %d", i+1, r.status, want)
			}
		}
		in.reload(t, limiter(redisAddr, nil, fast), echo())
		r := get(t, in.URL, "X-User", "frank")
		lim := parseFields(t, r.header, "RateLimit")
		t.Logf("after the reload to 100/1h burst 100: %d, RateLimit %+v, Retry-After %q", r.status, lim, r.header.Get("Retry-After"))
		if r.status != 200 || len(lim) != 1 || lim[0].params["r"] < 90 {
			t.Fatalf("after raising the limit: %d %+v, want 200 with about 96 tokens left", r.status, lim)
		}
		for range 3 {
			get(t, in.URL, "X-User", "frank")
		}
		in.reload(t, limiter(redisAddr, nil, slow), echo())
		r = get(t, in.URL, "X-User", "frank")
		if r.status != 429 {
			t.Fatalf("after lowering the limit again: %d, want 429 (7 tokens used of a burst of 3)", r.status)
		}
		lim = parseFields(t, r.header, "RateLimit")
		t.Logf("after lowering it again: %d, RateLimit %+v, Retry-After %s", r.status, lim, r.header.Get("Retry-After"))
		if tt := lim[0].params["t"]; tt > 60 || r.retryAfter(t) < tt {
			t.Fatalf("t=%d, Retry-After %d: a drained bucket of 1/1m burst 3 refills a token within 60 s, and Retry-After is never earlier", tt, r.retryAfter(t))
		}
	})
}

// TestRetryHerd: 200 clients on one key over 4 instances (burst 10 and 20/s)
// that honour Retry-After exactly, as go-retryablehttp does, all starting
// at once. The values they are sent spread them, so that the fleet gets at
// least 0.8 of its budget, never more, and no 100 ms window receives more
// than a quarter of a second's retries.
func TestRetryHerd(t *testing.T) {
	t.Run("default", func(t *testing.T) {
		if retries, _ := retryHerd(t, nil); retries < 40*6 {
			t.Errorf("%d retries: too few to judge the spread", retries)
		}
	})
	// Told how many instances share the budget, they pace the fleet's
	// returns at the rate the bucket refills (20/s).
	t.Run("instances 4", func(t *testing.T) {
		_, perSecond := retryHerd(t, map[string]any{"instances": 4})
		for s, n := range perSecond {
			if n > 20*5/4 {
				t.Errorf("second %d: %d retries, want about 20 (the refill rate)", s+1, n)
			}
		}
	})
}

// retryHerd runs the herd against 4 instances with the handler settings
// extra, checks the budget and, without extra, the spread, and returns the
// retries and the retries of each whole second after the first.
func retryHerd(t *testing.T, extra map[string]any) (retries int, retriesPerSecond []int) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, extra, attackPolicy()), echo()))
	}
	for _, in := range fleet {
		get(t, in.URL, "X-Api-Key", "warm-up")
	}
	const clients = 200
	const run = 8 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), run)
	defer cancel()
	var mu sync.Mutex
	var sentAt []time.Duration // when each request after a 429 was sent
	admitted, denied, other := 0, 0, 0
	var wg sync.WaitGroup
	start := time.Now()
	for c := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1}}
			url := fleet[c%len(fleet)].URL + "/"
			retry := false
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
				req.Header.Set("X-Api-Key", "shared")
				at := time.Since(start)
				resp, err := client.Do(req)
				if err != nil {
					return // the run is over
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				mu.Lock()
				if retry {
					sentAt = append(sentAt, at)
				}
				switch resp.StatusCode {
				case 200:
					admitted++
				case 429:
					denied++
				default:
					other++
				}
				mu.Unlock()
				retry = resp.StatusCode == 429
				if !retry {
					continue
				}
				ra, err := strconv.Atoi(resp.Header.Get("Retry-After"))
				if err != nil {
					t.Errorf("429 without a Retry-After in seconds: %q", resp.Header.Get("Retry-After"))
					return
				}
				select {
				case <-ctx.Done():
				case <-time.After(time.Duration(ra) * time.Second):
				}
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	budget := 10 + 20*elapsed.Seconds()
	// The busiest 100 ms window of each whole second after the first, as a
	// share of that second's retries; not the last second, whose retries'
	// responses may come after the run ended (a denial may be answered up
	// to a second after it is made, see internal/pace), unrecorded.
	busiest, busiestAt := 0.0, 0
	var perSecond []string
	for s := 1; s < int(elapsed/time.Second)-1; s++ {
		var windows [10]int
		total := 0
		for _, at := range sentAt {
			if at >= time.Duration(s)*time.Second && at < time.Duration(s+1)*time.Second {
				windows[(at-time.Duration(s)*time.Second)/(100*time.Millisecond)]++
				total++
			}
		}
		for _, n := range windows {
			if total > 0 && float64(n)/float64(total) > busiest {
				busiest, busiestAt = float64(n)/float64(total), s
			}
		}
		perSecond = append(perSecond, fmt.Sprint(windows))
		retriesPerSecond = append(retriesPerSecond, total)
	}
	t.Logf("retries per 100 ms window, second by second from 1 s: %s", strings.Join(perSecond, " "))
	utilization := float64(admitted) / budget
	t.Logf("200 clients honouring Retry-After, 4 instances, %v: admitted %d of a budget of %.1f (%.2f), %d denied, %d other, %d retries; busiest 100 ms window: %.0f%% of second %d's retries",
		elapsed.Round(time.Millisecond), admitted, budget, utilization, denied, other, len(sentAt), 100*busiest, busiestAt)
	if utilization < 0.8 || float64(admitted) > budget+2 {
		t.Errorf("admitted %d of %.1f: want at least 0.8 of the budget and never more", admitted, budget)
	}
	if busiest > 0.25 && extra == nil {
		t.Errorf("a 100 ms window got %.0f%% of a second's retries, want at most 25%%", 100*busiest)
	}
	if other != 0 {
		t.Errorf("%d responses neither 200 nor 429", other)
	}
	return len(sentAt), retriesPerSecond
}
