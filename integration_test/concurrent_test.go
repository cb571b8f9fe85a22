package integration_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Concurrency limits through real Caddy processes and a real Redis, with
// an upstream that counts the requests in flight per key and holds each
// for X-Hold milliseconds (or until the client goes away).

type holdingUpstream struct {
	addr     string
	mu       sync.Mutex
	inFlight map[string]int
	most     map[string]int
	spans    []span // of every request, in order of ending
}

type span struct {
	key        string
	start, end time.Time
}

func startHoldingUpstream(t *testing.T) *holdingUpstream {
	t.Helper()
	u := &holdingUpstream{inFlight: map[string]int{}, most: map[string]int{}}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key := r.Header.Get("X-User")
		hold, _ := strconv.Atoi(r.Header.Get("X-Hold"))
		u.mu.Lock()
		u.inFlight[key]++
		u.most[key] = max(u.most[key], u.inFlight[key])
		u.mu.Unlock()
		start := time.Now()
		select {
		case <-time.After(time.Duration(hold) * time.Millisecond):
		case <-r.Context().Done():
		}
		end := time.Now()
		u.mu.Lock()
		u.inFlight[key]--
		u.spans = append(u.spans, span{key, start, end})
		u.mu.Unlock()
		_, _ = io.WriteString(w, "done")
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return u
}

func (u *holdingUpstream) now(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.inFlight[key]
}

func (u *holdingUpstream) mostAtOnce(key string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.most[key]
}

// send makes one request for key, held hold by the upstream.
func send(ctx context.Context, in *instance, key string, hold time.Duration) (int, error) {
	req, _ := http.NewRequestWithContext(ctx, "GET", in.URL+"/", nil)
	req.Header.Set("X-User", key)
	req.Header.Set("X-Hold", strconv.Itoa(int(hold/time.Millisecond)))
	client := &http.Client{Transport: &http.Transport{DisableKeepAlives: false}}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	_, _ = io.Copy(io.Discard, resp.Body)
	return resp.StatusCode, nil
}

func slotsPolicy(n int, extra ...any) map[string]any {
	p := map[string]any{"name": "exports", "key": "{http.request.header.X-User}", "concurrent": n}
	for i := 0; i+1 < len(extra); i += 2 {
		p[extra[i].(string)] = extra[i+1]
	}
	return p
}

// TestConcurrentFleet: 4 instances, 12 clients on one key, concurrent 3
// with wait: the upstream never sees more than 3 at once, and sees 3 at
// once most of the time: the limit is used, not just respected.
//
// The clients stop sending at the end and let what they sent finish: a
// client cancelled mid-request frees its slot as soon as Caddy sees it go,
// while the upstream goes on counting that request until it notices the
// connection closed, 20 to 30 ms later on a busy machine, long enough for a
// waiter to take the slot and reach it (4 at the upstream, 3 leases in
// Redis: what this test once saw). Redis decides every request here
// (fail_closed, a timeout no load reaches), so that a failure mode cannot
// admit past the slots either; the share of time at 3 is measured from the
// upstream's own spans, with requests long enough (500 ms) that a hand-off,
// a few ms here and up to 100 ms or more when both cores are loaded, is a
// small part of each.
func TestConcurrentFleet(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, slotsPolicy(3, "wait", "10s")), proxyTo(up.addr)))
	}
	const hold = 500 * time.Millisecond
	begin := time.Now()
	stop := begin.Add(4 * time.Second)
	var wg sync.WaitGroup
	var served, denied, failed atomic.Int64
	for c := range 12 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for time.Now().Before(stop) {
				status, err := send(context.Background(), fleet[c%4], "shared", hold)
				switch {
				case err != nil:
					failed.Add(1)
				case status == 200:
					served.Add(1)
				default:
					denied.Add(1)
				}
			}
		}()
	}
	wg.Wait()
	// From a second in (the slots fill) to the last request sent.
	at3 := up.timeAt("shared", 3, begin.Add(time.Second), stop)
	share := at3.Seconds() / stop.Sub(begin.Add(time.Second)).Seconds()
	handOff := up.handOffs("shared")
	t.Logf("12 clients, 4 instances, concurrent 3: most at once %d; 3 in flight %.0f%% of the time; %d served, %d denied, %d failed; hand-off median %s, max %s",
		up.mostAtOnce("shared"), 100*share, served.Load(), denied.Load(), failed.Load(), handOff[len(handOff)/2].Round(time.Millisecond), handOff[len(handOff)-1].Round(time.Millisecond))
	if up.mostAtOnce("shared") > 3 {
		t.Errorf("the upstream saw %d at once, want at most 3", up.mostAtOnce("shared"))
	}
	if denied.Load() > 0 || failed.Load() > 0 {
		t.Errorf("%d denied and %d failed, want none: every client waits for its slot", denied.Load(), failed.Load())
	}
	if share < 0.6 {
		t.Errorf("3 in flight only %.0f%% of the time: the slots are not used", 100*share)
	}
}

