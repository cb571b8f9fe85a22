package integration_test

import (
	"fmt"
	"io"
	"net/http"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The window of a token bucket with hot keys (issue 45, item 1): over any
// interval T a bucket admits at most burst + rate × T. A key kept hot on
// an instance by requests another policy denies must not hold tokens past
// the bucket's own schedule: a burst of fresh clients after such a lull
// is admitted within the window, not the window plus what the instances
// held.

// windowPolicies are a tenant-wide budget (200/s, burst 100, hot keys
// as configured) and one request an hour per user, which denies the users
// that spent theirs.
func windowPolicies(hotKeys string) []map[string]any {
	global := map[string]any{"name": "tenant", "key": "{http.request.header.X-Tenant}", "rate": "200/1s", "burst": 100}
	if hotKeys != "" {
		global["hot_keys"] = hotKeys
	}
	perUser := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1/1h", "burst": 1, "hot_keys": "off"}
	return []map[string]any{perUser, global}
}

// burstRound is one round: fresh users sent at once across the fleet.
type burstRound struct {
	admitted int
	span     time.Duration // from the first request sent to the last admission answered
	bound    float64       // burst + rate × span
}

// burstRounds keeps the tenant's key hot on every instance with users that
// spent their request (per_user denies them: nothing is admitted), then,
// rounds times, sends users fresh users at once, split across the fleet,
// a second after the last round (the bucket refills in 0.5 s).
func burstRounds(t *testing.T, fleet []*instance, rounds, users int) []burstRound {
	t.Helper()
	// The spent users: their one request, then the bucket refills.
	const spentPerInstance = 4
	for i, in := range fleet {
		for c := range spentPerInstance {
			getWith(t, newClient(), in.URL+"/", map[string]string{"X-Tenant": "acme", "X-User": fmt.Sprintf("spent-%d-%d", i, c)})
		}
	}
	time.Sleep(time.Second)
	stop := make(chan struct{})
	var background sync.WaitGroup
	var denied, bgAdmitted atomic.Int64
	for i, in := range fleet {
		for c := range spentPerInstance {
			background.Add(1)
			go func() {
				defer background.Done()
				client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 1, DisableCompression: true}}
				defer client.CloseIdleConnections()
				for {
					select {
					case <-stop:
						return
					default:
					}
					switch statusOf(client, in.URL+"/", "X-Tenant", "acme", "X-User", fmt.Sprintf("spent-%d-%d", i, c)) {
					case 429:
						denied.Add(1)
					case 200:
						bgAdmitted.Add(1)
					}
				}
			}()
		}
	}
	defer func() {
		close(stop)
		background.Wait()
		t.Logf("background: %d requests denied by per_user, %d admitted", denied.Load(), bgAdmitted.Load())
	}()
	time.Sleep(time.Second) // the key is hot on every instance
	var out []burstRound
	for round := range rounds {
		clients := make([]*http.Client, users)
		for u := range clients {
			clients[u] = &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableCompression: true}}
		}
		var wg sync.WaitGroup
		var mu sync.Mutex
		var first, last time.Time
		admitted := 0
		start := make(chan struct{})
		for u := range users {
			wg.Add(1)
			go func() {
				defer wg.Done()
				in := fleet[u%len(fleet)]
				req, _ := http.NewRequest("GET", in.URL+"/", nil)
				req.Header.Set("X-Tenant", "acme")
				req.Header.Set("X-User", fmt.Sprintf("fresh-%d-%d", round, u))
				<-start
				sent := time.Now()
				resp, err := clients[u].Do(req)
				answered := time.Now()
				if err != nil {
					return
				}
				resp.Body.Close()
				clients[u].CloseIdleConnections()
				mu.Lock()
				defer mu.Unlock()
				if first.IsZero() || sent.Before(first) {
					first = sent
				}
				if resp.StatusCode == 200 {
					admitted++
					if answered.After(last) {
						last = answered
					}
				}
			}()
		}
		close(start)
		wg.Wait()
		r := burstRound{admitted: admitted}
		if !last.IsZero() {
			r.span = last.Sub(first)
		}
		r.bound = 100 + 200*r.span.Seconds()
		out = append(out, r)
		time.Sleep(time.Second)
	}
	return out
}

// TestHotKeyWindowBurstRounds is the attack: two instances, the
// tenant's key kept hot on both by users per_user denies, then three
// rounds of 300 fresh users at once. Each round is admitted within burst +
// rate × its span (and the same rounds with hot_keys off, for the
// figure).
func TestHotKeyWindowBurstRounds(t *testing.T) {
	srv := testredis.Start(t)
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, decidedByRedis(srv.Addr, windowPolicies("")...), respond()))
	}
	rounds := burstRounds(t, fleet, 3, 300)
	for i, r := range rounds {
		t.Logf("hot keys on, round %d: %d admitted in %v, bound burst + rate × T = %.1f", i+1, r.admitted, r.span.Round(time.Millisecond), r.bound)
	}
	for i, r := range rounds {
		if float64(r.admitted) > r.bound {
			t.Errorf("round %d: %d admitted in %v, over the bound of %.1f", i+1, r.admitted, r.span.Round(time.Millisecond), r.bound)
		}
		if r.admitted < 100 {
			t.Errorf("round %d: %d admitted, fewer than the burst of a bucket that refilled", i+1, r.admitted)
		}
	}
	if testing.Verbose() {
		var off []*instance
		for range 2 {
			off = append(off, startCaddy(t, decidedByRedis(srv.Addr, windowPolicies("off")...), respond()))
		}
		if _, err := srv.Do("FLUSHALL"); err != nil {
			t.Fatal(err)
		}
		for i, r := range burstRounds(t, off, 3, 300) {
			t.Logf("hot keys off, round %d: %d admitted in %v, bound %.1f", i+1, r.admitted, r.span.Round(time.Millisecond), r.bound)
		}
	}
}

// statusOf sends a GET with the header pairs given and returns its status,
// 0 for a transport error (safe outside the test's goroutine).
func statusOf(c *http.Client, url string, header ...string) int {
	req, _ := http.NewRequest("GET", url, nil)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		return 0
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	return resp.StatusCode
}
