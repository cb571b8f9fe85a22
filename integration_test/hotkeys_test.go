package integration_test

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Hot keys (docs/hot-keys.md): one key that the whole fleet hits at once,
// decided from blocks of its tokens that each instance takes from the
// shared bucket. The fleet still admits at most burst + rate × elapsed at
// every instant, with a script call per many admissions, each instance in
// proportion to the requests it receives.

// The issue's key: 5,000 a second, burst 500.
const (
	hotRate  = 5_000
	hotBurst = 500
)

// hotPolicy is the one budget of the hot-key tests.
func hotPolicy(extra ...any) map[string]any {
	p := map[string]any{"name": "api_wide", "key": "{http.request.header.X-Api-Key}", "rate": "5000/1s", "burst": hotBurst}
	for i := 0; i+1 < len(extra); i += 2 {
		p[extra[i].(string)] = extra[i+1]
	}
	return p
}

// hotRun is what a load on one key saw, by instance.
type hotRun struct {
	elapsed  time.Duration
	requests []int64 // by instance
	admitted [][]time.Duration
	// failed: responses that were neither 200 nor 429, and transport errors
	failed int64
	// sent: when each request was sent, since the load began.
	sent []time.Duration
	// peakHeld is the highest caddy_rate_limit_hot_tokens_unspent each
	// instance showed while the load ran (scraped every 100 ms), and
	// peakFleet the highest sum of the four at one scrape.
	peakHeld  []float64
	peakFleet float64
}

// keyClient sends requests of one key to one instance on a keep-alive
// connection of its own.
type keyClient struct {
	client *http.Client
	tr     *http.Transport
	in     *instance
	key    string
}

func newKeyClient(in *instance, key string) *keyClient {
	tr := &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}
	return &keyClient{client: &http.Client{Transport: tr, Timeout: 10 * time.Second}, tr: tr, in: in, key: key}
}

// ask sends one request (with the header pairs given) and returns its
// status, 0 for a transport error.
func (c *keyClient) ask(header ...string) int {
	req, _ := http.NewRequest("GET", c.in.URL+"/", nil)
	req.Header.Set("X-Api-Key", c.key)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}

func (c *keyClient) close() { c.tr.CloseIdleConnections() }

// hotLoad sends requests on one key from conns[i] connections to instance
// i, each on its own keep-alive connection, as fast as they are answered,
// for d; an instance whose skew is n > 0 is sent one request for every n
// sent to instance 0, whatever their pace.
func hotLoad(t *testing.T, fleet []*instance, conns, skew []int, d time.Duration, key string) *hotRun {
	t.Helper()
	run := &hotRun{requests: make([]int64, len(fleet)), admitted: make([][]time.Duration, len(fleet)), peakHeld: make([]float64, len(fleet))}
	var mu sync.Mutex
	var failed atomic.Int64
	var wg sync.WaitGroup
	sentTo := make([]atomic.Int64, len(fleet))
	start := time.Now() // the bucket is full: its budget counts from here
	stop := start.Add(d)
	for i, in := range fleet {
		for range conns[i] {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := newKeyClient(in, key)
				defer c.close()
				var n int64
				var admitted, sent []time.Duration
				for time.Now().Before(stop) {
					if i > 0 && i < len(skew) && skew[i] > 0 {
						for time.Now().Before(stop) && sentTo[0].Load() < int64(skew[i])*(sentTo[i].Load()+1) {
							time.Sleep(200 * time.Microsecond)
						}
					}
					sentTo[i].Add(1)
					sent = append(sent, time.Since(start))
					n++
					switch c.ask() {
					case 200:
						admitted = append(admitted, time.Since(start)) // decided before now
					case 429:
					default:
						failed.Add(1)
					}
				}
				mu.Lock()
				run.requests[i] += n
				run.admitted[i] = append(run.admitted[i], admitted...)
				run.sent = append(run.sent, sent...)
				mu.Unlock()
			}()
		}
	}
	// The gauge of unspent tokens, scraped while the load runs.
	done := make(chan struct{})
	scraped := make(chan struct{})
	go func() {
		defer close(scraped)
		ticker := time.NewTicker(100 * time.Millisecond)
		defer ticker.Stop()
		for {
			select {
			case <-done:
				return
			case <-ticker.C:
			}
			sum := 0.0
			for i, in := range fleet {
				held := heldGauge(in)
				run.peakHeld[i] = math.Max(run.peakHeld[i], held)
				sum += held
			}
			run.peakFleet = math.Max(run.peakFleet, sum)
		}
	}()
	wg.Wait()
	close(done)
	<-scraped
	run.elapsed = time.Since(start)
	run.failed = failed.Load()
	for i := range run.admitted {
		sort.Slice(run.admitted[i], func(a, b int) bool { return run.admitted[i][a] < run.admitted[i][b] })
	}
	return run
}

var heldLine = regexp.MustCompile(`(?m)^caddy_rate_limit_hot_tokens_unspent\{policy="api_wide"\} (\S+)$`)

