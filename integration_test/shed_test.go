package integration_test

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Load shedding through real Caddy: an upstream that serves at most c
// requests at once at a fixed service time (the others wait in its queue),
// driven open-loop by three priority classes.

// queueUpstream serves at most c requests at once, each for its service
// time; the others wait in its queue, in arrival order, until served or
// their client goes away.
type queueUpstream struct {
	addr    string
	slots   chan struct{}
	service atomic.Int64 // ns
	served  atomic.Int64
}

func startQueueUpstream(t *testing.T, c int, service time.Duration) *queueUpstream {
	t.Helper()
	u := &queueUpstream{slots: make(chan struct{}, c)}
	u.service.Store(int64(service))
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case u.slots <- struct{}{}:
		case <-r.Context().Done():
			return
		}
		defer func() { <-u.slots }()
		timer := time.NewTimer(time.Duration(u.service.Load()))
		defer timer.Stop()
		select {
		case <-timer.C:
		case <-r.Context().Done():
			return
		}
		u.served.Add(1)
		_, _ = io.WriteString(w, "served")
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return u
}

// shedShot is one request of the load: its class, when it was sent, how long
// it took and how it ended.
type shedShot struct {
	class   int
	sent    time.Time
	latency time.Duration
	status  int // 0: no response (the client's timeout)
}

var shedClassNames = []string{"critical", "default", "batch"}

// loadClient is the HTTP client of the load: enough connections for every
// request in flight, each bounded by the client's timeout.
func loadClient(timeout time.Duration) *http.Client {
	return &http.Client{Timeout: timeout, Transport: &http.Transport{MaxIdleConnsPerHost: 4096, IdleConnTimeout: time.Minute}}
}

// drive sends requests to url open-loop, Poisson at rate per second for d,
// each of a class drawn from mix (highest first) and named in X-Priority,
// and returns every request once all have ended. Arrivals follow a
// schedule fixed in advance: a late sender catches up, so a busy machine
// does not lower the load.
func driveClasses(client *http.Client, url string, rate float64, d time.Duration, mix []float64, seed uint64, header ...string) []shedShot {
	rng := rand.New(rand.NewPCG(seed, 7))
	var mu sync.Mutex
	var shots []shedShot
	var wg sync.WaitGroup
	start := time.Now()
	next := time.Duration(0)
	for {
		next += time.Duration(rng.ExpFloat64() / rate * float64(time.Second))
		if next >= d {
			break
		}
		x, class := rng.Float64(), len(mix)-1
		for i, m := range mix {
			if x < m {
				class = i
				break
			}
			x -= m
		}
		if wait := time.Until(start.Add(next)); wait > 0 {
			time.Sleep(wait)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s := shedShot{class: class, sent: time.Now()}
			req, _ := http.NewRequest("GET", url, nil)
			req.Header.Set("X-Priority", shedClassNames[class])
			for k := 0; k+1 < len(header); k += 2 {
				req.Header.Set(header[k], header[k+1])
			}
			resp, err := client.Do(req)
			if err == nil {
				_, err = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				if err == nil {
					s.status = resp.StatusCode
				}
			}
			s.latency = time.Since(s.sent)
			mu.Lock()
			shots = append(shots, s)
			mu.Unlock()
		}()
	}
	wg.Wait()
	slices.SortFunc(shots, func(a, b shedShot) int { return a.sent.Compare(b.sent) })
	return shots
}

// classStats is what a user reads off a class's requests: the share that
// succeeded, the latency of those that did, the statuses of the others.
type classStats struct {
	offered, ok, shed, failed int
	p50, p90, p99             time.Duration
}

func (s classStats) success() float64 {
	if s.offered == 0 {
		return 1
	}
	return float64(s.ok) / float64(s.offered)
}

// stats sums up the requests sent in [from, to) by class.
func classStatsOf(shots []shedShot, from, to time.Time) []classStats {
	out := make([]classStats, len(shedClassNames))
	lat := make([][]time.Duration, len(shedClassNames))
	for _, s := range shots {
		if s.sent.Before(from) || !s.sent.Before(to) {
			continue
		}
		c := &out[s.class]
		c.offered++
		switch s.status {
		case 200:
			c.ok++
			lat[s.class] = append(lat[s.class], s.latency)
		case 503:
			c.shed++
		default:
			c.failed++
		}
	}
	for i := range out {
		slices.Sort(lat[i])
		out[i].p50, out[i].p90, out[i].p99 = durationQuantile(lat[i], 0.50), durationQuantile(lat[i], 0.90), durationQuantile(lat[i], 0.99)
	}
	return out
}

