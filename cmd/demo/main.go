// Command demo shows, in under a minute, the bug this module fixes and the
// fix: four Caddy instances that each allow "20 per second" admit about
// 80 per second between them with in-process buckets, and 20 per second
// with the buckets shared in Redis. It then shows the outbound case: four
// sidecars sharing one 1 request/s upstream budget in `wait` mode.
//
// It builds Caddy with the module (./cmd/caddy), starts a redis-server and
// the Caddy processes on free 127.0.0.1 ports, sends a bounded load (at
// most 200 requests/s, only to 127.0.0.1), prints the results as tables,
// writes demo-output/admitted.svg, and stops everything it started, also
// on Ctrl-C or SIGTERM. Run it with `make demo` (which installs
// redis-server when missing) or `go run ./cmd/demo`.
package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The inbound scenario: one API key's budget, spread over the fleet.
const (
	fleetSize   = 4
	inRate      = 20 // per second
	inBurst     = 10
	inOffered   = 200 // requests per second the client sends, in total
	inRun       = 6 * time.Second
	inWorkers   = 16
	apiKey      = "tenant-42"
	outRun      = 8 * time.Second
	outWorkers  = 2 * fleetSize
	outputDir   = "demo-output"
	chartFile   = "admitted.svg"
	redisPolicy = "per_key"
)

func main() {
	s := testcaddy.NewSession("demo")
	defer s.Close()
	s.CloseOnSignal(func() string { return "stopping every process it started" }, 130)
	start := time.Now()

	fmt.Println("rate_limit demo: the same policy on four Caddy instances, with in-process buckets and with buckets in Redis.")
	fmt.Println()
	fmt.Println("Building Caddy with the module (go build ./cmd/caddy)...")
	bin := filepath.Join(s.TempDir(), "caddy")
	if err := testcaddy.Build(bin); err != nil {
		s.Fatalf("building caddy: %v", err)
	}
	srv := testredis.Start(s)
	fmt.Printf("Started %s on %s.\n\n", srv.Server(), srv.Addr)

	// Inbound: one API key, one policy, four instances.
	fmt.Printf("Inbound: policy %q keyed on the X-Api-Key header, rate %d/1s, burst %d, on %d Caddy instances.\n", redisPolicy, inRate, inBurst, fleetSize)
	fmt.Printf("One client sends %d requests/s with one API key for %v, round-robin over the instances.\n", inOffered, inRun)
	local := runInbound(s, bin, "in-process", "")
	shared := runInbound(s, bin, "Redis", srv.Addr)
	fmt.Println()
	printInbound(local, shared)

	chart, err := writeChart(local, shared)
	if err != nil {
		s.Fatalf("writing the chart: %v", err)
	}
	fmt.Printf("\nChart of admitted requests per second against the budget: %s\n\n", chart)

	// Outbound: four sidecars in front of one third-party API.
	fmt.Printf("Outbound: %d sidecars in front of one upstream API that allows 1 request/s for everyone:\n", fleetSize)
	fmt.Println("policy vendor_api { key global; rate 1/1s; burst 1; wait 30s } and reverse_proxy to the upstream.")
	fmt.Printf("%d clients (2 per sidecar) send one request after the other for %v; a request held by wait is sent when its slot comes.\n", outWorkers, outRun)
	outLocal := runOutbound(s, bin, "in-process", "")
	outShared := runOutbound(s, bin, "Redis", srv.Addr)
	fmt.Println()
	printOutbound(outLocal, outShared)

	s.Close()
	fmt.Printf("\nStopped the %d Caddy processes and redis-server it started (%.0f s in all).\n", 4*fleetSize, time.Since(start).Seconds())
}

// limiter is the rate_limit handler, with the buckets in Redis when
// redisAddr is set, in the Caddy process otherwise.
func limiter(redisAddr string, policy map[string]any) map[string]any {
	h := map[string]any{"handler": "rate_limit", "policies": []any{policy}}
	if redisAddr != "" {
		h["redis"] = map[string]any{"addresses": []string{redisAddr}, "timeout": "1s"}
	}
	return h
}

// startFleet starts fleetSize Caddy instances at once, the i-th running
// handlers(i).
func startFleet(s *testcaddy.Session, bin string, handlers func(i int) []map[string]any) []*testcaddy.Instance {
	fleet := make([]*testcaddy.Instance, fleetSize)
	var wg sync.WaitGroup
	for i := range fleet {
		wg.Add(1)
		go func() {
			defer wg.Done()
			fleet[i] = testcaddy.Start(s, bin, nil, handlers(i)...)
		}()
	}
	wg.Wait()
	return fleet
}

// stopFleet stops the instances at once (each is also stopped on exit).
func stopFleet(fleet []*testcaddy.Instance) {
	var wg sync.WaitGroup
	for _, in := range fleet {
		wg.Add(1)
		go func() { defer wg.Done(); in.Stop() }()
	}
	wg.Wait()
}

