// Package topk counts, for one policy on one instance, the identities it
// denied most in the last Window: a ring of one-minute Space-Saving
// summaries (Metwally et al.), each of at most a fixed number of counters,
// so memory is fixed whatever the number of identities.
package topk

import (
	"slices"
	"sync"
	"time"
)

// Sketch is one policy's ring of summaries. An identity that is counted is
// over-counted by at most its error, and one denied more than a minute's
// denials / maxCounters times is always counted. The raw identities it
// holds are shown only by the admin API (`caddy rate-limit top`), never in
// metrics, logs or Redis. Safe for concurrent use.
type Sketch struct {
	mu      sync.Mutex
	minutes [minutes]summary
	now     func() time.Time
}

const (
	minutes = 5
	// Window is how far back a sketch counts.
	Window      = minutes * time.Minute
	maxCounters = 64
	// maxIdentityLen bounds the bytes of an identity kept for display;
	// longer ones are cut (and told apart by their bucket).
	maxIdentityLen = 256
)

type summary struct {
	minute   int64 // Unix minute
	counters []counter
	dropped  bool // an identity was forgotten for another (Space-Saving)
}

type counter struct {
	bucket   [2]uint64 // the identity's bucket: what tells identities apart
	key      string    // the storage key (a hash)
	identity string    // as sent, cut at maxIdentityLen
	cut      bool      // identity was longer
	count    int64
	err      int64 // at most this much of count belongs to identities it replaced
}

// New makes an empty sketch on the wall clock.
func New() *Sketch { return &Sketch{now: time.Now} }

// Record counts one denial of identity, whose bucket is id (a 128-bit
// hash of its key) under key.
func (t *Sketch) Record(id [2]uint64, key, identity string) {
	minute := t.now().Unix() / 60
	t.mu.Lock()
	defer t.mu.Unlock()
	s := &t.minutes[minute%minutes]
	if s.minute != minute {
		s.minute, s.counters, s.dropped = minute, s.counters[:0], false
	}
	for i := range s.counters {
		if s.counters[i].bucket == id {
			s.counters[i].count++
			return
		}
	}
	cut := len(identity) > maxIdentityLen
	if cut {
		identity = identity[:maxIdentityLen]
	}
	if len(s.counters) < maxCounters {
		s.counters = append(s.counters, counter{bucket: id, key: key, identity: identity, cut: cut, count: 1})
		return
	}
	// Space-Saving: the new identity takes the place of the least counted,
	// inheriting its count as error.
	least := 0
	for i := range s.counters {
		if s.counters[i].count < s.counters[least].count {
			least = i
		}
	}
	s.dropped = true
	c := &s.counters[least]
	*c = counter{bucket: id, key: key, identity: identity, cut: cut, count: c.count + 1, err: c.count}
}

// Entry is one identity in the answer of top.
type Entry struct {
	Identity  string `json:"identity"`
	Key       string `json:"key"`
	Denials   int64  `json:"denials"`
	Error     int64  `json:"error_bound"`
	Truncated bool   `json:"truncated,omitempty"`
}

// Top returns the n identities denied most in the last Window, those
// with the most denials for certain first. truncated says that the list
// is not all the identities denied in the window: more than n were, or the
// sketch forgot some for others (their denials are then in the error
// bounds of those that took their places).
func (t *Sketch) Top(n int) (_ []Entry, truncated bool) {
	minute := t.now().Unix() / 60
	byBucket := map[[2]uint64]*Entry{}
	t.mu.Lock()
	for _, s := range t.minutes {
		if s.minute <= minute-minutes || s.minute > minute {
			continue
		}
		truncated = truncated || s.dropped
		for _, c := range s.counters {
			e := byBucket[c.bucket]
			if e == nil {
				e = &Entry{Identity: c.identity, Key: c.key, Truncated: c.cut}
				byBucket[c.bucket] = e
			}
			e.Denials += c.count
			e.Error += c.err
		}
	}
	t.mu.Unlock()
	out := make([]Entry, 0, len(byBucket))
	for _, e := range byBucket {
		out = append(out, *e)
	}
	// Most denials for certain (the count less its error) first.
	slices.SortFunc(out, func(a, b Entry) int {
		if ga, gb := a.Denials-a.Error, b.Denials-b.Error; ga != gb {
			return int(gb - ga)
		}
		return int(b.Denials - a.Denials)
	})
	return out[:min(n, len(out))], truncated || len(out) > n
}