// quantile is the q-quantile of sorted (nearest rank).
func durationQuantile(sorted []time.Duration, q float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

// goodput is the requests answered 200 within [from, to), as a share of
// what c slots of service time S serve in that time.
func goodputOf(shots []shedShot, from, to time.Time, c int, service time.Duration) float64 {
	n := 0
	for _, s := range shots {
		if end := s.sent.Add(s.latency); s.status == 200 && !end.Before(from) && end.Before(to) {
			n++
		}
	}
	return float64(n) / (float64(c) * to.Sub(from).Seconds() / service.Seconds())
}

func statsTable(label string, st []classStats, good float64) string {
	var b strings.Builder
	for i, s := range st {
		fmt.Fprintf(&b, "%-9s %-8s offered %5d  success %6.2f%%  shed %5d  failed %4d  p50 %6v  p99 %6v\n", label, shedClassNames[i], s.offered,
			100*s.success(), s.shed, s.failed, s.p50.Round(time.Millisecond), s.p99.Round(time.Millisecond))
	}
	if good >= 0 {
		fmt.Fprintf(&b, "%-9s goodput %.1f%% of c\n", label, 100*good)
	}
	return b.String()
}

// limitPoint is a shed policy's adaptive limit, and the requests in flight
// under it, at one moment, as the admin API's inspect answers them.
type limitPoint struct {
	at            time.Duration // since the trace began
	limit, flight int64
}

// traceLimit reads the adaptive limit of policy on in every step until
// stop is closed, and returns what it read.
func traceLimit(in *instance, policy string, step time.Duration, stop chan struct{}) func() []limitPoint {
	var points []limitPoint
	done := make(chan struct{})
	begin := time.Now()
	go func() {
		defer close(done)
		tick := time.NewTicker(step)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
			}
			resp, err := http.Get(in.Admin + "/rate_limit/inspect?policy=" + policy)
			if err != nil {
				continue
			}
			var st struct {
				Limit  *int64 `json:"shed_limit"`
				Flight *int64 `json:"shed_in_flight"`
			}
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil && st.Limit != nil && st.Flight != nil {
				points = append(points, limitPoint{time.Since(begin), *st.Limit, *st.Flight})
			}
		}
	}()
	return func() []limitPoint { <-done; return points }
}

func traceString(points []limitPoint, every time.Duration) string {
	var b strings.Builder
	next := time.Duration(0)
	for _, p := range points {
		if p.at >= next {
			fmt.Fprintf(&b, "%.1fs:%d/%d ", p.at.Seconds(), p.flight, p.limit)
			next = p.at + every
		}
	}
	return b.String()
}

// shedPolicy is a shed policy named capacity, keyed global, whose classes
// critical, default and batch (X-Priority) have the shares given.
func shedPolicy(shed map[string]any, shares ...string) map[string]any {
	var classes []any
	for i, share := range shares {
		classes = append(classes, map[string]any{"name": shedClassNames[i], "share": share})
	}
	return map[string]any{"name": "capacity", "key": "global", "shed": shed,
		"priority": map[string]any{"from": "{http.request.header.X-Priority}", "classes": classes}}
}

// measuredShares are the shares of the measured tests. Critical is 10% of
// what is offered, so at 3 × the capacity its requests alone need 30% of
// what the upstream serves; the 30% of the limit above default's share
// holds them (with the design's 80%, its 20% does not quite: 1 to 6 of
// 150 critical requests were shed in 6 s).
var measuredShares = []string{"100%", "70%", "40%"}

// measuredLatency is the target of the measured tests: 1.5 × the unloaded
// median of 100 ms, as docs/load-shedding.md advises. The controller keeps
// the p90 of what it passes near it, and the critical p99 a little above
// (164 to 211 ms in nine runs). 130 ms gave 144 to 169 ms, but 2 to 5
// points of goodput less, which a busy machine took below 85%.
const measuredLatency = "150ms"

