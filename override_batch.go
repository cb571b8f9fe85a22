package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

// Many overrides at once, for a limits file (admin_apply.go): written in
// a few pipelines rather than three round trips each, each expiring at
// the time the file gives, and announced to the fleet in one go.

// applyBatch is how many commands a pipeline of applyOverrides holds.
const applyBatch = 1000

// applyOverrides writes the index entries first and the override keys
// after them (no override is in force without its entry), and deletes the
// other way round, as setOverride and deleteOverride do for one.
func (f *overrideFlags) applyOverrides(ctx context.Context, sets []overrideWrite, deletes []string) error {
	setAt := time.Now().UnixMilli()
	var firstErr error
	run := func(fill func(p redis.Pipeliner, i int), n int) {
		for from := 0; from < n && firstErr == nil; from += applyBatch {
			p := f.client.Pipeline()
			for i := from; i < min(n, from+applyBatch); i++ {
				fill(p, i)
			}
			cmds, err := p.Exec(ctx)
			if err != nil {
				for _, cmd := range cmds {
					if cmd.Err() != nil {
						err = cmd.Err()
						break
					}
				}
				firstErr = err
			}
		}
	}
	raws := make([]string, len(sets))
	for i, s := range sets {
		e := s.entry
		e.Format, e.Hash, e.Key, e.Set = 1, "", "", setAt
		b, _ := json.Marshal(e)
		raws[i] = string(b)
	}
	run(func(p redis.Pipeliner, i int) {
		p.HSet(ctx, overrideIndex(policyPrefixOf(sets[i].key)), hashOf(sets[i].key), raws[i])
	}, len(sets))
	run(func(p redis.Pipeliner, i int) {
		s := sets[i]
		if s.entry.Expires > 0 {
			p.SetArgs(ctx, overrideKey(s.key), s.o.encode(), redis.SetArgs{ExpireAt: time.UnixMilli(s.entry.Expires)})
		} else {
			p.Set(ctx, overrideKey(s.key), s.o.encode(), 0)
		}
	}, len(sets))
	run(func(p redis.Pipeliner, i int) { p.Del(ctx, overrideKey(deletes[i])) }, len(deletes))
	run(func(p redis.Pipeliner, i int) {
		p.HDel(ctx, overrideIndex(policyPrefixOf(deletes[i])), hashOf(deletes[i]))
	}, len(deletes))
	for _, s := range sets {
		f.changed(s.key)
	}
	for _, key := range deletes {
		f.changed(key)
	}
	return firstErr
}

// applyOverrides sets and deletes, each set expiring at its entry's time.
func (t *overrideTable) applyOverrides(_ context.Context, sets []overrideWrite, deletes []string) error {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := t.now()
	added := 0
	for _, s := range sets {
		if _, ok := t.get(s.key, now); !ok {
			added++
		}
	}
	if len(t.byKey)+added > maxProcessOverrides {
		return fmt.Errorf("the in-process store holds at most %d overrides", maxProcessOverrides)
	}
	for _, s := range sets {
		e := s.entry
		e.Format, e.Hash, e.Key, e.Set = 1, "", "", now.UnixMilli()
		to := tableOverride{o: s.o, e: e}
		if e.Expires > 0 {
			to.expires = time.UnixMilli(e.Expires)
		}
		if _, ok := t.byKey[s.key]; !ok {
			t.count[policyPrefixOf(s.key)]++
		}
		t.byKey[s.key] = to
		t.flagLocked(policyPrefixOf(s.key)).Store(true)
	}
	for _, key := range deletes {
		t.deleteLocked(key)
	}
	return nil
}

// announceOverrides announces the overrides of the buckets under keys, in
// pipelines, and waits for every instance to confirm each: a second, and
// a millisecond more per key, in all.
func (c *redisStore) announceOverrides(ctx context.Context, prefix string, keys []string) error {
	ch := eventsChannel(prefix)
	deadline := time.NewTimer(time.Second + time.Duration(len(keys))*time.Millisecond)
	defer deadline.Stop()
	waits := make([]*ackWait, len(keys))
	for i, key := range keys {
		waits[i] = c.overrides.expect(key)
		// This instance applies it at once, as it would on the event: its
		// own subscription may not be up yet (it just started, or is
		// subscribing again), and its next request must see the override.
		c.receive(eventOverride, key)
	}
	defer func() {
		for i, key := range keys {
			c.overrides.unexpect(key, waits[i])
		}
	}()
	// Nobody listens yet: this instance's own subscription is being made.
	// It is waited for, within the same bound: an announcement nobody
	// heard is not confirmed.
	want := c.subscribers(ctx, ch)
	for want == 0 {
		select {
		case <-time.After(5 * time.Millisecond):
		case <-deadline.C:
			return errUnconfirmed
		case <-ctx.Done():
			return ctx.Err()
		}
		want = c.subscribers(ctx, ch)
	}
	for from := 0; from < len(keys); from += applyBatch {
		p := c.client.Pipeline()
		for _, key := range keys[from:min(len(keys), from+applyBatch)] {
			p.Publish(ctx, ch, eventOverride+" "+instanceID+" "+key)
		}
		if _, err := p.Exec(ctx); err != nil {
			return err
		}
	}
	for _, w := range waits {
		for w.n.Load() < want {
			select {
			case <-w.signal:
			case <-deadline.C:
				return errUnconfirmed
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	return nil
}
