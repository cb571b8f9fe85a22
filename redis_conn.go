package ratelimit

import (
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The connection to Redis that every config connecting the same way
// shares (the Redis store, store_redis.go, is that connection): the pool
// that keeps it across reloads, the check of Redis's eviction policy, and
// the reports of what went wrong.

// redisStores shares Redis connections across config loads: Caddy
// provisions a new config before it cleans up the old one, so a reload
// reuses the open connections (and the circuit breaker's state) instead of
// redialling.
var redisStores = caddy.NewUsagePool()

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

// checkEviction warns, once, when Redis may evict buckets to make room: a
// bucket evicted is a full bucket, a budget given back. A managed Redis
// that refuses CONFIG GET is not an error.
func (c *redisStore) checkEviction() {
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
func (c *redisStore) report(kind string, err error) {
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
	"clock":     "Redis's clock and this instance's are more than a quota's period apart (a minute for quota N/minute): synchronise both with NTP; until then the requests of quota policies follow on_error",
	// Dragonfly refuses, by default, a script that touches a key its call
	// did not declare; this build declares every one (lua/decide.lua).
	"undeclared": "the server refuses a script that touches a key its call did not declare (Dragonfly's default); this release declares every key: " +
		"is an instance of an older release using this server? Upgrade it; or start Dragonfly with --default_lua_flags=allow-undeclared-keys, which locks the whole store for each script",
}
