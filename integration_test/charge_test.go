package integration_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Charges made after the response, through real Caddy processes and a
// real Redis: failed logins only, and measured usage settled against a
// reservation.

// usageUpstream answers like an LLM API: it reserves nothing, picks a usage
// for each request at or below X-Max-Tokens (or X-Usage-Above over it), and
// reports it as a header, a trailer, an OpenAI JSON body or an SSE stream
// (by path), remembering every usage it reported.
type usageUpstream struct {
	addr     string
	mu       sync.Mutex
	reported []int64
	seen     atomic.Int64
}

func startUsageUpstream(t *testing.T) *usageUpstream {
	t.Helper()
	u := &usageUpstream{}
	u.addr = serveLoopback(t, http.HandlerFunc(u.serve))
	return u
}

func (u *usageUpstream) serve(w http.ResponseWriter, r *http.Request) {
	u.seen.Add(1)
	reserved, _ := strconv.ParseInt(r.Header.Get("X-Max-Tokens"), 10, 64)
	usage := rand.Int64N(reserved + 1)
	if over, _ := strconv.ParseInt(r.Header.Get("X-Usage-Above"), 10, 64); over > 0 {
		usage = reserved + over
	}
	u.mu.Lock()
	u.reported = append(u.reported, usage)
	u.mu.Unlock()
	switch r.URL.Path {
	case "/header":
		w.Header().Set("X-Usage-Tokens", strconv.FormatInt(usage, 10))
		_, _ = io.WriteString(w, "ok")
	case "/trailer":
		w.Header().Set("Trailer", "X-Usage-Tokens")
		_, _ = io.WriteString(w, "ok")
		w.Header().Set("X-Usage-Tokens", strconv.FormatInt(usage, 10))
	case "/json":
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintf(w, `{"id":"x","choices":[{"message":{"content":"{\"usage\":{\"total_tokens\":0}}"}}],"usage":{"prompt_tokens":1,"completion_tokens":%d,"total_tokens":%d}}`, max(usage-1, 0), usage)
	case "/sse":
		w.Header().Set("Content-Type", "text/event-stream")
		for i := range 3 {
			fmt.Fprintf(w, "data: {\"choices\":[{\"delta\":{\"content\":\"part %d\"}}]}\n\n", i)
			w.(http.Flusher).Flush()
		}
		fmt.Fprintf(w, "data: {\"choices\":[],\"usage\":{\"total_tokens\":%d}}\n\ndata: [DONE]\n\n", usage)
	}
}

func (u *usageUpstream) total() (n int, sum int64) {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, v := range u.reported {
		sum += v
	}
	return len(u.reported), sum
}

func proxyTo(addr string) map[string]any {
	return map[string]any{"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": addr}}, "flush_interval": -1}
}

