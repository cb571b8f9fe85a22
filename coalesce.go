package ratelimit

import (
	"context"
	"errors"
	"sync"
	"time"
)

// Coalescing: the requests that arrive at one Redis while a call is on the
// wire go together in the next script call. A request that finds no call
// in flight is sent at once, alone; the others queue, and the call that
// finishes sends what is queued (up to maxBatch) as one call. Under
// concurrency this cuts the round trips, syscalls and Redis's per-call
// overhead to a fraction of one per request, and never delays a request
// that arrives alone. Each request is still decided atomically: the script
// decides a call's requests one after the other.
//
// Time spent queued is this instance's own load, not a Redis failure: a
// queued request waits its turn however long that takes (its call, once
// sent, is bounded by the store's timeout). When more requests queue than
// one call takes, more calls go at once, up to the connection pool's size,
// so the decisions an instance makes per round trip grow with its load
// instead of stopping at a fixed number.

const (
	// maxBatch bounds the requests in one call, and so how long one call
	// holds Redis.
	maxBatch = 64
	// parallelBatch is how many requests must wait, while calls are in
	// flight, before one more call takes them at once: enough to spread a
	// call's fixed cost (syscalls, wake-ups, Redis's per-call work) thin,
	// few enough that requests do not wait a whole call for company. Side
	// by side on make bench's scenarios (b) and (e) (wrk -c32, 5 alternating
	// pairs each), 16 gave 6% more requests/s than 64, and 12 and 32 less
	// than 16.
	parallelBatch = 16
	// afterWait is how long work after a response waits, when no call is
	// in flight, for a decision to ride with before it goes by itself: long
	// enough for the next request of a busy instance to come (the response
	// is written after the work is queued), short enough that a slot is
	// free at once on an idle one. BenchmarkAfterRides (32 callers, 200 µs
	// between a response and the next request, as a client's round trip
	// has it): settle and acquire_release made 0.17-0.18 calls per request,
	// nearly 40% of them carrying only work after responses, against
	// 0.12 for take; with the wait, 0.11, as take.
	afterWait = time.Millisecond
)

// pending is one request's operations on their way through a script call.
type pending struct {
	reqs   []bucketRequest
	queued time.Time
	// then, for work after a response, is called with the outcome once the
	// call is over. awaited: a response waits for it (see submitAwaited).
	then    func(*pending)
	awaited bool
	// ctx is the request's: a request still queued when it is done (its
	// client went away) is dropped, neither decided nor charged (nil:
	// never). Its Err is read, not its Done, which a context makes on
	// first use: one allocation per request saved.
	ctx context.Context
	// alone: the request is the only one the instance serves
	// (store_lone.go).
	alone bool

	// The outcome, with the monotonic µs just before the call was sent and
	// just after its reply (what the deny cache learns from).
	d              decision
	tats           []int64
	sent, received int64
	err            error

	done chan struct{} // the outcome is in, or lead is set
	lead []*pending
	one  [1]*pending
}

var pendingPool = sync.Pool{New: func() any { return &pending{done: make(chan struct{}, 1)} }}

func newPending(reqs []bucketRequest, ctx context.Context) *pending {
	p := pendingPool.Get().(*pending)
	p.reqs, p.ctx = reqs, ctx
	p.queued = time.Now()
	p.one[0] = p
	return p
}

func (p *pending) recycle() {
	*p = pending{done: p.done}
	pendingPool.Put(p)
}

// coalescer coalesces the requests sent to one Redis.
type coalescer struct {
	// call makes one script call for a batch, filling in each member's
	// outcome.
	call func(batch []*pending)
	// maxCalls bounds the calls in flight: the connections of the pool.
	maxCalls int

	mu      sync.Mutex
	calling int // calls in flight
	queue   []*pending
	// after is work after responses (settles, charges, releases), which
	// rides with the next call; awaited of it, responses wait for.
	after   []*pending
	awaited int
	// waiting: the work after responses waits (afterWait) for a call to ride with, and
	// the timer will send it by itself if none comes.
	waiting bool
	timer   *time.Timer
	// wait is afterWait, unless set (tests).
	wait time.Duration
	// idle are closed once no call is in flight and no work after
	// responses is queued (drained); while any wait, that work goes at
	// once.
	idle drainWaiters
}

// drained sends the work after responses at once, rather than after
// afterWait, and returns a channel closed once it and every call in flight
// are done: for a connection about to close.
func (c *coalescer) drained() <-chan struct{} {
	c.mu.Lock()
	if c.calling == 0 && len(c.after) == 0 {
		c.mu.Unlock()
		return closedChan()
	}
	ch := c.idle.add()
	var batch []*pending
	if c.calling == 0 {
		c.calling++
		batch = c.take()
	}
	c.mu.Unlock()
	if batch != nil {
		go c.lead(nil, batch)
	}
	return ch
}

// submitAfter queues p, work after a response that nobody waits for: it
// joins the call that goes next, when calls are in flight, or the next
// decision's; when neither comes within afterWait, it goes by itself
// (so that a slot is free within a millisecond on an idle instance, and no
// response waits).
func (c *coalescer) submitAfter(p *pending) {
	c.mu.Lock()
	c.after = append(c.after, p)
	if c.calling == 0 { // else a call in flight takes it when it finishes
		c.waitAfter()
	}
	c.mu.Unlock()
}

// waitAfter arms the timer that sends the work after responses by itself; c.mu is
// held.
func (c *coalescer) waitAfter() {
	if c.waiting {
		return
	}
	c.waiting = true
	wait := c.wait
	if wait == 0 {
		wait = afterWait
	}
	if c.timer == nil {
		c.timer = time.AfterFunc(wait, c.sendAfter)
	} else {
		c.timer.Reset(wait)
	}
}