// heldGauge is an instance's caddy_rate_limit_hot_tokens_unspent of the
// policy (0 when it cannot be read).
func heldGauge(in *instance) float64 {
	resp, err := http.Get(in.Admin + "/metrics")
	if err != nil {
		return 0
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	m := heldLine.FindSubmatch(raw)
	if m == nil {
		return 0
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// hotKey is a hot key's limit: rate a second, and burst.
type hotKey struct{ rate, burst int }

// issueKey is the issue's key: 5,000 a second, burst 500.
var issueKey = hotKey{hotRate, hotBurst}

func (k hotKey) String() string { return fmt.Sprintf("%d/s burst %d", k.rate, k.burst) }

// policy is hotPolicy with the key's limit, and the extra pairs.
func (k hotKey) policy(extra ...any) map[string]any {
	return hotPolicy(append([]any{"rate", fmt.Sprintf("%d/1s", k.rate), "burst", k.burst}, extra...)...)
}

// hotLadder are the rates a hot-key test may be sized down to: each a whole
// number of microseconds apart (the bucket's interval, and the exact
// bucket's of idealAdmitsOf, are exact), from the issue's 5,000 a second.
var hotLadder = []int{5000, 4000, 2500, 2000, 1600, 1250, 1000, 800, 500, 400}

// sizeHotKey sizes a hot-key test's key to what this machine delivers. It
// drives the load the test will (conns and skew as hotLoad) for 1.5 s on a
// key of its own, measures the requests a second the fleet was sent from
// 0.5 s on (the connections opened, the key hot), and returns the largest
// limit of the ladder, at most want, that this load exceeds over times,
// with the burst in want's proportion; reload, when that is not want, puts
// it on the fleet (the key's policy in the handlers of each instance). It
// waits until the fleet has given back what it held of the calibration key.
// A machine too slow to load even the ladder's smallest rate over times
// skips the test, saying so: what it measures needs the key over its
// budget. Only the assumption about the machine changes: what the test
// asserts of the key holds at any rate.
func sizeHotKey(t *testing.T, fleet []*instance, conns, skew []int, want hotKey, over float64, reload func(hotKey) []map[string]any) (hotKey, float64) {
	t.Helper()
	const warm = 500 * time.Millisecond
	cal := hotLoad(t, fleet, conns, skew, warm+time.Second, "calibration-"+strings.ToLower(t.Name()))
	n := 0
	for _, at := range cal.sent {
		if at >= warm {
			n++
		}
	}
	delivered := float64(n) / (cal.elapsed - warm).Seconds()
	key := hotKey{}
	for _, rate := range hotLadder {
		if rate <= want.rate && float64(rate)*over <= delivered {
			key = hotKey{rate, max(1, rate*want.burst/want.rate)}
			break
		}
	}
	if key.rate == 0 {
		t.Skipf("this machine delivers %.0f requests a second of the load: %.1f times the smallest key of %d/s would need %.0f; what the test measures needs the key over its budget",
			delivered, over, hotLadder[len(hotLadder)-1], over*float64(hotLadder[len(hotLadder)-1]))
	}
	if key != want {
		for _, in := range fleet {
			in.reload(t, reload(key)...)
		}
		t.Logf("the machine delivers %.0f requests a second of the load, less than %.1f times %v: the key is %v", delivered, over, want, key)
	} else {
		t.Logf("the machine delivers %.0f requests a second of the load: the key is %v", delivered, key)
	}
	waitReturned(t, fleet)
	return key, delivered
}

// all is every admission's time, in order.
func (r *hotRun) all() []time.Duration {
	var out []time.Duration
	for _, a := range r.admitted {
		out = append(out, a...)
	}
	sort.Slice(out, func(a, b int) bool { return out[a] < out[b] })
	return out
}

// checkBudget fails when the admissions by any instant exceed burst + rate
// × the time since the load began (the issue's key's), and returns the
// admitted and the budget at the last admission.
func checkBudget(t *testing.T, r *hotRun) (admitted int, budget float64) {
	t.Helper()
	return checkBudgetOf(t, r, hotRate, hotBurst)
}

// checkBudgetOf is checkBudget for a key of another rate (a second) and
// burst.
func checkBudgetOf(t *testing.T, r *hotRun, rate, burst float64) (admitted int, budget float64) {
	t.Helper()
	all := r.all()
	for i, at := range all {
		if b := burst + rate*at.Seconds(); float64(i+1) > b {
			t.Fatalf("%d admitted by %v since the load began: over the budget of %.1f", i+1, at, b)
		}
	}
	if len(all) == 0 {
		t.Fatal("nothing admitted")
	}
	return len(all), burst + rate*all[len(all)-1].Seconds()
}

// shares is each instance's share of the admissions over its share of the
// requests: 1 is exactly in proportion.
func (r *hotRun) shares() []float64 {
	var req, adm float64
	for i := range r.requests {
		req += float64(r.requests[i])
		adm += float64(len(r.admitted[i]))
	}
	out := make([]float64, len(r.requests))
	for i := range r.requests {
		out[i] = (float64(len(r.admitted[i])) / adm) / (float64(r.requests[i]) / req)
	}
	return out
}

// waitReturned waits (at most 5 s) until no instance holds tokens of the
// key: it cooled, and what was held went back.
func waitReturned(t *testing.T, fleet []*instance) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		sum := 0.0
		for _, in := range fleet {
			sum += heldGauge(in)
		}
		if sum == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the load, the fleet still holds %.0f tokens of the cooled key", sum)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestHotKeyFleet is the issue's measure: four instances hammering one key
// (5,000/s, burst 500) for 10 s with all the load this machine gives. At
// every instant the fleet admits at most burst + rate × elapsed, and by the
// end at least 0.95 of it, and of what one exact bucket admits of the
// requests sent; Redis runs at most one script call per 50 admissions; each
// instance admits within ±10% of its share of the requests; what the
// instances hold stays within the bound docs/hot-keys.md states, and goes
// back once the key cools. On a machine that cannot send 1.5 times the
// issue's key, the key is the largest of hotLadder it does (sizeHotKey),
// and the calls per admission, the issue's figure at the issue's key and
// load, are not measured (the subtest says so): a block is 50 ms of an
// instance's rate, fewer admissions a call at a lower one.
func TestHotKeyFleet(t *testing.T) {
	srv := testredis.Start(t)
	handlers := func(k hotKey) []map[string]any {
		return []map[string]any{decidedByRedis(srv.Addr, k.policy()), respond()}
	}
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, handlers(issueKey)...))
	}
	conns := []int{8, 8, 8, 8}
	key, delivered := sizeHotKey(t, fleet, conns, nil, issueKey, 1.5, handlers)
	blocksBefore := make([]float64, len(fleet))
	for i, in := range fleet {
		blocksBefore[i] = metricValue(t, in, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"})
	}
	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	r := hotLoad(t, fleet, conns, nil, 10*time.Second, "tenant-hot")
	calls := scriptCallsOf(t, srv)
	admitted, budget := checkBudgetOf(t, r, float64(key.rate), float64(key.burst))
	var sent int64
	for _, n := range r.requests {
		sent += n
	}
	shares := r.shares()
	t.Logf("4 instances, key %v, %.1f s: %d requests (%.0f/s), admitted %d of a budget of %.1f (%.4f); %d script calls, %.4f per admission; "+
		"requests by instance %v, admitted %v, share of admissions over share of requests %.3f; unspent tokens at most %v by instance, %.0f by the fleet; %d failed",
		key, r.elapsed.Seconds(), sent, float64(sent)/r.elapsed.Seconds(), admitted, budget, float64(admitted)/budget, calls, float64(calls)/float64(admitted),
		r.requests, counts(r.admitted), shares, r.peakHeld, r.peakFleet, r.failed)
	var blocks []float64
	for i, in := range fleet {
		blocks = append(blocks, metricValue(t, in, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"})-blocksBefore[i])
	}
	t.Logf("blocks taken by instance %v; by tenth of a second, admitted: %v; sent: %v", blocks, perTenth(r.all(), r.elapsed), perTenth(r.sent, r.elapsed))
	if path := os.Getenv("HOTKEYS_SVG"); path != "" {
		if err := writeHotChart(path, r, key, calls); err != nil {
			t.Errorf("writing the chart: %v", err)
		}
	}
	if r.failed != 0 {
		t.Errorf("%d responses neither 200 nor 429 (every decision is Redis's or a block's)", r.failed)
	}
	ideal := idealAdmitsOf(r.sent, int64(key.rate), int64(key.burst))
	t.Logf("one exact bucket would have admitted %d of the %d requests as sent: admitted %.4f of that", ideal, len(r.sent), float64(admitted)/float64(ideal))
	if share := float64(admitted) / float64(ideal); share < 0.95 {
		t.Errorf("admitted %.4f of what one exact bucket admits of the same requests, want at least 0.95", share)
	}
	for i, s := range shares {
		if math.Abs(s-1) > 0.1 {
			t.Errorf("instance %d admitted %.3f of its share of the requests, want 1 ± 0.1", i, s)
		}
	}
	// The bound of docs/hot-keys.md: an instance holds at most its lead (at
	// most half the horizon: 1,250 tokens at 5,000/s) and three blocks (each
	// at most a quarter of the burst); the fleet, the sum of its instances'.
	bound := float64(key.rate/4 + 3*key.burst/4)
	for i, peak := range r.peakHeld {
		if peak > bound {
			t.Errorf("instance %d held %.0f tokens at its peak, over the bound of %.0f", i, peak, bound)
		}
	}
	if r.peakFleet > 4*bound {
		t.Errorf("the fleet held %.0f tokens at its peak, over the bound of %.0f", r.peakFleet, 4*bound)
	}
	waitReturned(t, fleet)
	// The calls a block saves are the issue's figure for its key under its
	// load, half as much again as the budget: blocks follow each instance's
	// rate.
	t.Run("calls per admission", func(t *testing.T) {
		if key != issueKey || float64(len(r.sent)) < 1.5*budget {
			t.Skipf("measured at the issue's key (%v) under 1.5 times its budget; the key was %v, sent %.2f times its budget", issueKey, key, float64(len(r.sent))/budget)
		}
		if per := float64(calls) / float64(admitted); per > 0.02 {
			t.Errorf("%.4f script calls per admission, want at most 0.02", per)
		}
	})
	if os.Getenv("HOTKEYS_COMPARE") != "" {
		// The same load with hot keys off: every decision a script call.
		var off []*instance
		for range 4 {
			off = append(off, startCaddy(t, decidedByRedis(srv.Addr, key.policy("hot_keys", "off")), respond()))
		}
		if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
			t.Fatal(err)
		}
		o := hotLoad(t, off, conns, nil, 10*time.Second, "tenant-cold")
		calls := scriptCallsOf(t, srv)
		admitted, budget := checkBudgetOf(t, o, float64(key.rate), float64(key.burst))
		t.Logf("hot_keys off, the same load: %d requests, admitted %d of a budget of %.1f (%.4f); %d script calls, %.4f per admission; shares %.3f",
			len(o.sent), admitted, budget, float64(admitted)/budget, calls, float64(calls)/float64(admitted), o.shares())
	}
	// The budget is the measure once the load is over it all along: the
	// key was sized to what the machine delivered a moment before (1.5
	// times it), but a busy machine stalls the client now and then (beside
	// four CPU hogs, once, an exact bucket would have admitted 0.951 of the
	// budget of the requests sent 1.6 times it). What one exact bucket
	// admits of them, checked above, is the measure then.
	if float64(ideal) < 0.99*budget {
		t.Skipf("%d requests sent (%.0f a second, against %.0f in the calibration), %.2f times the budget of %.0f, of which one exact bucket admits %.4f of the budget: the load fell below the rate, the budget's share not measured",
			len(r.sent), float64(len(r.sent))/r.elapsed.Seconds(), delivered, float64(len(r.sent))/budget, budget, float64(ideal)/budget)
	}
	if share := float64(admitted) / budget; share < 0.95 {
		t.Errorf("admitted %.4f of the budget, want at least 0.95", share)
	}
}

// counts is the admissions by instance.
func counts(admitted [][]time.Duration) []int {
	var out []int
	for _, a := range admitted {
		out = append(out, len(a))
	}
	return out
}

// scriptCallsOf is the script calls Redis ran since CONFIG RESETSTAT.
func scriptCallsOf(t *testing.T, srv *testredis.Server) int {
	t.Helper()
	info, err := srv.Do("INFO", "commandstats")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, m := range regexp.MustCompile(`cmdstat_(?:evalsha|eval):calls=(\d+)`).FindAllStringSubmatch(info, -1) {
		c, _ := strconv.Atoi(m[1])
		n += c
	}
	return n
}

// TestHotKeyFairness: one instance receives ten times the others' requests
// on a key over its budget; each still admits within ±10% of its share of
// the requests: the busy instance's blocks are not budget the others can
// never reach. The key is 2,000/s burst 200, or, on a machine that cannot
// send twice that, the largest of hotLadder it sends twice (sizeHotKey).
func TestHotKeyFairness(t *testing.T) {
	srv := testredis.Start(t)
	handlers := func(k hotKey) []map[string]any {
		return []map[string]any{decidedByRedis(srv.Addr, k.policy()), respond()}
	}
	want := hotKey{2_000, 200}
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, handlers(want)...))
	}
	conns, skew := []int{16, 2, 2, 2}, []int{0, 10, 10, 10}
	key, delivered := sizeHotKey(t, fleet, conns, skew, want, 2, handlers)
	r := hotLoad(t, fleet, conns, skew, 8*time.Second, "tenant-skewed")
	admitted, budget := checkBudgetOf(t, r, float64(key.rate), float64(key.burst))
	ideal := idealAdmitsOf(r.sent, int64(key.rate), int64(key.burst))
	shares := r.shares()
	var blocks []float64
	for _, in := range fleet {
		blocks = append(blocks, metricValue(t, in, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"}))
	}
	t.Logf("key %v: requests by instance %v, admitted %v (%d of a budget of %.1f; one exact bucket would have admitted %d of them); share of admissions over share of requests %.3f; blocks taken (with the calibration's) %v",
		key, r.requests, counts(r.admitted), admitted, budget, ideal, shares, blocks)
	if share := float64(admitted) / float64(ideal); share < 0.95 {
		t.Errorf("admitted %.4f of what one exact bucket admits of the same requests, want at least 0.95", share)
	}
	if float64(len(r.sent)) < 1.2*float64(ideal) {
		// The key was sized to half what the machine delivered a moment
		// before: it slowed down by half since.
		t.Skipf("%d requests sent (%.0f a second, against %.0f in the calibration) for %d an exact bucket admits: the key not over its budget, no shares to measure",
			len(r.sent), float64(len(r.sent))/r.elapsed.Seconds(), delivered, ideal)
	}
	for i, s := range shares {
		if math.Abs(s-1) > 0.1 {
			t.Errorf("instance %d admitted %.3f of its share of the requests, want 1 ± 0.1", i, s)
		}
	}
}

// writeHotChart draws, as an SVG, each instance's admissions and the
// fleet's since the load began, against the budget burst + rate × t.
func writeHotChart(path string, r *hotRun, key hotKey, calls int) error {
	const (
		width, height            = 820, 440
		left, right, top, bottom = 80, 230, 60, 60
		plotW, plotH             = width - left - right, height - top - bottom
	)
	secs := r.elapsed.Seconds()
	rate, burst, step := float64(key.rate), float64(key.burst), float64(key.rate) // a grid line a second of the rate
	yMax := math.Ceil((burst+rate*secs)/step) * step
	x := func(s float64) float64 { return left + s/secs*plotW }
	y := func(v float64) float64 { return top + plotH - v/yMax*plotH }
	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="13">`+"\n", width, height, width, height)
	fmt.Fprintf(&b, `<rect width="%d" height="%d" fill="white"/>`+"\n", width, height)
	fmt.Fprintf(&b, `<text x="%d" y="22" font-size="16" font-weight="bold">Admitted on one hot key: 4 Caddy instances, %s/s burst %s</text>`+"\n", left, thousands(key.rate), thousands(key.burst))
	all := r.all()
	fmt.Fprintf(&b, `<text x="%d" y="40" fill="#555">Each instance decides from blocks of the key's tokens; %d admitted of a budget of %.0f, %d script calls.</text>`+"\n",
		left, len(all), burst+rate*all[len(all)-1].Seconds(), calls)
	for v := 0.0; v <= yMax+1e-9; v += step {
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#e4e4e4"/>`+"\n", left, y(v), left+plotW, y(v))
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%.0f</text>`+"\n", left-8, y(v)+4, v)
	}
	for s := 0; float64(s) <= secs; s++ {
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#e4e4e4"/>`+"\n", x(float64(s)), top, x(float64(s)), top+plotH)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%d</text>`+"\n", x(float64(s)), top+plotH+18, s)
	}
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top+plotH, left+plotW, top+plotH)
	fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="black"/>`+"\n", left, top, left, top+plotH)
	fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">seconds since the load began</text>`+"\n", left+plotW/2, height-16)
	fmt.Fprintf(&b, `<text transform="translate(20 %d) rotate(-90)" text-anchor="middle">requests admitted so far</text>`+"\n", top+plotH/2)
	// A cumulative line, sampled every 50 ms.
	line := func(times []time.Duration) string {
		var p []string
		k := 0
		for s := 0.0; s <= secs; s += 0.05 {
			for k < len(times) && times[k].Seconds() <= s {
				k++
			}
			p = append(p, fmt.Sprintf("%.1f,%.1f", x(s), y(float64(k))))
		}
		return strings.Join(p, " ")
	}
	type series struct{ label, color, dash, points string }
	colors := []string{"#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd"}
	var lines []series
	for i, a := range r.admitted {
		lines = append(lines, series{fmt.Sprintf("instance %d: %d", i+1, len(a)), colors[i%len(colors)], "", line(a)})
	}
	lines = append(lines, series{fmt.Sprintf("the fleet: %d", len(all)), "#d62728", "", line(all)})
	budget := fmt.Sprintf("%.1f,%.1f %.1f,%.1f", x(0), y(burst), x(secs), y(burst+rate*secs))
	lines = append(lines, series{fmt.Sprintf("budget: %s + %s/s × t", thousands(key.burst), thousands(key.rate)), "#222222", `stroke-dasharray="7 5"`, budget})
	for i, l := range lines {
		fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" %s points="%s"/>`+"\n", l.color, l.dash, l.points)
		ly := top + 20 + 26*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="2" %s/>`+"\n", left+plotW+14, ly, left+plotW+40, ly, l.color, l.dash)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s</text>`+"\n", left+plotW+46, ly+4, l.label)
	}
	b.WriteString("</svg>\n")
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// thousands writes n with a comma between thousands, as the docs do.
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// perTenth is the admissions in each tenth of a second of the run.
func perTenth(all []time.Duration, elapsed time.Duration) []int {
	out := make([]int, int(elapsed/(100*time.Millisecond))+1)
	for _, at := range all {
		out[at/(100*time.Millisecond)]++
	}
	return out
}

