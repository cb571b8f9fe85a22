// Command fleet runs a fleet on one machine: a Redis and two Caddy
// instances serving Caddyfile.fleet (Caddyfile.example with its buckets in
// Redis), one file for both, each on its own ports. It prints how to send
// requests to each, sends a short scripted run from one client to both,
// prints what each instance admitted against the budget they share, then
// keeps the fleet up until it is stopped: Ctrl-C, or `kill <pid>` of make,
// of go run or of this program (it prints the pids), when it stops
// everything it started, by PID. Run it with `make fleet` (which installs
// redis-server when missing) or `go run ./cmd/fleet`.
package main

import (
	"crypto/rand"
	"encoding/hex"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The Caddyfile both instances run, and its per_ip policy's budget.
const (
	caddyfile = "Caddyfile.fleet"
	policy    = "per_ip"
	burst     = 10
	rate      = 2 // per second
)

// The scripted run: one client, so one per_ip bucket, over both instances.
const (
	runFor = 5 * time.Second
	// offered is requests per second, in total: 15, so that a token comes
	// back (every 500 ms) on either instance's turn in the alternation, not
	// always on the same one's.
	offered = 15
	workers = 8
)

// Ports tried first, so that the commands printed are the same from run to
// run (beside `make run`'s 8080 and 2019); free ones when they are taken.
var preferred = []struct{ site, admin int }{{8081, 2021}, {8082, 2022}}

func main() {
	caddyBin := flag.String("caddy", "", "a Caddy binary with the module (default: build ./cmd/caddy)")
	exit := flag.Bool("exit", false, "stop the fleet once the scripted run is printed, instead of waiting for Ctrl-C")
	load := flag.Bool("load", true, "run the scripted load and print what each instance admitted")
	flag.Parse()
	if _, err := os.Stat(caddyfile); err != nil {
		fmt.Fprintf(os.Stderr, "fleet: %v: run it from the repository's root (make fleet)\n", err)
		os.Exit(1)
	}

	s := testcaddy.NewSession("fleet")
	defer s.Close()
	var pids []string
	var pidsMu sync.Mutex
	stopping := func() string {
		pidsMu.Lock()
		defer pidsMu.Unlock()
		return "stopping " + strings.Join(pids, ", ")
	}
	s.CloseOnSignal(stopping, 0) // Ctrl-C (or a kill of this program) is how the fleet ends: exit 0
	parent := closeWithParent(s, stopping)

	bin := *caddyBin
	if bin == "" {
		fmt.Println("Building Caddy with the module (go build ./cmd/caddy)...")
		bin = filepath.Join(s.TempDir(), "caddy")
		if err := testcaddy.Build(bin); err != nil {
			s.Fatalf("building caddy: %v", err)
		}
	}
	secret := os.Getenv("RATE_LIMIT_SECRET")
	if secret == "" {
		var b [32]byte
		_, _ = rand.Read(b[:])
		secret = hex.EncodeToString(b[:])
	}

	srv := testredis.Start(s)
	pidsMu.Lock()
	pids = append(pids, fmt.Sprintf("redis-server (pid %d)", srv.Pid()))
	pidsMu.Unlock()

	fleet := make([]*testcaddy.Instance, len(preferred))
	names := make([]string, len(preferred))
	for i, p := range preferred {
		names[i] = "caddy-" + strconv.Itoa(i+1)
		site, admin := portOr(s, p.site), portOr(s, p.admin)
		fleet[i] = testcaddy.StartFile(s, bin, caddyfile, "caddyfile", site, admin, []string{
			"SITE_PORT=" + strconv.Itoa(site), "ADMIN_ADDRESS=127.0.0.1:" + strconv.Itoa(admin),
			"REDIS_ADDRESS=" + srv.Addr, "RATE_LIMIT_SECRET=" + secret, "INSTANCE=" + names[i],
		})
		pidsMu.Lock()
		pids = append(pids, fmt.Sprintf("%s (pid %d)", names[i], fleet[i].Pid()))
		pidsMu.Unlock()
	}

	fmt.Printf("\nA fleet: one Redis and two Caddy instances running %s, one file for both:\n", caddyfile)
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  %s\t%s\tpid %d\n", srv.Server(), srv.Addr, srv.Pid())
	for i, in := range fleet {
		fmt.Fprintf(tw, "  %s\t%s\tpid %d, admin API %s, log %s\n", names[i], in.URL, in.Pid(), strings.TrimPrefix(in.Admin, "http://"), in.Log)
	}
	tw.Flush()
	fmt.Printf("Policy %s: each client IP gets %d requests at once, then %d per second, on both instances together.\n", policy, burst, rate)
	fmt.Println("\nSend requests to each (in another shell):")
	for _, in := range fleet {
		fmt.Printf("  curl -i %s/\n", in.URL)
	}
	fmt.Printf("  for i in $(seq 12); do curl -s -o /dev/null -w '%%{http_code} ' %s/; curl -s -o /dev/null -w '%%{http_code} ' %s/; done; echo\n", fleet[0].URL, fleet[1].URL)
	fmt.Printf("  %s rate-limit inspect %s 127.0.0.1 --address %s   # the shared bucket, from either instance\n", bin, policy, strings.TrimPrefix(fleet[1].Admin, "http://"))

	if *load {
		fmt.Printf("\nScripted run: one client (127.0.0.1: one %s bucket) sends %d requests/s for %v, alternating between the instances...\n", policy, offered, runFor)
		rows := scriptedRun(fleet)
		printRun(names, fleet, rows)
	}

	if *exit {
		fmt.Printf("\nStopping %s.\n", strings.Join(pids, ", "))
		return
	}
	fmt.Println("\nThe fleet keeps running: send your own requests (above). To stop Redis and both Caddy instances:")
	fmt.Printf("  Ctrl-C here, or from another shell: kill %d   (%s); the pid of the make that started it, or this program's (%d), do the same\n",
		parent, processName(parent), os.Getpid())
	select {}
}

// closeWithParent stops the fleet, as a signal would, when the process that
// started this program exits: `go run` under `make fleet` dies of the
// SIGTERM that make forwards to it when make is killed, and `go run` itself
// forwards no SIGTERM to its child, so the fleet would otherwise outlive
// the command the user stopped. It returns the parent's pid.
func closeWithParent(s *testcaddy.Session, stopping func() string) int {
	parent := os.Getppid()
	if parent <= 1 { // started detached: nothing to follow
		return parent
	}
	name := processName(parent)
	go func() {
		for range time.Tick(200 * time.Millisecond) {
			if os.Getppid() != parent {
				fmt.Fprintf(os.Stderr, "\nfleet: the process that started it (%s, pid %d) is gone: %s\n", name, parent, stopping())
				s.Close()
				os.Exit(0)
			}
		}
	}()
	return parent
}

// processName is the name of process pid (Linux's /proc), or "its parent".
func processName(pid int) string {
	comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
	if err != nil {
		return "its parent"
	}
	name := strings.TrimSpace(string(comm))
	if name == "go" {
		return "go run"
	}
	return name
}

// portOr is port when it is free on 127.0.0.1, otherwise a free one.
func portOr(s *testcaddy.Session, port int) int {
	l, err := net.Listen("tcp", "127.0.0.1:"+strconv.Itoa(port))
	if err != nil {
		return testredis.FreePort(s)
	}
	l.Close()
	return port
}

// row is what the client saw of one instance: requests sent, admitted by
// the shared budget, denied (429), and anything else (admitted without a
// decision, fail_open, or an error).
type row struct {
	sent, admitted, denied, other int
}

// scriptedRun offers requests over the instances in turn (testcaddy.Paced)
// and counts each instance's answers.
func scriptedRun(fleet []*testcaddy.Instance) []row {
	rows := make([]row, len(fleet))
	var mu sync.Mutex
	client := &http.Client{Timeout: 5 * time.Second}
	testcaddy.Paced(offered, runFor, workers, func(n int, _ time.Duration) {
		i := n % len(fleet)
		status, decision := 0, ""
		if resp, err := client.Get(fleet[i].URL + "/"); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			status, decision = resp.StatusCode, resp.Header.Get("X-RateLimit-Decision")
		}
		mu.Lock()
		defer mu.Unlock()
		rows[i].sent++
		switch {
		case status == 200 && decision == "allowed":
			rows[i].admitted++
		case status == 429:
			rows[i].denied++
		default:
			rows[i].other++
		}
	})
	return rows
}

func printRun(names []string, fleet []*testcaddy.Instance, rows []row) {
	var all row
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "Instance\tURL\tSent\tAdmitted\t429s\tOther")
	for i, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%d\t%d\n", names[i], fleet[i].URL, r.sent, r.admitted, r.denied, r.other)
		all.sent, all.admitted, all.denied, all.other = all.sent+r.sent, all.admitted+r.admitted, all.denied+r.denied, all.other+r.other
	}
	fmt.Fprintf(tw, "Together\t\t%d\t%d\t%d\t%d\n", all.sent, all.admitted, all.denied, all.other)
	tw.Flush()
	budget := burst + rate*int(runFor/time.Second)
	fmt.Printf("Budget of %s over %v: burst %d + %d/s × %v = %d. Admitted together: %d (%.2f× the budget): one budget for the fleet, not one per instance (%d).\n",
		policy, runFor, burst, rate, runFor, budget, all.admitted, float64(all.admitted)/float64(budget), len(fleet)*budget)
	if all.other > 0 {
		fmt.Printf("%d answers were neither admitted by Redis nor 429 (fail_open while Redis was slow, or errors): see the Caddy logs above.\n", all.other)
	}
}
