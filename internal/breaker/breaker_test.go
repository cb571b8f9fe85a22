package breaker

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestBreaker walks the circuit breaker through its states on a clock the
// test moves: it opens after Failures failed calls in a row spanning
// Span, lets nothing through for Cooldown, then one probe at
// a time, and closes on a successful probe.
func TestBreaker(t *testing.T) {
	now := time.Unix(1000, 0)
	var changes []string
	b := New(func(from, to State) { changes = append(changes, from.String()+"->"+to.String()) })
	b.now = func() time.Time { return now }
	pass := func(outcome Result) bool {
		t.Helper()
		gen, ok := b.Allow()
		if ok {
			b.Done(gen, outcome)
		}
		return ok
	}

	// Failures that are not consecutive, or that say nothing about Redis, do
	// not open it.
	for range 3 {
		for range Failures - 1 {
			if !pass(Failed) {
				t.Fatal("refused while closed")
			}
		}
		pass(Ignored)
		pass(Answered)
	}
	if len(changes) != 0 {
		t.Fatalf("changed state after interleaved failures: %v", changes)
	}

	// Calls that were in flight together when one connection was cut fail
	// in the same instant: however many, they are one event.
	for range 20 * Failures {
		pass(Failed)
	}
	if len(changes) != 0 || !pass(Answered) {
		t.Fatalf("opened on %d calls that failed at once: %v", 20*Failures, changes)
	}

	// Failures in a row over Span open it.
	for i := range Failures {
		if i > 0 {
			now = now.Add(Span / (Failures - 1))
		}
		pass(Failed)
	}
	if pass(Answered) {
		t.Fatalf("let a decision through right after %d failures (%v)", Failures, changes)
	}
	now = now.Add(Cooldown - time.Millisecond)
	if pass(Answered) {
		t.Fatal("let a decision through before the cooldown ended")
	}

	// Half-open: one probe at a time. It fails: open again for a cooldown.
	now = now.Add(time.Millisecond)
	probe, ok := b.Allow()
	if !ok {
		t.Fatal("no probe after the cooldown")
	}
	if _, ok := b.Allow(); ok {
		t.Fatal("a second decision went with the probe out")
	}
	b.Done(probe, Failed)
	if pass(Answered) {
		t.Fatal("let a decision through after the probe failed")
	}

	// A probe whose client went away frees the slot for another probe,
	// whose success closes the breaker.
	now = now.Add(Cooldown)
	probe, _ = b.Allow()
	b.Done(probe, Ignored)
	if !pass(Answered) {
		t.Fatal("no second probe after an ignored one")
	}
	for range 10 {
		if !pass(Answered) {
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
	b := New(nil)
	b.now = func() time.Time { return now }
	var inFlight []uint64
	for range 2 * Failures {
		gen, _ := b.Allow()
		inFlight = append(inFlight, gen)
	}
	for _, gen := range inFlight[:Failures] {
		b.Done(gen, Failed)
		now = now.Add(Span)
	}
	now = now.Add(Cooldown)
	probe, ok := b.Allow()
	if !ok {
		t.Fatal("no probe after the cooldown")
	}
	for _, gen := range inFlight[Failures:] {
		b.Done(gen, Answered) // late: from before it opened
	}
	if State(b.state.Load()) != HalfOpen {
		t.Fatalf("state %v after stale successes, want half-open", State(b.state.Load()))
	}
	b.Done(probe, Answered)
	if State(b.state.Load()) != Closed {
		t.Fatalf("state %v after a successful probe", State(b.state.Load()))
	}
}

// TestBreakerConcurrent: under concurrent failures it opens once, and while
// open only one probe at a time gets through (run with -race).
func TestBreakerConcurrent(t *testing.T) {
	var mu sync.Mutex
	opened := 0
	b := New(func(from, to State) {
		if to == Open && from == Closed {
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
				if gen, ok := b.Allow(); ok {
					b.Done(gen, Failed)
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
			if gen, ok := b.Allow(); ok {
				got <- gen
			}
		}()
	}
	through.Wait()
	if len(got) != 1 {
		t.Fatalf("%d probes at once, want 1", len(got))
	}
}
