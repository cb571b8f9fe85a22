package ratelimit

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestBreaker walks the circuit breaker through its states on a clock the
// test moves: it opens after breakerFailures failed calls in a row spanning
// breakerSpan, lets nothing through for breakerCooldown, then one probe at
// a time, and closes on a successful probe.
func TestBreaker(t *testing.T) {
	now := time.Unix(1000, 0)
	var changes []string
	b := newBreaker(func(from, to breakerState) { changes = append(changes, from.String()+"->"+to.String()) })
	b.now = func() time.Time { return now }
	pass := func(outcome callResult) bool {
		t.Helper()
		gen, ok := b.allow()
		if ok {
			b.done(gen, outcome)
		}
		return ok
	}

	// Failures that are not consecutive, or that say nothing about Redis, do
	// not open it.
	for range 3 {
		for range breakerFailures - 1 {
			if !pass(callFailed) {
				t.Fatal("refused while closed")
			}
		}
		pass(callIgnored)
		pass(callAnswered)
	}
	if len(changes) != 0 {
		t.Fatalf("changed state after interleaved failures: %v", changes)
	}

	// Calls that were in flight together when one connection was cut fail
	// in the same instant: however many, they are one event.
	for range 20 * breakerFailures {
		pass(callFailed)
	}
	if len(changes) != 0 || !pass(callAnswered) {
		t.Fatalf("opened on %d calls that failed at once: %v", 20*breakerFailures, changes)
	}

	// Failures in a row over breakerSpan open it.
	for i := range breakerFailures {
		if i > 0 {
			now = now.Add(breakerSpan / (breakerFailures - 1))
		}
		pass(callFailed)
	}
	if pass(callAnswered) {
		t.Fatalf("let a decision through right after %d failures (%v)", breakerFailures, changes)
	}
	now = now.Add(breakerCooldown - time.Millisecond)
	if pass(callAnswered) {
		t.Fatal("let a decision through before the cooldown ended")
	}

	// Half-open: one probe at a time. It fails: open again for a cooldown.
	now = now.Add(time.Millisecond)
	probe, ok := b.allow()
	if !ok {
		t.Fatal("no probe after the cooldown")
	}
	if _, ok := b.allow(); ok {
		t.Fatal("a second decision went with the probe out")
	}
	b.done(probe, callFailed)
	if pass(callAnswered) {
		t.Fatal("let a decision through after the probe failed")
	}

	// A probe whose client went away frees the slot for another probe,
	// whose success closes the breaker.
	now = now.Add(breakerCooldown)
	probe, _ = b.allow()
	b.done(probe, callIgnored)
	if !pass(callAnswered) {
		t.Fatal("no second probe after an ignored one")
	}
	for range 10 {
		if !pass(callAnswered) {
			t.Fatal("refused after it closed")
		}
	}
	want := "[closed->open open->half-open half-open->open open->half-open half-open->closed]"
	if got := fmt.Sprint(changes); got != want {
		t.Fatalf("state changes %s, want %s", got, want)
	}
}

// TestBreakerStaleOutcomes: decisions that started before the breaker
// changed state do not move it: failures that arrive after it opened do not
// extend the cooldown, and a late success does not close it.
func TestBreakerStaleOutcomes(t *testing.T) {
	now := time.Unix(1000, 0)
	b := newBreaker(nil)
	b.now = func() time.Time { return now }
	var inFlight []uint64
	for range 2 * breakerFailures {
		gen, _ := b.allow()
		inFlight = append(inFlight, gen)
	}
	for _, gen := range inFlight[:breakerFailures] {
		b.done(gen, callFailed)
		now = now.Add(breakerSpan)
	}
	now = now.Add(breakerCooldown)
	probe, ok := b.allow()
	if !ok {
		t.Fatal("no probe after the cooldown")
	}
	for _, gen := range inFlight[breakerFailures:] {
		b.done(gen, callAnswered) // late: from before it opened
	}
	if breakerState(b.state.Load()) != breakerHalfOpen {
		t.Fatalf("state %v after stale successes, want half-open", breakerState(b.state.Load()))
	}
	b.done(probe, callAnswered)
	if breakerState(b.state.Load()) != breakerClosed {
		t.Fatalf("state %v after a successful probe", breakerState(b.state.Load()))
	}
}

// TestBreakerConcurrent: under concurrent failures it opens once, and while
// open only one probe at a time gets through (run with -race).
func TestBreakerConcurrent(t *testing.T) {
	var mu sync.Mutex
	opened := 0
	b := newBreaker(func(from, to breakerState) {
		if to == breakerOpen && from == breakerClosed {
			mu.Lock()
			opened++
			mu.Unlock()
		}
	})
	// Each reading of the clock moves it 1 ms: the failures span seconds.
	var ticks atomic.Int64
	start := time.Now()
	b.now = func() time.Time { return start.Add(time.Duration(ticks.Add(1)) * time.Millisecond) }
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if gen, ok := b.allow(); ok {
					b.done(gen, callFailed)
				}
			}
		}()
	}
	wg.Wait()
	if opened != 1 {
		t.Fatalf("opened %d times within one cooldown", opened)
	}
	b.now = func() time.Time { return start.Add(time.Hour) }
	var through sync.WaitGroup
	got := make(chan uint64, 8)
	for range 8 {
		through.Add(1)
		go func() {
			defer through.Done()
			if gen, ok := b.allow(); ok {
				got <- gen
			}
		}()
	}
	through.Wait()
	if len(got) != 1 {
		t.Fatalf("%d probes at once, want 1", len(got))
	}
}
