package ratelimit

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	_ "embed"
	"encoding/json"
	"errors"
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

//go:embed lua/decide.lua
var decideLua string

var decideSHA = redis.NewScript(decideLua).Hash()

var (
	// errCircuitOpen: the decision skipped Redis, which recently failed.
	errCircuitOpen = errors.New("rate limit store: circuit open after repeated Redis failures")
	// errScriptReply: the script's reply is not what bucket.go expects.
	errScriptReply = errors.New("rate limit script reply")
)

// redisStore decides against buckets in Redis with one script call.
type redisStore struct {
	conn    *redisConn
	timeout time.Duration
	cluster bool       // keys in several slots take one script call per slot
	denials *denyCache // nil in cluster mode, whose refunds move TATs back
}

func (s *redisStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.denials != nil {
		if d, ok := s.denials.deny(reqs); ok {
			return d, nil
		}
	}
	gen, ok := s.conn.breaker.allow()
	if !ok {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	outcome := breakerFailure // unless the decision returns: a panic is a failure
	defer func() { s.conn.breaker.done(gen, outcome) }()
	d, err := s.decideGuarded(ctx, reqs)
	switch {
	// Our own script disagreeing with bucket.go is not an outage.
	case err == nil || errors.Is(err, errScriptReply):
		outcome = breakerSuccess
	// A client that went away says nothing about Redis.
	case errors.Is(err, context.Canceled):
		outcome = breakerIgnored
	}
	return d, err
}

// decideGuarded is the decision the breaker guards.
func (s *redisStore) decideGuarded(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.cluster {
		if groups := slotGroups(reqs); len(groups) > 1 {
			ctx, cancel := context.WithTimeout(ctx, s.timeout)
			defer cancel()
			return s.decideAcrossSlots(ctx, reqs, groups)
		}
	}
	return s.decideOnce(ctx, reqs)
}

// decideOnce decides buckets that one script call can reach: a single
// Redis, or one Redis Cluster slot.
func (s *redisStore) decideOnce(ctx context.Context, reqs []bucketRequest) (decision, error) {
	p := newPendingDecision(reqs, s.timeout)
	if s.conn.batches != nil {
		s.conn.batches.decide(p)
	} else {
		ctx, cancel := context.WithDeadline(ctx, p.deadline)
		s.conn.decideBatch(ctx, p.one[:])
		cancel()
	}
	d, err := p.d, p.err
	if err == nil && s.denials != nil {
		s.denials.learn(reqs, d, p.tats, p.sent, p.received)
	}
	p.release()
	return d, err
}

// decideBatch decides the requests of a batch, in order, in one call of
// lua/decide.lua.
func (c *redisConn) decideBatch(ctx context.Context, batch []*pendingDecision) {
	args := scriptCall(batch)
	sent := monotonicMicros()
	cmd := redis.NewIntSliceCmd(ctx, args...)
	_ = c.client.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		// A restarted or flushed Redis: EVAL loads the script again. The
		// script did not run, so nothing was charged twice.
		args[0], args[1] = "eval", decideLua
		cmd = redis.NewIntSliceCmd(ctx, args...)
		_ = c.client.Process(ctx, cmd)
	}
	received := monotonicMicros()
	res, err := cmd.Result()
	if err == nil {
		err = decisionsFromScript(res, batch)
	}
	end := time.Now()
	for _, p := range batch {
		p.sent, p.received = sent, received
		if err != nil {
			p.err = err
		}
		storeDuration.Observe(end.Sub(p.queued).Seconds())
		if p.err != nil {
			storeErrors.WithLabelValues(errorKind(p.err)).Inc()
		}
	}
}

// scriptCall is the EVALSHA of lua/decide.lua for the requests of a batch.
func scriptCall(batch []*pendingDecision) []any {
	n := 0
	for _, p := range batch {
		n += len(p.reqs)
	}
	args := make([]any, 3, 3+n+len(batch)+5*n)
	args[0], args[1], args[2] = "evalsha", decideSHA, n
	for _, p := range batch {
		for _, rq := range p.reqs {
			args = append(args, rq.key)
		}
	}
	for _, p := range batch {
		args = append(args, len(p.reqs))
		for _, rq := range p.reqs {
			shadow := 0
			if rq.shadow {
				shadow = 1
			}
			args = append(args, rq.limit.interval, rq.limit.burst, rq.cost, rq.wait, shadow)
		}
	}
	return args
}

// decisionsFromScript reads the script's reply into each request's
// decision, computing the remaining tokens and waits from the stored state
// with the Go algorithm, and the TATs the script stored.
func decisionsFromScript(res []int64, batch []*pendingDecision) error {
	if len(res) == 0 {
		return fmt.Errorf("%w: empty", errScriptReply)
	}
	now, off := res[0], 1
	for _, p := range batch {
		m := len(p.reqs)
		if len(res) < off+1+2*m {
			return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
		}
		p.d, p.tats, p.err = decisionFromScript(now, res[off:off+1+2*m], p.reqs)
		off += 1 + 2*m
	}
	if off != len(res) {
		return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
	}
	return nil
}

// decisionFromScript turns the script's reply for one request, {admitted,
// allowed_1, tat_1, ...}, into its decision and the TATs the script stored.
func decisionFromScript(now int64, res []int64, reqs []bucketRequest) (decision, []int64, error) {
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = res[2+2*i]
	}
	d, next := decideBuckets(tats, now, reqs)
	// Redis's own verdict is the one that was charged; the Go algorithm is the
	// same one, so they agree unless the script and bucket.go drift apart.
	if d.admitted != (res[0] == 1) {
		return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree (admitted %d); is lua/decide.lua in step with bucket.go?", errScriptReply, res[0])
	}
	for i := range reqs {
		if d.verdicts[i].allowed != (res[1+2*i] == 1) {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on bucket %d", errScriptReply, i)
		}
	}
	return d, next, nil
}