// inbound is what the client saw of one fleet.
type inbound struct {
	store                    string
	sent, admitted, rejected int
	other                    int
	perSecond                []int // admitted, by the second the request was sent in
}

// budget is what one bucket admits over the run: the burst, then the rate.
func (r inbound) budget() int { return inBurst + inRate*int(inRun/time.Second) }

// steady is the admitted rate after the first second (the burst).
func (r inbound) steady() float64 {
	n := 0
	for _, c := range r.perSecond[1:] {
		n += c
	}
	return float64(n) / float64(len(r.perSecond)-1)
}

// runInbound starts a fleet and paces inOffered requests per second over
// it for inRun, from inWorkers concurrent requests at most (a tick whose
// request cannot be sent because all are busy is skipped).
func runInbound(s *testcaddy.Session, bin, store, redisAddr string) inbound {
	fmt.Printf("  %-10s starting %d Caddy instances... ", store+":", fleetSize)
	fleet := startFleet(s, bin, func(int) []map[string]any {
		return []map[string]any{limiter(redisAddr, map[string]any{
			"name": redisPolicy, "key": "{http.request.header.X-Api-Key}", "rate": strconv.Itoa(inRate) + "/1s", "burst": inBurst,
		}), {"handler": "static_response", "status_code": 200, "body": "ok"}}
	})
	defer stopFleet(fleet)
	fmt.Printf("sending for %v... ", inRun)

	r := inbound{store: store, perSecond: make([]int, int(inRun/time.Second))}
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: inWorkers}}
	var mu sync.Mutex
	r.sent = testcaddy.Paced(inOffered, inRun, inWorkers, func(n int, at time.Duration) {
		status := 0
		req, _ := http.NewRequest("GET", fleet[n%fleetSize].URL+"/", nil)
		req.Header.Set("X-Api-Key", apiKey)
		if resp, err := client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			status = resp.StatusCode
		}
		mu.Lock()
		defer mu.Unlock()
		switch status {
		case 200:
			r.admitted++
			r.perSecond[int(at/time.Second)]++
		case 429:
			r.rejected++
		default:
			r.other++
		}
	})
	fmt.Printf("%d admitted of %d.\n", r.admitted, r.sent)
	if r.other > 0 {
		fmt.Printf("  %d responses were neither 200 nor 429; see the Caddy logs above.\n", r.other)
	}
	return r
}

func printInbound(rows ...inbound) {
	fmt.Printf("Inbound, one API key over %v (budget %d/s with burst %d: at most %d + %d × %d = %d requests):\n",
		inRun, inRate, inBurst, inBurst, inRate, int(inRun/time.Second), rows[0].budget())
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "Store\tInstances\tBudget\tSent\tAdmitted\tAdmitted / budget\tAdmitted/s after the burst\t429s")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%d\t%d/s, burst %d\t%d\t%d\t%.2f×\t%.1f/s\t%d\n",
			r.store, fleetSize, inRate, inBurst, r.sent, r.admitted, float64(r.admitted)/float64(r.budget()), r.steady(), r.rejected)
	}
	tw.Flush()
	for _, r := range rows {
		ratio := float64(r.admitted) / float64(r.budget())
		if r.store == "Redis" {
			fmt.Printf("%s: one bucket shared by the %d instances: %.2f× the budget.\n", r.store, fleetSize, ratio)
		} else {
			fmt.Printf("%s: each instance has its own bucket, so %d instances admit %.2f× the budget.\n", r.store, fleetSize, ratio)
		}
	}
}

// outbound is what the upstream and the clients saw of one set of sidecars.
type outbound struct {
	store    string
	arrivals []time.Duration // at the upstream, since the run began
	sidecar  []string        // which sidecar sent each arrival
	// At the clients: sent on at once, held by wait and then sent,
	// answered 429, still held when the run ended.
	immediate, held, rejected, unfinished, other int
	late                                         int // arrivals after the run
	longestHold                                  time.Duration
}

// rate is the upstream's requests per second over the run.
func (o outbound) rate() float64 { return float64(len(o.arrivals)) / outRun.Seconds() }

func (o outbound) closest() time.Duration {
	gap := time.Duration(-1)
	for i := 1; i < len(o.arrivals); i++ {
		if d := o.arrivals[i] - o.arrivals[i-1]; gap < 0 || d < gap {
			gap = d
		}
	}
	return gap
}

