package ratelimit

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
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
// beside it, under the same hash tag (so in the same Cluster slot), the
// script's cheapest key to derive.
func overrideKey(bucketKey string) string { return bucketKey + ":override" }

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
	switch s := s.(type) {
	case *redisStore:
		return s.conn
	case *memoryStore:
		if s.overrides != nil {
			return s.overrides
		}
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
	switch s := s.(type) {
	case *redisStore:
		return s.conn.overrideSet(prefix)
	case *memoryStore:
		if s.overrides != nil {
			return flagFilter{s.overrides.flag(prefix)}
		}
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

// Announcing an override. The instance that set (or deleted) one publishes
// "override <instance> <storage key>" on <key_prefix>events; each instance
// adds the key to its policy's set, forgets what it remembered of the
// bucket, and confirms with "seen <storage key>" on <key_prefix>events:<instance>, the
// announcer's own channel; the announcer answers once as many confirmations
// came as the events channel has subscribers (PUBSUB NUMSUB: every
// instance, itself included), or after a second. So when the admin API
// answers, the override applies to the next request on every instance,
// not only once each has read the message.

// eventSeen confirms an override's announcement.
const eventSeen = "seen"

// instanceID names this process in announcements and in the fleet's
// records (fleet.go): random, new with each process.
var instanceID = func() string {
	var b [8]byte
	_, _ = cryptorand.Read(b[:])
	return hex.EncodeToString(b[:])
}()

// ackChannel is this process's channel for confirmations of the events
// channel ch.
func ackChannel(ch string) string { return ch + ":" + instanceID }

// dispatch applies a message of the events channels: overrides' events
// here, the others in receive.
func (c *redisConn) dispatch(channel, payload string) {
	event, rest, _ := strings.Cut(payload, " ")
	switch event {
	case eventSeen:
		if strings.HasSuffix(channel, ":"+instanceID) { // to this process
			c.overrides.seen(rest)
		}
		return
	case eventOverride:
		from, key, ok := strings.Cut(rest, " ")
		if !ok {
			return
		}
		c.receive(eventOverride, key) // the key in its set, the bucket forgotten: then confirmed
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
			defer cancel()
			_ = c.client.Publish(ctx, channel+":"+from, eventSeen+" "+key).Err()
		}()
		return
	}
	c.receive(event, rest)
}

// errUnconfirmed: some instance did not confirm an override in time.
var errUnconfirmed = errors.New("the override was announced, but not every instance confirmed it within 1s: those that did not see it within 10s")

// announceOverride announces the override of the bucket under key and
// waits for every instance to confirm it, at most a second.
func (c *redisConn) announceOverride(ctx context.Context, prefix, key string) error {
	ch := eventsChannel(prefix)
	want := c.subscribers(ctx, ch)
	w := c.overrides.expect(key)
	defer c.overrides.unexpect(key, w)
	if err := c.client.Publish(ctx, ch, eventOverride+" "+instanceID+" "+key).Err(); err != nil {
		return err
	}
	deadline := time.NewTimer(time.Second)
	defer deadline.Stop()
	for w.n.Load() < want {
		select {
		case <-w.signal:
		case <-deadline.C:
			return errUnconfirmed
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// subscribers is how many connections listen to the events channel ch:
// one per instance (and Redis store) of the fleet; at least this one.
func (c *redisConn) subscribers(ctx context.Context, ch string) int64 {
	var cmd *redis.MapStringIntCmd
	if cc, ok := c.client.(*redis.ClusterClient); ok {
		// Every instance subscribes on the master of the channel's slot.
		node, err := cc.MasterForKey(ctx, ch)
		if err != nil {
			return 1
		}
		cmd = node.PubSubNumSub(ctx, ch)
	} else {
		cmd = c.client.PubSubNumSub(ctx, ch)
	}
	n, err := cmd.Result()
	if err != nil || n[ch] < 1 {
		return 1
	}
	return n[ch]
}

// ackWait counts the confirmations of one announcement.
type ackWait struct {
	n      atomic.Int64
	signal chan struct{}
}

func (f *overrideFlags) expect(key string) *ackWait {
	w := &ackWait{signal: make(chan struct{}, 1)}
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.waits == nil {
		f.waits = map[string][]*ackWait{}
	}
	f.waits[key] = append(f.waits[key], w)
	return w
}

func (f *overrideFlags) unexpect(key string, w *ackWait) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.waits[key] = slices.DeleteFunc(f.waits[key], func(x *ackWait) bool { return x == w })
	if len(f.waits[key]) == 0 {
		delete(f.waits, key)
	}
}

// seen counts a confirmation for the announcements of key in flight.
func (f *overrideFlags) seen(key string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, w := range f.waits[key] {
		w.n.Add(1)
		select {
		case w.signal <- struct{}{}:
		default:
		}
	}
}

// overrideFlags are a Redis connection's filters (overrideSet), by policy
// prefix, and what keeps them.
type overrideFlags struct {
	mu      sync.Mutex
	sets    map[string]*overrideSet
	gen     map[string]uint64 // bumped by each announcement
	cursors map[string]uint64 // where pruning goes on in each index
	read    chan struct{}
	started bool
	waits   map[string][]*ackWait // announcements awaiting confirmation, by key
}

// overrideSet returns the filter of prefix, following it from now on.
func (c *redisConn) overrideSet(prefix string) *overrideSet {
	f := &c.overrides
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
		go c.followOverrides()
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
func (c *redisConn) followOverrides() {
	t := time.NewTicker(overridesEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
		case <-c.overrides.read:
		case <-c.closed:
			return
		}
		c.readOverrideSets()
	}
}

// readOverrideSets reads, for every policy prefix, the keys its index
// lists (HKEYS: some 22 bytes per override), first pruning a few expired
// entries.
func (c *redisConn) readOverrideSets() {
	f := &c.overrides
	f.mu.Lock()
	prefixes := make([]string, 0, len(f.sets))
	for prefix := range f.sets {
		prefixes = append(prefixes, prefix)
	}
	f.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
	defer cancel()
	now, err := c.client.Time(ctx).Result()
	if err != nil {
		return // keep what was known
	}
	for _, prefix := range prefixes {
		f.mu.Lock()
		gen, cursor := f.gen[prefix], f.cursors[prefix]
		f.mu.Unlock()
		next, err := c.pruneOverrides(ctx, prefix, cursor, now.UnixMilli())
		if err != nil {
			return
		}
		hashes, err := c.client.HKeys(ctx, overrideIndex(prefix)).Result()
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
func (c *redisConn) pruneOverrides(ctx context.Context, prefix string, cursor uint64, nowMS int64) (uint64, error) {
	index := overrideIndex(prefix)
	kv, next, err := c.client.HScan(ctx, index, cursor, "", overridesPruned).Result()
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
		if err := c.client.HDel(ctx, index, expired...).Err(); err != nil {
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

func (c *redisConn) setOverride(ctx context.Context, key string, o override, e overrideEntry, d time.Duration) (overrideEntry, error) {
	prefix, hash := policyPrefixOf(key), hashOf(key)
	index := overrideIndex(prefix)
	e.Format, e.Hash, e.Key, e.Set = 1, "", "", time.Now().UnixMilli()
	if d > 0 {
		e.Expires = e.Set + d.Milliseconds() // until the store says
	}
	raw, _ := json.Marshal(e)
	// The entry first: no override is ever in force without one.
	if err := c.client.HSet(ctx, index, hash, raw).Err(); err != nil {
		return e, err
	}
	var err error
	if d > 0 {
		var at int64
		if at, err = setOverrideFor.Run(ctx, c.client, []string{overrideKey(key)}, o.encode(), d.Milliseconds()).Int64(); err == nil && at != e.Expires {
			e.Expires = at
			raw, _ = json.Marshal(e)
			err = c.client.HSet(ctx, index, hash, raw).Err()
		}
	} else {
		err = c.client.Set(ctx, overrideKey(key), o.encode(), 0).Err()
	}
	if err != nil {
		_ = c.client.HDel(context.WithoutCancel(ctx), index, hash).Err()
		return e, err
	}
	c.overrides.changed(key)
	return e, nil
}

func (c *redisConn) deleteOverride(ctx context.Context, key string) (bool, error) {
	n, err := c.client.Del(ctx, overrideKey(key)).Result()
	if err != nil {
		return false, err
	}
	if err := c.client.HDel(ctx, overrideIndex(policyPrefixOf(key)), hashOf(key)).Err(); err != nil {
		return n > 0, err
	}
	c.overrides.changed(key)
	return n > 0, nil
}

func (c *redisConn) overridesOf(ctx context.Context, prefix string) ([]overrideEntry, error) {
	all, err := c.client.HGetAll(ctx, overrideIndex(prefix)).Result()
	if err != nil {
		return nil, err
	}
	now, err := c.client.Time(ctx).Result()
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
func (c *redisConn) overrideOf(ctx context.Context, key string) (*overrideEntry, error) {
	v, err := c.client.Get(ctx, overrideKey(key)).Result()
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
	raw, err := c.client.HGet(ctx, overrideIndex(policyPrefixOf(key)), hashOf(key)).Result()
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
