package ratelimit

import (
	"sync"
	"sync/atomic"
	"time"
)

// breaker keeps a failing Redis from costing every request its timeout.
// After breakerFailures consecutive failed decisions it opens: decisions
// skip Redis (and follow on_error at once) for breakerCooldown. Then one
// probe at a time goes to Redis; its success closes the breaker, its
// failure opens it for another cooldown.
//
// It sits on every decision, so the closed state, the common one, costs a
// few atomic loads: no lock and no clock.
type breaker struct {
	state    atomic.Int32  // a breakerState
	gen      atomic.Uint64 // moves on every change of state
	failures atomic.Int32  // consecutive failures while closed

	mu      sync.Mutex
	until   time.Time // open: when a probe may go
	probing bool      // half-open: the probe is out

	now      func() time.Time
	onChange func(from, to breakerState)
}

type breakerState int32

const (
	breakerClosed breakerState = iota
	breakerOpen
	breakerHalfOpen
)

func (s breakerState) String() string {
	return [...]string{"closed", "open", "half-open"}[s]
}

// Circuit breaker settings: after breakerFailures consecutive failed
// decisions, decisions skip Redis (and follow on_error at once) for
// breakerCooldown; then one probe at a time tests whether Redis is back.
const (
	breakerFailures = 5
	breakerCooldown = 500 * time.Millisecond
)

func newBreaker(onChange func(from, to breakerState)) *breaker {
	return &breaker{now: time.Now, onChange: onChange}
}

// allow reports whether a decision may go to Redis, and the generation to
// hand back to done with its outcome.
func (b *breaker) allow() (gen uint64, ok bool) {
	gen = b.gen.Load()
	if breakerState(b.state.Load()) == breakerClosed {
		return gen, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch breakerState(b.state.Load()) {
	case breakerClosed:
		return b.gen.Load(), true
	case breakerOpen:
		if b.now().Before(b.until) {
			return 0, false
		}
		b.set(breakerHalfOpen)
	}
	if b.probing {
		return 0, false
	}
	b.probing = true
	return b.gen.Load(), true
}

// breakerOutcome is what a decision tells the breaker.
type breakerOutcome int

const (
	breakerSuccess breakerOutcome = iota
	breakerFailure
	// breakerIgnored: says nothing about Redis (the client went away).
	breakerIgnored
)

// done records the outcome of a decision that allow let through. Outcomes
// from an earlier generation (a decision that started before the breaker
// changed state) are ignored.
func (b *breaker) done(gen uint64, outcome breakerOutcome) {
	if outcome == breakerSuccess && b.failures.Load() == 0 && breakerState(b.state.Load()) == breakerClosed {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if gen != b.gen.Load() {
		return
	}
	switch breakerState(b.state.Load()) {
	case breakerClosed:
		switch outcome {
		case breakerSuccess:
			b.failures.Store(0)
		case breakerFailure:
			if b.failures.Add(1) >= breakerFailures {
				b.set(breakerOpen)
			}
		}
	case breakerHalfOpen:
		b.probing = false
		switch outcome {
		case breakerSuccess:
			b.set(breakerClosed)
		case breakerFailure:
			b.set(breakerOpen)
		}
	}
}

// set changes the state; b.mu is held.
func (b *breaker) set(to breakerState) {
	from := breakerState(b.state.Load())
	b.failures.Store(0)
	b.probing = false
	if to == breakerOpen {
		b.until = b.now().Add(breakerCooldown)
	}
	b.gen.Add(1)
	b.state.Store(int32(to))
	if b.onChange != nil {
		b.onChange(from, to)
	}
}
