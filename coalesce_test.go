package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"maps"
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
	conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Destruct() })
	conn.denials = nil // no deny cache: every decision reaches Redis
	rs := conn
	ctx := context.Background()

	// Alone: one call per decision.
	lone := []bucketRequest{{key: "rl:p:{lone}", limit: limit{interval: 1, burst: 1_000_000}, op: opTake, cost: 1}}
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
	shared := []bucketRequest{{key: "rl:p:{shared}", limit: limit{interval: 86_400_000_000, burst: 500}, op: opTake, cost: 1}}
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

// TestCoalescerQueue follows the queue itself, with a stand-in for the
// script call: a request sent while a call is in flight waits; parallelBatch
// waiting start another call at once, up to maxCalls; beyond that they wait
// their turn however long it takes (queueing is this instance's load, not a
// Redis failure); a finishing call sends up to maxBatch of those queued; a
// call that panics still releases its members and the queue.
func TestCoalescerQueue(t *testing.T) {
	var mu sync.Mutex
	var sizes []int
	gates := map[int]chan struct{}{1: make(chan struct{}), 2: make(chan struct{}), 3: make(chan struct{})}
	started := make(chan int, 10)
	c := &coalescer{maxCalls: 3, call: func(batch []*pending) {
		mu.Lock()
		sizes = append(sizes, len(batch))
		n := len(sizes)
		mu.Unlock()
		started <- n
		if g := gates[n]; g != nil {
			<-g
		}
		if n == 5 {
			panic("call failed badly")
		}
		for _, m := range batch {
			m.err = nil
		}
	}}
	type result struct {
		err      error
		panicked bool
	}
	results := make(chan result, 200)
	decide := func() {
		r := result{}
		defer func() {
			if recover() != nil {
				r.panicked = true
			}
			results <- r
		}()
		p := newPending(nil, nil)
		c.submit(p)
		r.err = p.err
	}
	queued := func(want int) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
			c.mu.Lock()
			n := len(c.queue)
			c.mu.Unlock()
			if n == want {
				return
			}
			if time.Now().After(deadline) {
				t.Fatalf("%d requests queued, want %d", n, want)
			}
		}
	}
	wantStarted := func(want int) {
		t.Helper()
		if n := <-started; n != want {
			t.Fatalf("call %d started, want call %d", n, want)
		}
	}

	go decide()
	wantStarted(1)
	// Call 1 in flight: 15 queue; the 16th makes a batch worth a call of
	// its own, sent at once; 16 more make a third.
	for range 2 * parallelBatch {
		go decide()
	}
	wantStarted(2)
	wantStarted(3)
	queued(0)
	// maxCalls in flight: 70 more wait, and keep waiting.
	for range 70 {
		go decide()
	}
	queued(70)
	time.Sleep(50 * time.Millisecond)
	select {
	case r := <-results:
		t.Fatalf("a queued request returned while every call was in flight: %+v", r)
	default:
	}
	// Call 2 ends and sends 64 of them as call 4, which ends and sends the
	// other 6 as call 5, which panics.
	close(gates[2])
	wantStarted(4)
	wantStarted(5)
	close(gates[3])
	close(gates[1])
	counts := map[string]int{}
	for range 1 + 2*parallelBatch + 70 {
		r := <-results
		switch {
		case r.panicked:
			counts["panicked"]++
		case r.err == nil:
			counts["decided"]++
		case errors.Is(r.err, errCallAborted):
			counts["aborted"]++
		default:
			t.Fatalf("unexpected outcome: %v", r.err)
		}
	}
	want := map[string]int{"decided": 1 + 2*parallelBatch + maxBatch, "panicked": 1, "aborted": 70 - maxBatch - 1}
	if !maps.Equal(counts, want) {
		t.Fatalf("outcomes %v, want %v", counts, want)
	}
	// Nothing in flight now: a lone request is sent at once, alone.
	decide()
	if r := <-results; r.err != nil {
		t.Fatalf("lone request: %v", r.err)
	}
	if want := []int{1, parallelBatch, parallelBatch, maxBatch, 70 - maxBatch, 1}; !slices.Equal(sizes, want) {
		t.Fatalf("calls carried %v requests, want %v", sizes, want)
	}
}

