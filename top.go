package ratelimit

import (
	"slices"
	"sync"
	"time"
)

// topDenied is, for one policy on this instance, the identities denied most
// in the last topWindow: a ring of one-minute Space-Saving summaries
// (Metwally et al.), each of at most topCounters identities, so memory is
// fixed whatever the number of identities. An identity that is counted is
// over-counted by at most its error, and one denied more than a minute's
// denials / topCounters times is always counted. The raw identities it
// holds are shown only by the admin API (`caddy rate-limit top`), never in
// metrics, logs or Redis.
type topDenied struct {
	mu      sync.Mutex
	minutes [topMinutes]topSummary
	now     func() time.Time
}

const (
	topMinutes  = 5
	topWindow   = topMinutes * time.Minute
	topCounters = 64
	// topIdentityLen bounds the bytes of an identity kept for display;
	// longer ones are cut (and told apart by their bucket).
	topIdentityLen = 256
)

type topSummary struct {
	minute   int64 // Unix minute
	counters []topCounter
	dropped  bool // an identity was forgotten for another (Space-Saving)
}

type topCounter struct {
	bucket   bucketID // the identity's bucket: what tells identities apart
	key      string   // the storage key (a hash)
	identity string   // as sent, cut at topIdentityLen
	cut      bool     // identity was longer
	count    int64
	err      int64 // at most this much of count belongs to identities it replaced
}

func newTopDenied() *topDenied { return &topDenied{now: time.Now} }

// topByPolicy keeps each policy name's topDenied for the process, so that
// what was counted survives config reloads. Its size is the number of
// policy names in configs.
var topByPolicy sync.Map // name -> *topDenied

func topOf(name string) *topDenied {
	if t, ok := topByPolicy.Load(name); ok {
		return t.(*topDenied)
	}
	t, _ := topByPolicy.LoadOrStore(name, newTopDenied())
	return t.(*topDenied)
}

// topIDs tells identities' buckets apart in the summaries.
var topIDs = newBucketIDs()

// record counts one denial of identity, whose bucket is id under key.
func (t *topDenied) record(id bucketID, key, identity string) {
	minute := t.now().Unix() / 60
	t.mu.Lock()
	defer t.mu.Unlock()
	s := &t.minutes[minute%topMinutes]
	if s.minute != minute {
		s.minute, s.counters, s.dropped = minute, s.counters[:0], false
	}
	for i := range s.counters {
		if s.counters[i].bucket == id {
			s.counters[i].count++
			return
		}
	}
	cut := len(identity) > topIdentityLen
	if cut {
		identity = identity[:topIdentityLen]
	}
	if len(s.counters) < topCounters {
		s.counters = append(s.counters, topCounter{bucket: id, key: key, identity: identity, cut: cut, count: 1})
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
	*c = topCounter{bucket: id, key: key, identity: identity, cut: cut, count: c.count + 1, err: c.count}
}

// topEntry is one identity in the answer of top.
type topEntry struct {
	Identity  string `json:"identity"`
	Key       string `json:"key"`
	Denials   int64  `json:"denials"`
	Error     int64  `json:"error_bound"`
	Truncated bool   `json:"truncated,omitempty"`
}

// top returns the n identities denied most in the last topWindow, those
// with the most denials for certain first. truncated says that the list
// is not all the identities denied in the window: more than n were, or the
// sketch forgot some for others (their denials are then in the error
// bounds of those that took their places).
func (t *topDenied) top(n int) (_ []topEntry, truncated bool) {
	minute := t.now().Unix() / 60
	byBucket := map[bucketID]*topEntry{}
	t.mu.Lock()
	for _, s := range t.minutes {
		if s.minute <= minute-topMinutes || s.minute > minute {
			continue
		}
		truncated = truncated || s.dropped
		for _, c := range s.counters {
			e := byBucket[c.bucket]
			if e == nil {
				e = &topEntry{Identity: c.identity, Key: c.key, Truncated: c.cut}
				byBucket[c.bucket] = e
			}
			e.Denials += c.count
			e.Error += c.err
		}
	}
	t.mu.Unlock()
	out := make([]topEntry, 0, len(byBucket))
	for _, e := range byBucket {
		out = append(out, *e)
	}
	// Most denials for certain (the count less its error) first.
	slices.SortFunc(out, func(a, b topEntry) int {
		if ga, gb := a.Denials-a.Error, b.Denials-b.Error; ga != gb {
			return int(gb - ga)
		}
		return int(b.Denials - a.Denials)
	})
	return out[:min(n, len(out))], truncated || len(out) > n
}
