package ratelimit

import (
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestRedisEnvPlaceholdersAtLoad: in a Caddyfile, {$X} is replaced when
// the file is adapted (by caddy reload too, in the shell that runs it),
// while {env.X} in address, password and key_secret stays in the JSON and
// is read from the environment of the Caddy that loads it: the fleet's
// examples use it for everything a reload must not change. An address
// (or sentinel master) whose {env.X} is unset fails the load naming the
// variable, rather than pointing the instance elsewhere.
func TestRedisEnvPlaceholdersAtLoad(t *testing.T) {
	srv := testredis.Start(t)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { admin.Close() })
	if err := admin.ConfigSet(context.Background(), "requirepass", "s3cret").Err(); err != nil {
		t.Fatal(err)
	}
	const caddyfileText = `:8080 {
	rate_limit {
		redis {
			address {env.RL_TEST_REDIS_ADDRESS}
			password {env.RL_TEST_REDIS_PASSWORD}
			key_prefix {$RL_TEST_PREFIX:adapted:}
		}
		key_secret {env.RL_TEST_SECRET}
		require_redis
		policy api {
			key {client_ip}
			rate 10/1s
		}
	}
}
`
	// Adapted with none of them set: the {env.X} stay, {$X} took its default.
	for _, v := range []string{"RL_TEST_REDIS_ADDRESS", "RL_TEST_REDIS_PASSWORD", "RL_TEST_SECRET", "RL_TEST_PREFIX"} {
		t.Setenv(v, "") // restored when the test ends
		os.Unsetenv(v)
	}
	out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`"addresses":["{env.RL_TEST_REDIS_ADDRESS}"]`, `"password":"{env.RL_TEST_REDIS_PASSWORD}"`,
		`"key_secret":"{env.RL_TEST_SECRET}"`, `"key_prefix":"adapted:"`} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("adapted: %s lacks %s", out, want)
		}
	}
	found := rateLimitHandlers(t, out)
	if len(found) != 1 {
		t.Fatalf("%d rate_limit handlers in %s", len(found), out)
	}
	delete(found[0], "handler")
	handlerJSON, _ := json.Marshal(found[0])

	provision := func() error {
		h := new(Handler)
		if err := json.Unmarshal(handlerJSON, h); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		err := h.Provision(ctx)
		_ = h.Cleanup()
		return err
	}

	// Set in the environment of the Caddy that loads it: read then, the
	// password included (require_redis: Redis decides, or the load fails).
	t.Setenv("RL_TEST_REDIS_ADDRESS", srv.Addr)
	t.Setenv("RL_TEST_REDIS_PASSWORD", "s3cret")
	t.Setenv("RL_TEST_SECRET", "a-secret")
	if err := provision(); err != nil {
		t.Fatalf("with the variables set at load: %v", err)
	}
	t.Setenv("RL_TEST_REDIS_PASSWORD", "wrong")
	if err := provision(); err == nil || !strings.Contains(err.Error(), "password") {
		t.Fatalf("with a wrong password at load: %v, want the load refused naming the password", err)
	}
	t.Setenv("RL_TEST_REDIS_PASSWORD", "s3cret")

	// The address's variable unset: the load fails naming it.
	t.Setenv("RL_TEST_REDIS_ADDRESS", "")
	err = provision()
	if err == nil || !strings.Contains(err.Error(), "RL_TEST_REDIS_ADDRESS is not set") || !strings.Contains(err.Error(), "caddy reload does not change it") {
		t.Fatalf("address variable unset: %v", err)
	}
	t.Logf("unset: %v", err)

	// A sentinel master's name unset is not a single server at the
	// sentinels' addresses: the load fails naming it.
	t.Setenv("RL_TEST_REDIS_ADDRESS", srv.Addr)
	h := new(Handler)
	if err := json.Unmarshal(handlerJSON, h); err != nil {
		t.Fatal(err)
	}
	h.Redis.Sentinel = "{env.RL_TEST_SENTINEL_MASTER}"
	h.RequireRedis = false
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	err = h.Provision(ctx)
	_ = h.Cleanup()
	if err == nil || !strings.Contains(err.Error(), "sentinel") || !strings.Contains(err.Error(), "RL_TEST_SENTINEL_MASTER is not set") {
		t.Fatalf("sentinel variable unset: %v", err)
	}
}
