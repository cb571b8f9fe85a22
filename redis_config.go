package ratelimit

import (
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
)

// RedisConfig points the limiter at the Redis where every Caddy instance of
// a deployment keeps the same buckets: one server, a Redis Cluster, or a
// master found through Sentinel. Values accept `{env.*}` placeholders,
// resolved when the config is loaded.
type RedisConfig struct {
	// The Redis server as host:port; with `cluster`, seed nodes of the
	// cluster; with `sentinel`, the sentinels. One address without either.
	// Not a URL: username, password, db and tls have their own settings.
	Addresses []string `json:"addresses,omitempty"`

	// Treats the addresses as nodes of a Redis Cluster.
	Cluster bool `json:"cluster,omitempty"`

	// The master name to ask the sentinels at the addresses for; failovers
	// are followed.
	Sentinel string `json:"sentinel,omitempty"`

	// The user for Redis ACL authentication (see docs/redis.md for the ACL
	// the limiter needs).
	Username string `json:"username,omitempty"`

	// The password for Redis authentication. Use a placeholder such as
	// `{env.REDIS_PASSWORD}` rather than writing it into the config.
	Password string `json:"password,omitempty"`

	// The database number (not with `cluster`). Default 0.
	DB int `json:"db,omitempty"`

	// Connects to Redis over TLS (1.2 or later) when present.
	TLS *RedisTLS `json:"tls,omitempty"`

	// How long each call to Redis may take, from sending it to its reply:
	// when it runs out, the requests of that call follow their policies'
	// `on_error`. Connecting (TCP, TLS, authentication) may take up to
	// max(timeout, 1s). Time a request spends queued in this instance
	// behind other calls is not a Redis failure and is not bounded by it.
	// When Caddy stops, or reloads to another Redis, the work its last
	// requests left after their responses (slots' releases, settles) is
	// waited for up to max(timeout, 1s) + 3 × timeout before the
	// connection closes. At least 1ms. Default 100ms.
	Timeout caddy.Duration `json:"timeout,omitempty"`

	// The most connections kept open to each Redis server, and so the most
	// calls in flight to it at once. Default: 10 per CPU.
	PoolSize int `json:"pool_size,omitempty"`

	// What every storage key starts with: deployments that share a Redis
	// keep apart with different prefixes. Default `rl:`.
	KeyPrefix string `json:"key_prefix,omitempty"`
}