// TestFailedLogins: `route { rate_limit; basic_auth }` keyed on a client
// header, 5 failed logins per 15 minutes shared by 2 instances: successful
// logins are never charged; after 5 wrong passwords the 6th attempt is 429
// even with the right password, and neither authentication nor the
// upstream sees it.
func TestFailedLogins(t *testing.T) {
	srv := testredis.Start(t)
	up := startUsageUpstream(t)
	hash, err := bcrypt.GenerateFromPassword([]byte("right"), bcrypt.MinCost)
	if err != nil {
		t.Fatal(err)
	}
	auth := map[string]any{"handler": "authentication", "providers": map[string]any{"http_basic": map[string]any{
		"accounts": []any{map[string]any{"username": "alice", "password": string(hash)}}, "hash": map[string]any{"algorithm": "bcrypt"}}}}
	policy := map[string]any{"name": "failed_logins", "key": "{http.request.header.X-Client}", "rate": "5/15m",
		"charge_if": map[string]any{"status_code": []int{401, 403}}}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), auth, proxyTo(up.addr)))
	}
	login := func(in *instance, password string) response {
		t.Helper()
		req, _ := http.NewRequest("GET", in.URL+"/header", nil)
		req.SetBasicAuth("alice", password)
		req.Header.Set("X-Client", "mallory")
		req.Header.Set("X-Max-Tokens", "1")
		resp, err := newClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return response{resp.StatusCode, resp.Header, body}
	}
	// A successful login gives its reservation back before its response
	// ends: the next login, sent the instant it has it, to the other
	// instance, sees the whole budget, and nothing stays charged.
	for i := range 10 {
		r := login(fleet[i%2], "right")
		if r.status != 200 || remainingOf(t, r.header)["failed_logins"] != 5 {
			t.Fatalf("successful login %d: %d RateLimit %q, want 200 with the whole budget left, 5", i+1, r.status, r.header.Get("RateLimit"))
		}
	}
	if got := inspect(t, fleet[0], "failed_logins", "mallory").Tokens; got != 5 {
		t.Fatalf("after 10 successful logins, %d tokens left, want 5", got)
	}
	for i := range 5 {
		r := login(fleet[i%2], "wrong")
		if r.status != 401 || remainingOf(t, r.header)["failed_logins"] != int64(4-i) {
			t.Fatalf("wrong password %d on instance %d: %d RateLimit %q, want 401 with %d left", i+1, i%2, r.status, r.header.Get("RateLimit"), 4-i)
		}
	}
	seen := up.seen.Load()
	for _, in := range fleet {
		r := login(in, "right")
		if r.status != 429 {
			t.Fatalf("the 6th attempt, right password, on %s: %d, want 429", in.URL, r.status)
		}
		r.problem(t)
	}
	if up.seen.Load() != seen {
		t.Fatalf("the upstream saw %d requests after the 5 failures", up.seen.Load()-seen)
	}
	// The 429 came before authentication: an attempt with no credentials
	// at all is not asked for them.
	req, _ := http.NewRequest("GET", fleet[0].URL+"/header", nil)
	req.Header.Set("X-Client", "mallory")
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 429 || resp.Header.Get("WWW-Authenticate") != "" {
		t.Fatalf("without credentials: %d %q, want 429 without a challenge", resp.StatusCode, resp.Header.Get("WWW-Authenticate"))
	}
}

// settleLoad drives 16 clients over the fleet for d, each request reserving
// reserve tokens at path, and returns how many were admitted, of how many
// sent.
func settleLoad(t *testing.T, fleet []*instance, path string, reserve int, d time.Duration, header ...string) (admitted, sent int, elapsed time.Duration) {
	t.Helper()
	var n, all atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	client := newClient()
	for c := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; time.Since(start) < d; i++ {
				req, _ := http.NewRequest("GET", fleet[(c+i)%len(fleet)].URL+path, nil)
				req.Header.Set("X-Api-Key", "tenant")
				req.Header.Set("X-Max-Tokens", strconv.Itoa(reserve))
				for j := 0; j+1 < len(header); j += 2 {
					req.Header.Set(header[j], header[j+1])
				}
				resp, err := client.Do(req)
				if err != nil {
					t.Error(err)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				all.Add(1)
				if resp.StatusCode == 200 {
					n.Add(1)
				} else {
					time.Sleep(10 * time.Millisecond)
				}
			}
		}()
	}
	wg.Wait()
	return int(n.Load()), int(all.Load()), time.Since(start)
}

// tokenPolicy reserves X-Max-Tokens (at most 200) of a budget of 2,000
// tokens at once and 1,000 a second, settled as given.
func tokenPolicy(settle map[string]any) map[string]any {
	p := map[string]any{"name": "llm_tokens", "key": "{http.request.header.X-Api-Key}", "rate": "1000/1s", "burst": 2000,
		"cost": "{http.request.header.X-Max-Tokens}", "max_cost": 200}
	if settle != nil {
		p["settle"] = settle
	}
	return p
}