// TestShedOverload: an upstream of c = 10 slots at S = 100 ms (capacity
// 100 requests/s), driven at 3 × c/S by critical, default and batch
// requests (10%, 45%, 45%: a minority that must get through, the bulk of
// the product, background work), through Caddy without and with
// `shed { latency 150ms }` (measuredLatency) and measuredShares
// (critical 100%, default 70%, batch 40%).
//
// Asserted, with shedding, over the overload from its first second (the
// controller's reaction: it starts where calm traffic left it, about
// twice what the upstream serves): critical succeeds >= 99% with its p99
// within 2 × the unloaded latency; batch is shed most, then default, then
// critical, overall and in every second; the upstream's goodput is >= 85%
// of c. Without shedding, the classes are alike: all wait in the
// upstream's queue (critical's p99 above 2 × unloaded).
//
// The unloaded latency is measured alongside, on the same Caddy at the
// same time: a control stream of 50 requests/s to an upstream that never
// queues, routed around the policy. On this shared machine a stall of the
// processes (other tests, CPU hogs) delays a few requests of every stream
// by 50 to 150 ms, which no limiter can prevent: the bound is 2 × the
// control's median plus the control's own tail (its p99 less its median),
// which is 2 × the median when the machine is quiet. Both are quoted.
// When even the control is slow (machineBusy: the machine cannot give the
// upstream its fixed service time, and the adaptive limit rightly sheds
// for it), the run with shedding is not a measurement: it is made once
// more, on a fresh instance, and the test is skipped, saying why, if the
// machine is as busy again.
func TestShedOverload(t *testing.T) {
	const (
		c       = 10
		service = 100 * time.Millisecond
		timeout = 3 * time.Second
		span    = 8 * time.Second
	)
	capacity := float64(c) / service.Seconds()
	mix := []float64{0.10, 0.45, 0.45}
	up := startQueueUpstream(t, c, service)
	idle := startQueueUpstream(t, 1000, service) // the control's: never queues
	client := loadClient(timeout)
	run := func(in *instance, seed uint64) ([]shedShot, time.Time, time.Time) {
		begin := time.Now()
		shots := driveClasses(client, in.URL, 3*capacity, span, mix, seed)
		return shots, begin.Add(time.Second), begin.Add(span)
	}

	// Without shedding.
	plain := startCaddy(t, proxyTo(up.addr))
	without, wFrom, wTo := run(plain, 2)
	plain.Stop()
	noShed := classStatsOf(without, wFrom, wTo)

	// With shedding: half the capacity for 2 s (unloaded: nothing is shed
	// at that rate), then the overload, with the control stream beside it.
	var unloaded time.Duration
	var with []shedShot
	var from, to time.Time
	var control classStats
	for attempt := 1; ; attempt++ {
		shedding := startCaddy(t, map[string]any{"handler": "subroute", "routes": []any{
			map[string]any{"match": []any{map[string]any{"header": map[string]any{"X-Control": []string{"yes"}}}},
				"handle": []any{proxyTo(idle.addr)}, "terminal": true},
			map[string]any{"handle": []any{limiter("", nil, shedPolicy(map[string]any{"latency": measuredLatency}, measuredShares...)), proxyTo(up.addr)}},
		}})
		var served []time.Duration
		calm := driveClasses(client, shedding.URL, 0.5*capacity, 2*time.Second, mix, 1)
		for _, s := range calm {
			if s.status == 200 {
				served = append(served, s.latency)
			}
		}
		slices.Sort(served)
		unloaded = durationQuantile(served, 0.5)
		t.Logf("unloaded (0.5 × c/S): %d requests, p50 %v, p99 %v, %d not served (batch bursts past its 40%% of the limit)",
			len(calm), unloaded.Round(time.Millisecond), durationQuantile(served, 0.99).Round(time.Millisecond), len(calm)-len(served))
		stop := make(chan struct{})
		trace := traceLimit(shedding, "capacity", 50*time.Millisecond, stop)
		controlDone := make(chan []shedShot)
		go func() {
			controlDone <- driveClasses(client, shedding.URL, 0.5*capacity, span, []float64{1}, 9, "X-Control", "yes")
		}()
		with, from, to = run(shedding, 3)
		control = classStatsOf(<-controlDone, from, to)[0]
		close(stop)
		t.Logf("in flight/limit: %s", traceString(trace(), 250*time.Millisecond))
		shedding.Stop()
		busy := machineBusy(control, service)
		if busy == "" {
			break
		}
		if attempt == 2 {
			t.Skipf("not measured: %s, and as much the attempt before, so the upstream's service time is not the fixed %v this test needs", busy, service)
		}
		t.Logf("attempt %d not measured: %s; again", attempt, busy)
	}
	var slowest []string
	for _, s := range with {
		if s.class == 0 && s.status != 200 {
			t.Logf("critical %d at %v", s.status, s.sent.Sub(from.Add(-time.Second)))
		}
		if s.class == 0 && s.status == 200 && !s.sent.Before(from) && s.latency > 3*unloaded/2 {
			slowest = append(slowest, fmt.Sprintf("%.2fs:%v", s.sent.Sub(from.Add(-time.Second)).Seconds(), s.latency.Round(time.Millisecond)))
		}
	}
	t.Logf("critical requests from 1 s in slower than 1.5 × unloaded: %s", strings.Join(slowest, " "))
	bound := 2*control.p50 + max(0, control.p99-control.p50)
	t.Logf("control, unloaded at the same time: %d requests, %d not served, p50 %v, p99 %v: the critical p99 bound is %v",
		control.offered, control.offered-control.ok, control.p50.Round(time.Millisecond), control.p99.Round(time.Millisecond), bound.Round(time.Millisecond))
	shed := classStatsOf(with, from, to)
	whole := classStatsOf(with, from.Add(-time.Second), to)
	good := goodputOf(with, from, to, c, service)
	t.Logf("3 × c/S for %v (c = %d, S = %v, mix 10/45/45, client timeout %v), from 1 s in:\n%s%s"+
		"with shedding, the whole overload (its first second too):\n%s", span, c, service, timeout,
		statsTable("no-shed", noShed, goodputOf(without, wFrom, wTo, c, service)), statsTable("shed", shed, good),
		statsTable("shed-all", whole, goodputOf(with, from.Add(-time.Second), to, c, service)))

	crit, def, batch := shed[0], shed[1], shed[2]
	if s := crit.success(); s < 0.99 {
		t.Errorf("critical success %.2f%%, want >= 99%%", 100*s)
	}
	if crit.p99 > bound {
		t.Errorf("critical p99 %v, want within 2 × the unloaded %v plus the machine's tail then (%v): %v", crit.p99, control.p50, control.p99-control.p50, bound)
	}
	if !(batch.success() < def.success() && def.success() < crit.success()) {
		t.Errorf("success batch %.1f%%, default %.1f%%, critical %.1f%%: want batch shed most, then default", 100*batch.success(), 100*def.success(), 100*crit.success())
	}
	for sec := from; sec.Before(to); sec = sec.Add(time.Second) {
		st := classStatsOf(with, sec, sec.Add(time.Second))
		if !(st[2].success() <= st[1].success() && st[1].success() <= st[0].success()) {
			t.Errorf("second from %v: success batch %.1f%%, default %.1f%%, critical %.1f%%: out of order", sec.Sub(from)+time.Second,
				100*st[2].success(), 100*st[1].success(), 100*st[0].success())
		}
	}
	if good < 0.85 {
		t.Errorf("goodput %.1f%% of c, want >= 85%%", 100*good)
	}
	for i, s := range shed {
		if s.failed > 0 {
			t.Errorf("%s: %d requests failed (neither served nor shed)", shedClassNames[i], s.failed)
		}
	}
	if noShed[0].p99 <= 2*unloaded {
		t.Errorf("without shedding, critical p99 %v: want the upstream's queue to show (above 2 × %v)", noShed[0].p99, unloaded)
	}
}

