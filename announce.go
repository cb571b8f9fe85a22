package ratelimit

// The events channel between the instances of a fleet: what each message
// means, the subscription and its dispatcher, and the announcements
// (a bucket changed, an override set) with their echo or confirmations.

import (
	"context"
	cryptorand "crypto/rand"
	"encoding/hex"
	"errors"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Events between instances, on the Redis channel <key_prefix>events: a
// message is "<event> <storage key>". "changed": an operator changed the
// bucket (a reset, a grant): every instance forgets what it remembers of
// it (deny cache, return turns), at once rather than within denyMaxAge.
// "freed": a concurrency slot was freed: the requests waiting for one try.
// "format <key_prefix>": the fleet marker changed (upgrade.go).
// "fleet <instance>": the instance's record in the fleet changed
// (fleet.go).
// "override <instance> <storage key>": an operator set or deleted the
// override of the bucket's identity (override_redis.go): as "changed", and
// the bucket's requests read its override from now on; each instance then
// confirms it ("seen <storage key>" on
// <key_prefix>events:<instance>), so that the instance that announced it
// answers once every instance applies it.
type redisEvents struct {
	mu       sync.Mutex
	ps       *redis.PubSub
	channels map[string]bool
	watched  []string // the key prefixes, in the order first watched
	closed   bool
	// mine are the events this instance announced, awaiting their echo.
	mine map[string][]chan struct{}
}

// eventChanged: an operator changed the bucket; eventFreed: a concurrency
// slot was freed from a full set (lua/decide.lua publishes it).
const (
	eventChanged = "changed"
	eventFreed   = "freed"
	eventFormat  = "format"
	// eventOverride: an operator set or deleted an override.
	eventOverride = "override"
)

func eventsChannel(prefix string) string { return prefix + "events" }

// watch subscribes, in the background (Caddy starts while Redis is away),
// to the events of the buckets under prefix.
func (c *redisStore) watch(prefix string) {
	ch := eventsChannel(prefix)
	e := &c.events
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed || e.channels[ch] {
		return
	}
	if e.channels == nil {
		e.channels, e.mine = map[string]bool{}, map[string][]chan struct{}{}
	}
	e.channels[ch] = true
	e.watched = append(e.watched, prefix)
	select {
	case c.format.changed <- struct{}{}: // read the new prefix's marker
	default:
	}
	if e.ps != nil {
		ps := e.ps
		go func() { _ = ps.Subscribe(context.Background(), ch, ackChannel(ch)) }()
		return
	}
	// go-redis resubscribes after a lost connection by itself.
	e.ps = c.client.Subscribe(context.Background())
	ps := e.ps
	go func() {
		if err := ps.Subscribe(context.Background(), ch, ackChannel(ch)); err != nil {
			c.logger.Debug("subscribing to rate-limit events", zap.String("redis", c.name), zap.Error(err))
		}
		for msg := range ps.Channel() {
			c.dispatch(msg.Channel, msg.Payload) // overrides' events, and receive
		}
	}()
}

// receive applies an event from any instance, this one included.
func (c *redisStore) receive(event, key string) {
	switch event {
	case eventFreed:
		slotQueues.wake(key)
		return
	case eventFormat:
		select {
		case c.format.changed <- struct{}{}:
		default:
		}
		return
	case eventFleet:
		if key != instanceID { // another instance's record changed
			c.fleet.nudgeFleet()
		}
		return
	case eventOverride:
		c.overrides.changed(key) // and on: the bucket changed
	}
	if event != eventChanged && event != eventOverride {
		return
	}
	if c.denials != nil {
		c.denials.forget(key)
	}
	c.hot.forget(key) // its blocks go back: the bucket's new state reaches them
	pacing.Forget(key)
	e := &c.events
	e.mu.Lock()
	for _, w := range e.mine[key] {
		select {
		case <-w:
		default:
			close(w)
		}
	}
	e.mu.Unlock()
}

// announce tells every instance that the bucket under key changed, and
// returns once the message came back through Redis (so it reached every
// subscriber), or after a second.
func (c *redisStore) announce(ctx context.Context, prefix, key string) error {
	echo := make(chan struct{})
	e := &c.events
	e.mu.Lock()
	if e.mine == nil {
		e.mine = map[string][]chan struct{}{}
	}
	e.mine[key] = append(e.mine[key], echo)
	e.mu.Unlock()
	defer func() {
		e.mu.Lock()
		e.mine[key] = slices.DeleteFunc(e.mine[key], func(w chan struct{}) bool { return w == echo })
		if len(e.mine[key]) == 0 {
			delete(e.mine, key)
		}
		e.mu.Unlock()
	}()
	if err := c.client.Publish(ctx, eventsChannel(prefix), eventChanged+" "+key).Err(); err != nil {
		return err
	}
	select {
	case <-echo:
		return nil
	case <-time.After(time.Second):
		return errNoEcho
	case <-ctx.Done():
		return ctx.Err()
	}
}

var errNoEcho = errors.New("the change was announced, but did not come back through Redis within 1s: other instances may take up to 1s to see it")

// prefixes are the key prefixes watched.
func (e *redisEvents) prefixes() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.watched)
}

func (e *redisEvents) isClosed() bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.closed
}

func (e *redisEvents) close() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.closed = true
	if e.ps != nil {
		_ = e.ps.Close()
	}
}

// Announcing an override. The instance that set (or deleted) one publishes
// "override <instance> <storage key>" on <key_prefix>events; each instance
// adds the key to its policy's set, forgets what it remembered of the
// bucket, and confirms with "seen <storage key>" on <key_prefix>events:<instance>, the
// announcer's own channel; the announcer applies it to itself at once,
// and answers once as many confirmations came as the events channel has
// subscribers (PUBSUB NUMSUB: every instance, itself included once its
// subscription is up, which it waits for), or after a second in all. So
// when the admin API answers, the override applies to the next request on
// every instance, not only once each has read the message.

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
func (c *redisStore) dispatch(channel, payload string) {
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
// waits for every instance to confirm it, at most a second
// (announceOverrides, override_batch.go).
func (c *redisStore) announceOverride(ctx context.Context, prefix, key string) error {
	return c.announceOverrides(ctx, prefix, []string{key})
}

// subscribers is how many connections listen to the events channel ch:
// one per instance (and Redis store) of the fleet, this one included once
// its subscription is up; 0 while none is. When Redis does not say, 1: at
// least this one, whose confirmation then shows the announcement went
// round.
func (c *redisStore) subscribers(ctx context.Context, ch string) int64 {
	var cmd *redis.MapStringIntCmd
	if cc, ok := c.client.(*redis.ClusterClient); ok {
		// Every instance subscribes on the master of the channel's hash slot.
		node, err := cc.MasterForKey(ctx, ch)
		if err != nil {
			return 1
		}
		cmd = node.PubSubNumSub(ctx, ch)
	} else {
		cmd = c.client.PubSubNumSub(ctx, ch)
	}
	n, err := cmd.Result()
	if err != nil {
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