// idealAdmits is how many of the requests, sent at the given times since
// the load began, one exact bucket of the issue's key would admit,
// deciding each as it is sent.
func idealAdmits(sent []time.Duration) int { return idealAdmitsOf(sent, hotRate, hotBurst) }

// idealAdmitsOf is idealAdmits for a key of another rate (a second) and
// burst.
func idealAdmitsOf(sent []time.Duration, rate, burst int64) int {
	at := append([]time.Duration(nil), sent...)
	sort.Slice(at, func(a, b int) bool { return at[a] < at[b] })
	interval := 1_000_000 / rate // µs
	tau := burst * interval
	var tat int64
	n := 0
	for _, s := range at {
		now := s.Microseconds()
		if base := max(tat, now); base+interval-now <= tau {
			tat, n = base+interval, n+1
		}
	}
	return n
}

// admissionsUnder drives key on the fleet (4 connections per instance) for
// d, calling change once, at changeAt, and returns when each admission's
// response came, since the load began, and when change returned. plan, when
// not nil, gives the X-Plan of a request sent at a time since the load
// began.
func admissionsUnder(t *testing.T, fleet []*instance, d, changeAt time.Duration, key string, plan func(time.Duration) string, change func()) (admitted []time.Duration, changed time.Duration) {
	t.Helper()
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for _, in := range fleet {
		for range 4 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := newKeyClient(in, key)
				defer c.close()
				for time.Since(start) < d {
					var header []string
					if plan != nil {
						header = []string{"X-Plan", plan(time.Since(start))}
					}
					if c.ask(header...) == 200 {
						mu.Lock()
						admitted = append(admitted, time.Since(start))
						mu.Unlock()
					}
				}
			}()
		}
	}
	time.Sleep(changeAt)
	change()
	changed = time.Since(start)
	wg.Wait()
	sort.Slice(admitted, func(a, b int) bool { return admitted[a] < admitted[b] })
	return admitted, changed
}

