package ratelimit

import (
	"fmt"
	"sync"
	"testing"
	"time"
)

// TestBreaker walks the circuit breaker through its states on a clock the
// test moves: it opens after breakerFailures consecutive failures, lets
// nothing through for breakerCooldown, then one probe at a time, and closes
// on a successful probe.
func TestBreaker(t *testing.T) {
	now := time.Unix(1000, 0)
	var changes []string
	b := newBreaker(func(from, to breakerState) { changes = append(changes, from.String()+"->"+to.String()) })
	b.now = func() time.Time { return now }
	pass := func(outcome breakerOutcome) bool {
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
			if !pass(breakerFailure) {
				t.Fatal("refused while closed")
			}
		}
		pass(breakerIgnored)
		pass(breakerSuccess)
	}
	if len(changes) != 0 {
		t.Fatalf("changed state after interleaved failures: %v", changes)
	}

	for range breakerFailures {
		pass(breakerFailure)
	}
	if pass(breakerSuccess) {
		t.Fatalf("let a decision through right after %d failures (%v)", breakerFailures, changes)
	}
	now = now.Add(breakerCooldown - time.Millisecond)
	if pass(breakerSuccess) {
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
	b.done(probe, breakerFailure)
	if pass(breakerSuccess) {
		t.Fatal("let a decision through after the probe failed")
	}

	// A probe whose client went away frees the slot for another probe,
	// whose success closes the breaker.
	now = now.Add(breakerCooldown)
	probe, _ = b.allow()
	b.done(probe, breakerIgnored)
	if !pass(breakerSuccess) {
		t.Fatal("no second probe after an ignored one")
	}
	for range 10 {
		if !pass(breakerSuccess) {
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
		b.done(gen, breakerFailure)
	}
	now = now.Add(breakerCooldown)
	probe, ok := b.allow()
	if !ok {
		t.Fatal("no probe after the cooldown")
	}
	for _, gen := range inFlight[breakerFailures:] {
		b.done(gen, breakerSuccess) // late: from before it opened
	}
	if breakerState(b.state.Load()) != breakerHalfOpen {
		t.Fatalf("state %v after stale successes, want half-open", breakerState(b.state.Load()))
	}
	b.done(probe, breakerSuccess)
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
	var wg sync.WaitGroup
	for range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 200 {
				if gen, ok := b.allow(); ok {
					b.done(gen, breakerFailure)
				}
			}
		}()
	}
	wg.Wait()
	if opened != 1 {
		t.Fatalf("opened %d times within one cooldown", opened)
	}
	b.now = func() time.Time { return time.Now().Add(breakerCooldown) }
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