// machineBusy says why the control stream shows the machine did not give
// an idle upstream its service time (the control's median above 1.1 × it,
// its p90 above 1.25 ×, or a request not served), "" when it did. A latency
// target then measures the machine, not the limiter: the adaptive limit,
// which acts on the p90 of what it passes, sees the upstream slow and
// sheds, as it should. (A short stall that delays a few requests is not
// this: the critical p99 bound takes the control's tail in.)
func machineBusy(control classStats, service time.Duration) string {
	if control.p50 > 11*service/10 || control.p90 > 5*service/4 || control.ok < control.offered {
		return fmt.Sprintf("the control stream to an idle upstream of %v took p50 %v, p90 %v, p99 %v (%d of %d served)", service,
			control.p50.Round(time.Millisecond), control.p90.Round(time.Millisecond), control.p99.Round(time.Millisecond), control.ok, control.offered)
	}
	return ""
}

// TestShedRecovers: the upstream of TestShedOverload under half its
// capacity (50 requests/s) slows down five-fold for 4 s (S = 500 ms: it
// serves 20/s), an overload of 2.5 ×: latency far above the target drives
// the adaptive limit down (towards what Little's law says the slow upstream
// runs within D, 20/s × 150 ms = 3, so the floor of 4), shedding most
// requests. Once S is 100 ms again, the limit climbs back above the
// upstream's c = 10 and shedding stops. Asserted: the limit came down below
// c, was back at c within 5 s of the recovery (quoted to the 50 ms it is
// read at), and from 6 s to 10 s after, every critical and default request
// was served, and batch lost at most 20%: at half the capacity, only the
// lowest class's bursts past its 40% of the limit, about as many as the
// upstream's c, are shed (the upstream is full then: they would queue),
// fewer as the limit grows (it grows by √limit steps, once it has been
// above the target: 4 s after the recovery it is 13 to 18). As in
// TestShedOverload, a control stream to an idle upstream beside it shows
// whether the machine gave the upstream its service time after the
// recovery; if not, the run is made again once, then skipped.
func TestShedRecovers(t *testing.T) {
	const (
		c       = 10
		service = 100 * time.Millisecond
	)
	up := startQueueUpstream(t, c, service)
	idle := startQueueUpstream(t, 1000, service) // the control's: never queues
	client := loadClient(10 * time.Second)
	slow, back, end := 2*time.Second, 6*time.Second, 16*time.Second
	rate := 0.5 * float64(c) / service.Seconds()
	var begin time.Time
	var shots []shedShot
	var points []limitPoint
	for attempt := 1; ; attempt++ {
		up.service.Store(int64(service))
		in := startCaddy(t, map[string]any{"handler": "subroute", "routes": []any{
			map[string]any{"match": []any{map[string]any{"header": map[string]any{"X-Control": []string{"yes"}}}},
				"handle": []any{proxyTo(idle.addr)}, "terminal": true},
			map[string]any{"handle": []any{limiter("", nil, shedPolicy(map[string]any{"latency": measuredLatency}, measuredShares...)), proxyTo(up.addr)}},
		}})
		stop := make(chan struct{})
		trace := traceLimit(in, "capacity", 50*time.Millisecond, stop)
		controlDone := make(chan []shedShot)
		go func() { controlDone <- driveClasses(client, in.URL, rate, end, []float64{1}, 8, "X-Control", "yes") }()
		begin = time.Now()
		slowdown := time.AfterFunc(slow, func() { up.service.Store(int64(5 * service)) })
		recovery := time.AfterFunc(back, func() { up.service.Store(int64(service)) })
		shots = driveClasses(client, in.URL, rate, end, []float64{0.10, 0.45, 0.45}, 4)
		control := classStatsOf(<-controlDone, begin.Add(back), begin.Add(end))[0]
		slowdown.Stop()
		recovery.Stop()
		close(stop)
		points = trace()
		// Without traffic the limit stands still: the gauge says what inspect does.
		if gauge, st := metricValue(t, in, "caddy_rate_limit_shed_limit", map[string]string{"policy": "capacity"}), inspectShed(t, in); st.Limit == nil || gauge != float64(*st.Limit) {
			t.Errorf("caddy_rate_limit_shed_limit %v, inspect %+v", gauge, st)
		}
		in.Stop()
		busy := machineBusy(control, service)
		if busy == "" {
			break
		}
		if attempt == 2 {
			t.Skipf("not measured: %s after the recovery, and as much the attempt before, so the upstream's service time is not the fixed %v this test needs", busy, service)
		}
		t.Logf("attempt %d not measured: %s after the recovery; again", attempt, busy)
	}
	low, recovered := int64(math.MaxInt64), time.Duration(-1)
	for _, p := range points {
		at := begin.Add(p.at)
		if !at.Before(begin.Add(slow)) && at.Before(begin.Add(back+time.Second)) {
			low = min(low, p.limit)
		}
		if recovered < 0 && !at.Before(begin.Add(back)) && p.limit >= c {
			recovered = at.Sub(begin.Add(back))
		}
	}
	var perSecond []string
	for from := begin.Add(slow); from.Before(begin.Add(end)); from = from.Add(time.Second) {
		shed, offered := 0, 0
		for _, s := range shots {
			if !s.sent.Before(from) && s.sent.Before(from.Add(time.Second)) {
				offered++
				if s.status == 503 {
					shed++
				}
			}
		}
		perSecond = append(perSecond, fmt.Sprintf("%d/%d", shed, offered))
	}
	after := classStatsOf(shots, begin.Add(back+6*time.Second), begin.Add(end))
	t.Logf("in flight/limit from the slowdown (%v): %s", slow, traceString(points[int(slow/(50*time.Millisecond))-2:], 250*time.Millisecond))
	t.Logf("lowest limit %d; back to c = %d %v after the upstream recovered; shed/offered per second from the slowdown: %s; from 6 s after:\n%s",
		low, c, recovered, strings.Join(perSecond, " "), statsTable("after", after, -1))
	if low >= c {
		t.Errorf("lowest limit while slow %d: want it below the c = %d the upstream runs when well", low, c)
	}
	if recovered < 0 || recovered > 5*time.Second {
		t.Errorf("limit back to c after %v, want within 5 s", recovered)
	}
	if after[0].success() < 1 || after[1].success() < 1 || after[2].success() < 0.8 {
		t.Errorf("from 6 s after the upstream recovered: critical %.1f%%, default %.1f%%, batch %.1f%% served; want 100%%, 100%% and 80%%",
			100*after[0].success(), 100*after[1].success(), 100*after[2].success())
	}
}

