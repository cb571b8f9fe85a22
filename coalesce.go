package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// Coalescing: the decisions that arrive at one Redis while a call is on
// the wire go together in the next script call. A decision that finds no
// call in flight is sent at once, alone; the others queue, and the call
// that finishes sends everything queued (up to maxBatch) as one call.
// Under concurrency this cuts the round trips, syscalls and Redis's
// per-call overhead to a fraction of one per request, and never delays a
// request that arrives alone. Each request is still decided atomically: the
// script decides a call's requests one after the other.

const (
	// maxBatch bounds the requests in one call, and so how long one call
	// holds Redis.
	maxBatch = 64
	// maxCalls bounds the calls in flight to one Redis, so that a slow
	// Redis or a long round trip does not cap an instance at maxBatch
	// decisions per round trip.
	maxCalls = 4
	// parallelBatch is how many decisions must wait, while calls are in
	// flight, before one more call (up to maxCalls) takes them at once:
	// enough to spread a call's fixed cost (syscalls, wake-ups, Redis's
	// per-call work) thin, few enough that requests do not wait a whole
	// call for company. Side by side on make bench's scenarios (b) and (e)
	// (wrk -c32, 5 alternating pairs each), 16 gave 6% more requests/s
	// than 64, and 12 and 32 less than 16; at 128 connections, where the
	// cores are saturated, 16 and 64 were within 2%.
	parallelBatch = 16
)

// pendingDecision is one request's decision on its way through a script
// call.
type pendingDecision struct {
	reqs     []bucketRequest
	queued   time.Time
	deadline time.Time

	// The outcome, with the monotonic µs just before the call was sent and
	// just after its reply (what the deny cache learns from).
	d              decision
	tats           []int64
	sent, received int64
	err            error

	done chan struct{} // the outcome is in, or lead is set
	lead []*pendingDecision
	one  [1]*pendingDecision
}

var pendingPool = sync.Pool{New: func() any { return &pendingDecision{done: make(chan struct{}, 1)} }}

func newPendingDecision(reqs []bucketRequest, timeout time.Duration) *pendingDecision {
	p := pendingPool.Get().(*pendingDecision)
	p.reqs = reqs
	p.queued = time.Now()
	p.deadline = p.queued.Add(timeout)
	p.one[0] = p
	return p
}

func (p *pendingDecision) release() {
	*p = pendingDecision{done: p.done}
	pendingPool.Put(p)
}

// decisionBatches coalesces the decisions sent to one Redis.
type decisionBatches struct {
	// call decides a batch in one script call, filling in each member's
	// outcome.
	call func(ctx context.Context, batch []*pendingDecision)

	mu      sync.Mutex
	calling int // calls in flight
	queue   []*pendingDecision
}

// decide returns once p's outcome is in.
func (b *decisionBatches) decide(p *pendingDecision) {
	b.mu.Lock()
	if b.calling == 0 {
		b.calling++
		b.mu.Unlock()
		b.send(p, p.one[:])
		return
	}
	b.queue = append(b.queue, p)
	if len(b.queue) >= parallelBatch && b.calling < maxCalls {
		// Enough wait to be worth a call of their own: send them now, on
		// another connection.
		b.calling++
		batch := b.take()
		b.mu.Unlock()
		b.send(p, batch) // p, the last to arrive, is in it
		return
	}
	b.mu.Unlock()
	<-p.done
	if p.lead != nil {
		b.send(p, p.lead)
	}
}

// take removes the next batch from the queue; b.mu is held.
func (b *decisionBatches) take() []*pendingDecision {
	n := min(len(b.queue), maxBatch)
	batch := make([]*pendingDecision, n)
	copy(batch, b.queue)
	b.queue = b.queue[:copy(b.queue, b.queue[n:])]
	return batch
}

// send makes the call for batch, which p belongs to and sends, then hands
// the next batch to one of its members and wakes the rest of its own.
func (b *decisionBatches) send(p *pendingDecision, batch []*pendingDecision) {
	// Whatever happens to the call, the queue moves on and no member is
	// left waiting.
	defer b.finish(p, batch)
	// No decision waits, queue included, longer than its store's timeout:
	// those whose time ran out in the queue fail now, and the earliest
	// deadline of the others bounds the call.
	now := time.Now()
	expired := func(m *pendingDecision) bool { return !now.Before(m.deadline) }
	live := batch
	if slices.ContainsFunc(batch, expired) {
		live = nil
		for _, m := range batch {
			if !expired(m) {
				live = append(live, m)
				continue
			}
			m.err = errQueueTimeout
			storeDuration.Observe(now.Sub(m.queued).Seconds())
			storeErrors.WithLabelValues("timeout").Inc()
		}
		if len(live) == 0 {
			return
		}
	}
	deadline := live[0].deadline
	for _, m := range live {
		m.err = errCallAborted // until the call says otherwise
		if m.deadline.Before(deadline) {
			deadline = m.deadline
		}
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	b.call(ctx, live)
}

func (b *decisionBatches) finish(p *pendingDecision, batch []*pendingDecision) {
	var next []*pendingDecision
	b.mu.Lock()
	if len(b.queue) > 0 {
		next = b.take()
	} else {
		b.calling--
	}
	b.mu.Unlock()
	if next != nil {
		next[0].lead = next
		next[0].done <- struct{}{}
	}
	for _, m := range batch {
		if m != p {
			m.done <- struct{}{}
		}
	}
}

var (
	errCallAborted  = errors.New("rate limit store: script call aborted")
	errQueueTimeout = fmt.Errorf("rate limit store: %w queueing for a script call", context.DeadlineExceeded)
)