// TestSettleAcrossInstances: 4 instances, 16 concurrent clients, each
// request reserving 100 tokens and using a random 0 to 100, reported in a
// header, a trailer, an OpenAI JSON body or an SSE stream: the usage
// settled stays within burst + rate × elapsed (+ one reservation), and the
// refunds let about twice as many requests through as reservations alone.
func TestSettleAcrossInstances(t *testing.T) {
	const run = 3 * time.Second
	srv := testredis.Start(t)
	up := startUsageUpstream(t)
	fleets := 0
	fleetWith := func(settle map[string]any) []*instance {
		fleets++ // each fleet its own buckets
		redis := map[string]any{"addresses": []string{srv.Addr}, "key_prefix": "rl" + strconv.Itoa(fleets) + ":"}
		var fleet []*instance
		for range 4 {
			fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0, "redis": redis}, tokenPolicy(settle)), proxyTo(up.addr)))
		}
		return fleet
	}
	reservationOnly, sentOnly, elapsedOnly := settleLoad(t, fleetWith(nil), "/header", 100, run)
	budgetTokens := func(elapsed time.Duration) float64 { return 2000 + 1000*elapsed.Seconds() }
	// The comparison needs both loads over their budgets: the requests of
	// 100 tokens a budget admits, of about 50 with the refunds.
	requireOver(t, "reservations alone", sentOnly, budgetTokens(elapsedOnly)/100, 2)
	for _, tc := range []struct {
		path   string
		settle map[string]any
	}{
		{"/header", map[string]any{"from": "header", "field": "X-Usage-Tokens"}},
		{"/trailer", map[string]any{"from": "trailer", "field": "X-Usage-Tokens"}},
		{"/json", map[string]any{"from": "openai"}},
		{"/sse", map[string]any{"from": "openai"}},
	} {
		t.Run(strings.TrimPrefix(tc.path, "/"), func(t *testing.T) {
			fleet := fleetWith(tc.settle)
			n0, sum0 := up.total()
			admitted, sent, elapsed := settleLoad(t, fleet, tc.path, 100, run)
			n1, sum1 := up.total()
			settled, budget := float64(sum1-sum0), budgetTokens(elapsed)
			t.Logf("%s: %d requests admitted of %d sent (%d reached the upstream), %0.f tokens settled of a budget of %.0f (%.2f); reservations alone admitted %d of %d",
				tc.path, admitted, sent, n1-n0, settled, budget, settled/budget, reservationOnly, sentOnly)
			if settled > budget+100 {
				t.Errorf("settled %.0f tokens, more than the budget %.0f + one reservation", settled, budget)
			}
			requireOver(t, tc.path, sent, budget/50, 2)
			if float64(admitted) < 1.5*float64(reservationOnly) {
				t.Errorf("%d admitted with refunds, against %d with reservations alone: want about twice", admitted, reservationOnly)
			}
		})
	}
}

// TestSettleDebt: usage above the reservation is charged as debt, which
// later requests wait out; a response's usage is capped at settle max; and
// the key, having used more than it reserved, reserves what it used (at
// most the burst) on its next request of the same size.
func TestSettleDebt(t *testing.T) {
	srv := testredis.Start(t)
	up := startUsageUpstream(t)
	policy := map[string]any{"name": "llm_tokens", "key": "{http.request.header.X-Api-Key}", "rate": "100/1s", "burst": 1000,
		"cost": "{http.request.header.X-Max-Tokens}", "max_cost": 1000, "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens", "max": 1500}}
	in := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, policy), proxyTo(up.addr))
	send := func(reserve int, above int) response {
		return get(t, in.URL+"/header", "X-Api-Key", "deep", "X-Max-Tokens", strconv.Itoa(reserve), "X-Usage-Above", strconv.Itoa(above))
	}
	// 100 reserved, 2,100 used: capped at 1,500, so 1,400 more than reserved.
	start := time.Now()
	r := send(100, 2000)
	if r.status != 200 {
		t.Fatalf("first request: %d", r.status)
	}
	b := inspect(t, in, "llm_tokens", "deep")
	refilled := int64(100*time.Since(start).Seconds()) + 1 // at most, at 100/s, while the request and the inspect ran
	t.Logf("after a usage of 2,100 against a reservation of 100 (cap 1,500): %d tokens (at most %d refilled since)", b.Tokens, refilled)
	if b.Tokens > -500+refilled || b.Tokens < -500 {
		t.Fatalf("%d tokens after the debt, want -500 (1,000 - 1,500) and at most the %d refilled since", b.Tokens, refilled)
	}
	if r := send(1, 0); r.status != 429 {
		t.Fatalf("in debt: %d, want 429", r.status)
	}
	// The debt refills at 100/s: 500 owed, then, for a request like the one
	// that taught it (a reservation of 100), the 1,000 the key now reserves
	// (it learned such requests use 1,500; at most the burst): 15 s from the
	// first decision, which came after start; less what has passed since.
	lim := parseFields(t, send(100, 0).header, "RateLimit")
	if least := leastWait(15, time.Since(start)); len(lim) != 1 || lim[0].params["t"] < least || lim[0].params["t"] > 16 {
		t.Fatalf("RateLimit %+v, %v after the first request, want t of about 15 s (the debt's refill, then the learned reservation), at least %d",
			lim, time.Since(start).Round(time.Millisecond), least)
	}
	// A request of another size (1 token, a smaller class) is not raised by
	// what the 100s taught: it waits for the debt alone, about 5 s.
	lim = parseFields(t, send(1, 0).header, "RateLimit")
	if least := leastWait(5, time.Since(start)); len(lim) != 1 || lim[0].params["t"] < least || lim[0].params["t"] > 6 {
		t.Fatalf("RateLimit %+v, %v after the first request, want t of about 5 s (the debt's refill alone), at least %d",
			lim, time.Since(start).Round(time.Millisecond), least)
	}
}

