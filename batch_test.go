package ratelimit

import (
	"context"
	"errors"
	"regexp"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

var evalshaCalls = regexp.MustCompile(`cmdstat_evalsha:calls=(\d+)`)

// scriptCalls is how many EVALSHA calls Redis served since CONFIG RESETSTAT.
func scriptCalls(t *testing.T, srv *testredis.Server) int {
	t.Helper()
	info, err := srv.Do("INFO", "commandstats")
	if err != nil {
		t.Fatal(err)
	}
	m := evalshaCalls.FindStringSubmatch(info)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// TestCoalescedDecisions: a request that arrives alone gets a script call
// of its own at once; concurrent requests share calls, and each is still
// decided atomically and in some order: a bucket of 500 tokens admits
// exactly 500 requests, and the remaining tokens they are told are 499
// down to 0, each once.
func TestCoalescedDecisions(t *testing.T) {
	srv := testredis.Start(t)
	conn, err := newRedisConn(RedisConfig{Addresses: []string{srv.Addr}}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	rs := &redisStore{conn: conn, timeout: 2 * time.Second} // no deny cache: every decision reaches Redis
	ctx := context.Background()

	// Alone: one call per decision.
	lone := []bucketRequest{{key: "rl:p:{lone}", limit: limit{interval: 1, burst: 1_000_000}, cost: 1}}
	if _, err := rs.decide(ctx, lone); err != nil { // loads the script
		t.Fatal(err)
	}
	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	for range 50 {
		if d, err := rs.decide(ctx, lone); err != nil || !d.admitted {
			t.Fatalf("lone decision: %+v %v", d, err)
		}
	}
	if n := scriptCalls(t, srv); n != 50 {
		t.Fatalf("50 lone decisions took %d script calls, want 50", n)
	}

	// Together: 64 callers, 1,500 decisions on one bucket of 500 tokens
	// that refills once a day.
	if _, err := srv.Do("CONFIG", "RESETSTAT"); err != nil {
		t.Fatal(err)
	}
	shared := []bucketRequest{{key: "rl:p:{shared}", limit: limit{interval: 86_400_000_000, burst: 500}, cost: 1}}
	const callers, each = 64, 1500 / 64
	var mu sync.Mutex
	told := map[int64]int{} // remaining tokens reported to admitted requests
	denied := 0
	var wg sync.WaitGroup
	for range callers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range each {
				d, err := rs.decide(ctx, shared)
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				if d.admitted {
					told[d.verdicts[0].remaining]++
				} else {
					denied++
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	calls := scriptCalls(t, srv)
	decisions := callers * each
	t.Logf("%d concurrent decisions in %d script calls (%.1f per call): %d admitted, %d denied",
		decisions, calls, float64(decisions)/float64(calls), len(told), denied)
	if len(told) != 500 || denied != decisions-500 {
		t.Fatalf("admitted %d distinct remaining counts and denied %d; want 500 and %d", len(told), denied, decisions-500)
	}
	for r := range int64(500) {
		if told[r] != 1 {
			t.Fatalf("remaining %d told to %d requests, want 1", r, told[r])
		}
	}
	if calls*2 > decisions {
		t.Fatalf("%d concurrent decisions took %d script calls: not coalesced", decisions, calls)
	}
}

// TestBatchQueue follows the queue itself, with a stand-in for the script
// call: a decision sent while a call is in flight waits for it, everything
// that queued meanwhile goes in the next call, and a call that panics
// still releases its members and the queue.
func TestBatchQueue(t *testing.T) {
	var mu sync.Mutex
	var sizes []int
	first, release := make(chan struct{}), make(chan struct{})
	b := &decisionBatches{call: func(_ context.Context, batch []*pendingDecision) {
		mu.Lock()
		sizes = append(sizes, len(batch))
		n := len(sizes)
		mu.Unlock()
		switch n {
		case 1:
			close(first)
			<-release
		case 2:
			panic("call failed badly")
		}
		for _, m := range batch {
			m.err = nil
		}
	}}
	decide := func() (err error, panicked bool) {
		defer func() {
			if recover() != nil {
				panicked = true
			}
		}()
		p := newPendingDecision(nil, time.Second)
		b.decide(p)
		return p.err, false
	}

	done := make(chan error, 1)
	go func() { err, _ := decide(); done <- err }()
	<-first // the first call is in flight
	type result struct {
		err      error
		panicked bool
	}
	results := make(chan result, 10)
	for range 10 {
		go func() { err, p := decide(); results <- result{err, p} }()
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		b.mu.Lock()
		queued := len(b.queue)
		b.mu.Unlock()
		if queued == 10 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d of 10 decisions queued behind the call in flight", queued)
		}
	}
	close(release)
	if err := <-done; err != nil {
		t.Fatalf("first decision: %v", err)
	}
	var aborted, panicked int
	for range 10 {
		r := <-results
		switch {
		case r.panicked:
			panicked++
		case errors.Is(r.err, errCallAborted):
			aborted++
		default:
			t.Errorf("a member of the failed call got %v", r.err)
		}
	}
	if panicked != 1 || aborted != 9 {
		t.Fatalf("the call that panicked: %d callers saw the panic, %d were told it aborted; want 1 and 9", panicked, aborted)
	}
	// Nothing in flight now: a lone decision is sent at once, alone.
	if err, _ := decide(); err != nil {
		t.Fatalf("lone decision after the failure: %v", err)
	}
	if want := []int{1, 10, 1}; !slices.Equal(sizes, want) {
		t.Fatalf("calls carried %v decisions, want %v", sizes, want)
	}
}