// submitAwaited queues p, work after a response that the response waits
// for (a finished request is finished everywhere: finish.go): it rides
// with the call that goes next when calls are in flight, without making
// one more (a request's own decision and its finish would otherwise be
// two members of calls, twice the calls under load), and goes at once, by
// itself, when none is. p.then tells the waiter.
func (c *coalescer) submitAwaited(p *pending) {
	p.awaited = true
	c.mu.Lock()
	if c.calling == 0 {
		c.calling++
		batch := append(c.takeAfter(), p)
		c.mu.Unlock()
		c.lead(nil, batch)
		return
	}
	c.after = append(c.after, p)
	c.awaited++
	c.mu.Unlock()
}

// sendAfter sends the work after responses by itself, unless a call took it or is in
// flight (which will).
func (c *coalescer) sendAfter() {
	c.mu.Lock()
	c.waiting = false
	if c.calling > 0 || len(c.after) == 0 {
		c.mu.Unlock()
		return
	}
	c.calling++
	batch := c.take()
	c.mu.Unlock()
	c.lead(nil, batch)
}

// submit returns once p's outcome is in.
func (c *coalescer) submit(p *pending) {
	c.mu.Lock()
	if c.calling == 0 {
		c.calling++
		batch := p.one[:]
		if len(c.after) > 0 { // the work after responses rides with it
			batch = append(c.takeAfter(), p)
		}
		c.mu.Unlock()
		c.lead(p, batch)
		return
	}
	c.queue = append(c.queue, p)
	if len(c.queue) >= parallelBatch && c.calling < c.maxCalls {
		// Enough wait to be worth a call of their own: send them now, on
		// another connection.
		c.calling++
		batch := c.takeWith(false)
		c.mu.Unlock()
		c.lead(p, batch) // p, the last to arrive, is in it
		return
	}
	c.mu.Unlock()
	<-p.done
	if p.lead != nil {
		c.lead(p, p.lead)
	}
}

// take removes the next batch from the queue: the work after responses
// first (it was owed first), then the decisions waiting; c.mu is held.
func (c *coalescer) take() []*pending { return c.takeWith(true) }

// takeWith is take, without the work after responses when after is false.
func (c *coalescer) takeWith(after bool) []*pending {
	l := 0
	if after {
		l = min(len(c.after), maxBatch)
	}
	n := min(len(c.queue), maxBatch-l)
	batch := make([]*pending, 0, l+n)
	batch = append(batch, c.after[:l]...)
	batch = append(batch, c.queue[:n]...)
	c.tookAfter(l)
	c.after = c.after[:copy(c.after, c.after[l:])]
	c.queue = c.queue[:copy(c.queue, c.queue[n:])]
	return batch
}

// takeAfter removes the work after responses (as much as one call takes,
// leaving room for one decision); c.mu is held.
func (c *coalescer) takeAfter() []*pending {
	l := min(len(c.after), maxBatch-1)
	batch := append([]*pending(nil), c.after[:l]...)
	c.tookAfter(l)
	c.after = c.after[:copy(c.after, c.after[l:])]
	return batch
}

// tookAfter counts the awaited work among the first l of the work after responses, about to
// be taken; c.mu is held.
func (c *coalescer) tookAfter(l int) {
	if c.awaited == 0 {
		return
	}
	for _, p := range c.after[:l] {
		if p.awaited {
			c.awaited--
		}
	}
}

// leader is the member of batch that waits for it and can lead it, nil
// when all are work after responses.
func leader(batch []*pending) *pending {
	for _, m := range batch {
		if m.then == nil {
			return m
		}
	}
	return nil
}

// lead sends batch, which p belongs to and leads, then hands the next batch
// to one of its members and wakes the rest of its own.
func (c *coalescer) lead(p *pending, batch []*pending) {
	// Whatever happens to the call, the queue moves on and no member is
	// left waiting.
	defer c.finish(p, batch)
	live := batch
	for i, m := range batch {
		if m.ctx != nil && m.ctx.Err() != nil {
			// Its client went away while it queued: its place is freed.
			m.err = errClientGone
			if len(live) == len(batch) {
				live = append([]*pending(nil), batch[:i]...)
			}
			continue
		}
		m.err = errCallAborted // until the call says otherwise
		if len(live) != len(batch) {
			live = append(live, m)
		}
	}
	if len(live) > 0 {
		c.call(live)
	}
}

// errClientGone: the request's client went away before it was decided.
var errClientGone = errors.New("rate limit: the client went away before its decision")

func (c *coalescer) finish(p *pending, batch []*pending) {
	var next []*pending
	var idle drainWaiters // woken once batch's callbacks are done
	c.mu.Lock()
	if len(c.queue) > 0 || len(c.after) >= maxBatch || (len(c.after) > 0 && (len(c.idle) > 0 || c.awaited > 0)) {
		next = c.take()
	} else {
		c.calling--
		switch {
		case c.calling > 0:
		case len(c.after) > 0:
			c.waitAfter() // for the next decision to carry it
		default:
			idle = c.idle.take()
		}
	}
	c.mu.Unlock()
	if next != nil {
		if m := leader(next); m != nil {
			m.lead = next
			m.done <- struct{}{}
		} else {
			go c.lead(nil, next) // only work after responses: nobody waits to lead it
		}
	}
	for _, m := range batch {
		switch {
		case m.then != nil:
			m.then(m)
			m.recycle()
		case m != p:
			m.done <- struct{}{}
		}
	}
	idle.wake()
}