// TestHotKeyChangesReachBlocks: a plan change, an operator's override and
// a reset reach the instances holding blocks of a hot key within the deny
// cache's bound (1 s): from a second after the change, the key's
// admissions follow the new limit (at most its burst plus its rate over
// the time since), and inspect shows the blocks held meanwhile.
func TestHotKeyChangesReachBlocks(t *testing.T) {
	const lowRate, lowBurst = 500, 50 // the plan's and the override's limit
	within := func(t *testing.T, admitted []time.Duration, from, to time.Duration) {
		t.Helper()
		n := 0
		for _, at := range admitted {
			if at >= from && at < to {
				n++
			}
		}
		bound := lowBurst + lowRate*(to-from).Seconds()
		t.Logf("%d admitted from %v to %v: at most %.0f under the new limit", n, from.Round(time.Millisecond), to.Round(time.Millisecond), bound)
		if float64(n) > bound {
			t.Errorf("%d admitted from %v to %v, more than the new limit's %.0f: the change did not reach the blocks within 1 s", n, from, to, bound)
		}
	}
	t.Run("plan", func(t *testing.T) {
		srv := testredis.Start(t)
		planned := hotPolicy("rate", "500/1s", "burst", lowBurst, "plan", map[string]any{"from": "{http.request.header.X-Plan}",
			"plans": map[string]any{"pro": map[string]any{"rate": "5000/1s", "burst": hotBurst}}})
		fleet := []*instance{startCaddy(t, decidedByRedis(srv.Addr, planned), respond()), startCaddy(t, decidedByRedis(srv.Addr, planned), respond())}
		const switchAt = 2 * time.Second
		admitted, _ := admissionsUnder(t, fleet, 5*time.Second, 0, "tenant-plan", func(since time.Duration) string {
			if since < switchAt {
				return "pro"
			}
			return "" // downgraded: the policy's own limit
		}, func() {})
		within(t, admitted, switchAt+time.Second, 5*time.Second)
	})
	t.Run("override", func(t *testing.T) {
		srv := testredis.Start(t)
		fleet := []*instance{startCaddy(t, decidedByRedis(srv.Addr, hotPolicy()), respond()), startCaddy(t, decidedByRedis(srv.Addr, hotPolicy()), respond())}
		var held string
		admitted, changed := admissionsUnder(t, fleet, 5*time.Second, 2*time.Second, "tenant-override", nil, func() {
			_, held = adminCall(t, fleet[1], "POST", "/rate_limit/inspect", `{"policy":"api_wide","identity":"tenant-override"}`)
			status, body := adminCall(t, fleet[0], "POST", "/rate_limit/override", `{"policy":"api_wide","identity":"tenant-override","rate":"500/1s","burst":50}`)
			if status != 200 {
				t.Errorf("override: %d %s", status, body)
			}
		})
		if !strings.Contains(held, `"blocks_here":{"blocks":`) {
			t.Errorf("inspect of the hot key on an instance holding blocks of it: %s, want blocks_here", held)
		}
		within(t, admitted, changed+time.Second, 5*time.Second)
	})
	t.Run("reset", func(t *testing.T) {
		// A reset gives the bucket its burst back: from a second after it,
		// the fleet admits at most that burst and the rate since. Blocks
		// taken before it must not be spent on top.
		srv := testredis.Start(t)
		fleet := []*instance{startCaddy(t, decidedByRedis(srv.Addr, hotPolicy()), respond()), startCaddy(t, decidedByRedis(srv.Addr, hotPolicy()), respond())}
		admitted, changed := admissionsUnder(t, fleet, 5*time.Second, 2*time.Second, "tenant-reset", nil, func() {
			if status, body := adminCall(t, fleet[0], "POST", "/rate_limit/reset", `{"policy":"api_wide","identity":"tenant-reset"}`); status != 200 {
				t.Errorf("reset: %d %s", status, body)
			}
		})
		from := changed + time.Second
		n := 0
		for _, at := range admitted {
			if at >= from {
				n++
			}
		}
		// What the bucket holds a second after the reset is at most its
		// burst; the rate adds from then on.
		if bound := hotBurst + hotRate*(5*time.Second-from).Seconds(); float64(n) > bound {
			t.Errorf("%d admitted from %v, more than %.0f", n, from, bound)
		}
		t.Logf("%d admitted in the %v from a second after the reset", n, (5*time.Second - from).Round(time.Millisecond))
	})
}

