package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// Overrides in Redis: the filters each connection keeps of the keys that
// may have one (followed, read every overridesEvery, pruned), and the
// commands that write, delete and list them.

// overrideFlags are a Redis connection's overrides: its filters
// (overrideSet), by policy prefix, and what keeps them, and the commands
// that write, delete and list overrides (the Redis store's overrideStore).
// It holds what it needs of the connection: the client, the bound of a
// call, and the connection's end.
type overrideFlags struct {
	client      redis.UniversalClient
	callTimeout time.Duration
	closed      <-chan struct{}

	mu      sync.Mutex
	sets    map[string]*overrideSet
	gen     map[string]uint64 // bumped by each announcement
	cursors map[string]uint64 // where pruning goes on in each index
	read    chan struct{}
	started bool
	waits   map[string][]*ackWait // announcements awaiting confirmation, by key
}

// overrideSet returns the filter of prefix, following it from now on.
func (f *overrideFlags) overrideSet(prefix string) *overrideSet {
	f.mu.Lock()
	defer f.mu.Unlock()
	if s := f.sets[prefix]; s != nil {
		return s
	}
	if f.sets == nil {
		f.sets, f.gen, f.cursors = map[string]*overrideSet{}, map[string]uint64{}, map[string]uint64{}
		f.read = make(chan struct{}, 1)
	}
	s := newOverrideSet()
	f.sets[prefix] = s
	if !f.started {
		f.started = true
		go f.followOverrides()
	}
	f.ask()
	return s
}

// ask has the sets read again soon.
func (f *overrideFlags) ask() {
	select {
	case f.read <- struct{}{}:
	default:
	}
}

// changed adds key to its policy's set, at once, and has the set read
// again: an override of it was set or deleted.
func (f *overrideFlags) changed(key string) {
	prefix := policyPrefixOf(key)
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.sets[prefix]
	if s == nil {
		return // no policy of this instance
	}
	f.gen[prefix]++
	s.add(key)
	f.ask()
}

// followOverrides reads the sets until the connection closes.
func (f *overrideFlags) followOverrides() {
	t := time.NewTicker(overridesEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-f.read:
		case <-f.closed:
			return
		}
		f.readOverrideSets()
	}
}

// readOverrideSets reads, for every policy prefix, the keys its index
// lists (HKEYS: some 22 bytes per override), first pruning a few expired
// entries.
func (f *overrideFlags) readOverrideSets() {
	f.mu.Lock()
	prefixes := make([]string, 0, len(f.sets))
	for prefix := range f.sets {
		prefixes = append(prefixes, prefix)
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), f.callTimeout)
	defer cancel()
	now, err := f.client.Time(ctx).Result()
	if err != nil {
		return // keep what was known
	}
	for _, prefix := range prefixes {
		f.mu.Lock()
		gen, cursor := f.gen[prefix], f.cursors[prefix]
		f.mu.Unlock()
		next, err := f.pruneOverrides(ctx, prefix, cursor, now.UnixMilli())
		if err != nil {
			return
		}
		hashes, err := f.client.HKeys(ctx, overrideIndex(prefix)).Result()
		if err != nil {
			return
		}
		keys := make([]string, len(hashes))
		for i, h := range hashes {
			keys[i] = prefix + "{" + h + "}"
		}
		f.mu.Lock()
		f.cursors[prefix] = next
		if f.gen[prefix] == gen { // no announcement since: what was read holds
			f.sets[prefix].replace(keys)
		} else {
			f.ask()
		}
		f.mu.Unlock()
	}
}

// pruneOverrides deletes the expired entries among a few of the index's,
// from cursor on, and returns where to go on.
func (f *overrideFlags) pruneOverrides(ctx context.Context, prefix string, cursor uint64, nowMS int64) (uint64, error) {
	index := overrideIndex(prefix)
	kv, next, err := f.client.HScan(ctx, index, cursor, "", overridesPruned).Result()
	if err != nil {
		return cursor, err
	}
	var expired []string
	for i := 0; i+1 < len(kv); i += 2 {
		if e, ok := parseOverrideEntry(kv[i+1]); !ok || e.Expires > 0 && e.Expires <= nowMS {
			expired = append(expired, kv[i])
		}
	}
	if len(expired) > 0 {
		if err := f.client.HDel(ctx, index, expired...).Err(); err != nil {
			return cursor, err
		}
	}
	return next, nil
}

