package integration_test

import (
	"encoding/json"
	"io"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// shot is one request's outcome as the client saw it.
type shot struct {
	at       time.Duration // since the load began, when the response arrived
	latency  time.Duration
	status   int // 0: transport error
	decision string
}

// maxShots bounds a load run's requests (and the memory to record them).
const maxShots = 400_000

// tally is the outcome of a load run.
type tally struct {
	shots   []shot
	elapsed time.Duration
}

// drive sends requests from workers goroutines, round-robin over the
// instances, as fast as they are answered, for d (and at most maxShots
// requests). The first word of each body is the decision placeholder (see
// echo); header pairs are added to every request.
func drive(t *testing.T, fleet []*instance, workers int, d time.Duration, header ...string) *tally {
	t.Helper()
	return driveFunc(t, fleet, workers, d, func() []string { return header })
}

// driveFunc is drive with the header pairs of each request from headers.
func driveFunc(t *testing.T, fleet []*instance, workers int, d time.Duration, headers func() []string) *tally {
	t.Helper()
	client := newClient()
	var mu sync.Mutex
	var tl tally
	var wg sync.WaitGroup
	start := time.Now()
	stop := start.Add(d)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; time.Now().Before(stop); i++ {
				req, _ := http.NewRequest("GET", fleet[i%len(fleet)].URL+"/", nil)
				header := headers()
				for j := 0; j+1 < len(header); j += 2 {
					req.Header.Set(header[j], header[j+1])
				}
				sent := time.Now()
				s := shot{}
				if resp, err := client.Do(req); err == nil {
					body, _ := io.ReadAll(resp.Body)
					resp.Body.Close()
					s.status = resp.StatusCode
					s.decision = decisionOf(resp.StatusCode, body)
				}
				s.latency = time.Since(sent)
				s.at = time.Since(start)
				mu.Lock()
				full := len(tl.shots) >= maxShots
				if !full {
					tl.shots = append(tl.shots, s)
				}
				mu.Unlock()
				if full {
					return
				}
			}
		}()
	}
	wg.Wait()
	tl.elapsed = time.Since(start)
	sort.Slice(tl.shots, func(i, j int) bool { return tl.shots[i].at < tl.shots[j].at })
	return &tl
}

// requireOver skips t, saying why, when a load sent fewer than over times
// the requests its budget admits: a lower bound on what was admitted (the
// budget ± 2, its share) then measures the machine that sent the requests,
// not the limiter. The upper bound holds whatever was sent: check it
// first. The loads that call this send a hundred times their budgets and
// more (20 or 30 requests a second) beside two CPU hogs: their budgets need
// no sizing to the machine, and only a machine that much slower is skipped.
func requireOver(t *testing.T, what string, sent int, budget, over float64) {
	t.Helper()
	if float64(sent) < over*budget {
		t.Skipf("%s: %d requests sent, %.1f times the budget of %.1f: this machine did not send the %.0f times it that the lower bound needs",
			what, sent, float64(sent)/budget, budget, over)
	}
}

// decisionOf reads the decision from a response: the first word of an echo
// body, or the problem type (quota-exceeded, temporary-reduced-capacity)
// of a rate limiter's problem response.
func decisionOf(status int, body []byte) string {
	if status == 200 {
		d, _, _ := strings.Cut(string(body), " ")
		return d
	}
	var p problemBody
	if json.Unmarshal(body, &p) == nil {
		_, typ, _ := strings.Cut(p.Type, "#")
		return typ
	}
	return "status-" + strconv.Itoa(status)
}

// statuses counts responses by status code.
func (tl *tally) statuses() map[int]int {
	m := map[int]int{}
	for _, s := range tl.shots {
		m[s.status]++
	}
	return m
}

// decisions counts responses by {http.rate_limit.decision}.
func (tl *tally) decisions() map[string]int {
	m := map[string]int{}
	for _, s := range tl.shots {
		m[s.decision]++
	}
	return m
}

// count counts the shots for which keep is true.
func (tl *tally) count(keep func(shot) bool) int {
	n := 0
	for _, s := range tl.shots {
		if keep(s) {
			n++
		}
	}
	return n
}

// medianLatency of the shots for which keep is true.
func (tl *tally) medianLatency(keep func(shot) bool) time.Duration {
	var l []time.Duration
	for _, s := range tl.shots {
		if keep(s) {
			l = append(l, s.latency)
		}
	}
	if len(l) == 0 {
		return 0
	}
	sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
	return l[len(l)/2]
}
