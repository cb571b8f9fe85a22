package hotkey

import "sync"

// Window is the µs over which an Estimator counts: a key becomes hot
// within about a window of its rate passing the threshold.
const Window = 100_000

// Estimator estimates the rate of a stream of decisions (on a key) and of
// their amounts (the tokens they asked for): a sliding window made
// of the current window's count and the last one's, weighed by how much
// of the last one the sliding window still covers.
type Estimator struct {
	start        int64 // local µs: the current window's start
	curN, prevN  int64
	curA, prevA  int64
	started, any bool
}

// roll moves the windows up to now.
func (e *Estimator) roll(now int64) {
	if !e.started {
		e.start, e.started = now, true
		return
	}
	gone := now - e.start
	if gone < Window {
		return
	}
	if gone < 2*Window {
		e.prevN, e.prevA = e.curN, e.curA
	} else {
		e.prevN, e.prevA = 0, 0
	}
	e.curN, e.curA = 0, 0
	e.start = now - gone%Window
}

// Add counts one decision of the given amount at now.
func (e *Estimator) Add(amount, now int64) {
	e.roll(now)
	e.curN++
	e.curA += amount
	e.any = true
}

// Remove takes back one decision of the given amount counted at now or
// shortly before (in the current window, else the last): a request that
// another policy denied asked nothing of this key's bucket.
func (e *Estimator) Remove(amount, now int64) {
	e.roll(now)
	switch {
	case e.curN > 0:
		e.curN--
		e.curA = max(0, e.curA-amount)
	case e.prevN > 0:
		e.prevN--
		e.prevA = max(0, e.prevA-amount)
	}
}

// Rate is the decisions and the amount per second at now.
func (e *Estimator) Rate(now int64) (decisions, amount float64) {
	e.roll(now)
	if !e.any {
		return 0, 0
	}
	cover := 1 - float64(now-e.start)/Window // of the last window
	decisions = (float64(e.prevN)*cover + float64(e.curN)) * 1e6 / Window
	amount = (float64(e.prevA)*cover + float64(e.curA)) * 1e6 / Window
	return decisions, amount
}

// idle reports whether the estimator counted at most one decision over
// the last two windows: its entry may go to another key.
func (e *Estimator) idle(now int64) bool {
	e.roll(now)
	return e.prevN+e.curN <= 1
}

// Rates estimates the decision rate of each key an instance decides, in a
// fixed table: memory is bounded whatever the number of keys. A key that
// finds both its entries taken by keys busier than one decision per two
// windows is not tracked (its rate reads 0) until one of them quiets down:
// a key can become hot only while fewer than the table's entries are busy.
type Rates struct {
	shards [rateShards]rateShard
}

const (
	rateShards  = 32
	rateEntries = 32 // per shard: 1,024 keys tracked at once
)

type rateShard struct {
	mu      sync.Mutex
	entries [rateEntries]rateEntry
}

type rateEntry struct {
	id  uint64
	est Estimator
	// contended is the local µs until which the key counts as hot whatever
	// its rate (see Contend).
	contended int64
}

// entry returns the entry tracking id, taking a free one for it when
// there is one; nil when neither of its two entries can be had. s.mu is
// held.
func (s *rateShard) entry(id uint64, now int64) *rateEntry {
	a, b := &s.entries[(id>>8)%rateEntries], &s.entries[(id>>16)%rateEntries]
	switch {
	case a.id == id && a.est.started:
		return a
	case b.id == id && b.est.started:
		return b
	case !a.est.started || a.est.idle(now) && a.contended <= now:
		*a = rateEntry{id: id}
		a.est.roll(now)
		return a
	case !b.est.started || b.est.idle(now) && b.contended <= now:
		*b = rateEntry{id: id}
		b.est.roll(now)
		return b
	}
	return nil
}

// Observe counts a decision of the given amount on key id at now and
// returns the key's estimator (a copy, to read its rates from) and whether
// it is contended; tracked is false when the key has no entry (its rates
// read 0).
func (r *Rates) Observe(id uint64, amount, now int64) (est Estimator, contended, tracked bool) {
	s := &r.shards[id%rateShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	en := s.entry(id, now)
	if en == nil {
		return Estimator{}, false, false
	}
	en.est.Add(amount, now)
	return en.est, en.contended > now, true
}

// Unobserve takes back a decision Observe counted: the request was
// denied by another policy, and asked nothing of this key's bucket, so
// that requests another policy denies never make a key hot.
func (r *Rates) Unobserve(id uint64, amount, now int64) {
	s := &r.shards[id%rateShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	a, b := &s.entries[(id>>8)%rateEntries], &s.entries[(id>>16)%rateEntries]
	switch {
	case a.id == id && a.est.started:
		a.est.Remove(amount, now)
	case b.id == id && b.est.started:
		b.est.Remove(amount, now)
	}
}

// Contend marks key id contended until the local µs until: another
// instance holds blocks of its bucket ahead of the requests this one sends
// it, which the bucket then denies; taking blocks too puts this instance's
// requests in the same line.
func (r *Rates) Contend(id uint64, until, now int64) {
	s := &r.shards[id%rateShards]
	s.mu.Lock()
	defer s.mu.Unlock()
	if en := s.entry(id, now); en != nil {
		en.contended = max(en.contended, until)
	}
}