// handOffs are, sorted, the times from each request's end to the start of
// the next request of key that started after it.
func (u *holdingUpstream) handOffs(key string) []time.Duration {
	u.mu.Lock()
	var starts, ends []time.Time
	for _, sp := range u.spans {
		if sp.key == key {
			starts, ends = append(starts, sp.start), append(ends, sp.end)
		}
	}
	u.mu.Unlock()
	slices.SortFunc(starts, time.Time.Compare)
	gaps := []time.Duration{0}
	for _, e := range ends {
		if i, _ := slices.BinarySearchFunc(starts, e, time.Time.Compare); i < len(starts) {
			gaps = append(gaps, starts[i].Sub(e))
		}
	}
	slices.Sort(gaps)
	return gaps
}

// timeAt is how long, between from and to, the upstream had exactly n
// requests of key in flight, from the spans of the requests that ended.
func (u *holdingUpstream) timeAt(key string, n int, from, to time.Time) time.Duration {
	u.mu.Lock()
	type edge struct {
		at    time.Time
		delta int
	}
	var edges []edge
	for _, sp := range u.spans {
		if sp.key == key {
			edges = append(edges, edge{sp.start, 1}, edge{sp.end, -1})
		}
	}
	u.mu.Unlock()
	slices.SortFunc(edges, func(a, b edge) int { return a.at.Compare(b.at) })
	var total time.Duration
	inFlight, last := 0, from
	for _, e := range edges {
		if e.at.After(from) {
			end := e.at
			if end.After(to) {
				end = to
			}
			if inFlight == n && end.After(last) {
				total += end.Sub(last)
			}
			if end.After(last) {
				last = end
			}
		}
		inFlight += e.delta
	}
	if inFlight == n && to.After(last) {
		total += to.Sub(last)
	}
	return total
}

// TestConcurrentLongRequest: a request that runs 3× its lease keeps its
// slot (its lease is renewed): no other gets in meanwhile.
func TestConcurrentLongRequest(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, slotsPolicy(1, "lease", "1s")), proxyTo(up.addr))
	done := make(chan int)
	go func() {
		status, _ := send(context.Background(), in, "long", 3500*time.Millisecond)
		done <- status
	}()
	for up.now("long") == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	tries, admitted := probeWhileRunning(in, up, "long")
	if status := <-done; status != 200 {
		t.Fatalf("the long request: %d", status)
	}
	t.Logf("a request of 3.5 s with a lease of 1 s: %d of %d other requests got in meanwhile", admitted, tries)
	if admitted != 0 || tries < 25 || up.mostAtOnce("long") != 1 {
		t.Fatalf("%d of %d got in while the long request ran (most at once %d), want none", admitted, tries, up.mostAtOnce("long"))
	}
	if status, _ := send(context.Background(), in, "long", 0); status != 200 {
		t.Fatalf("after it ended: %d", status)
	}
}

// probeWhileRunning sends a request for key every 100 ms while one request
// of key runs at the upstream, and counts those answered while it still
// runs there, and those of them admitted. A probe answered after it left
// is not counted: its slot may have been freed before the probe was
// decided (beside two CPU hogs, the last probe once was).
func probeWhileRunning(in *instance, up *holdingUpstream, key string) (tries, admitted int) {
	for up.now(key) == 1 {
		status, _ := send(context.Background(), in, key, 0)
		// The upstream counts a request out before it answers it: 1 is the
		// long request still there.
		if up.now(key) != 1 {
			break
		}
		if status == 200 {
			admitted++
		}
		tries++
		time.Sleep(100 * time.Millisecond)
	}
	return tries, admitted
}

