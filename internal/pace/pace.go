// Package pace spreads the Retry-After values sent to the denied clients
// of one bucket so that clients that honour them return no faster than the
// bucket refills, and never earlier than their true wait.
package pace

import (
	"hash/maphash"
	"math"
	"math/rand/v2"
	"net/http"
	"sync"
	"sync/atomic"
	"time"
)

// Pacer gives each bucket a calendar of return turns, one every cost ×
// interval (× instances: the instances of a fleet keep their own
// calendars): a denied client is given the next free turn, at least its
// true wait and at least a second away, at a random point of the turn (up
// to jitter of the wait). Retry-After is whole seconds, and whole seconds
// alone cannot spread a herd: clients that start together and honour them
// exactly come back together, second after second, however many seconds
// each is told. So the denial is answered at the fraction of a second that
// puts the client's return, response time plus Retry-After, on its turn:
// the turns, and with them the clients, spread over the second.
//
// Only clients that honour Retry-After are paced. A connection that comes
// back before it was told to is answered at once (with a Retry-After
// spread by jitter, as before); so an abusive client is never held, and an
// instance holds at most maxPacedDenials denials at once. `jitter 0`
// turns pacing off: Retry-After is then the true wait, rounded up. Safe
// for concurrent use.
type Pacer struct {
	turns [shards]shard // per bucket: the next free return turn
	conns [shards]shard // per connection: when it was told to return
	seed  maphash.Seed
	held  atomic.Int64
	now   func() int64 // µs, monotonic
}

const (
	shards = 16
	// shardMax bounds each shard's entries: memory is fixed whatever
	// the number of buckets and connections.
	shardMax = 4096
	// maxPacedDenials bounds the denials one instance holds at once.
	maxPacedDenials = 4096
	// horizon bounds how far ahead a turn is given: a bucket whose
	// calendar is booked further (far more clients than it can serve) tells
	// the later ones to come back within it, spread by jitter.
	horizon = 60 * time.Second
	// earlyTolerance is how early a connection may come back and still be
	// taken as honouring its Retry-After (clocks, scheduling).
	earlyTolerance = 200 * time.Millisecond
)

type shard struct {
	mu sync.Mutex
	m  map[uint64]int64 // µs
}

// New makes a pacer on the clock now, in µs (monotonic).
func New(now func() int64) *Pacer {
	p := &Pacer{seed: maphash.MakeSeed(), now: now}
	for i := range p.turns {
		p.turns[i].m = map[uint64]int64{}
		p.conns[i].m = map[uint64]int64{}
	}
	return p
}

// Pace returns the Retry-After, in whole seconds, for a denial whose true
// wait is untilFits µs on the bucket under key, whose turns are stride µs
// apart, and how long to hold the response first. conn identifies the
// client's connection.
func (p *Pacer) Pace(conn, key string, untilFits, stride int64, jitter float64) (retryAfter int64, hold time.Duration) {
	const second = int64(time.Second / time.Microsecond)
	now := p.now()
	wait := max(untilFits, 0)
	if jitter <= 0 {
		return max(1, (wait+second-1)/second), 0 // the wait in whole seconds, rounded up
	}
	c := maphash.String(p.seed, conn)
	cs := &p.conns[c%shards]
	cs.mu.Lock()
	told, known := cs.m[c]
	early := known && now < told-earlyTolerance.Microseconds()
	cs.mu.Unlock()

	// The turn: the bucket's next free one, at least the true wait and a
	// second away, within the horizon; then spread by jitter, within the
	// turn (a wider spread would bunch turns together again).
	at := now + max(wait, second)
	spread := int64(float64(at-now) * jitter)
	if !early {
		b := maphash.String(p.seed, key)
		bs := &p.turns[b%shards]
		bs.mu.Lock()
		if next := bs.m[b]; next > at {
			at = min(next, now+max(wait, second)+horizon.Microseconds())
		}
		if next := at + stride; next > bs.m[b] {
			bs.set(b, next, now)
		}
		bs.mu.Unlock()
		spread = min(int64(float64(at-now)*jitter), stride)
	}
	at += int64(float64(spread) * rand.Float64())

	ahead := at - now
	if early || p.held.Load() >= maxPacedDenials {
		retryAfter = int64(math.Ceil(float64(ahead) / float64(second)))
	} else {
		retryAfter = ahead / second
		hold = time.Duration(ahead-retryAfter*second) * time.Microsecond
	}
	retryAfter = max(retryAfter, 1)
	cs.mu.Lock()
	cs.set(c, now+hold.Microseconds()+retryAfter*second, now)
	cs.mu.Unlock()
	return retryAfter, hold
}

// set records v under k, first dropping the entries that are past when
// the shard is full (and all of them if none is).
func (s *shard) set(k uint64, v, now int64) {
	if _, found := s.m[k]; !found && len(s.m) >= shardMax {
		for key, at := range s.m {
			if at < now {
				delete(s.m, key)
			}
		}
		if len(s.m) >= shardMax {
			clear(s.m)
		}
	}
	s.m[k] = v
}

// HoldDenial waits d before a denial is answered, unless the client goes
// away first.
func (p *Pacer) HoldDenial(r *http.Request, d time.Duration) {
	if d <= 0 {
		return
	}
	p.held.Add(1)
	defer p.held.Add(-1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
	case <-r.Context().Done():
	}
}

// Forget drops the return turns of the bucket under key: an operator reset
// it, and clients told to come back later may come now.
func (p *Pacer) Forget(key string) {
	b := maphash.String(p.seed, key)
	bs := &p.turns[b%shards]
	bs.mu.Lock()
	delete(bs.m, b)
	bs.mu.Unlock()
}
