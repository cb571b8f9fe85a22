package integration_test

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// arrival is one request as the upstream saw it.
type arrival struct {
	at      time.Time
	sidecar string
	sentAt  time.Time // when the client sent it
}

// countingUpstream records every request's arrival.
type countingUpstream struct {
	mu       sync.Mutex
	arrivals []arrival
	addr     string
}

func startUpstream(t *testing.T) *countingUpstream {
	t.Helper()
	u := &countingUpstream{}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sent, _ := strconv.ParseInt(r.Header.Get("X-Sent"), 10, 64)
		u.mu.Lock()
		u.arrivals = append(u.arrivals, arrival{at: time.Now(), sidecar: r.Header.Get("X-Sidecar"), sentAt: time.Unix(0, sent)})
		u.mu.Unlock()
		_, _ = w.Write([]byte("upstream"))
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return u
}

// TestWaitSharesAnOutboundBudget: four sidecars share one third-party
// budget of 1 request per second in wait mode. Workers send as fast as they
// can; the upstream sees one request per second, never two within 0.9 s; a
// request is denied only when its slot is beyond the 30 s wait.
func TestWaitSharesAnOutboundBudget(t *testing.T) {
	srv := testredis.Start(t)
	up := startUpstream(t)
	var sidecars []*instance
	for i := range 4 {
		sidecars = append(sidecars, startCaddy(t,
			redisLimiter(srv.Addr, "1s", nil, map[string]any{
				"name": "vendor_api", "key": "global", "rate": "1/1s", "burst": 1, "wait": "30s",
			}),
			map[string]any{
				"handler":   "reverse_proxy",
				"upstreams": []any{map[string]any{"dial": up.addr}},
				"headers":   map[string]any{"request": map[string]any{"set": map[string]any{"X-Sidecar": []string{strconv.Itoa(i)}}}},
			},
		))
	}

	// 40 workers, 10 per sidecar: enough to queue more than 30 s of slots.
	const run = 12 * time.Second
	ctx, cancel := context.WithTimeout(context.Background(), run)
	defer cancel()
	client := newClient()
	client.Timeout = 0 // held requests wait up to 30 s; the run's context bounds them
	var mu sync.Mutex
	statuses := map[string]int{}
	var deniedT []int64
	var wg sync.WaitGroup
	start := time.Now()
	for w := range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				req, _ := http.NewRequestWithContext(ctx, "GET", sidecars[w%4].URL+"/", nil)
				req.Header.Set("X-Sent", strconv.FormatInt(time.Now().UnixNano(), 10))
				resp, err := client.Do(req)
				if err != nil {
					mu.Lock()
					statuses["gave up at the end of the run"]++
					mu.Unlock()
					continue
				}
				resp.Body.Close()
				mu.Lock()
				statuses[strconv.Itoa(resp.StatusCode)]++
				if resp.StatusCode == 429 {
					lim := parseFields(t, resp.Header, "RateLimit")
					deniedT = append(deniedT, lim[0].params["t"])
				}
				mu.Unlock()
				if resp.StatusCode == 429 {
					time.Sleep(50 * time.Millisecond) // a polite client; keeps the log small
				}
			}
		}()
	}
	wg.Wait()

	up.mu.Lock()
	arrivals := append([]arrival(nil), up.arrivals...)
	up.mu.Unlock()
	sort.Slice(arrivals, func(i, j int) bool { return arrivals[i].at.Before(arrivals[j].at) })
	if len(arrivals) < 2 {
		t.Fatalf("upstream saw %d requests", len(arrivals))
	}
	var series []string
	minGap := time.Hour
	for i, a := range arrivals {
		series = append(series, fmt.Sprintf("%.2fs(%s)", a.at.Sub(start).Seconds(), a.sidecar))
		if i > 0 {
			minGap = min(minGap, a.at.Sub(arrivals[i-1].at))
		}
	}
	span := arrivals[len(arrivals)-1].at.Sub(arrivals[0].at).Seconds()
	t.Logf("upstream arrivals (s since start, sidecar): %s", strings.Join(series, " "))
	t.Logf("%d arrivals over %.2fs (1 + 1/s × span = %.1f), closest two %v apart; client saw %v",
		len(arrivals), span, 1+span, minGap.Round(time.Millisecond), statuses)

	if d := float64(len(arrivals)) - (1 + span); d < -1 || d > 1 {
		t.Errorf("%d arrivals over %.2fs, want 1 per second (%.1f ± 1)", len(arrivals), span, 1+span)
	}
	if minGap < 900*time.Millisecond {
		t.Errorf("two upstream requests %v apart, want ≥ 0.9s", minGap)
	}
	if statuses["429"] == 0 {
		t.Errorf("no 429: 40 workers should have queued beyond the 30s wait")
	}
	for _, tt := range deniedT {
		if tt < 30 {
			t.Errorf("a 429 whose slot was %ds away: within the 30s wait it should have been held", tt)
			break
		}
	}
	for code := range statuses {
		if code != "200" && code != "429" && code != "gave up at the end of the run" {
			t.Errorf("status %s: want only 200 and 429", code)
		}
	}
	// Arrival order per sidecar follows send order (FIFO), within 100ms.
	for i := range arrivals {
		for j := i + 1; j < len(arrivals); j++ {
			a, b := arrivals[i], arrivals[j]
			if a.sidecar == b.sidecar && b.sentAt.Add(100*time.Millisecond).Before(a.sentAt) {
				t.Errorf("sidecar %s: a request sent %v earlier arrived later", a.sidecar, a.sentAt.Sub(b.sentAt))
			}
		}
	}
}
