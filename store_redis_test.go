package ratelimit

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestRedisStoreKeys checks what lands in Redis: hashed identities under
// <prefix><policy>:{hash}, a TTL that ends when the bucket is full again,
// and no trace of the raw identity.
func TestRedisStoreKeys(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	p := &Policy{Name: "per_user", keyPrefix: "rl:per_user:"}
	kh := newKeyHasher("s3cret")
	identity := "alice@example.com"
	key := p.storageKey(kh, identity)
	if !strings.HasPrefix(key, "rl:per_user:{") || strings.Contains(key, "alice") || len(key) != len("rl:per_user:{}")+22 {
		t.Fatalf("storage key %q", key)
	}
	if key == p.storageKey(newKeyHasher("other"), identity) {
		t.Fatal("changing key_secret did not change the key")
	}
	d, err := rs.decide(ctx, []bucketRequest{{key: key, limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 3}})
	if err != nil || !d.admitted || d.verdicts[0].remaining != 97 {
		t.Fatalf("decide: %+v %v", d, err)
	}
	ttl, err := client.PTTL(ctx, key).Result()
	if err != nil || ttl <= 1700*time.Millisecond || ttl > 1800*time.Millisecond {
		t.Fatalf("TTL %v (%v), want 1.8s: 3 tokens at 600ms each", ttl, err)
	}
	keys, _ := client.Keys(ctx, "*").Result()
	for _, k := range keys {
		v, _ := client.Get(ctx, k).Result()
		if strings.Contains(k+v, "alice") {
			t.Fatalf("raw identity in Redis: %s = %s", k, v)
		}
	}
}

// TestRedisStoreReloadsFlushedScript: after SCRIPT FLUSH (or a restarted
// Redis) EVALSHA answers NOSCRIPT and the store loads the script again.
func TestRedisStoreReloadsFlushedScript(t *testing.T) {
	srv, _, rs := newTestRedis(t)
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{x}", limit: limit{interval: 1000, burst: 10}, op: opTake, cost: 1}}
	for i := range 3 {
		if _, err := srv.Do("SCRIPT", "FLUSH"); err != nil {
			t.Fatal(err)
		}
		if d, err := rs.decide(ctx, r); err != nil || !d.admitted {
			t.Fatalf("decision %d after SCRIPT FLUSH: %+v %v", i, d, err)
		}
	}
}
