package ratelimit

import (
	"fmt"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler enforces rate limits that every Caddy instance of a deployment
// shares: token buckets kept in Redis (or in this process, without a
// `redis` block) and decided by one atomic script on Redis time, so that
// four instances allowing "100 per minute" allow 100 per minute together.
// Each request is checked against every policy that matches it, in one
// decision: all of them admit and charge it, or it is denied and none is
// charged. A denial is a 429 `application/problem+json` response with
// `Retry-After` (or, on a site with `handle_errors`, a Caddy error of
// status 429 with the same fields set); responses carry the
// `RateLimit-Policy` and `RateLimit` fields of the IETF draft. Identities
// are stored only as keyed hashes.
//
// The handler sets placeholders for later handlers and access logs (in
// response headers, use a deferred `header >Name {placeholder}`):
//
// Placeholder | Value
// ------------|------
// `{http.rate_limit.decision}` | `allowed`, `delayed`, `denied`, `shadow_denied`, `fail_open`, `fail_closed`, `local_allowed`, `local_denied` or `shed`
// `{http.rate_limit.policy}` | the denying policy, or the one with the fewest tokens left
// `{http.rate_limit.key}` | that policy's storage key (a hash, never the identity), to tie a hot Redis key to requests
// `{http.rate_limit.remaining}` | that policy's whole tokens left (empty when nothing was decided)
// `{http.rate_limit.retry_after}` | the Retry-After sent, in seconds (0 when none)
// `{http.rate_limit.bearer}` | the token of an `Authorization: Bearer` header, to key on: the scheme in any case, the spaces around it dropped; empty without one
// `{http.rate_limit.credential}` | the request's credential, to key on: the token of `Authorization: Bearer`, or `x-api-key`, `api-key` or `x-goog-api-key`, as the LLM SDKs send it; empty without one, or with two different ones
type Handler struct {
	// Shares the buckets through Redis with every Caddy instance that points
	// at the same Redis (and key prefix). Without it, buckets live in this
	// process only: one instance's limits.
	Redis *RedisConfig `json:"redis,omitempty"`

	// The secret that keys the HMAC-SHA-256 hash standing for each identity
	// in storage keys, so that keys cannot be linked to known identities
	// (an IP address's plain hash can be reversed). Use a placeholder such
	// as `{env.RATE_LIMIT_SECRET}`; one that resolves to nothing fails the
	// config. Without it, plain SHA-256.
	KeySecret string `json:"key_secret,omitempty"`

	// What policies do when Redis cannot decide (down, or no answer within
	// its timeout): `fail_open` admits the request, `fail_closed` answers
	// 503, `local` decides with an in-process bucket. Only Redis failing
	// engages it, never load. A policy can override it. Default `fail_open`.
	OnError string `json:"on_error,omitempty"`

	// How far Retry-After is spread, as a fraction (0.2 = 20%), so denied
	// clients do not return together; never below the true wait. With it,
	// clients that honour Retry-After are paced: given return turns at the
	// rate the bucket refills, the denial answered at the fraction of a
	// second that lands them on their turn. 0 turns both off. Default 0.2.
	Jitter *float64 `json:"jitter,omitempty"`

	// The RateLimit fields sent on responses: `draft` (RateLimit-Policy and
	// RateLimit, draft-ietf-httpapi-ratelimit-headers) or `off`. Retry-After
	// is sent on denials either way. Default `draft`.
	Headers string `json:"headers,omitempty"`

	// The body of a 429: `problem` (an RFC 9457 problem, the default),
	// `openai` or `anthropic` (the provider's own rate-limit error, which
	// its SDKs surface to the application as such: OpenAI's
	// `{"error": {"type", "code": "rate_limit_exceeded", "message"}}`,
	// Anthropic's `{"type": "error", "error": {"type": "rate_limit_error",
	// "message"}}`), for the routes of an LLM API. The RateLimit fields and
	// Retry-After are sent whatever the format. A policy can override it.
	ErrorFormat string `json:"error_format,omitempty"`

	// Evaluates and reports every policy without rejecting any request or
	// adding response fields: a dry run for rolling out limits.
	Shadow bool `json:"shadow,omitempty"`

	// How many leading bits of an IPv6 client address policies' keys keep
	// ({client_ip}, {remote_host}, {http.request.remote}): all the
	// addresses of one network share a bucket. One subscriber line or one
	// cloud VM is given a /64, 2^64 addresses, so a key of whole IPv6
	// addresses would let one client take a fresh bucket per request;
	// Cloudflare counts IPv6 clients by /64 too. 1 to 128 (128: one bucket
	// per address). A policy can override it. Default 64.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// How many leading bits of an IPv4 client address policies' keys keep,
	// e.g. 24 for one bucket per /24. 1 to 32. A policy can override it.
	// Default 32 (one bucket per address).
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// How many Caddy instances share these limits. While Redis is away,
	// `on_error local` gives each instance 1/instances of every policy's
	// rate and burst (at least one token), so that the fleet together stays
	// within the budget; and Retry-After pacing spaces each instance's
	// return turns by instances tokens. Default 1.
	Instances int `json:"instances,omitempty"`

	// Refuses to start (or reload to) this config unless Redis decides for
	// every policy: checked while Caddy loads the config, with one
	// read-only decision per policy. Without it, Caddy starts while Redis
	// cannot decide (unreachable, a wrong password, an ACL without the
	// limiter's commands, no scripting), logs one ERROR per cause, and the
	// policies follow `on_error` until Redis answers. Needs a `redis`
	// block. Once started, Redis failing later engages `on_error` either
	// way.
	RequireRedis bool `json:"require_redis,omitempty"`

	// The prices of the LLM models served, for the policies that budget in
	// money (`unit usd`): lines, and a price list in LiteLLM's format. See
	// docs/money.md.
	Prices *Prices `json:"prices,omitempty"`

	// The budgets. Every policy that matches a request takes part in its
	// decision. A policy name is one budget: the same name in two handlers
	// shares its buckets, and must be defined the same way in both.
	Policies []*Policy `json:"policies,omitempty"`

	store     store
	storeUse  *storeUse
	config    any    // the config load this handler belongs to (see budgets)
	events    string // the Redis channel of events between instances
	keyPrefix string
	hasher    *keyHasher
	// allPolicyHdr is RateLimit-Policy when every policy matches and none
	// is a shadow: the common case, built once.
	allPolicyHdr string
	jitter       float64
	headers      bool
	logger       *zap.Logger
	// mholtZone is where the Caddyfile first used mholt/caddy-ratelimit's
	// zone syntax (see parseCaddyfile).
	mholtZone *sourceLine
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

const defaultJitter = 0.2

// announceVersion logs the module's version once per process.
var announceVersion sync.Once

// Bounds of numeric settings, well beyond any real deployment.
const (
	maxInstances = 10_000
	maxPoolSize  = 10_000
	maxDB        = 1_000_000
)

// Provision sets up the handler: its defaults, its policies and its store.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	goRedisLog.use(h.logger)
	watchSharedListeners(h.logger) // listeners_linux.go
	announceVersion.Do(func() { h.logger.Info("rate_limit module", zap.String("version", Version)) })
	if err := registerMetrics(ctx); err != nil {
		return err
	}
	// Caddy validates after provisioning; the provisioning below needs the
	// checked and parsed values first.
	if err := h.Validate(); err != nil {
		return err
	}
	if h.OnError == "" {
		h.OnError = failOpen
	}
	h.jitter = defaultJitter
	if h.Jitter != nil {
		h.jitter = *h.Jitter
	}
	h.headers = h.Headers != "off"
	h.keyPrefix = defaultKeyPrefix
	if h.Redis != nil && h.Redis.KeyPrefix != "" {
		h.keyPrefix = h.Redis.KeyPrefix
	}
	if h.Redis != nil {
		h.events = eventsChannel(h.keyPrefix)
	}
	secret := caddy.NewReplacer().ReplaceAll(h.KeySecret, "")
	if h.KeySecret != "" && secret == "" {
		// An unset {env.X} must not silently drop to unkeyed SHA-256, whose
		// hashes of IPv4 addresses anyone can reverse.
		return emptySecretError(h.KeySecret)
	}
	h.hasher = newKeyHasher(secret)
	h.Prices.logLoaded(h.logger)
	for _, p := range h.Policies {
		if err := p.provision(ctx, h); err != nil {
			return fmt.Errorf("policy %q: %v", p.Name, err)
		}
	}
	h.warnUnauthenticatedKeys(ctx)
	h.warnAnonymousQuotaKeys(ctx)

	var all []byte
	for _, p := range h.Policies {
		if p.kind == kindShed {
			continue // not in the fields (writeFields)
		}
		if p.shadow || p.kind == kindQuota || p.Plan != nil { // a quota's member changes with its period, a plan's is the plan's
			all = nil
			break
		}
		if len(all) > 0 {
			all = append(all, ", "...)
		}
		all = append(all, p.policyHdr...)
	}
	h.allPolicyHdr = string(all)

	// One name, one budget: across the handlers of this config (a config
	// load has its own metrics registry).
	h.config = ctx.GetMetricsRegistry()
	if err := budgets.add(h.config, h); err != nil {
		h.config = nil
		return err
	}
	store, closeStore, err := openStore(h.Redis, h.keyPrefix, h.logger)
	if err != nil {
		return err
	}
	h.store, h.storeUse = store, &storeUse{close: closeStore}
	if err := h.provisionPlans(); err != nil {
		return err
	}
	if h.RequireRedis {
		if err := h.requireRedis(); err != nil {
			return err
		}
	}
	if fm, ok := store.(fleetMember); ok {
		fm.fleetView().join(h) // announced to the fleet once the config runs (fleet.go)
	}
	return nil
}

// storeName says where the handler's buckets are, for messages.
func (h *Handler) storeName() string {
	if h.Redis == nil {
		return "in-process"
	}
	return fmt.Sprintf("Redis %s db %d, key_prefix %s", strings.Join(h.Redis.Addresses, ","), h.Redis.DB, h.keyPrefix)
}

// Validate checks the whole config, naming the field of each mistake (and,
// for a policy, the policy): the same checks the Caddyfile parser runs on
// each block it reads, so that `caddy adapt` and `caddy validate` cannot
// disagree.
func (h *Handler) Validate() error {
	if err := h.checkOwn(); err != nil {
		return err
	}
	if h.Redis != nil {
		if err := h.Redis.validate(); err != nil {
			return fmt.Errorf("redis: %v", err)
		}
	}
	if len(h.Policies) == 0 {
		return fmt.Errorf("at least one policy is required")
	}
	seen := make(map[string]bool, len(h.Policies))
	for i, p := range h.Policies {
		if p == nil {
			return fmt.Errorf("policies[%d]: empty", i)
		}
		p.hot.shared = h.Redis != nil // hot keys are the Redis store's (hotkeys.go)
		if err := p.check(); err != nil {
			return fmt.Errorf("policy %q: %w", p.Name, err)
		}
		if seen[p.Name] {
			return fmt.Errorf("policy %q: defined twice", p.Name)
		}
		seen[p.Name] = true
	}
	if err := h.checkPrices(); err != nil {
		return err
	}
	if h.Prices != nil {
		if err := h.Prices.load(); err != nil {
			return err
		}
	}
	return h.checkDurableStore()
}

// checkOwn checks the handler's own fields (not its redis block nor its
// policies).
func (h *Handler) checkOwn() error {
	if h.OnError != "" && !validOnError(h.OnError) {
		return fieldErr("on_error", "on_error: %q is not fail_open, fail_closed or local", h.OnError)
	}
	if h.Instances < 0 || h.Instances > maxInstances {
		return fieldErr("instances", "instances: %d must be from 1 to %d", h.Instances, maxInstances)
	}
	if h.Jitter != nil && (*h.Jitter < 0 || *h.Jitter > maxJitter || *h.Jitter != *h.Jitter) {
		return fieldErr("jitter", "jitter: %v must be between 0 and %v (%v%%)", *h.Jitter, maxJitter, 100*maxJitter)
	}
	if h.RequireRedis && h.Redis == nil {
		return fieldErr("require_redis", "require_redis: needs a redis block (without one, the buckets are in this process)")
	}
	if h.Headers != "" && h.Headers != "draft" && h.Headers != "off" {
		return fieldErr("headers", "headers: %q is not draft or off", h.Headers)
	}
	if err := checkErrorFormat(h.ErrorFormat); err != nil {
		return err
	}
	if err := checkPrefix("ipv6_prefix", h.IPv6Prefix, 128); err != nil {
		return err
	}
	if err := checkPrefix("ipv4_prefix", h.IPv4Prefix, 32); err != nil {
		return err
	}
	return nil
}

// maxJitter is the largest jitter, a fraction: 1000%.
const maxJitter = 10.0

// Cleanup releases this config's reference to its Redis client; the client
// is closed when no loaded config uses it any more.
func (h *Handler) Cleanup() error {
	if fm, ok := h.store.(fleetMember); ok {
		fm.fleetView().part(h)
	}
	if h.config != nil {
		budgets.remove(h.config, h)
		h.config = nil
	}
	if h.storeUse == nil {
		return nil
	}
	return h.storeUse.end()
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
