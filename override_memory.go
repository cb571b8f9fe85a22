package ratelimit

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Overrides without a redis block: kept in this process, as its buckets
// are, and applied by the in-process store (memoryStore.decide) as
// lua/decide.lua applies those in Redis.

// processOverrides are the overrides of the in-process store (handlers
// without a redis block), which survive reloads as its buckets do.
var processOverrides = newOverrideTable()

func init() { processMemory.overrides = processOverrides }

// overridesKept is the in-process store's override table (nil for the
// `local` fallback, which keeps none).
func (m *memoryStore) overridesKept() overrideStore {
	if m.overrides == nil {
		return nil
	}
	return m.overrides
}

// overrideFilter is on for every bucket of the policy while it has an
// override (the store looks the bucket's up itself).
func (m *memoryStore) overrideFilter(prefix string) overrideFilter {
	if m.overrides == nil {
		return noOverrides{}
	}
	return flagFilter{m.overrides.flag(prefix)}
}

// overrideTable keeps overrides in this process, at most
// maxProcessOverrides; each expires on the monotonic clock.
type overrideTable struct {
	mu    sync.Mutex
	byKey map[string]tableOverride
	flags map[string]*atomic.Bool // by policy prefix: on while it has some
	count map[string]int
	now   func() time.Time // injectable for tests
}

type tableOverride struct {
	o       override
	e       overrideEntry
	expires time.Time // zero: never
}

func newOverrideTable() *overrideTable {
	return &overrideTable{byKey: map[string]tableOverride{}, flags: map[string]*atomic.Bool{}, count: map[string]int{}, now: time.Now}
}

func (t *overrideTable) flag(prefix string) *atomic.Bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.flagLocked(prefix)
}

func (t *overrideTable) flagLocked(prefix string) *atomic.Bool {
	fl := t.flags[prefix]
	if fl == nil {
		fl = new(atomic.Bool)
		fl.Store(t.count[prefix] > 0)
		t.flags[prefix] = fl
	}
	return fl
}

// get is the override in force for key; an expired one is deleted.
func (t *overrideTable) get(key string, now time.Time) (tableOverride, bool) {
	o, ok := t.byKey[key]
	if ok && !o.expires.IsZero() && !now.Before(o.expires) {
		t.deleteLocked(key)
		return tableOverride{}, false
	}
	return o, ok
}

func (t *overrideTable) deleteLocked(key string) {
	if _, ok := t.byKey[key]; !ok {
		return
	}
	delete(t.byKey, key)
	prefix := policyPrefixOf(key)
	if t.count[prefix]--; t.count[prefix] <= 0 {
		delete(t.count, prefix)
		t.flagLocked(prefix).Store(false)
	}
}

func (t *overrideTable) setOverride(_ context.Context, key string, o override, e overrideEntry, d time.Duration) (overrideEntry, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	if _, ok := t.get(key, now); !ok && len(t.byKey) >= maxProcessOverrides {
		return e, fmt.Errorf("the in-process store holds %d overrides, its most: delete some first", maxProcessOverrides)
	}
	e.Format, e.Hash, e.Key, e.Set, e.Expires = 1, "", "", now.UnixMilli(), 0
	to := tableOverride{o: o, e: e}
	if d > 0 {
		to.expires = now.Add(d)
		to.e.Expires = to.expires.UnixMilli()
	}
	if _, ok := t.byKey[key]; !ok {
		t.count[policyPrefixOf(key)]++
	}
	t.byKey[key] = to
	t.flagLocked(policyPrefixOf(key)).Store(true)
	return to.e, nil
}

func (t *overrideTable) deleteOverride(_ context.Context, key string) (bool, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	_, ok := t.get(key, t.now())
	t.deleteLocked(key)
	return ok, nil
}

func (t *overrideTable) overridesOf(_ context.Context, prefix string) ([]overrideEntry, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	var out []overrideEntry
	for key := range t.byKey {
		if policyPrefixOf(key) != prefix {
			continue
		}
		if o, ok := t.get(key, now); ok {
			e := o.e
			e.Hash, e.Key = hashOf(key), key
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b overrideEntry) int { return strings.Compare(a.Hash, b.Hash) })
	return out, nil
}

func (t *overrideTable) overrideOf(_ context.Context, key string) (*overrideEntry, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	o, ok := t.get(key, t.now())
	if !ok {
		return nil, nil
	}
	e := o.e
	e.Hash, e.Key = hashOf(key), key
	return &e, nil
}

// decidedUnder is reqs with the limits of the overrides in force for their
// overridable buckets (reqs itself when none is).
func (t *overrideTable) decidedUnder(reqs []bucketRequest) []bucketRequest {
	out := reqs
	var now time.Time
	for i, rq := range reqs {
		if !rq.overridable {
			continue
		}
		if now.IsZero() {
			now = t.now()
			t.mu.Lock()
			defer t.mu.Unlock()
		}
		o, ok := t.get(rq.key, now)
		if !ok {
			continue
		}
		if &out[0] == &reqs[0] {
			out = append([]bucketRequest(nil), reqs...)
		}
		out[i] = rq.applyOverride(o.o)
	}
	return out
}
