package ratelimit

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/breaker"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The connection to Redis that every config connecting the same way
// shares: the client, the circuit breaker, the coalescing of calls, the
// deny cache, and the reports of what went wrong.

// redisConns shares Redis connections across config loads: Caddy
// provisions a new config before it cleans up the old one, so a reload
// reuses the open connections (and the circuit breaker's state) instead of
// redialling.
var redisConns = caddy.NewUsagePool()

// redisConn is one Redis client with what every config using it shares:
// the circuit breaker, the coalescing of calls and the deny cache.
type redisConn struct {
	client redis.UniversalClient
	name   string // the addresses, for logs
	// coalescer merges concurrent requests into one script call (see
	// coalesce.go); nil in cluster mode, where a call reaches one slot only.
	coalescer *coalescer
	breaker   *breaker.Breaker
	// denials is shared by every config on this Redis: what one learned of
	// a bucket holds for all. Nil in cluster mode, whose cross-slot refunds
	// move TATs back.
	denials *denyCache
	// cluster: a Redis Cluster, where a script call reaches one slot, so
	// requests whose buckets span slots take one call per slot.
	cluster bool
	// callTimeout bounds a call as a whole: waiting for a connection,
	// connecting, and EVALSHA then EVAL when Redis lost the script.
	callTimeout time.Duration
	logger      *zap.Logger
	reported    redisReports
	events      redisEvents
	leases      leaseBook
	// format is the format buckets are written in (format.go), from the
	// fleet marker (upgrade.go); formatChanged asks to read the marker again.
	format        atomic.Int32
	formatChanged chan struct{}
	closed        chan struct{}
	// timeout is the redis block's, which durable quotas' WAIT and WAITAOF
	// wait at most; durable coalesces their calls (durable.go).
	timeout time.Duration
	durable durableCalls
	// overrides say which buckets may have overrides in this Redis
	// (override_redis.go).
	overrides overrideFlags
	// afterApart counts the work after responses on its way in calls of
	// its own: in cluster mode, which has no coalescer to ride.
	afterApart callCount
	// db is the database its buckets are in; fleet its part in the fleet
	// (fleet.go).
	db    int
	fleet fleetView
	// hot decides hot keys from blocks of their tokens (hotkeys_store.go).
	hot *hotKeys
	// server is who the server said it is, last asked (redis_server.go).
	server atomic.Pointer[redisinfo.Server]
}

// Destruct closes the connection once no handler uses it: Caddy stopped,
// after its requests ended, or the last request of a config reloaded to
// other connection settings ended (storeUse). What those requests left to
// do after their responses (releases, settles, charges) is sent first, and
// the releases not yet confirmed once more, waited for at most
// callTimeout: else a stopped instance's last slots stay taken until their
// leases run out, and its last settles are lost.
func (c *redisConn) Destruct() error {
	c.hot.close() // its blocks' unspent tokens go back with the work below
	c.finishAfterWork(time.Now().Add(c.callTimeout))
	c.events.close()
	close(c.closed)
	c.leaveFleet(time.Now().Add(c.callTimeout))
	return c.client.Close()
}

// finishAfterWork sends what requests left to do after their responses,
// and the releases the store has not confirmed once more, and waits for
// them until deadline.
func (c *redisConn) finishAfterWork(deadline time.Time) {
	if rels, policies := c.leases.unconfirmed(); len(rels) > 0 {
		c.sendReleases(&redisStore{conn: c}, rels, policies)
	}
	var done <-chan struct{}
	if c.coalescer != nil {
		done = c.coalescer.drained()
	} else {
		done = c.afterApart.drained()
	}
	wait := time.Until(deadline)
	timer := time.NewTimer(wait)
	defer timer.Stop()
	select {
	case <-done:
	case <-timer.C:
		c.logger.Warn("closing: Redis did not answer the work after the last responses (releases, settles, charges) in time; their slots come back when their leases run out",
			zap.String("redis", c.name), zap.Duration("waited", wait))
	}
}

// callCount counts calls in flight, and tells when none is.
type callCount struct {
	mu   sync.Mutex
	n    int
	idle drainWaiters
}

func (cc *callCount) add(n int) {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	cc.n += n
	if cc.n == 0 {
		cc.idle.take().wake()
	}
}

// drained returns a channel closed once no call is in flight.
func (cc *callCount) drained() <-chan struct{} {
	cc.mu.Lock()
	defer cc.mu.Unlock()
	if cc.n == 0 {
		return closedChan()
	}
	return cc.idle.add()
}

// noCoalescing sends every request in its own script call, for benchmarks
// comparing.
var noCoalescing = false