// TestConcurrentInstanceKilled: SIGKILL an instance holding slots: they
// come back within the lease (plus the margin stated below), and the
// instance that reclaims them counts them in leases_expired_total.
func TestConcurrentInstanceKilled(t *testing.T) {
	const lease = 2 * time.Second
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	// 1s: a call timed out on a loaded machine would follow fail_open and
	// let the survivor in while both slots are held.
	doomed := startCaddy(t, redisLimiter(srv.Addr, "1s", nil, slotsPolicy(2, "lease", "2s")), proxyTo(up.addr))
	survivor := startCaddy(t, redisLimiter(srv.Addr, "1s", map[string]any{"jitter": 0}, slotsPolicy(2, "lease", "2s")), proxyTo(up.addr))
	for range 2 {
		go func() { _, _ = send(context.Background(), doomed, "held", time.Minute) }()
	}
	for up.now("held") < 2 {
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(700 * time.Millisecond) // its leases were renewed at least once
	if status, _ := send(context.Background(), survivor, "held", 0); status != 429 {
		t.Fatalf("with both slots held: %d, want 429", status)
	}
	if err := syscall.Kill(doomed.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	var back time.Duration
	for time.Since(killed) < 3*lease {
		if status, _ := send(context.Background(), survivor, "held", 0); status == 200 {
			back = time.Since(killed)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	// The two leases were renewed apart (each renewal is sent when due):
	// the first slot may come back before the second lease has run out. A
	// request reclaims the leases that ran out when it finds them.
	expired := metricValue(t, survivor, "caddy_rate_limit_leases_expired_total", map[string]string{"policy": "exports"})
	for expired < 2 && time.Since(killed) < lease+time.Second {
		time.Sleep(50 * time.Millisecond)
		_, _ = send(context.Background(), survivor, "held", 0)
		expired = metricValue(t, survivor, "caddy_rate_limit_leases_expired_total", map[string]string{"policy": "exports"})
	}
	t.Logf("slots of a SIGKILLed instance back after %v (lease %v); leases_expired_total %v %v after the kill", back.Round(time.Millisecond), lease, expired, time.Since(killed).Round(time.Millisecond))
	// The margin: the killed instance may have renewed just before it died
	// (a lease is renewed when a third of it is left... or more), plus the
	// poll of this loop.
	if back == 0 || back > lease+250*time.Millisecond {
		t.Fatalf("the slots came back after %v, want within the lease of %v (+250 ms)", back, lease)
	}
	if expired != 2 {
		t.Fatalf("leases_expired_total %v within the lease (+1 s) of the kill, want 2", expired)
	}
}

// TestConcurrentDisconnect: a client that goes away while holding a slot
// frees it at once; one that goes away while waiting leaves the queue, so
// the slot it waited for goes to the next waiter.
func TestConcurrentDisconnect(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, slotsPolicy(1, "wait", "10s")), proxyTo(up.addr))

	ctx, cancel := context.WithCancel(context.Background())
	go func() { _, _ = send(ctx, in, "gone", time.Minute) }()
	for up.now("gone") == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	start := time.Now()
	status, _ := send(context.Background(), in, "gone", 0)
	t.Logf("holder gone: the next request admitted after %v", time.Since(start).Round(time.Millisecond))
	if status != 200 || time.Since(start) > 500*time.Millisecond {
		t.Fatalf("after the holder went away: %d after %v, want 200 at once", status, time.Since(start))
	}

	// A holder, a waiter that goes away, and a waiter that stays.
	hold := make(chan int)
	go func() { s, _ := send(context.Background(), in, "queue", 500*time.Millisecond); hold <- s }()
	for up.now("queue") == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	wctx, wcancel := context.WithCancel(context.Background())
	go func() { _, _ = send(wctx, in, "queue", 0) }()
	// The waiter is in the queue before it goes away.
	for deadline := time.Now().Add(2 * time.Second); metricValue(t, in, "caddy_rate_limit_waiting", map[string]string{"policy": "exports"}) < 1; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the waiter was not waiting within 2s")
		}
	}
	wcancel()
	stay := make(chan time.Time)
	go func() {
		if s, _ := send(context.Background(), in, "queue", 0); s == 200 {
			stay <- time.Now()
		}
		close(stay)
	}()
	<-hold
	released := time.Now()
	got, ok := <-stay
	if !ok {
		t.Fatal("the waiter that stayed was denied")
	}
	t.Logf("a waiter gone, the one that stayed admitted %v after the release", got.Sub(released).Round(time.Millisecond))
	if got.Sub(released) > 200*time.Millisecond {
		t.Fatalf("the waiter that stayed got the slot %v after it was freed", got.Sub(released))
	}
	// Every request has its response: every slot is free.
	if v := metricValue(t, in, "caddy_rate_limit_in_flight", map[string]string{"policy": "exports"}); v != 0 {
		t.Fatalf("caddy_rate_limit_in_flight %v after every request ended", v)
	}
}

