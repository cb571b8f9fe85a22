// Package breaker is a circuit breaker for calls to a server that may stop
// answering (Redis, here): it keeps a failing server from costing every
// request its timeout.
package breaker

import (
	"sync"
	"sync/atomic"
	"time"
)

// Breaker counts calls, not the requests riding on them: after Failures
// calls in a row have failed, over at least Span (calls that were in
// flight together when one connection was cut fail together, in an
// instant, and are one event), it opens: requests skip the server and
// follow their failure mode at once for Cooldown. Then one probe call at a
// time goes to the server; its success closes the breaker, its failure
// opens it for another cooldown. Only timeouts and broken connections are
// failures (Failed): an error the server replies with, a request's own bad
// key or a client that went away says nothing about whether the server
// answers.
//
// It sits on every call, so the closed state, the common one, costs a few
// atomic loads: no lock and no clock.
type Breaker struct {
	state    atomic.Int32  // a State
	gen      atomic.Uint64 // moves on every change of state
	failures atomic.Int32  // failed calls in a row while closed

	mu           sync.Mutex
	firstFailure time.Time // of the failures in a row
	until        time.Time // open: when a probe may go
	probing      bool      // half-open: the probe is out

	now      func() time.Time
	onChange func(from, to State)
}

// State is where a breaker is: closed (calls go), open (calls skip the
// server) or half-open (one probe goes).
type State int32

const (
	Closed State = iota
	Open
	HalfOpen
)

func (s State) String() string {
	return [...]string{"closed", "open", "half-open"}[s]
}

// Circuit breaker settings.
const (
	Failures = 5
	Span     = 250 * time.Millisecond
	Cooldown = 500 * time.Millisecond
)

// New makes a closed breaker. onChange, when not nil, is told of every
// change of state, under the breaker's lock.
func New(onChange func(from, to State)) *Breaker {
	return &Breaker{now: time.Now, onChange: onChange}
}

// Skipping reports whether requests skip the server now: the breaker is
// open, or half-open with its probe out. A request that does not skip may
// still find, when its call is about to go, that another took the probe.
func (b *Breaker) Skipping() bool {
	if State(b.state.Load()) == Closed {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch State(b.state.Load()) {
	case Open:
		return b.now().Before(b.until)
	case HalfOpen:
		return b.probing
	}
	return false
}

// Allow reports whether a call may go to the server, and the generation to
// hand back to Done with its outcome.
func (b *Breaker) Allow() (gen uint64, ok bool) {
	gen = b.gen.Load()
	if State(b.state.Load()) == Closed {
		return gen, true
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	switch State(b.state.Load()) {
	case Closed:
		return b.gen.Load(), true
	case Open:
		if b.now().Before(b.until) {
			return 0, false
		}
		b.set(HalfOpen)
	}
	if b.probing {
		return 0, false
	}
	b.probing = true
	return b.gen.Load(), true
}

// Result is what a call tells the breaker.
type Result int

const (
	Answered Result = iota // the server replied, with a result or an error
	Failed                 // timed out, or the connection broke
	Ignored                // says nothing about the server: the caller went away
)

// Done records the result of a call that Allow let through. Results from
// an earlier generation (a call that started before the breaker changed
// state) are ignored.
func (b *Breaker) Done(gen uint64, result Result) {
	if result == Answered && b.failures.Load() == 0 && State(b.state.Load()) == Closed {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if gen != b.gen.Load() {
		return
	}
	switch State(b.state.Load()) {
	case Closed:
		switch result {
		case Answered:
			b.failures.Store(0)
		case Failed:
			now := b.now()
			if b.failures.Add(1) == 1 {
				b.firstFailure = now
			}
			if b.failures.Load() >= Failures && now.Sub(b.firstFailure) >= Span {
				b.set(Open)
			}
		}
	case HalfOpen:
		b.probing = false
		switch result {
		case Answered:
			b.set(Closed)
		case Failed:
			b.set(Open)
		}
	}
}

// set changes the state; b.mu is held.
func (b *Breaker) set(to State) {
	from := State(b.state.Load())
	b.failures.Store(0)
	b.probing = false
	if to == Open {
		b.until = b.now().Add(Cooldown)
	}
	b.gen.Add(1)
	b.state.Store(int32(to))
	if b.onChange != nil {
		b.onChange(from, to)
	}
}
