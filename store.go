package ratelimit

import (
	"context"
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// store holds the buckets and decides requests against them atomically.
type store interface {
	// decide applies the operations of one request to its buckets at once:
	// an admission charges all its buckets or none (see decideBuckets).
	// A store that cannot decide returns an error, and the request's
	// policies follow their on_error.
	decide(ctx context.Context, reqs []bucketRequest) (decision, error)
	// decideAfter decides reqs when it suits the store, and then calls then:
	// work after a response (a settle, a charge, a release), which nobody
	// waits for. It must not keep reqs' memory past the call.
	decideAfter(reqs []bucketRequest, then func(decision, error))
	// decideAwaited decides reqs, work after a response that the response
	// waits for (finish.go), when it suits the store without delaying it:
	// riding with a call already due, never making one more.
	decideAwaited(reqs []bucketRequest) (decision, error)
}

// What only some stores can do is a capability of its own, a small
// interface beside the code that asks its store for it (`if a, ok :=
// s.(announcer)`), so that neither the request path nor the admin API
// names a concrete store: a store without the capability has nothing to do
// there, and the caller says what happens instead. The request path asks
// for one, the lease interface (slots.go); the others are the admin API's,
// the fleet's and the probe's (admin.go, admin_fleet.go, probe.go,
// override_store.go). The Redis store has them all; the in-process one
// answers those where it has nothing to do trivially (leases, announcer,
// blockKeeper) and keeps overrides.

// openStore returns the store a handler's buckets live in: this process's
// without a redis block; otherwise a Redis one, on a connection shared with
// every config that connects the same way (so that it survives reloads,
// circuit breaker and all), listening to the events of the buckets under
// keyPrefix. close releases the handler's use of it.
func openStore(cfg *RedisConfig, keyPrefix string, logger *zap.Logger) (s store, close func() error, err error) {
	if cfg == nil {
		return processMemory, func() error { return nil }, nil
	}
	rc := cfg.resolved()
	for i, a := range rc.Addresses {
		if a == "" && cfg.Addresses[i] != "" {
			// An unset {env.X}: name it, as key_secret does.
			return nil, nil, emptyEnvError("address", cfg.Addresses[i], "10.0.0.5:6379")
		}
	}
	if rc.Sentinel == "" && cfg.Sentinel != "" {
		// Not a single server at the sentinels' addresses: name the variable.
		return nil, nil, emptyEnvError("sentinel", cfg.Sentinel, "mymaster")
	}
	if err := rc.validateAddresses(); err != nil {
		return nil, nil, fmt.Errorf("redis: %v", err)
	}
	key := rc.poolKey()
	// Caddy must start and reload while Redis is unreachable: the client
	// connects lazily and each call bounds its own wait.
	v, _, err := redisStores.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newRedisStore(rc, logger)
	})
	if err != nil {
		return nil, nil, fmt.Errorf("redis: %v", err)
	}
	rs := v.(*redisStore)
	rs.watch(keyPrefix)
	released := false
	return rs, func() error {
		if released {
			return nil
		}
		released = true
		// A reload: what hot keys hold goes back; the new config takes its
		// own blocks, under its own limits.
		rs.hot.releaseAll()
		_, err := redisStores.Delete(key)
		return err
	}, nil
}