// TestConcurrentHandOff: concurrent 1 with wait over 2 instances, requests
// queued on both: each takes the slot as soon as the one before frees it.
// The time from a request leaving the upstream to the next reaching it is
// quoted as the hand-off latency.
func TestConcurrentHandOff(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, nil, slotsPolicy(1, "wait", "10s")), proxyTo(up.addr)))
	}
	var wg sync.WaitGroup
	for c := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 10 {
				if status, err := send(context.Background(), fleet[c%2], "one", 20*time.Millisecond); err != nil || status != 200 {
					t.Errorf("%d %v, want every request admitted in turn", status, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	up.mu.Lock()
	spans := append([]span(nil), up.spans...)
	up.mu.Unlock()
	slices.SortFunc(spans, func(a, b span) int { return a.start.Compare(b.start) })
	var gaps []time.Duration
	for i := 1; i < len(spans); i++ {
		if spans[i].start.Before(spans[i-1].end) {
			t.Fatalf("two requests in the upstream at once with concurrent 1")
		}
		gaps = append(gaps, spans[i].start.Sub(spans[i-1].end))
	}
	slices.Sort(gaps)
	median := gaps[len(gaps)/2]
	t.Logf("40 requests in turn over 2 instances: hand-off median %v, p90 %v, max %v", median.Round(100*time.Microsecond),
		gaps[len(gaps)*9/10].Round(100*time.Microsecond), gaps[len(gaps)-1].Round(100*time.Microsecond))
	if median > 50*time.Millisecond {
		t.Fatalf("hand-off median %v, want under 50 ms", median)
	}
}

// TestConcurrentWithRate: a concurrent policy and a rate policy on one
// request decide together: denied by the rate policy, it takes no slot;
// denied a slot, it charges no rate.
func TestConcurrentWithRate(t *testing.T) {
	srv := testredis.Start(t)
	up := startHoldingUpstream(t)
	rate := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "2/1h"}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, slotsPolicy(1), rate), proxyTo(up.addr))
	inUse := func() int64 { return slotsInUse(t, in, "exports", "pat") }
	// The slot taken by a long request: another is denied a slot, and the
	// rate bucket is not charged for it.
	go func() { _, _ = send(context.Background(), in, "pat", 800*time.Millisecond) }()
	for up.now("pat") == 0 {
		time.Sleep(5 * time.Millisecond)
	}
	if status, _ := send(context.Background(), in, "pat", 0); status != 429 {
		t.Fatalf("slot taken: %d, want 429", status)
	}
	if b := inspect(t, in, "per_user", "pat"); b.Tokens != 1 {
		t.Fatalf("denied a slot, the rate bucket has %d tokens, want 1 (charged once, by the long request)", b.Tokens)
	}
	// The long request ends: its slot is freed once its handler returns.
	for deadline := time.Now().Add(2 * time.Second); inUse() != 0; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the long request's slot was not freed within 2s of it ending")
		}
	}
	if status, _ := send(context.Background(), in, "pat", 0); status != 200 {
		t.Fatalf("second: %d", status)
	}
	// The rate bucket is empty: a request it denies takes no slot.
	if status, _ := send(context.Background(), in, "pat", 0); status != 429 {
		t.Fatalf("rate spent: %d, want 429", status)
	}
	if n := inUse(); n != 0 {
		t.Fatalf("%d slots in use after a request the rate policy denied", n)
	}
}
