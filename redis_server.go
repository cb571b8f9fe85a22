package ratelimit

import (
	"context"
	"fmt"
	"strings"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The server says who it is. At start (probe.go) and in `caddy rate-limit
// check`, the module names the server it talks to, from INFO server:
// Redis, Valkey or Dragonfly and their versions; or, where an ACL or a
// managed service refuses INFO, from HELLO, which every user may send.
// Below the oldest version the module supports, one ERROR says so, what
// to do, and what the policies do meanwhile.

// minRedis is the oldest Redis the module supports, by the redis_version
// a server reports (Valkey 7.2 and later, and Dragonfly, report 7.x or
// 6.2.x): 6.2, which brought SET's PXAT (an override for a while,
// override_redis.go) and the HELLO without arguments that names a server
// whose ACL refuses INFO. Redis 7.0 is not needed: where SET has no NX and
// GET together, lua/decide.lua reads a missing bucket with one more
// command (see its header). The suite runs on 6.2 (docs/redis.md,
// "Servers").
const (
	minRedisMajor, minRedisMinor = 6, 2
	minRedisText                 = "6.2"
)

// serverInfo asks the server who it is: INFO server, or HELLO when INFO
// is refused.
func (c *redisStore) serverInfo(ctx context.Context) (redisinfo.Server, error) {
	info, err := c.client.Info(ctx, "server").Result()
	if err == nil {
		return redisinfo.Parse(info), nil
	}
	if !isRedisError(err) || connectionWide(probeKind(err)) && probeKind(err) != "noscripting" {
		return redisinfo.Server{}, err // not answered, or not to this user: nothing to fall back on
	}
	hello, herr := c.client.Do(ctx, "HELLO").Result()
	if herr != nil {
		return redisinfo.Server{}, fmt.Errorf("INFO server: %w; HELLO: %v", err, herr)
	}
	fields := map[string]string{}
	switch h := hello.(type) {
	case map[any]any: // RESP3
		for k, v := range h {
			fields[fmt.Sprint(k)] = fmt.Sprint(v)
		}
	case []any: // RESP2: field, value, ...
		for i := 0; i+1 < len(h); i += 2 {
			fields[fmt.Sprint(h[i])] = fmt.Sprint(h[i+1])
		}
	}
	return redisinfo.FromHello(fields["server"], fields["version"], fields["mode"]), nil
}

func isRedisError(err error) bool {
	_, ok := err.(redis.Error)
	return ok
}

// tooOld reports whether s is older than the oldest Redis the module
// supports.
func tooOld(s redisinfo.Server) bool {
	return !s.RedisAtLeast(minRedisMajor, minRedisMinor)
}

// tooOldText says what an old server means, and what to do.
func tooOldText(s redisinfo.Server) string {
	return fmt.Sprintf("%s is older than Redis %s, the oldest this module supports: "+
		"an override given a duration (SET ... PXAT, Redis 6.2) is refused, and nothing else was tested on it. "+
		"Upgrade to Redis %s or later, or Valkey", s, minRedisText, minRedisText)
}

// identify names the server at start, once per connection, and says
// loudly when it is too old; ps are the policies that use it.
func (c *redisStore) identify(ps []*Policy) (redisinfo.Server, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
	defer cancel()
	s, err := c.serverInfo(ctx)
	if err != nil {
		c.logger.Debug("could not ask the server who it is", zap.String("redis", c.name), zap.Error(err))
		return s, false
	}
	c.server.Store(&s)
	if tooOld(s) && c.claimReport("version", true) {
		c.logger.Error(tooOldText(s)+". Meanwhile it still decides for "+policiesText(ps)+"; where it refuses a call, "+failureModes(ps),
			zap.String("redis", c.name), zap.String("server", s.String()))
	}
	return s, true
}

// serverName is the server as last identified, for logs: "Valkey 8.0.1
// (redis_version 7.2.4)", or "Redis" before it answered.
func (c *redisStore) serverName() string {
	if s := c.server.Load(); s != nil {
		return s.String()
	}
	return "Redis"
}

// scriptsRefused names a server that runs no scripts.
func scriptsRefused(server string) string {
	if server == "" || server == "Redis" {
		return "Redis runs no scripts"
	}
	return strings.TrimSpace(server) + " runs no scripts"
}