// RedisTLS configures TLS to Redis.
type RedisTLS struct {
	// A PEM file of the certificate authorities that Redis's certificate
	// must chain to. Default: the system's roots.
	CA string `json:"ca,omitempty"`

	// The name to verify Redis's certificate against. Default: the host of
	// the address.
	ServerName string `json:"server_name,omitempty"`

	// Skips verifying the server's certificate. For testing only.
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
// one client, which survives config reloads (see redisStores).
func (c RedisConfig) poolKey() string {
	c.KeyPrefix = "" // not a connection setting
	b, _ := json.Marshal(c)
	return string(b)
}

// minRedisTimeout is the least timeout: below it no Redis call completes.
const minRedisTimeout = time.Millisecond

// validate checks the connection settings: what `caddy adapt` and `caddy
// validate` can check before placeholders are resolved. Errors name the
// field; the caller prefixes "redis: ".
func (c *RedisConfig) validate() error {
	if len(c.Addresses) == 0 {
		return fieldErr("addresses", "address: at least one host:port is required")
	}
	if len(c.Addresses) > 1 && !c.Cluster && c.Sentinel == "" {
		return fieldErr("addresses", "address: %d addresses given: several addresses are the nodes of a Redis Cluster (add cluster) or the sentinels of a master (add sentinel <master_name>); a single server takes one", len(c.Addresses))
	}
	if c.Cluster && c.Sentinel != "" {
		return fieldErr("sentinel", "cluster and sentinel exclude each other")
	}
	if err := c.validateAddresses(); err != nil {
		return err
	}
	if c.Timeout < 0 || c.Timeout != 0 && time.Duration(c.Timeout) < minRedisTimeout {
		return fieldErr("timeout", "timeout: %s is below %s: no Redis call completes that fast", time.Duration(c.Timeout), minRedisTimeout)
	}
	if strings.ContainsAny(c.KeyPrefix, "{}") {
		// Braces would move the Redis Cluster hash tag off the identity.
		return fieldErr("key_prefix", "key_prefix: %q must not contain { or }", c.KeyPrefix)
	}
	if c.PoolSize < 0 || c.PoolSize > maxPoolSize {
		return fieldErr("pool_size", "pool_size: %d must be from 1 to %d", c.PoolSize, maxPoolSize)
	}
	if c.DB < 0 || c.DB > maxDB {
		return fieldErr("db", "db: %d must be from 0 to %d", c.DB, maxDB)
	}
	if c.DB != 0 && c.Cluster {
		return fieldErr("db", "db: Redis Cluster has only database 0")
	}
	return nil
}

// validateAddresses checks that every address is host:port; one that is a
// placeholder is checked once resolved.
func (c *RedisConfig) validateAddresses() error {
	for _, a := range c.Addresses {
		if strings.Contains(a, "{") {
			continue
		}
		if scheme, _, ok := strings.Cut(a, "://"); ok {
			return fieldErr("addresses", "address: %q is a URL: write host:port, and set username, password, db and tls in the redis block (%s:// is not read)", a, scheme)
		}
		host, port, err := net.SplitHostPort(a)
		if err != nil {
			return fieldErr("addresses", "address: %q is not host:port (e.g. 127.0.0.1:6379): %v", a, err)
		}
		if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 || host == "" {
			return fieldErr("addresses", "address: %q is not host:port with a port from 1 to 65535", a)
		}
	}
	return nil
}

// dialTimeout bounds connecting: TCP, TLS and authentication, which take
// several round trips.
func (c RedisConfig) dialTimeout() time.Duration {
	return max(time.Duration(c.Timeout), time.Second)
}

// poolSize is the most connections to one server: go-redis's default when
// unset.
func (c RedisConfig) poolSize() int {
	if c.PoolSize > 0 {
		return c.PoolSize
	}
	return 10 * runtime.GOMAXPROCS(0)
}

func (c RedisConfig) newClient() (redis.UniversalClient, error) {
	return c.connect(c.poolSize(), 2)
}

// newLone is the connection for the calls an instance makes while it
// serves one request alone, which waits for Redis in a blocking system
// call (store_lone.go, lone_conn.go); nil in cluster mode, which calls
// without the coalescer, with Sentinel, which names the server to call
// through go-redis, and where sockets cannot block so. It connects later.
func (c RedisConfig) newLone() (*loneConn, error) {
	if c.Cluster || c.Sentinel != "" || !blockingWaits {
		return nil, nil
	}
	tlsConfig, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	dial := c.dialTimeout()
	return &loneConn{dial: redisDialer(tlsConfig, dial, time.Duration(c.Timeout), true), addr: c.Addresses[0],
		username: c.Username, password: c.Password, db: c.DB, dialTimeout: dial, timeout: time.Duration(c.Timeout)}, nil
}

// tlsConfig is the tls block's configuration, or nil.
func (c RedisConfig) tlsConfig() (*tls.Config, error) {
	if c.TLS == nil {
		return nil, nil
	}
	tlsConfig := &tls.Config{InsecureSkipVerify: c.TLS.InsecureSkipVerify, ServerName: c.TLS.ServerName, MinVersion: tls.VersionTLS12}
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
	return tlsConfig, nil
}

// connect makes a client of pool connections, minIdle of them kept open.
func (c RedisConfig) connect(pool, minIdle int) (redis.UniversalClient, error) {
	tlsConfig, err := c.tlsConfig()
	if err != nil {
		return nil, err
	}
	timeout := time.Duration(c.Timeout)
	// The timeout bounds each command's write and the read of its reply;
	// connecting has its own bound. One dial attempt and no retry: a script
	// whose reply was lost (a timeout, a connection Redis closed) may have
	// charged the buckets, and running it again would charge them twice.
	// The failure mode answers instead, and the circuit breaker keeps a dead
	// Redis from costing a timeout per request. minIdle connections are
	// kept open, so that the first requests after a start or an idle spell
	// do not pay for connecting.
	dial := c.dialTimeout()
	// The timeout counts Redis's time, not this process's (redis_socket.go).
	dialer := redisDialer(tlsConfig, dial, timeout, false)
	switch {
	case c.Cluster:
		return redis.NewClusterClient(&redis.ClusterOptions{
			Addrs: c.Addresses, Username: c.Username, Password: c.Password, TLSConfig: tlsConfig, Dialer: dialer,
			DialTimeout: dial, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: dial,
			ContextTimeoutEnabled: true, PoolSize: pool, MinIdleConns: minIdle, MaxRetries: -1, DialerRetries: 1,
		}), nil
	case c.Sentinel != "":
		return redis.NewFailoverClient(&redis.FailoverOptions{
			MasterName: c.Sentinel, SentinelAddrs: c.Addresses, Username: c.Username, Password: c.Password,
			DB: c.DB, TLSConfig: tlsConfig, Dialer: dialer,
			DialTimeout: dial, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: dial,
			ContextTimeoutEnabled: true, PoolSize: pool, MinIdleConns: minIdle, MaxRetries: -1, DialerRetries: 1,
		}), nil
	default:
		return redis.NewClient(&redis.Options{
			Addr: c.Addresses[0], Username: c.Username, Password: c.Password, DB: c.DB, TLSConfig: tlsConfig, Dialer: dialer,
			DialTimeout: dial, ReadTimeout: timeout, WriteTimeout: timeout, PoolTimeout: dial,
			ContextTimeoutEnabled: true, PoolSize: pool, MinIdleConns: minIdle, MaxRetries: -1, DialerRetries: 1,
		}), nil
	}
}
