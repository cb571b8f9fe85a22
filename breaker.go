package ratelimit

import (
	"sync"
	"sync/atomic"
	"time"
)

// breaker keeps a failing Redis from costing every request its timeout. It
// counts Redis calls, not the requests riding on them: after
// breakerFailures calls in a row have failed, over at least breakerSpan
// (calls that were in flight together when one connection was cut fail
// together, in an instant, and are one event), it opens: requests skip
// Redis and follow on_error at once for breakerCooldown. Then one probe
// call at a time goes to Redis; its success closes the breaker, its failure
// opens it for another cooldown. Only timeouts and broken connections are
// failures: an error Redis replies with, a request's own bad key or a
// client that went away says nothing about whether Redis answers.
//
// It sits on every call, so the closed state, the common one, costs a few
// atomic loads: no lock and no clock.
type breaker struct {
	state    atomic.Int32  // a breakerState
	gen      atomic.Uint64 // moves on every change of state
	failures atomic.Int32  // failed calls in a row while closed

	mu           sync.Mutex
	firstFailure time.Time // of the failures in a row
	until        time.Time // open: when a probe may go
	probing      bool      // half-open: the probe is out

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

// Circuit breaker settings.
const (
	breakerFailures = 5
	breakerSpan     = 250 * time.Millisecond
	breakerCooldown = 500 * time.Millisecond
)

func newBreaker(onChange func(from, to breakerState)) *breaker {
	return &breaker{now: time.Now, onChange: onChange}
}

// skipping reports whether requests skip Redis now: the breaker is open,
// or half-open with its probe out. A request that does not skip may still
// find, when its call is about to go, that another took the probe.
func (b *breaker) skipping() bool {
	if breakerState(b.state.Load()) == breakerClosed {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch breakerState(b.state.Load()) {
	case breakerOpen:
		return b.now().Before(b.until)
	case breakerHalfOpen:
		return b.probing
	}
	return false
}

// allow reports whether a call may go to Redis, and the generation to hand
// back to done with its outcome.
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

// callResult is what a call tells the breaker.
type callResult int

const (
	callAnswered callResult = iota // Redis replied, with a result or an error
	callFailed                     // timed out, or the connection broke
	callIgnored                    // says nothing about Redis: the caller went away
)

// done records the result of a call that allow let through. Results from
// an earlier generation (a call that started before the breaker changed
// state) are ignored.
func (b *breaker) done(gen uint64, result callResult) {
	if result == callAnswered && b.failures.Load() == 0 && breakerState(b.state.Load()) == breakerClosed {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if gen != b.gen.Load() {
		return
	}
	switch breakerState(b.state.Load()) {
	case breakerClosed:
		switch result {
		case callAnswered:
			b.failures.Store(0)
		case callFailed:
			now := b.now()
			if b.failures.Add(1) == 1 {
				b.firstFailure = now
			}
			if b.failures.Load() >= breakerFailures && now.Sub(b.firstFailure) >= breakerSpan {
				b.set(breakerOpen)
			}
		}
	case breakerHalfOpen:
		b.probing = false
		switch result {
		case callAnswered:
			b.set(breakerClosed)
		case callFailed:
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
