package ratelimit

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// overrideKeeper is a store that may keep operators' overrides of its
// buckets' limits (override_store.go). Implemented by redisStore and
// memoryStore (whose `local` fallback keeps none).
type overrideKeeper interface {
	// overridesKept is where they are kept; nil when the store keeps none.
	overridesKept() overrideStore
	// overrideFilter says which buckets of the policy whose keys start with
	// prefix may have one.
	overrideFilter(prefix string) overrideFilter
}

var (
	_ overrideKeeper = (*redisStore)(nil)
	_ overrideKeeper = (*memoryStore)(nil)
)

// Where overrides live: in Redis beside their buckets (lua/decide.lua reads
// them), or in this process without a redis block; and the filters that say
// which buckets may have one, so that the others never pay a read.
//
// In Redis, a policy's overrides are:
//   - <key_prefix><policy>:{<hash>}:override, the override of one identity,
//     in its bucket's hash slot: "o1 r <interval> <burst>" or "o1 c 0
//     <slots>" (override.encode), expiring by itself (PXAT, on Redis time)
//     when set `for` a while;
//   - <key_prefix><policy>:overrides, the index: a hash of <hash> to a JSON
//     entry ({"v":1, ...}: the limit as given, its expiry, its note), which
//     the override list reads, and whose fields every instance keeps (the
//     keys whose requests read their override). An entry is written before
//     its key and deleted after it, so
//     that no override is in force without one. Expired entries are pruned
//     a few at a time by every instance.
//
// Neither is a value the release before this one reads (see override.go).

// overridesEvery is how often an instance reads whether each policy has
// overrides; an override set or deleted through any instance is announced
// to all at once (eventOverride).
const overridesEvery = 10 * time.Second

// overridesPruned is how many index entries an instance looks at per
// policy each time, for expired ones to delete.
const overridesPruned = 64

// Bounds of what an override holds.
const (
	minOverrideFor = time.Second
	maxOverrideFor = 366 * 24 * time.Hour
	maxNoteLen     = 200
	// maxProcessOverrides bounds the overrides of the in-process store.
	maxProcessOverrides = 1 << 17
)

// overrideKey is where the override of the bucket under bucketKey is:
// beside it, under the same hash tag (so in the same Cluster hash slot), the
// script's cheapest key to derive.
func overrideKey(bucketKey string) string { return bucketKey + overrideSuffix }

// overrideSuffix names the key of a bucket's override.
const overrideSuffix = ":override"

// overrideIndex is the index of the overrides of the policy whose storage
// keys start with prefix (<key_prefix><policy>:).
func overrideIndex(prefix string) string { return prefix + "overrides" }

// policyPrefixOf is the policy part of a storage key: <key_prefix><policy>:.
func policyPrefixOf(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		return key[:i]
	}
	return key
}

// hashOf is the identity's hash in a storage key: the text between its
// braces.
func hashOf(key string) string {
	i, j := strings.IndexByte(key, '{'), strings.LastIndexByte(key, '}')
	if i < 0 || j < i {
		return key
	}
	return key[i+1 : j]
}

// overrideEntry is an override as the index and the admin API show it.
type overrideEntry struct {
	// Format is the entry's format: 1.
	Format int    `json:"v"`
	Hash   string `json:"hash,omitempty"`
	Key    string `json:"key,omitempty"`
	// Kind is rate, concurrent or quota; Rate and Burst (rate), Concurrent
	// (concurrent), Quota (quota: N/<the policy's unit>) the limit as
	// given.
	Kind       string `json:"kind"`
	Rate       string `json:"rate,omitempty"`
	Burst      int64  `json:"burst,omitempty"`
	Concurrent int64  `json:"concurrent,omitempty"`
	Quota      string `json:"quota,omitempty"`
	// Expires is when it expires, Unix ms on the store's clock (0: never);
	// Set when it was set, Unix ms.
	Expires int64  `json:"expires_ms,omitempty"`
	Set     int64  `json:"set_ms,omitempty"`
	Note    string `json:"note,omitempty"`
	// Source is the limits file that set it (`caddy rate-limit apply`),
	// which may remove it; empty: set by hand, which no file removes. A
	// field the release before ignores.
	Source string `json:"source,omitempty"`
}