// runOutbound starts an upstream that records when each request arrives,
// and fleetSize sidecars in front of it sharing one 1/s budget in wait
// mode; outWorkers clients send one request after the other for outRun.
func runOutbound(s *testcaddy.Session, bin, store, redisAddr string) outbound {
	o := outbound{store: store}
	var mu sync.Mutex
	var begin time.Time
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.Fatalf("upstream: %v", err)
	}
	up := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		o.arrivals = append(o.arrivals, time.Since(begin))
		o.sidecar = append(o.sidecar, r.Header.Get("X-Sidecar"))
		mu.Unlock()
		_, _ = w.Write([]byte("upstream"))
	})}
	go func() { _ = up.Serve(l) }()
	s.Cleanup(func() { up.Close() })

	fmt.Printf("  %-10s starting %d sidecars... ", store+":", fleetSize)
	fleet := startFleet(s, bin, func(i int) []map[string]any {
		return []map[string]any{
			limiter(redisAddr, map[string]any{"name": "vendor_api", "key": "global", "rate": "1/1s", "burst": 1, "wait": "30s"}),
			{
				"handler":   "reverse_proxy",
				"upstreams": []any{map[string]any{"dial": l.Addr().String()}},
				"headers":   map[string]any{"request": map[string]any{"set": map[string]any{"X-Sidecar": []string{strconv.Itoa(i + 1)}}}},
			},
		}
	})
	defer stopFleet(fleet)
	fmt.Printf("sending for %v... ", outRun)

	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: outWorkers}}
	ctx, cancel := context.WithTimeout(context.Background(), outRun)
	defer cancel()
	mu.Lock()
	begin = time.Now()
	mu.Unlock()
	var cw sync.WaitGroup
	for w := range outWorkers {
		cw.Add(1)
		go func() {
			defer cw.Done()
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, "GET", fleet[w%fleetSize].URL+"/", nil)
				sent := time.Now()
				resp, err := client.Do(req)
				took := time.Since(sent)
				status := 0
				if err == nil {
					_, _ = io.Copy(io.Discard, resp.Body)
					resp.Body.Close()
					status = resp.StatusCode
				}
				mu.Lock()
				switch {
				case err != nil && ctx.Err() != nil:
					o.unfinished++
				case status == 200 && took < 200*time.Millisecond:
					o.immediate++
				case status == 200:
					o.held++
					o.longestHold = max(o.longestHold, took)
				case status == 429:
					o.rejected++
				default:
					o.other++
				}
				mu.Unlock()
				if status == 429 {
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}
	cw.Wait()
	up.Close()
	mu.Lock()
	defer mu.Unlock()
	idx := make([]int, len(o.arrivals))
	for i := range idx {
		idx[i] = i
	}
	sort.Slice(idx, func(a, b int) bool { return o.arrivals[idx[a]] < o.arrivals[idx[b]] })
	arr, sc := make([]time.Duration, len(idx)), make([]string, len(idx))
	for i, j := range idx {
		arr[i], sc[i] = o.arrivals[j], o.sidecar[j]
	}
	// A request the sidecar held past the end of the run belongs to a
	// client that gave up; it is counted apart (on a busy machine a
	// sidecar can notice the client leaving after the slot came).
	for len(arr) > 0 && arr[len(arr)-1] >= outRun {
		arr, sc = arr[:len(arr)-1], sc[:len(sc)-1]
		o.late++
	}
	o.arrivals, o.sidecar = arr, sc
	fmt.Printf("the upstream got %d.\n", len(o.arrivals))
	return o
}

func printOutbound(rows ...outbound) {
	fmt.Printf("Outbound, %v, upstream budget 1 request/s:\n", outRun)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "Store\tSidecars\tBudget\tUpstream got\tUpstream rate\tClosest two\tSent at once\tHeld, then sent\tLongest hold\t429s\tHeld at the end")
	for _, o := range rows {
		fmt.Fprintf(tw, "%s\t%d\t1/s, wait 30s\t%d\t%.2f/s\t%.3f s\t%d\t%d\t%.1f s\t%d\t%d\n",
			o.store, fleetSize, len(o.arrivals), o.rate(), o.closest().Seconds(), o.immediate, o.held, o.longestHold.Seconds(), o.rejected, o.unfinished)
	}
	tw.Flush()
	for _, o := range rows {
		var b strings.Builder
		for i, at := range o.arrivals {
			if i == 12 {
				fmt.Fprintf(&b, " … (%d more)", len(o.arrivals)-i)
				break
			}
			fmt.Fprintf(&b, " %.2f(%s)", at.Seconds(), o.sidecar[i])
		}
		fmt.Printf("Upstream arrivals, %s (s since start, sidecar):%s\n", o.store, b.String())
	}
	for _, o := range rows {
		if o.other > 0 {
			fmt.Printf("%s: %d responses were neither 200 nor 429.\n", o.store, o.other)
		}
		if o.late > 0 {
			fmt.Printf("%s: %d more reached the upstream after the run, from clients that had given up.\n", o.store, o.late)
		}
	}
}