// gateUpstream holds every request until the test opens the gate (or the
// client goes away), counting those that reached it.
type gateUpstream struct {
	addr    string
	mu      sync.Mutex
	gate    chan struct{}
	arrived int
	now     int
	most    int
}

func startGateUpstream(t *testing.T) *gateUpstream {
	t.Helper()
	u := &gateUpstream{gate: make(chan struct{})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		u.mu.Lock()
		gate := u.gate
		u.arrived++
		u.now++
		u.most = max(u.most, u.now)
		u.mu.Unlock()
		select {
		case <-gate:
		case <-r.Context().Done():
		}
		u.mu.Lock()
		u.now--
		u.mu.Unlock()
		_, _ = io.WriteString(w, "served")
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { u.open(); srv.Close() })
	return u
}

// open lets every request held go on; later ones wait at a new gate.
func (u *gateUpstream) open() {
	u.mu.Lock()
	close(u.gate)
	u.gate = make(chan struct{})
	u.mu.Unlock()
}

func (u *gateUpstream) counts() (arrived, now, most int) {
	u.mu.Lock()
	defer u.mu.Unlock()
	return u.arrived, u.now, u.most
}

// burst sends n requests at once, spread over the instances, with the
// header pairs; it returns, once each was either shed or reached the
// upstream (at most 10 s), how many were shed, and a wait for the others'
// statuses (a request that failed is 0).
func burst(t *testing.T, fleet []*instance, up *gateUpstream, n int, header ...string) (shed int, wait func() []int) {
	t.Helper()
	arrivedBefore, _, _ := up.counts()
	statuses := make(chan int, n)
	var shedCount atomic.Int64
	var problems []string
	var mu sync.Mutex
	for i := range n {
		go func() {
			req, _ := http.NewRequest("GET", fleet[i%len(fleet)].URL+"/", nil)
			for k := 0; k+1 < len(header); k += 2 {
				req.Header.Set(header[k], header[k+1])
			}
			resp, err := newClient().Do(req)
			if err != nil {
				statuses <- 0
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 503 {
				var p problemBody
				if json.Unmarshal(body, &p) != nil || p.Type != "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity" ||
					resp.Header.Get("Retry-After") == "" || resp.Header.Get("Content-Type") != "application/problem+json" {
					mu.Lock()
					problems = append(problems, fmt.Sprintf("%s %q %v", resp.Status, body, resp.Header))
					mu.Unlock()
				}
				shedCount.Add(1)
				return
			}
			statuses <- resp.StatusCode
		}()
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		arrived, _, _ := up.counts()
		if int(shedCount.Load())+arrived-arrivedBefore >= n {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after 10 s, %d of %d requests shed and %d at the upstream", shedCount.Load(), n, arrived-arrivedBefore)
		}
	}
	mu.Lock()
	for _, p := range problems {
		t.Errorf("a 503 that is not a shed request's: %s", p)
	}
	mu.Unlock()
	return int(shedCount.Load()), func() []int {
		var out []int
		for range n - int(shedCount.Load()) {
			out = append(out, <-statuses)
		}
		return out
	}
}

// TestShedFleetSlots: shed { concurrent 10 } with the design's classes
// (critical 100%, default 80%, batch 50%) on two instances sharing one
// Redis: a burst of 20 batch requests gets 5 slots of the fleet's 10, 20
// default requests 3 more, 20 critical requests the last 2; the others are
// shed (503). The upstream never has more than 10 at once, however the
// requests are spread over the instances; the slots come back once the
// requests end.
func TestShedFleetSlots(t *testing.T) {
	srv := testredis.Start(t)
	up := startGateUpstream(t)
	policy := shedPolicy(map[string]any{"concurrent": 10}, "100%", "80%", "50%")
	var fleet []*instance
	for range 2 {
		// 1s: a call timed out on a loaded machine would follow the default
		// fail_open and admit past the slots, which this test counts.
		fleet = append(fleet, startCaddy(t, redisLimiter(srv.Addr, "1s", nil, policy), proxyTo(up.addr)))
	}
	var waits []func() []int
	for _, step := range []struct {
		class      string
		admitted   int
		shedByThen int
	}{{"batch", 5, 15}, {"default", 3, 17}, {"critical", 2, 18}} {
		shed, wait := burst(t, fleet, up, 20, "X-Priority", step.class)
		waits = append(waits, wait)
		_, now, _ := up.counts()
		t.Logf("20 %s requests over 2 instances: %d shed, %d at the upstream now", step.class, shed, now)
		if shed != step.shedByThen {
			t.Errorf("%s: %d shed, want %d (%d admitted)", step.class, shed, step.shedByThen, step.admitted)
		}
	}
	in := inspectShed(t, fleet[1])
	if _, now, most := up.counts(); now != 10 || most != 10 || in.InUse == nil || *in.InUse != 10 || in.Slots != 10 {
		t.Errorf("at the upstream %d now, at most %d; inspect: %+v; want 10 of 10 slots in use", now, most, in)
	}
	up.open()
	for _, wait := range waits {
		for _, status := range wait() {
			if status != 200 {
				t.Errorf("an admitted request ended %d", status)
			}
		}
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if in := inspectShed(t, fleet[0]); in.InUse != nil && *in.InUse == 0 {
			break
		}
		if time.Now().After(deadline) {
			in := inspectShed(t, fleet[0])
			inUse := int64(-1)
			if in.InUse != nil {
				inUse = *in.InUse
			}
			t.Fatalf("slots still in use 5 s after the requests ended: %d of %d; release retries %v", inUse, in.Slots,
				metricValue(t, fleet[0], "caddy_rate_limit_release_retries_total", map[string]string{"policy": "capacity"})+
					metricValue(t, fleet[1], "caddy_rate_limit_release_retries_total", map[string]string{"policy": "capacity"}))
		}
	}
	for class, want := range map[string][2]float64{"batch": {5, 15}, "default": {3, 17}, "critical": {2, 18}} {
		var allowed, shed float64
		for _, in := range fleet {
			allowed += metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "capacity", "class": class, "outcome": "allowed"})
			shed += metricValue(t, in, "caddy_rate_limit_decisions_total", map[string]string{"policy": "capacity", "class": class, "outcome": "shed"})
		}
		if allowed != want[0] || shed != want[1] {
			t.Errorf("decisions_total of class %s: %v allowed, %v shed over the fleet; want %v and %v", class, allowed, shed, want[0], want[1])
		}
	}
}

