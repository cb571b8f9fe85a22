package ratelimit

import (
	"context"
	"fmt"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
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
// interface the caller asks its store for (`if ls, ok := s.(leaseStore)`),
// so that neither the request path nor the admin API names a concrete
// store: a store without the capability has nothing to do there, and the
// caller says what happens instead. The Redis store (redisStore) has them
// all; the in-process one (memoryStore) keeps overrides only.

// leaseStore is a store whose concurrency slots are leases that run out,
// because the instance holding one may die (lease.go): renewed while their
// requests run, released after the response, a release that fails sent
// again until it lands or its lease has run out anyway. In process, a slot
// lasts until it is freed, which never fails. Implemented by redisStore.
type leaseStore interface {
	// renewLeases keeps leases an admitted request took renewed until they
	// are released.
	renewLeases(leases []lease)
	// releasing stops renewing leases: the requests that free them, for
	// the caller to send (sendReleases).
	releasing(leases []lease) (rels []bucketRequest, policies []*Policy)
	// sendReleases frees slots with the store's next call, and wakes this
	// instance's requests waiting for them once they are free; a release
	// that fails is kept, to send again.
	sendReleases(rels []bucketRequest, policies []*Policy)
	// retryReleases keeps releases the store did not take, to send again.
	retryReleases(rels []bucketRequest, policies []*Policy)
}

// announcer is a store that a fleet of instances shares: an operator's
// change to a bucket (a reset, a grant, an override set or deleted) is
// announced to every instance, which forgets what it remembered of the
// bucket. In process, the change is this instance's own. Implemented by
// redisStore (announce.go, override_redis.go).
type announcer interface {
	// announce tells every instance the bucket under key changed, and
	// returns once the announcement went round (or after a second).
	announce(ctx context.Context, prefix, key string) error
	// announceOverride tells every instance the override of the bucket
	// under key changed, and waits for each to confirm it (a second at
	// most: errUnconfirmed).
	announceOverride(ctx context.Context, prefix, key string) error
}

// fleetMember is a store whose instances form a fleet: each records its
// policies for the others to compare (fleet.go), and the admin API lists
// them (admin_fleet.go). Implemented by redisStore.
type fleetMember interface {
	// join registers a provisioned handler, announced to the fleet once
	// its config runs; part unregisters it when it is cleaned up.
	join(h *Handler)
	part(h *Handler)
	// fleetRecord is what this instance announces of the policies of hs.
	fleetRecord(hs []*Handler) fleet.Record
	// readFleets reads the live instances and their fleets, for a listing;
	// liveRecords the records of those of the store's database (db), for
	// a comparison.
	readFleets(ctx context.Context) (fleetStore, error)
	liveRecords(ctx context.Context) (db int, records []fleet.Record, err error)
	// fleetView is what this instance knows of its fleet: stores that
	// share one (on one connection) read the same fleets, which a listing
	// shows once.
	fleetView() *fleetView
}

// prober is a store that may be unable to decide for a policy (unreachable,
// refused by an ACL, without scripting), which a probe finds out before a
// request does: at start, with require_redis, and in `caddy rate-limit
// check` (probe.go, check.go). Implemented by redisStore.
type prober interface {
	probe(defs []definition) []probeResult
}

// formatStore is a store whose buckets outlive a release: a fleet writes
// them in the storage format its marker says, so that a mixed fleet reads
// them both ways (format.go, upgrade.go). Implemented by redisStore.
type formatStore interface {
	// setFormat sets the fleet's marker of the buckets under prefix, tells
	// every instance, and writes in what the markers now say at once.
	setFormat(ctx context.Context, prefix, marker string) error
	// formatOf is the fleet's marker of the buckets under prefix, and the
	// format this instance writes them in.
	formatOf(ctx context.Context, prefix string) (marker, writes string, err error)
}

// overrideKeeper is a store that may keep operators' overrides of its
// buckets' limits (override_store.go). Implemented by redisStore and
// memoryStore (whose `local` fallback keeps none).
type overrideKeeper interface {
	// overridesKept is where they are kept; nil when the store keeps none.
	overridesKept() overrideStore
	// overrideFilter says which buckets of the policy whose keys start with
	// prefix may have one.
	overrideFilter(prefix string) overrideFilter
}

// blockKeeper is a store that may decide a busy key's requests from blocks
// of its tokens taken ahead (hot keys, hotkeys_store.go): inspect shows
// what this instance has taken of a bucket and not spent. In process,
// every decision is local already. Implemented by redisStore.
type blockKeeper interface {
	// blocksOf is the blocks this instance holds of the bucket under key,
	// and their unspent tokens.
	blocksOf(key string) (blocks int, tokens int64)
}

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
			return nil, nil, emptyAddressError(cfg.Addresses[i])
		}
	}
	if err := rc.validateAddresses(); err != nil {
		return nil, nil, fmt.Errorf("redis: %v", err)
	}
	key := rc.poolKey()
	// Caddy must start and reload while Redis is unreachable: the client
	// connects lazily and each call bounds its own wait.
	v, _, err := redisConns.LoadOrNew(key, func() (caddy.Destructor, error) {
		return newRedisConn(rc, logger)
	})
	if err != nil {
		return nil, nil, fmt.Errorf("redis: %v", err)
	}
	rs := &redisStore{conn: v.(*redisConn)}
	rs.conn.watch(keyPrefix)
	released := false
	return rs, func() error {
		if released {
			return nil
		}
		released = true
		// A reload: what hot keys hold goes back; the new config takes its
		// own blocks, under its own limits.
		rs.conn.hot.releaseAll()
		_, err := redisConns.Delete(key)
		return err
	}, nil
}