// TestCoalescerDropsGone: a request whose client went away while it queued
// is dropped from its call, neither decided nor charged.
func TestCoalescerDropsGone(t *testing.T) {
	gate := make(chan struct{})
	var mu sync.Mutex
	var sizes []int
	c := &coalescer{maxCalls: 1, call: func(batch []*pending) {
		mu.Lock()
		sizes = append(sizes, len(batch))
		first := len(sizes) == 1
		mu.Unlock()
		if first {
			<-gate
		}
		for _, m := range batch {
			m.err = nil
		}
	}}
	results := make(chan error, 3)
	submit := func(ctx context.Context) {
		p := newPending(nil, ctx)
		c.submit(p)
		results <- p.err
	}
	go submit(nil)
	for {
		c.mu.Lock()
		busy := c.calling == 1
		c.mu.Unlock()
		if busy {
			break
		}
		time.Sleep(time.Millisecond)
	}
	gone, cancel := context.WithCancel(context.Background())
	go submit(gone)
	go submit(nil)
	for {
		c.mu.Lock()
		n := len(c.queue)
		c.mu.Unlock()
		if n == 2 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel() // that client goes away while queued
	close(gate)
	var errs []error
	for range 3 {
		errs = append(errs, <-results)
	}
	dropped := 0
	for _, err := range errs {
		if errors.Is(err, errClientGone) {
			dropped++
		} else if err != nil {
			t.Fatal(err)
		}
	}
	if dropped != 1 || !slices.Equal(sizes, []int{1, 1}) {
		t.Fatalf("dropped %d, calls of %v requests: want the gone request dropped from the second call", dropped, sizes)
	}
}

// TestCoalescerAfter: work after responses (settles, charges, releases),
// which nobody waits for, rides with the next call when calls are in
// flight, goes at once by itself when none is, goes first in the batch it
// rides with, and reaches its callback with the outcome.
func TestCoalescerAfter(t *testing.T) {
	var mu sync.Mutex
	var batches [][]string // what each call carried: "later" or "decision"
	gate := make(chan struct{})
	started := make(chan struct{}, 10)
	c := &coalescer{maxCalls: 1, call: func(batch []*pending) {
		var kinds []string
		for _, m := range batch {
			kind := "decision"
			if m.then != nil {
				kind = "later"
			}
			kinds = append(kinds, kind)
			m.err = nil
		}
		mu.Lock()
		batches = append(batches, kinds)
		first := len(batches) == 1
		mu.Unlock()
		started <- struct{}{}
		if first {
			<-gate
		}
	}}
	done := make(chan error, 10)
	later := func() {
		p := newPending(nil, nil)
		p.then = func(p *pending) { done <- p.err }
		c.submitAfter(p)
	}
	// Alone, with no decision to ride with: by itself, within afterWait.
	later()
	<-started
	// A decision while that call is in flight queues; so does more work
	// after responses; the next call carries the work first.
	decided := make(chan struct{})
	go func() {
		p := newPending(nil, nil)
		c.submit(p)
		p.recycle()
		close(decided)
	}()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		c.mu.Lock()
		n := len(c.queue)
		c.mu.Unlock()
		if n == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the decision did not queue")
		}
	}
	later()
	later()
	close(gate)
	<-decided
	for range 3 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("work after a response: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a callback never came")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(batches) != "[[later] [later later decision]]" {
		t.Fatalf("calls carried %v, want [[later] [later later decision]]", batches)
	}
}

// TestCoalescerAfterRides: work after responses on an idle instance waits
// for the next decision and rides with it (one call, the work first),
// rather than making a call of its own; with no decision, it goes by
// itself (TestCoalescerAfter).
func TestCoalescerAfterRides(t *testing.T) {
	var mu sync.Mutex
	var batches [][]string
	c := &coalescer{maxCalls: 1, wait: time.Hour, call: func(batch []*pending) {
		var kinds []string
		for _, m := range batch {
			kind := "decision"
			if m.then != nil {
				kind = "later"
			}
			kinds = append(kinds, kind)
			m.err = nil
		}
		mu.Lock()
		batches = append(batches, kinds)
		mu.Unlock()
	}}
	done := make(chan error, 2)
	for range 2 {
		p := newPending(nil, nil)
		p.then = func(p *pending) { done <- p.err }
		c.submitAfter(p)
	}
	p := newPending(nil, nil)
	c.submit(p)
	p.recycle()
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Fatalf("work after a response: %v", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("a callback never came")
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if fmt.Sprint(batches) != "[[later later decision]]" {
		t.Fatalf("calls carried %v, want [[later later decision]]", batches)
	}
}

// TestCoalescerAwaited: work after a response that the response waits for
// goes at once, alone, when no call is in flight; while one is, it rides
// with the next call and never makes one more: parallelBatch of it
// queued beside a call in flight start no call of their own; and when the
// call in flight ends with only such work queued, it goes at once, not
// after afterWait.
func TestCoalescerAwaited(t *testing.T) {
	var mu sync.Mutex
	var sizes []int
	gate := make(chan struct{})
	started := make(chan int, 10)
	c := &coalescer{maxCalls: 3, wait: time.Hour, call: func(batch []*pending) {
		mu.Lock()
		sizes = append(sizes, len(batch))
		n := len(sizes)
		mu.Unlock()
		started <- n
		if n == 2 {
			<-gate
		}
		for _, m := range batch {
			m.err = nil
		}
	}}
	awaited := func(done chan<- error) {
		p := newPending(nil, nil)
		p.err = errCallAborted
		p.then = func(p *pending) { done <- p.err }
		c.submitAwaited(p)
	}
	// Alone: at once.
	done := make(chan error, 1)
	awaited(done)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	<-started
	// A decision in flight (call 2): awaited work waits for it, and starts
	// no call of its own however much of it comes.
	go func() { c.submit(newPending(nil, nil)) }()
	if n := <-started; n != 2 {
		t.Fatalf("call %d started, want 2", n)
	}
	many := make(chan error, 2*parallelBatch)
	for range 2 * parallelBatch {
		go awaited(many)
	}
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(time.Millisecond) {
		c.mu.Lock()
		n := len(c.after)
		c.mu.Unlock()
		if n == 2*parallelBatch {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d awaited queued, want %d", n, 2*parallelBatch)
		}
	}
	select {
	case n := <-started:
		t.Fatalf("call %d started while one was in flight: awaited work made a call of its own", n)
	case <-time.After(50 * time.Millisecond):
	}
	// Call 2 ends: the awaited work goes at once (afterWait is an hour
	// here), all in call 3.
	close(gate)
	for range 2 * parallelBatch {
		if err := <-many; err != nil {
			t.Fatal(err)
		}
	}
	if want := []int{1, 1, 2 * parallelBatch}; !slices.Equal(sizes, want) {
		t.Fatalf("calls carried %v, want %v", sizes, want)
	}
}