// shedState is what the admin API's inspect answers of a shed policy.
type shedState struct {
	Kind     string `json:"kind"`
	Slots    int64  `json:"slots"`
	InUse    *int64 `json:"in_use"`
	Limit    *int64 `json:"shed_limit"`
	InFlight *int64 `json:"shed_in_flight"`
}

func inspectShed(t *testing.T, in *instance) shedState {
	t.Helper()
	var st shedState
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, "inspect", "capacity", "--json")), &st); err != nil || st.Kind != "shed" {
		t.Fatalf("inspect capacity: %+v %v", st, err)
	}
	return st
}

// TestShedPriorityFromAuth: the class comes from what the placeholder
// says. Taken from a request header, it is the client's to choose: a
// client that says critical is critical, a value that names no class is
// the lowest (and is counted under that class's name, never its own).
// Taken from authentication (basic_auth, then a map of the user to a
// class), a client that forges the header stays in its user's class.
// shed { concurrent 4 } with critical 100% and batch 50%: batch's 2 slots
// are taken by two held batch requests, so a batch request is shed and a
// critical one admitted.
func TestShedPriorityFromAuth(t *testing.T) {
	up := startGateUpstream(t)
	classes := func(from string) map[string]any {
		return map[string]any{"name": "capacity", "key": "global", "shed": map[string]any{"concurrent": 4},
			"priority": map[string]any{"from": from, "classes": []any{
				map[string]any{"name": "critical", "share": "100%"}, map[string]any{"name": "batch", "share": "50%"}}}}
	}
	fromHeader := startCaddy(t, limiter("", nil, classes("{http.request.header.X-Priority}")), proxyTo(up.addr))
	auth := map[string]any{"handler": "authentication", "providers": map[string]any{"http_basic": map[string]any{"accounts": []any{
		map[string]any{"username": "alice", "password": "$2a$04$Diph/PkfXfAWeJPDW.cndORgGKezkJU/YYh4gPuK1TKzm0RprtrXK"}, // alice-secret
		map[string]any{"username": "bob", "password": "$2a$04$NvEEpijFIOsm0EUYbBlWcu6WAMGuMvCZAqXb4Oy0lELfzawSX/Pay"},   // bob-secret
	}}}}
	userClass := map[string]any{"handler": "map", "source": "{http.auth.user.id}", "destinations": []string{"{priority}"},
		"mappings": []any{map[string]any{"input": "alice", "outputs": []string{"critical"}}}, "defaults": []string{"batch"}}
	fromAuth := startCaddy(t, auth, userClass, limiter("", nil, classes("{priority}")), proxyTo(up.addr))

	as := func(user string) []string {
		if user == "" {
			return nil
		}
		return []string{"Authorization", "Basic " + base64.StdEncoding.EncodeToString([]byte(user+":"+user+"-secret"))}
	}
	for _, tc := range []struct {
		name  string
		in    *instance
		hold  []string // the two batch requests that fill batch's slots
		probe []string
		shed  bool
	}{
		{"header: the client says critical", fromHeader, []string{"X-Priority", "batch"}, []string{"X-Priority", "critical"}, false},
		{"header: a value that names no class is batch", fromHeader, []string{"X-Priority", "batch"}, []string{"X-Priority", "urgent"}, true},
		{"auth: bob forges critical, stays batch", fromAuth, as("bob"), append(as("bob"), "X-Priority", "critical"), true},
		{"auth: alice is critical", fromAuth, as("bob"), as("alice"), false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			shed, wait := burst(t, []*instance{tc.in}, up, 2, tc.hold...)
			if shed != 0 {
				t.Fatalf("the two batch requests: %d shed", shed)
			}
			probed, probeWait := burst(t, []*instance{tc.in}, up, 1, tc.probe...)
			if (probed == 1) != tc.shed {
				t.Errorf("probe shed %v, want %v", probed == 1, tc.shed)
			}
			up.open()
			for _, status := range append(wait(), probeWait()...) {
				if status != 200 {
					t.Errorf("an admitted request ended %d", status)
				}
			}
			for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
				if st := inspectShed(t, tc.in); st.InUse != nil && *st.InUse == 0 {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("slots still in use 5 s after the requests ended")
				}
			}
		})
	}
	_, raw := scrape(t, fromHeader)
	if strings.Contains(raw, "urgent") {
		t.Errorf("a priority value the client sent is in the metrics:\n%s", raw)
	}
	if n := metricValue(t, fromHeader, "caddy_rate_limit_decisions_total", map[string]string{"policy": "capacity", "class": "batch", "outcome": "shed"}); n != 1 {
		t.Errorf("fromHeader: %v batch requests shed, want 1 (the urgent one)", n)
	}
}

