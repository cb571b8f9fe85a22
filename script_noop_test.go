package ratelimit

import (
	"context"
	"os"
	"strconv"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestNoopScriptShape: lua/noop.lua, the script of make bench's scenario
// (z), takes the calls lua/decide.lua takes and replies in its shape, which
// decodeReply reads without a disagreement: every request admitted, every
// bucket full, and no key written.
func TestNoopScriptShape(t *testing.T) {
	noop, err := os.ReadFile("lua/noop.lua")
	if err != nil {
		t.Fatal(err)
	}
	srv := testredis.Start(t)
	conn, err := newRedisStore(RedisConfig{Addresses: []string{srv.Addr}, Timeout: testTimeout}.resolved(), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Destruct()
	rate := limit{interval: 1_000, burst: 100}
	slots := limit{interval: 30_000_000, burst: 3}
	var batch []*pending
	for i := range 64 {
		key := "rl:noop:{" + strconv.Itoa(i) + "}"
		reqs := []bucketRequest{{key: key, limit: rate, op: opTake, cost: 1}}
		switch i % 4 {
		case 1:
			reqs = append(reqs, bucketRequest{key: key + "s", limit: slots, op: opAcquire, lease: "l" + strconv.Itoa(i), events: "rl:events"})
		case 2:
			reqs[0].overridable, reqs[0].overrideWait = true, 5
		case 3:
			reqs[0].shadow = true
		}
		batch = append(batch, newPending(reqs, nil))
	}
	args := encodeCall(batch, formatV2)
	args[0], args[1] = "eval", string(noop)
	cmd := redis.NewIntSliceCmd(context.Background(), args...)
	_ = conn.client.Process(context.Background(), cmd)
	res, err := cmd.Result()
	if err != nil {
		t.Fatal(err)
	}
	if err := decodeReply(res, batch); err != nil {
		t.Fatalf("decodeReply of the no-op script's reply: %v", err)
	}
	for i, p := range batch {
		if p.err != nil || !p.d.admitted {
			t.Errorf("request %d: admitted %v, %v; want admitted", i, p.d.admitted, p.err)
		}
	}
	if n, err := srv.Do("DBSIZE"); err != nil || n != "0" {
		t.Errorf("DBSIZE %s %v: the no-op script wrote keys", n, err)
	}
}