// TestHotKeyBesideV030: instances of this build holding blocks of a hot key
// and one of v0.3.0 (which decides every request in Redis, and knows
// nothing of blocks) on one budget: together they never admit more than
// burst + rate × elapsed. The v0.3.0 instance reads the bucket the blocks
// debited, and so denies what they hold.
func TestHotKeyBesideV030(t *testing.T) {
	bin := previousBin(t) // v0.3.0
	srv := testredis.Start(t)
	fleet := []*instance{startBinary(t, bin, decidedByRedis(srv.Addr, hotPolicy()), respond())}
	for range 3 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, hotPolicy()), respond()))
	}
	r := hotLoad(t, fleet, []int{8, 8, 8, 8}, nil, 8*time.Second, "tenant-mixed")
	admitted, budget := checkBudget(t, r)
	t.Logf("v0.3.0 and 3 of this build: requests %v, admitted %v: %d of a budget of %.1f (%.4f); one exact bucket would have admitted %d; %d failed",
		r.requests, counts(r.admitted), admitted, budget, float64(admitted)/budget, idealAdmits(r.sent), r.failed)
	if r.failed != 0 {
		t.Errorf("%d responses neither 200 nor 429", r.failed)
	}
}

// TestHotKeyCluster: on a Redis Cluster, blocks are taken from the hot
// key's own shard, in the same script as any decision there: two instances
// never admit more than burst + rate × elapsed, and take blocks.
func TestHotKeyCluster(t *testing.T) {
	c := testredis.StartCluster(t, 3, false)
	h := limiter("", map[string]any{"on_error": "fail_closed"}, hotPolicy())
	h["redis"] = map[string]any{"addresses": c.Addrs(), "cluster": true, "timeout": "1s"}
	fleet := []*instance{startCaddy(t, h, respond()), startCaddy(t, h, respond())}
	r := hotLoad(t, fleet, []int{8, 8}, nil, 6*time.Second, "tenant-cluster")
	admitted, budget := checkBudget(t, r)
	var blocks float64
	for _, in := range fleet {
		blocks += metricValue(t, in, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"})
	}
	ideal := idealAdmits(r.sent)
	t.Logf("Redis Cluster, 2 instances: requests %v, admitted %v: %d of a budget of %.1f (one exact bucket: %d); %.0f blocks; %d failed",
		r.requests, counts(r.admitted), admitted, budget, ideal, blocks, r.failed)
	if r.failed != 0 {
		t.Errorf("%d responses neither 200 nor 429", r.failed)
	}
	if blocks == 0 {
		t.Error("no block taken: the key was never hot")
	}
	if share := float64(admitted) / float64(ideal); share < 0.95 {
		t.Errorf("admitted %.4f of what one exact bucket admits of the same requests, want at least 0.95", share)
	}
}

// TestHotKeyRedisAway: with Redis stopped under load, an instance holding
// blocks of a hot key spends what it holds, then the policy's on_error
// (fail_closed: 503); never more than it held, nor over the budget.
func TestHotKeyRedisAway(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddy(t, redisLimiter(srv.Addr, "100ms", map[string]any{"on_error": "fail_closed"}, hotPolicy()), respond())
	var mu sync.Mutex
	var admitted []time.Duration
	statuses := map[int]int{}
	var wg sync.WaitGroup
	start := time.Now()
	const run = 5 * time.Second
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := newKeyClient(in, "tenant-away")
			defer c.close()
			for time.Since(start) < run {
				status := c.ask()
				if status == 0 {
					continue
				}
				mu.Lock()
				statuses[status]++
				if status == 200 {
					admitted = append(admitted, time.Since(start))
				}
				mu.Unlock()
			}
		}()
	}
	time.Sleep(2 * time.Second)
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	paused := time.Since(start)
	time.Sleep(1500 * time.Millisecond)
	resumed := time.Since(start)
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	sort.Slice(admitted, func(a, b int) bool { return admitted[a] < admitted[b] })
	during := 0
	for i, at := range admitted {
		if b := hotBurst + hotRate*at.Seconds(); float64(i+1) > b {
			t.Fatalf("%d admitted by %v: over the budget of %.1f", i+1, at, b)
		}
		if at >= paused && at < resumed {
			during++
		}
	}
	t.Logf("Redis stopped from %v to %v: %d admitted meanwhile (what the instance held); statuses over the run %v",
		paused.Round(time.Millisecond), resumed.Round(time.Millisecond), during, statuses)
	// An instance holds at most its lead and three blocks (docs/hot-keys.md),
	// and a response already decided may arrive just after the stop.
	if during > hotRate/4+3*hotBurst/4+64 {
		t.Errorf("%d admitted with Redis stopped: more than an instance holds", during)
	}
	if statuses[503] == 0 {
		t.Error("no 503 while Redis was stopped: fail_closed never applied")
	}
}