// TestShedLocalFallbackCountsRedis: shed { concurrent 10 } with on_error
// local on two instances (instances 2: 5 slots each while Redis is away).
// 10 requests admitted through Redis are at the upstream when Redis goes
// away; 20 more, spread over the instances, find no room in the local
// fallback, which counts the requests Redis admitted: the upstream never
// has more than 10 at once. Once those end, the fallback admits its 5 per
// instance.
func TestShedLocalFallbackCountsRedis(t *testing.T) {
	srv := testredis.Start(t)
	up := startGateUpstream(t)
	policy := shedPolicy(map[string]any{"concurrent": 10}, "100%")
	policy["on_error"] = "local"
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, redisLimiter(srv.Addr, "1s", map[string]any{"instances": 2}, policy), proxyTo(up.addr)))
	}
	shed, waitHeld := burst(t, fleet, up, 10, "X-Priority", "critical")
	if _, now, _ := up.counts(); shed != 0 || now != 10 {
		t.Fatalf("through Redis: %d shed, %d at the upstream, want 0 and 10", shed, now)
	}
	srv.Stop()
	shed, waitMore := burst(t, fleet, up, 20, "X-Priority", "critical")
	_, now, most := up.counts()
	t.Logf("Redis gone with 10 requests it admitted running: 20 more over 2 instances, %d shed; at the upstream %d now, at most %d", shed, now, most)
	if most > 10 || shed != 20 {
		t.Errorf("with Redis gone, the upstream had up to %d at once (%d of 20 more shed), want at most 10: the local fallback did not count the requests Redis admitted", most, shed)
	}
	up.open()
	for _, status := range append(waitHeld(), waitMore()...) {
		if status != 200 && status != 503 {
			t.Errorf("a request ended %d", status)
		}
	}
	// The requests Redis admitted have ended: the fallback admits its 5 per
	// instance, no more.
	shed, waitLast := burst(t, fleet, up, 20, "X-Priority", "critical")
	_, now, _ = up.counts()
	t.Logf("after they ended: 20 more, %d shed, %d at the upstream", shed, now)
	if now != 10 || shed != 10 {
		t.Errorf("after the requests Redis admitted ended: %d at the upstream, %d of 20 shed; want 10 and 10", now, shed)
	}
	up.open()
	waitLast()
}
