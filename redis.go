package ratelimit

import (
	"context"
	"crypto/tls"
	_ "embed"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// RedisConfig points the limiter at Redis, where every Caddy instance of a
// deployment shares the same buckets. Properties accept `{env.*}`
// placeholders, resolved when the config is loaded.
type RedisConfig struct {
	// Addresses of the Redis server as host:port: one server; with `cluster`,
	// seed nodes of a Redis Cluster; with `sentinel`, the sentinels.
	Addresses []string `json:"addresses,omitempty"`

	// Cluster treats the addresses as nodes of a Redis Cluster.
	Cluster bool `json:"cluster,omitempty"`

	// Sentinel is the master name to ask the sentinels at the addresses for.
	Sentinel string `json:"sentinel,omitempty"`

	// Username for Redis ACL authentication.
	Username string `json:"username,omitempty"`

	// Password for Redis authentication. Use a placeholder such as
	// `{env.REDIS_PASSWORD}` rather than writing it into the config.
	Password string `json:"password,omitempty"`

	// DB is the database number (not in cluster mode). Default 0.
	DB int `json:"db,omitempty"`

	// TLS, when present, connects to Redis over TLS.
	TLS *RedisTLS `json:"tls,omitempty"`

	// Timeout bounds each decision's round trip to Redis, connecting
	// included. When it runs out, the policies' `on_error` applies.
	// Default 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// PoolSize is the most connections kept open to each Redis server.
	// Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// KeyPrefix starts every storage key. Default `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// InsecureSkipVerify disables verification of the server's certificate.
	// For testing only.
	InsecureSkipVerify bool `json:"insecure_skip_verify,omitempty"`
}

const (
	defaultRedisTimeout = 100 * time.Millisecond
	defaultKeyPrefix    = "rl:"
)

// resolved returns a copy with placeholders replaced and defaults filled in.
func (c RedisConfig) resolved() RedisConfig {
	repl := caddy.NewReplacer()
	c.Addresses = append([]string(nil), c.Addresses...)
	for i, a := range c.Addresses {
		c.Addresses[i] = repl.ReplaceAll(a, "")
	}
	c.Username = repl.ReplaceAll(c.Username, "")
	c.Password = repl.ReplaceAll(c.Password, "")
	c.Sentinel = repl.ReplaceAll(c.Sentinel, "")
	if c.Timeout <= 0 {
		c.Timeout = caddy.Duration(defaultRedisTimeout)
	}
	return c
}

// poolKey identifies a connection: configs that connect the same way share
// one client, which survives config reloads (see redisClients).
func (c RedisConfig) poolKey() string {
	c.KeyPrefix = "" // not a connection setting
	b, _ := json.Marshal(c)
	return string(b)
}

func (c RedisConfig) newClient() redis.UniversalClient {
	var tlsConfig *tls.Config
	if c.TLS != nil {
		tlsConfig = &tls.Config{InsecureSkipVerify: c.TLS.InsecureSkipVerify, MinVersion: tls.VersionTLS12}
	}
	timeout := time.Duration(c.Timeout)
	switch {
	case c.Cluster:
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: c.Addresses, Username: c.Username, Password: c.Password, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1,
		})
	case c.Sentinel != "":
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: c.Sentinel, SentinelAddrs: c.Addresses, Username: c.Username, Password: c.Password,
			DB: c.DB, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1,
		})
	default:
		return redis.NewClient(&redis.Options{
			Addr: c.Addresses[0], Username: c.Username, Password: c.Password, DB: c.DB, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1,
		})
	}
}

// redisClients shares Redis clients across config loads: Caddy provisions a
// new config before it cleans up the old one, so a reload reuses the open
// connections instead of dropping and redialling them.
var redisClients = caddy.NewUsagePool()

type pooledClient struct{ redis.UniversalClient }

func (p pooledClient) Destruct() error { return p.Close() }

//go:embed lua/decide.lua
var decideLua string

var decideScript = redis.NewScript(decideLua)

// redisStore decides against buckets in Redis with one script call.
type redisStore struct {
	client  redis.UniversalClient
	timeout time.Duration
}

func (s *redisStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	ctx, cancel := context.WithTimeout(ctx, s.timeout)
	defer cancel()
	keys := make([]string, len(reqs))
	args := make([]any, 0, 4*len(reqs))
	for i, rq := range reqs {
		keys[i] = rq.key
		shadow := "0"
		if rq.shadow {
			shadow = "1"
		}
		args = append(args, rq.limit.interval, rq.limit.burst, rq.cost, shadow)
	}
	// Run sends EVALSHA and falls back to EVAL after NOSCRIPT (a restarted or
	// flushed Redis), which loads the script again.
	res, err := decideScript.Run(ctx, s.client, keys, args...).Int64Slice()
	if err != nil {
		return decision{}, err
	}
	return decisionFromScript(res, reqs)
}

// decisionFromScript turns the script's reply into a decision, computing the
// remaining tokens and waits from the stored state with the Go algorithm.
func decisionFromScript(res []int64, reqs []bucketRequest) (decision, error) {
	if len(res) != 2+2*len(reqs) {
		return decision{}, fmt.Errorf("rate limit script: reply of %d numbers for %d buckets", len(res), len(reqs))
	}
	now := res[1]
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = res[3+2*i]
	}
	d, _ := decideBuckets(tats, now, reqs)
	// Redis's own verdict is the one that was charged; the Go algorithm is the
	// same one, so they agree unless the script and bucket.go drift apart.
	if d.admitted != (res[0] == 1) {
		return decision{}, fmt.Errorf("rate limit script and Go bucket disagree (admitted %d); is lua/decide.lua in step with bucket.go?", res[0])
	}
	for i := range reqs {
		if d.verdicts[i].allowed != (res[2+2*i] == 1) {
			return decision{}, fmt.Errorf("rate limit script and Go bucket disagree on bucket %d (%s)", i, strconv.FormatInt(res[2+2*i], 10))
		}
	}
	return d, nil
}