func newRedisConn(c RedisConfig, logger *zap.Logger) (*redisConn, error) {
	client, err := c.newClient()
	if err != nil {
		return nil, err
	}
	conn := &redisConn{
		client:      client,
		name:        strings.Join(c.Addresses, ","),
		cluster:     c.Cluster,
		callTimeout: c.dialTimeout() + 3*time.Duration(c.Timeout),
		logger:      logger,
		timeout:     time.Duration(c.Timeout),
		db:          c.DB,

		formatChanged: make(chan struct{}, 1),
		closed:        make(chan struct{}),
	}
	conn.format.Store(formatV1)
	conn.fleet.nudge = make(chan struct{}, 1)
	conn.breaker = breaker.New(func(from, to breaker.State) {
		switch {
		case to == breaker.Open && from == breaker.Closed:
			circuitOpen.Inc()
			logger.Warn("Redis unavailable: calls failed for "+breaker.Span.String()+"; requests follow on_error until a probe succeeds",
				zap.String("redis", conn.name), zap.Duration("probe_every", breaker.Cooldown))
		case to == breaker.Closed:
			circuitOpen.Dec()
			logger.Info("Redis available again: circuit closed", zap.String("redis", conn.name))
		default:
			logger.Debug("circuit breaker", zap.String("redis", conn.name), zap.Stringer("from", from), zap.Stringer("to", to))
		}
	})
	if !c.Cluster {
		conn.denials = newDenyCache(monotonicMicros)
		if !noCoalescing {
			conn.coalescer = &coalescer{call: conn.call, maxCalls: c.poolSize()}
		}
	}
	conn.hot = newHotKeys(conn)
	go conn.checkEviction()
	go conn.followFormat()
	go conn.followFleet()
	return conn, nil
}

// checkEviction warns, once, when Redis may evict buckets to make room: a
// bucket evicted is a full bucket, a budget given back. A managed Redis
// that refuses CONFIG GET is not an error.
func (c *redisConn) checkEviction() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := c.client.ConfigGet(ctx, "maxmemory-policy").Result()
	if errors.Is(err, redis.ErrClosed) || errors.Is(err, net.ErrClosed) {
		return // the handler was cleaned up first
	}
	if err != nil {
		c.logger.Debug("could not read maxmemory-policy", zap.String("redis", c.name), zap.Error(err))
		return
	}
	if policy := res["maxmemory-policy"]; strings.HasPrefix(policy, "allkeys-") {
		c.logger.Warn("Redis may evict rate-limit buckets to make room ("+policy+"): an evicted bucket is full again. "+
			"Use maxmemory-policy volatile-ttl (buckets all have TTLs; those nearest to full expire first) or noeviction, "+
			"or give the limiter its own Redis",
			zap.String("redis", c.name), zap.String("maxmemory_policy", policy))
	}
}

// redisReports logs each kind of Redis error at most once per
// reportInterval: while Redis refuses every call, every request fails the
// same way.
type redisReports struct {
	mu   sync.Mutex
	last map[string]time.Time
}

const reportInterval = 10 * time.Second

// report logs err, of the given kind, unless that kind was logged within
// reportInterval. Errors of the configuration (a password, an ACL, a
// replica) are logged at ERROR with what to change; a Redis that does not
// answer at WARN.
func (c *redisConn) report(kind string, err error) {
	if !c.claimReport(kind, true) {
		return
	}
	fields := []zap.Field{zap.String("redis", c.name), zap.String("kind", kind), zap.Error(err)}
	modes := ""
	if !perKey(kind) {
		if ps := c.fleet.registered(); len(ps) > 0 {
			modes = ". " + failureModes(ps)
		}
	}
	if fix, permanent := errorFixes[kind]; permanent {
		c.logger.Error("Redis refused rate-limit calls; policies follow on_error: "+fix+modes, fields...)
		return
	}
	c.logger.Warn("Redis unavailable; policies follow on_error"+modes, fields...)
}

// perKey reports whether a kind of error is one bucket's (its requests
// alone follow on_error), not Redis's.
func perKey(kind string) bool { return kind == "wrongtype" || kind == "corrupt" || kind == "clock" }

// limiterACL is what the limiter's Redis user needs: its keys and channels
// (rl: with the default key_prefix), the fleet's keys (fleet.go), the
// commands of lua/decide.lua and lua/fleet.lua (TYPE only to name a key
// that is not a bucket; the sorted-set commands for concurrency slots; the
// hash commands for overrides and the fleet), and PUBLISH and SUBSCRIBE
// for the events between instances.
const limiterACL = "~rl:* ~rate_limit:{fleet}* resetchannels &rl:* +evalsha +eval +time +get +set +del +type +publish +subscribe +zadd +zrem +zcard +zremrangebyscore +pexpire +hset +hdel +hget +hgetall +hkeys +hscan +pubsub|numsub"

// errorFixes is what to change for each permanent error kind.
var errorFixes = map[string]string{
	"wrongpass": "check the redis username and password (a {env.*} placeholder that is unset is an empty password)",
	"noauth":    "Redis requires a password: set password (and username for an ACL user) in the redis block",
	"noperm":    "grant the Redis user the commands and keys the limiter uses: ACL SETUSER <user> on ><password> " + limiterACL + " (with your key_prefix for rl:)",
	"readonly":  "the address is a replica: point address at the master, or use sentinel <master_name> to follow failovers",
	"oom":       "Redis is at maxmemory and may not evict: raise maxmemory, or use maxmemory-policy volatile-ttl (every bucket has a TTL)",
	"wrongtype": "a bucket's key holds a value of another type (was it written by hand?): DEL the key named in this log; the requests of that key follow on_error until then",
	"corrupt":   "a bucket's key holds a string that is not a bucket (was it written by hand?): DEL the key named in this log; the requests of that key follow on_error until then",
	"script":    "the script's reply does not match this build: is another version of the module using the same Redis and key_prefix?",
	// Dragonfly refuses, by default, a script that touches a key its call
	// did not declare; this build declares every one (lua/decide.lua).
	"undeclared": "the server refuses a script that touches a key its call did not declare (Dragonfly's default); this release declares every key: " +
		"is an instance of an older release using this server? Upgrade it; or start Dragonfly with --default_lua_flags=allow-undeclared-keys, which locks the whole store for each script",
}
