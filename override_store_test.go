package ratelimit

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.uber.org/zap"
)

// TestOverrideAnnouncement: the announcement of an override returns once
// every subscriber of the events channel confirmed it, so the other
// instance reads the bucket's override from the moment it returns (not
// merely soon after), and only that bucket's; a subscriber that never
// confirms makes it return errUnconfirmed after a second.
func TestOverrideAnnouncement(t *testing.T) {
	srv, client, a := newTestRedis(t)
	conn := func() *redisStore {
		c, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Destruct() })
		return c
	}
	b := conn()
	a.watch("rl:")
	b.watch("rl:")
	set := b.overrides.overrideSet("rl:p:")
	ctx := context.Background()
	deadline := time.Now().Add(5 * time.Second)
	for (client.PubSubNumSub(ctx, "rl:events").Val()["rl:events"] < 2 || set.may("rl:p:{h}")) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond) // both subscribed; b read that p has no overrides
	}
	if set.may("rl:p:{h}") {
		t.Fatal("a bucket of a policy without overrides may have one")
	}
	// Stored first, as the admin API does: the announcement makes b read it
	// at once, and the read of the index b makes on the event (which, with
	// nothing stored, would empty b's set again) keeps it.
	if _, err := a.overrides.setOverride(ctx, "rl:p:{h}", override{kind: overrideRate, interval: 3, burst: 300}, overrideEntry{}, 0); err != nil {
		t.Fatalf("storing the override: %v", err)
	}
	start := time.Now()
	if err := a.announceOverride(ctx, "rl:", "rl:p:{h}"); err != nil {
		t.Fatalf("announcing: %v", err)
	}
	took := time.Since(start)
	if !set.may("rl:p:{h}") || set.may("rl:p:{other}") {
		t.Fatalf("when the announcement returns, the other instance's set says %v for the bucket, %v for another: want true, false", set.may("rl:p:{h}"), set.may("rl:p:{other}"))
	}
	t.Logf("announced and confirmed by 2 subscribers in %v", took)

	// A subscriber that never confirms (as an instance of the release
	// before this one): unconfirmed, after a second.
	deaf := client.Subscribe(ctx, "rl:events")
	defer deaf.Close()
	if _, err := deaf.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	start = time.Now()
	if err := a.announceOverride(ctx, "rl:", "rl:p:{h}"); !errors.Is(err, errUnconfirmed) || time.Since(start) < time.Second {
		t.Fatalf("with a subscriber that does not confirm: %v after %v, want errUnconfirmed after 1s", err, time.Since(start))
	}
}

// TestOverrideAnnouncedBeforeSubscribing: an instance whose own
// subscription to the events is not up yet (it just started) applies the
// override it announces at once; its announcement waits for that
// subscription and is confirmed, and one nobody ever hears is not.
func TestOverrideAnnouncedBeforeSubscribing(t *testing.T) {
	_, _, a := newTestRedis(t)
	set := a.overrides.overrideSet("rl:p:")
	ctx := context.Background()
	if _, err := a.overrides.setOverride(ctx, "rl:p:{h}", override{kind: overrideRate, interval: 3, burst: 300}, overrideEntry{}, 0); err != nil {
		t.Fatalf("storing the override: %v", err)
	}
	start := time.Now()
	if err := a.announceOverride(ctx, "rl:", "rl:p:{h}"); !errors.Is(err, errUnconfirmed) || time.Since(start) > 3*time.Second {
		t.Fatalf("announcing with nobody subscribed: %v after %v, want errUnconfirmed after about 1s", err, time.Since(start))
	}
	if !set.may("rl:p:{h}") {
		t.Fatal("the instance that announced the override does not apply it")
	}
	a.watch("rl:") // its subscription is made in the background
	if err := a.announceOverride(ctx, "rl:", "rl:p:{h}"); err != nil {
		t.Fatalf("announcing while the instance's own subscription is being made: %v", err)
	}
}