// heldStream is an upstream answering an SSE stream: its first event at
// once, then, once release is closed, final.
type heldStream struct {
	addr     string
	release  chan struct{}
	finished atomic.Int64 // when it wrote final, UnixNano
}

func startHeldStream(t *testing.T, first, final string) *heldStream {
	t.Helper()
	u := &heldStream{release: make(chan struct{})}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	u.addr = l.Addr().String()
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, first)
		w.(http.Flusher).Flush()
		<-u.release
		_, _ = io.WriteString(w, final)
		u.finished.Store(time.Now().UnixNano())
	})}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { srv.Close() })
	return u
}

// streamedTokens waits (at most 2 s) for the bucket to leave the
// reservation's count (reserved) for want, and fails if it holds anything
// else.
func streamedTokens(t *testing.T, in *instance, identity string, reserved, want int64) {
	t.Helper()
	deadline := time.Now().Add(2 * time.Second)
	for {
		b := inspect(t, in, "llm_tokens", identity)
		if b.Tokens == want {
			return
		}
		if time.Now().After(deadline) || b.Tokens != reserved {
			t.Fatalf("after the stream: %d tokens, want %d", b.Tokens, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// openStream sends the request of a stream reserving 100 tokens for
// "streamer", and returns its body once the response's header is in.
func openStream(t *testing.T, in *instance) *bufio.Reader {
	t.Helper()
	req, _ := http.NewRequestWithContext(context.Background(), "GET", in.URL+"/sse", nil)
	req.Header.Set("X-Api-Key", "streamer")
	req.Header.Set("X-Max-Tokens", "100")
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return bufio.NewReader(resp.Body)
}

// TestSettleStreams: with settle openai, an SSE stream's bytes reach the
// client as the upstream sends them: the first byte arrives before the
// upstream finishes, and the stream is forwarded unchanged.
func TestSettleStreams(t *testing.T) {
	srv := testredis.Start(t)
	stream := "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n"
	final := "data: {\"choices\":[],\"usage\":{\"total_tokens\":3}}\n\ndata: [DONE]\n\n"
	up := startHeldStream(t, stream, final)
	slow := tokenPolicy(map[string]any{"from": "openai"})
	slow["rate"] = "1000/1h" // nothing refills during the test
	in := startCaddy(t, limiter(srv.Addr, nil, slow), proxyTo(up.addr))

	start := time.Now()
	br := openStream(t, in)
	first, err := br.ReadString('\n')
	firstAt := time.Since(start)
	if err != nil || up.finished.Load() != 0 {
		t.Fatalf("first line %q (%v): read after the upstream finished, or not at all", first, err)
	}
	close(up.release)
	rest, _ := io.ReadAll(br)
	t.Logf("first byte after %v, before the upstream finished; %d bytes in all", firstAt.Round(time.Millisecond), len(first)+len(rest))
	if first+string(rest) != stream+final {
		t.Fatalf("the stream changed on the way:\n%q\nwant\n%q", first+string(rest), stream+final)
	}
	// 100 reserved, 3 used: the bucket has 1,997 of 2,000 once settled.
	streamedTokens(t, in, "streamer", 1900, 1997)
}

// TestSettleAcrossReload: a stream that runs while a reload changes the
// redis block (its timeout: another connection) is settled when it ends,
// on the config it was admitted by: 100 reserved, 150 used, 150 charged.
func TestSettleAcrossReload(t *testing.T) {
	srv := testredis.Start(t)
	up := startHeldStream(t, "data: {\"choices\":[{\"delta\":{\"content\":\"first\"}}]}\n\n",
		"data: {\"choices\":[],\"usage\":{\"total_tokens\":150}}\n\ndata: [DONE]\n\n")
	slow := tokenPolicy(map[string]any{"from": "openai"})
	slow["rate"] = "1000/1h" // nothing refills during the test
	in := startCaddy(t, redisLimiter(srv.Addr, "1s", nil, slow), proxyTo(up.addr))
	br := openStream(t, in)
	if _, err := br.ReadString('\n'); err != nil {
		t.Fatal(err)
	}
	in.reload(t, redisLimiter(srv.Addr, "2s", nil, slow), proxyTo(up.addr))
	close(up.release)
	if _, err := io.ReadAll(br); err != nil {
		t.Fatal(err)
	}
	streamedTokens(t, in, "streamer", 1900, 1850)
	if lost := lostCount(t, in, "llm_tokens", "store_unreachable"); lost != 0 {
		t.Fatalf("charges_lost_total{reason=store_unreachable} %v, want 0", lost)
	}
}

// TestParallelFailedLogins: attempts sent all at once, over 2 instances, to
// a slow password check (an upstream that takes 300 ms to answer 401):
// each holds its reservation while it runs, so of 64 at once, and of 1,000
// at once, only the burst (5) reach the check; the others are denied
// before it.
func TestParallelFailedLogins(t *testing.T) {
	srv := testredis.Start(t)
	var checked atomic.Int64
	slowCheck := startCounting(t, &checked, func(w http.ResponseWriter) {
		time.Sleep(300 * time.Millisecond)
		w.WriteHeader(http.StatusUnauthorized)
	})
	policy := map[string]any{"name": "failed_logins", "key": "{http.request.header.X-Client}", "rate": "5/15m",
		"charge_if": map[string]any{"status_code": []int{401}}}
	// Redis gets a second, not the default 100 ms: this test is about what
	// parallel attempts reach, and 1,000 at once on a loaded 2-core machine
	// made calls time out, which the default on_error (fail_open) admits.
	redis := map[string]any{"addresses": []string{srv.Addr}, "timeout": "1s"}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, limiter(srv.Addr, map[string]any{"redis": redis}, policy), proxyTo(slowCheck)))
	}
	for _, n := range []int{64, 1000} {
		before := checked.Load()
		var wg sync.WaitGroup
		var denied, unauthorized, failed atomic.Int64
		client := &http.Client{Timeout: 20 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: n, DisableCompression: true}}
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				req, _ := http.NewRequest("GET", fleet[i%2].URL+"/", nil)
				req.Header.Set("X-Client", fmt.Sprintf("attacker-%d", n))
				resp, err := client.Do(req)
				if err != nil {
					failed.Add(1)
					return
				}
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
				switch resp.StatusCode {
				case 429:
					denied.Add(1)
				case 401:
					unauthorized.Add(1)
				}
			}()
		}
		wg.Wait()
		reached := checked.Load() - before
		t.Logf("%d parallel failed logins over 2 instances, burst 5: %d reached the password check, %d denied before it, %d failed", n, reached, denied.Load(), failed.Load())
		if reached != 5 || unauthorized.Load() != 5 || denied.Load() != int64(n-5) {
			t.Errorf("%d attempts: %d reached the check (%d answered 401), %d denied, %d failed: want 5, 5, %d, 0", n, reached, unauthorized.Load(), denied.Load(), failed.Load(), n-5)
		}
	}
}
