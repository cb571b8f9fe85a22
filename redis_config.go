package ratelimit

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/json"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
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

	// Timeout bounds each decision's wait for Redis: queueing behind the
	// script call in flight, connecting, the round trip. When it runs out,
	// the policies' `on_error` applies. Default 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// PoolSize is the most connections kept open to each Redis server.
	// Default: go-redis's, 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// KeyPrefix starts every storage key. Default `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// CA is a PEM file of the certificate authorities that Redis's
	// certificate must chain to. Default: the system's roots.
	CA string `json:"ca,omitempty"`

	// ServerName is the name to verify Redis's certificate against.
	// Default: the host of the address.
	ServerName string `json:"server_name,omitempty"`

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

func (c RedisConfig) newClient() (redis.UniversalClient, error) {
	var tlsConfig *tls.Config
	if c.TLS != nil {
		tlsConfig = &tls.Config{InsecureSkipVerify: c.TLS.InsecureSkipVerify, ServerName: c.TLS.ServerName, MinVersion: tls.VersionTLS12}
		if c.TLS.CA != "" {
			pem, err := os.ReadFile(c.TLS.CA)
			if err != nil {
				return nil, fmt.Errorf("tls: ca: %v", err)
			}
			tlsConfig.RootCAs = x509.NewCertPool()
			if !tlsConfig.RootCAs.AppendCertsFromPEM(pem) {
				return nil, fmt.Errorf("tls: ca: no PEM certificate in %s", c.TLS.CA)
			}
		}
	}
	timeout := time.Duration(c.Timeout)
	// One dial attempt and no retry: a script whose reply was lost (a
	// timeout, a connection Redis closed) may have charged the buckets, and
	// running it again would charge them twice. The failure mode answers
	// instead, and the circuit breaker keeps a dead Redis from costing a
	// timeout per request.
	switch {
	case c.Cluster:
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: c.Addresses, Username: c.Username, Password: c.Password, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1, DialerRetries: 1,
		}), nil
	case c.Sentinel != "":
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: c.Sentinel, SentinelAddrs: c.Addresses, Username: c.Username, Password: c.Password,
			DB: c.DB, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1, DialerRetries: 1,
		}), nil
	default:
		return redis.NewClient(&redis.Options{
			Addr: c.Addresses[0], Username: c.Username, Password: c.Password, DB: c.DB, TLSConfig: tlsConfig,
			DialTimeout: timeout, ReadTimeout: timeout, WriteTimeout: timeout,
			ContextTimeoutEnabled: true, PoolSize: c.PoolSize, MaxRetries: -1, DialerRetries: 1,
		}), nil
	}
}

func init() {
	// go-redis logs to stderr by default; its reports (mostly failed dials,
	// which the circuit breaker and metrics already cover) go to Caddy's log
	// at DEBUG instead.
	redis.SetLogger(redisLog{})
}

type redisLog struct{}

func (redisLog) Printf(_ context.Context, format string, v ...any) {
	caddy.Log().Named("http.handlers.rate_limit.redis").Debug(fmt.Sprintf(format, v...))
}

// redisClients shares Redis clients across config loads: Caddy provisions a
// new config before it cleans up the old one, so a reload reuses the open
// connections (and the circuit breaker's state) instead of redialling.
var redisClients = caddy.NewUsagePool()

// redisConn is one pooled Redis client with the circuit breaker that
// guards it.
type redisConn struct {
	client redis.UniversalClient
	// batches coalesces concurrent decisions into one script call (see
	// batch.go); nil in cluster mode, where a call reaches one slot only.
	batches *decisionBatches
	breaker *breaker
	// denials is shared by every config on this Redis: what one learned of a
	// bucket holds for all.
	denials *denyCache
}

func (c *redisConn) Destruct() error { return c.client.Close() }

// noBatching sends every decision in its own script call, for benchmarks
// comparing.
var noBatching = false

func newRedisConn(c RedisConfig, logger *zap.Logger) (*redisConn, error) {
	client, err := c.newClient()
	if err != nil {
		return nil, err
	}
	conn := &redisConn{
		client:  client,
		denials: newDenyCache(monotonicMicros),
	}
	name := strings.Join(c.Addresses, ",")
	conn.breaker = newBreaker(func(from, to breakerState) {
		switch {
		case to == breakerOpen && from == breakerClosed:
			circuitOpen.Inc()
			logger.Warn("Redis unavailable: circuit open, decisions follow on_error until a probe succeeds",
				zap.String("redis", name), zap.Duration("probe_every", breakerCooldown))
		case to == breakerClosed:
			circuitOpen.Dec()
			logger.Info("Redis available again: circuit closed", zap.String("redis", name))
		default:
			logger.Debug("circuit breaker", zap.String("redis", name), zap.Stringer("from", from), zap.Stringer("to", to))
		}
	})
	if !c.Cluster && !noBatching {
		conn.batches = &decisionBatches{call: conn.decideBatch}
	}
	return conn, nil
}