// describe is the entry's limit as the command line writes it.
func (e overrideEntry) describe() string {
	if e.Kind == "concurrent" {
		return fmt.Sprintf("concurrent %d", e.Concurrent)
	}
	if e.Kind == "quota" {
		return "quota " + e.Quota
	}
	if e.Burst > 0 {
		return fmt.Sprintf("rate %s burst %d", e.Rate, e.Burst)
	}
	return "rate " + e.Rate
}

// overrideStore is where a store keeps overrides.
type overrideStore interface {
	// setOverride stores o for the bucket under key, for d (0: until
	// deleted), and returns the entry as stored (its expiry set).
	setOverride(ctx context.Context, key string, o override, e overrideEntry, d time.Duration) (overrideEntry, error)
	// deleteOverride deletes the override of the bucket under key, and
	// reports whether one was in force.
	deleteOverride(ctx context.Context, key string) (bool, error)
	// overridesOf lists the overrides in force of the policy whose keys
	// start with prefix.
	overridesOf(ctx context.Context, prefix string) ([]overrideEntry, error)
	// overrideOf is the entry of the bucket under key (nil: none).
	overrideOf(ctx context.Context, key string) (*overrideEntry, error)
}

// overridesIn is the override store of a handler's store (nil for one that
// keeps none: the `local` fallback, a test's).
func overridesIn(s store) overrideStore {
	if k, ok := s.(overrideKeeper); ok {
		return k.overridesKept()
	}
	return nil
}

// overrideFilter says which of a policy's buckets may have an override in
// the store: the requests of those, and only those, ask the store to read
// their override (the overridable bit), which costs a read in the script.
type overrideFilter interface {
	may(key string) bool
}

// noOverrides is the filter of a store that keeps none.
type noOverrides struct{}

func (noOverrides) may(string) bool { return false }

// overrideFilterOf is the store's filter of the overrides of the policy
// whose keys start with prefix.
func overrideFilterOf(s store, prefix string) overrideFilter {
	if k, ok := s.(overrideKeeper); ok {
		return k.overrideFilter(prefix)
	}
	return noOverrides{}
}

// flagFilter is a filter by a flag: every bucket of the policy while it is
// on (the in-process store, which looks the override up itself).
type flagFilter struct{ on *atomic.Bool }

func (f flagFilter) may(string) bool { return f.on.Load() }

// overrideSet is a Redis store's filter of one policy: the keys its index
// lists, read at start, every overridesEvery and when an override is
// announced (which adds its key at once). Until first read every key may
// have one (an instance that starts meanwhile reads the overrides rather
// than miss one); while Redis cannot say, it stays as it was. A key whose
// override expired or was deleted stays in it until the next read: its
// requests cost a read that finds nothing.
type overrideSet struct {
	unread atomic.Bool
	count  atomic.Int64
	ids    bucketIDs
	mu     sync.RWMutex
	keys   map[bucketID]struct{} // pointer-free, as the deny cache's
}

func newOverrideSet() *overrideSet {
	s := &overrideSet{ids: newBucketIDs(), keys: map[bucketID]struct{}{}}
	s.unread.Store(true)
	return s
}

func (s *overrideSet) may(key string) bool {
	switch {
	case s.unread.Load():
		return true
	case s.count.Load() == 0: // the policy has none: nothing to look up
		return false
	}
	id := s.ids.of(key)
	s.mu.RLock()
	_, ok := s.keys[id]
	s.mu.RUnlock()
	return ok
}

// add puts key in the set.
func (s *overrideSet) add(key string) {
	s.mu.Lock()
	s.keys[s.ids.of(key)] = struct{}{}
	s.count.Store(int64(len(s.keys)))
	s.mu.Unlock()
}

// replace makes the set the keys read from the index.
func (s *overrideSet) replace(keys []string) {
	m := make(map[bucketID]struct{}, len(keys))
	for _, k := range keys {
		m[s.ids.of(k)] = struct{}{}
	}
	s.mu.Lock()
	s.keys = m
	s.count.Store(int64(len(m)))
	s.mu.Unlock()
	s.unread.Store(false)
}