// parseOverrideEntry reads an index entry.
func parseOverrideEntry(v string) (overrideEntry, bool) {
	var e overrideEntry
	if err := json.Unmarshal([]byte(v), &e); err != nil || e.Format != 1 {
		return overrideEntry{}, false
	}
	return e, true
}

// setOverrideFor stores an override that expires after ARGV[2] ms of Redis
// time, and returns when, in Unix ms.
var setOverrideFor = redis.NewScript(`
local t = redis.call('TIME')
local at = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[2])
redis.call('SET', KEYS[1], ARGV[1], 'PXAT', at)
return at`)

func (f *overrideFlags) setOverride(ctx context.Context, key string, o override, e overrideEntry, d time.Duration) (overrideEntry, error) {
	prefix, hash := policyPrefixOf(key), hashOf(key)
	index := overrideIndex(prefix)
	e.Format, e.Hash, e.Key, e.Set = 1, "", "", time.Now().UnixMilli()
	if d > 0 {
		e.Expires = e.Set + d.Milliseconds() // until the store says
	}
	raw, _ := json.Marshal(e)
	// The entry first: no override is ever in force without one.
	if err := f.client.HSet(ctx, index, hash, raw).Err(); err != nil {
		return e, err
	}
	var err error
	if d > 0 {
		var at int64
		if at, err = setOverrideFor.Run(ctx, f.client, []string{overrideKey(key)}, o.encode(), d.Milliseconds()).Int64(); err == nil && at != e.Expires {
			e.Expires = at
			raw, _ = json.Marshal(e)
			err = f.client.HSet(ctx, index, hash, raw).Err()
		}
	} else {
		err = f.client.Set(ctx, overrideKey(key), o.encode(), 0).Err()
	}
	if err != nil {
		_ = f.client.HDel(context.WithoutCancel(ctx), index, hash).Err()
		return e, err
	}
	f.changed(key)
	return e, nil
}

func (f *overrideFlags) deleteOverride(ctx context.Context, key string) (bool, error) {
	n, err := f.client.Del(ctx, overrideKey(key)).Result()
	if err != nil {
		return false, err
	}
	if err := f.client.HDel(ctx, overrideIndex(policyPrefixOf(key)), hashOf(key)).Err(); err != nil {
		return n > 0, err
	}
	f.changed(key)
	return n > 0, nil
}

func (f *overrideFlags) overridesOf(ctx context.Context, prefix string) ([]overrideEntry, error) {
	all, err := f.client.HGetAll(ctx, overrideIndex(prefix)).Result()
	if err != nil {
		return nil, err
	}
	now, err := f.client.Time(ctx).Result()
	if err != nil {
		return nil, err
	}
	var out []overrideEntry
	for hash, v := range all {
		e, ok := parseOverrideEntry(v)
		if !ok || e.Expires > 0 && e.Expires <= now.UnixMilli() {
			continue
		}
		e.Hash, e.Key = hash, prefix+"{"+hash+"}"
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b overrideEntry) int { return strings.Compare(a.Hash, b.Hash) })
	return out, nil
}

// overrideOf reads the override key, which says whether one is in force
// (it expires by itself), then its entry for the rest.
func (f *overrideFlags) overrideOf(ctx context.Context, key string) (*overrideEntry, error) {
	v, err := f.client.Get(ctx, overrideKey(key)).Result()
	if errors.Is(err, redis.Nil) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	o, ok := decodeOverride(v)
	if !ok {
		return nil, nil // not an override: the script ignores it too
	}
	raw, err := f.client.HGet(ctx, overrideIndex(policyPrefixOf(key)), hashOf(key)).Result()
	if err != nil && !errors.Is(err, redis.Nil) {
		return nil, err
	}
	e, ok := parseOverrideEntry(raw)
	if !ok { // no entry (a write that failed half-way): what the key says
		e = overrideEntry{Format: 1, Kind: "concurrent", Concurrent: o.burst}
		switch o.kind {
		case overrideRate:
			e = overrideEntry{Format: 1, Kind: "rate", Rate: fmt.Sprintf("1/%s", time.Duration(o.interval)*time.Microsecond), Burst: o.burst}
		case overrideQuota:
			e = overrideEntry{Format: 1, Kind: "quota", Quota: strconv.FormatInt(o.burst, 10)}
		}
	}
	e.Hash, e.Key = hashOf(key), key
	return &e, nil
}

var _ overrideStore = (*overrideFlags)(nil)