// TestHotKeyInstanceKilled: SIGKILL an instance while it holds blocks of a
// hot key. Nothing it held is spent by anyone else: the fleet never admits
// more than burst + rate × elapsed. What it held is lost for at most one
// block's lifetime (hotkey.MaxAge, 1 s): over the seconds after the kill the
// survivors admit at least 0.95 of what one exact bucket, empty at the kill,
// would admit of the requests they were sent, and from a block's lifetime
// after the kill on, at least 0.95 of it as well. The key is the issue's,
// or, on a machine that cannot send the survivors 1.5 times its rate, the
// largest of hotLadder it does (sizeHotKey): what the kill strands is
// measured only while the survivors are over the budget.
func TestHotKeyInstanceKilled(t *testing.T) {
	const (
		killAt   = 3 * time.Second
		window   = 3 * time.Second // after the kill: longer than a block's lifetime
		lifetime = time.Second     // hotkey.MaxAge
		run      = killAt + time.Second + window + 500*time.Millisecond
	)
	srv := testredis.Start(t)
	handlers := func(k hotKey) []map[string]any {
		return []map[string]any{decidedByRedis(srv.Addr, k.policy()), respond()}
	}
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, handlers(issueKey)...))
	}
	// The survivors are sent three quarters of the load: 1.5 times the
	// rate is twice it for the four.
	key, _ := sizeHotKey(t, fleet, []int{8, 8, 8, 8}, nil, issueKey, 2, handlers)
	rate, burst := float64(key.rate), int64(key.burst)
	doomed := fleet[0]
	blocksBefore := metricValue(t, doomed, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"})
	var (
		mu       sync.Mutex
		admitted []time.Duration // every instance's, as their responses came
		survived []time.Duration // the survivors' requests, as sent
		killed   atomic.Bool
		failed   atomic.Int64
		wg       sync.WaitGroup
	)
	start := time.Now()
	for i, in := range fleet {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := newKeyClient(in, "tenant-killed")
				defer c.close()
				var adm, sent []time.Duration
				for time.Since(start) < run && (i > 0 || !killed.Load()) {
					at := time.Since(start)
					status := c.ask()
					switch {
					case status == 200:
						adm = append(adm, time.Since(start))
					case status == 429:
					case i == 0 && killed.Load(): // its connection died with it
					default:
						failed.Add(1)
					}
					if i > 0 {
						sent = append(sent, at)
					}
				}
				mu.Lock()
				admitted = append(admitted, adm...)
				survived = append(survived, sent...)
				mu.Unlock()
			}()
		}
	}
	time.Sleep(killAt)
	// Kill it the moment it is seen holding tokens of the key.
	var held float64
	for deadline := time.Now().Add(time.Second); held == 0 && time.Now().Before(deadline); {
		held = heldGauge(doomed)
	}
	if held == 0 {
		t.Fatal("the instance to kill holds no tokens of the hot key")
	}
	blocks := metricValue(t, doomed, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"}) - blocksBefore
	killed.Store(true)
	if err := syscall.Kill(doomed.Pid(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	kill := time.Since(start)
	wg.Wait()
	sort.Slice(admitted, func(a, b int) bool { return admitted[a] < admitted[b] })
	for i, at := range admitted {
		if b := float64(burst) + rate*at.Seconds(); float64(i+1) > b {
			t.Fatalf("%d admitted by %v since the load began (an instance killed at %v holding %.0f tokens): over the budget of %.1f", i+1, at, kill, held, b)
		}
	}
	// What the survivors admitted from a time on, against what one exact
	// bucket, empty then, admits of the requests they were sent since.
	over := func(from, to time.Duration) (got, exact int) {
		for _, at := range admitted {
			if at >= from && at < to {
				got++
			}
		}
		interval := int64(1_000_000 / key.rate)
		tat := from.Microseconds() + burst*interval // empty
		sort.Slice(survived, func(a, b int) bool { return survived[a] < survived[b] })
		for _, s := range survived {
			if s < from || s >= to {
				continue
			}
			now := s.Microseconds()
			if base := max(tat, now); base+interval-now <= burst*interval {
				tat, exact = base+interval, exact+1
			}
		}
		return got, exact
	}
	got, exact := over(kill, kill+window)
	later, laterExact := over(kill+lifetime, kill+window)
	sent := 0
	for _, s := range survived {
		if s >= kill && s < kill+window {
			sent++
		}
	}
	t.Logf("key %v: killed at %v holding %.0f tokens (%.0f blocks taken); in the %v after: the survivors were sent %d requests, admitted %d of the %d one exact bucket empty at the kill admits (%.4f; the rate alone: %.0f); from %v after the kill: %d of %d (%.4f); %d failed",
		key, kill.Round(time.Millisecond), held, blocks, window, sent, got, exact, float64(got)/float64(exact), rate*window.Seconds(),
		lifetime, later, laterExact, float64(later)/float64(laterExact), failed.Load())
	if float64(sent) < 1.5*rate*window.Seconds() {
		// The survivors then hold blocks sized to less than the budget,
		// and what the killed one held is hidden in what they were not sent.
		t.Logf("the machine sent the survivors %d requests, less than 1.5 times the %.0f the rate allows in the %v: what the kill strands is measured only in part", sent, rate*window.Seconds(), window)
	}
	if failed.Load() != 0 {
		t.Errorf("%d responses of the survivors neither 200 nor 429", failed.Load())
	}
	if share := float64(got) / float64(exact); share < 0.95 {
		t.Errorf("the survivors admitted %.4f of the budget in the %v after the kill, want at least 0.95: what the killed instance held stayed lost", share, window)
	}
	if share := float64(later) / float64(laterExact); share < 0.95 {
		t.Errorf("from a block's lifetime after the kill, the survivors admitted %.4f of the budget, want at least 0.95", share)
	}
}

// TestHotKeyChargeIf: a busy key of a charge_if policy (charged only for a
// 401, the others' tokens given back after their responses) is decided call
// by call, never from blocks (its give-backs would move the bucket's line
// under blocks held elsewhere), and what its users see holds: the charged
// responses never exceed burst + rate × elapsed across the fleet, and a
// response not charged leaves its token for the others (the charged ones
// reach at least 0.95 of what one exact bucket admits of the 401s sent).
func TestHotKeyChargeIf(t *testing.T) {
	const rate, burst = 2_000, 200
	srv := testredis.Start(t)
	policy := hotPolicy("rate", "2000/1s", "burst", burst, "charge_if", map[string]any{"status_code": []int{401}})
	// The client says which status it gets: half the requests are charged.
	echo := map[string]any{"handler": "static_response", "status_code": "{http.request.header.X-Status}", "body": "ok"}
	var fleet []*instance
	for range 3 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, policy), echo))
	}
	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	const run = 6 * time.Second
	var (
		mu                   sync.Mutex
		charged, free        []time.Duration // 401s and 200s, as their responses came
		chargedSent          []time.Duration // the requests sent for a 401
		denied, failed, sent atomic.Int64
		wg                   sync.WaitGroup
	)
	start := time.Now()
	for _, in := range fleet {
		for range 8 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				c := newKeyClient(in, "tenant-charge-if")
				defer c.close()
				var ch, fr, chSent []time.Duration
				for n := 0; time.Since(start) < run; n++ {
					want := "200"
					at := time.Since(start)
					if n%2 == 0 {
						want = "401"
						chSent = append(chSent, at)
					}
					sent.Add(1)
					switch status := c.ask("X-Status", want); {
					case status == 429:
						denied.Add(1)
					case strconv.Itoa(status) != want:
						failed.Add(1)
					case status == 401:
						ch = append(ch, time.Since(start))
					default:
						fr = append(fr, time.Since(start))
					}
				}
				mu.Lock()
				charged, free, chargedSent = append(charged, ch...), append(free, fr...), append(chargedSent, chSent...)
				mu.Unlock()
			}()
		}
	}
	wg.Wait()
	calls := scriptCallsOf(t, srv)
	sort.Slice(charged, func(a, b int) bool { return charged[a] < charged[b] })
	for i, at := range charged {
		if b := burst + rate*at.Seconds(); float64(i+1) > b {
			t.Fatalf("%d responses charged by %v since the load began: over the budget of %.1f", i+1, at, b)
		}
	}
	var blocks float64
	for _, in := range fleet {
		blocks += metricValue(t, in, "caddy_rate_limit_hot_blocks_total", map[string]string{"policy": "api_wide"})
	}
	exact := idealAdmitsOf(chargedSent, rate, burst)
	budget := burst + rate*run.Seconds()
	t.Logf("3 instances, %v: %d requests, %d charged (401) of %d sent for a 401, %d not charged (200), %d denied; one exact bucket admits %d of the 401s sent (charged %.4f of that; the budget %.0f); %.0f blocks taken; %d script calls (%.4f per admission); %d failed",
		run, sent.Load(), len(charged), len(chargedSent), len(free), denied.Load(), exact, float64(len(charged))/float64(exact), budget, blocks, calls, float64(calls)/float64(len(charged)+len(free)), failed.Load())
	if failed.Load() != 0 {
		t.Errorf("%d responses neither 429 nor the status asked for", failed.Load())
	}
	if blocks != 0 {
		t.Errorf("%.0f blocks taken of a charge_if key", blocks)
	}
	if share := float64(len(charged)) / float64(exact); share < 0.95 {
		t.Errorf("charged %.4f of what one exact bucket admits of the 401s sent, want at least 0.95: the tokens of responses not charged did not come back", share)
	}
}
