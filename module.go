// Package ratelimit is a Caddy HTTP handler that enforces rate limits shared
// by every Caddy instance of a deployment: token buckets kept in Redis and
// decided by one atomic Lua script, so that four instances allowing
// "100 per minute" allow 100 per minute together, not 400.
package ratelimit

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler limits the rate of requests with token buckets shared by every
// Caddy instance through Redis (or kept in this process without a `redis`
// block). Each request is checked against every policy whose matcher it
// matches, in one atomic decision. A denied request gets a 429
// `application/problem+json` response with `Retry-After`; every response
// carries the `RateLimit-Policy` and `RateLimit` fields of the IETF draft.
//
// The handler sets placeholders for later handlers and access logs:
// `{http.rate_limit.decision}` (allowed, denied, shadow_denied, fail_open,
// fail_closed, local_allowed or local_denied), `{http.rate_limit.policy}`
// (the denying policy, or the one with the fewest tokens left),
// `{http.rate_limit.remaining}` and `{http.rate_limit.retry_after}`.
//
// Keys accept placeholders. Identities are stored only as keyed hashes.
type Handler struct {
	// Redis shares the buckets between all Caddy instances that point at the
	// same Redis. Without it, buckets live in this process only.
	Redis *RedisConfig `json:"redis,omitempty"`

	// KeySecret keys the HMAC-SHA-256 hash that stands for each identity in
	// storage keys. Set it (e.g. `{env.RATE_LIMIT_SECRET}`) so that keys
	// cannot be linked to known identities; without it, plain SHA-256.
	KeySecret string `json:"key_secret,omitempty"`

	// OnError is what policies do when Redis cannot decide in time:
	// `fail_open` admits the request, `fail_closed` answers 503, `local`
	// decides with an in-process bucket. Default `fail_open`.
	OnError string `json:"on_error,omitempty"`

	// Jitter spreads Retry-After upward by up to this fraction (0.2 = 20%)
	// of the true wait, so denied clients do not all return at once. It is
	// never below the true wait. Default 0.2; 0 disables it.
	Jitter *float64 `json:"jitter,omitempty"`

	// Headers selects the RateLimit fields sent on responses: `draft`
	// (RateLimit-Policy and RateLimit, draft-ietf-httpapi-ratelimit-headers)
	// or `off`. Retry-After is sent on denials either way. Default `draft`.
	Headers string `json:"headers,omitempty"`

	// Shadow evaluates and reports every policy without rejecting any
	// request or adding response fields: a dry run for rolling out limits.
	Shadow bool `json:"shadow,omitempty"`

	// Instances is how many Caddy instances share these limits. It matters
	// only to the `local` failure mode: while Redis is away each instance
	// decides alone, with 1/instances of every policy's rate and burst (at
	// least one token), so that the fleet together stays within the budget.
	// Default 1.
	Instances int `json:"instances,omitempty"`

	// Policies are the budgets. Every policy that matches a request takes
	// part in its decision.
	Policies []*Policy `json:"policies,omitempty"`

	store     store
	poolKey   string // in redisClients, when Redis is used
	keyPrefix string
	hasher    *keyHasher
	// allPolicyHdr is RateLimit-Policy when every policy matches and none
	// is a shadow: the common case, built once.
	allPolicyHdr string
	jitter       float64
	headers      bool
	logger       *zap.Logger
	lastWarn     *atomic.Int64 // unix nanoseconds of the last store-failure warning
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.rate_limit",
		New: func() caddy.Module { return new(Handler) },
	}
}

const defaultJitter = 0.2

// Bounds of numeric settings, well beyond any real deployment.
const (
	maxInstances = 10_000
	maxPoolSize  = 10_000
	maxDB        = 1_000_000
)

// Provision sets up the handler.
func (h *Handler) Provision(ctx caddy.Context) error {
	h.logger = ctx.Logger()
	if err := registerMetrics(ctx); err != nil {
		return err
	}
	h.lastWarn = new(atomic.Int64)
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
	if err := h.checkConfig(); err != nil {
		return err
	}
	secret := caddy.NewReplacer().ReplaceAll(h.KeySecret, "")
	if h.KeySecret != "" && secret == "" {
		// An unset {env.X} must not silently drop to unkeyed SHA-256, whose
		// hashes of IPv4 addresses anyone can reverse.
		return fmt.Errorf("key_secret: %q resolves to the empty string", h.KeySecret)
	}
	h.hasher = newKeyHasher(secret)
	for _, p := range h.Policies {
		if err := p.provision(ctx, h); err != nil {
			return fmt.Errorf("policy %q: %v", p.Name, err)
		}
	}

	var all []byte
	for _, p := range h.Policies {
		if p.shadow {
			all = nil
			break
		}
		if len(all) > 0 {
			all = append(all, ", "...)
		}
		all = append(all, p.policyHdr...)
	}
	h.allPolicyHdr = string(all)

	h.store = processMemory
	if h.Redis != nil {
		rc := h.Redis.resolved()
		h.poolKey = rc.poolKey()
		// Caddy must start and reload while Redis is unreachable: the client
		// connects lazily and each decision bounds its own wait.
		v, _, err := redisClients.LoadOrNew(h.poolKey, func() (caddy.Destructor, error) {
			return newRedisConn(rc, h.logger)
		})
		if err != nil {
			h.poolKey = ""
			return fmt.Errorf("redis: %v", err)
		}
		rs := &redisStore{conn: v.(*redisConn), timeout: time.Duration(rc.Timeout), cluster: rc.Cluster}
		if !rc.Cluster {
			rs.denials = v.(*redisConn).denials
		}
		h.store = rs
	}
	return nil
}

// checkConfig checks what provisioning the policies does not, so that a
// JSON mistake fails `caddy validate` naming the field.
func (h *Handler) checkConfig() error {
	if !validOnError(h.OnError) {
		return fmt.Errorf("on_error: %q is not fail_open, fail_closed or local", h.OnError)
	}
	if h.Instances < 0 || h.Instances > maxInstances {
		return fmt.Errorf("instances: %d must be from 1 to %d", h.Instances, maxInstances)
	}
	if h.jitter < 0 || h.jitter > 10 {
		return fmt.Errorf("jitter: %v must be between 0 and 10 (1000%%)", h.jitter)
	}
	if h.Headers != "" && h.Headers != "draft" && h.Headers != "off" {
		return fmt.Errorf("headers: %q is not draft or off", h.Headers)
	}
	if h.Redis != nil {
		if strings.ContainsAny(h.Redis.KeyPrefix, "{}") {
			// Braces would move the Redis Cluster hash tag off the identity.
			return fmt.Errorf("redis: key_prefix: %q must not contain { or }", h.Redis.KeyPrefix)
		}
		if len(h.Redis.Addresses) == 0 {
			return fmt.Errorf("redis: at least one address is required")
		}
		if h.Redis.Cluster && h.Redis.Sentinel != "" {
			return fmt.Errorf("redis: cluster and sentinel exclude each other")
		}
		if h.Redis.Timeout < 0 {
			return fmt.Errorf("redis: timeout: must not be negative")
		}
		if h.Redis.PoolSize < 0 || h.Redis.PoolSize > maxPoolSize {
			return fmt.Errorf("redis: pool_size: %d must be from 1 to %d", h.Redis.PoolSize, maxPoolSize)
		}
		if h.Redis.DB < 0 || h.Redis.DB > maxDB {
			return fmt.Errorf("redis: db: %d must be from 0 to %d", h.Redis.DB, maxDB)
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
		if seen[p.Name] {
			return fmt.Errorf("policy %q: defined twice", p.Name)
		}
		seen[p.Name] = true
	}
	return nil
}

// Validate is done by Provision, which needs the parsed numbers; this keeps
// the interface for tools that only validate.
func (h *Handler) Validate() error { return nil }

// Cleanup releases this config's reference to its Redis client; the client
// is closed when no loaded config uses it any more.
func (h *Handler) Cleanup() error {
	if h.poolKey == "" {
		return nil
	}
	_, err := redisClients.Delete(h.poolKey)
	h.poolKey = ""
	return err
}

// ServeHTTP decides the request against every matching policy.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	repl := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)

	var pbuf [4]*Policy
	var rbuf [4]bucketRequest
	policies, reqs := pbuf[:0], rbuf[:0]
	for _, p := range h.Policies {
		ok, err := p.matches(r)
		if err != nil {
			return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("rate_limit: policy %s: matching: %w", p.Name, err))
		}
		if !ok {
			continue
		}
		policies = append(policies, p)
		key := p.fixedKey
		if key == "" {
			key = p.storageKey(h.hasher, p.key(r, repl))
		}
		reqs = append(reqs, bucketRequest{
			key:    key,
			limit:  p.limit,
			cost:   p.cost(r, repl),
			shadow: p.shadow,
		})
	}
	if len(reqs) == 0 {
		return next.ServeHTTP(w, r)
	}
	o := outcomeOf(r, repl)
	// A policy with `wait` may reserve a future slot only while it has room
	// to hold the request until then.
	var hbuf [4]int
	held := hbuf[:0]
	for i, p := range policies {
		if p.hold() {
			reqs[i].wait = p.waitUS
			held = append(held, i)
		}
	}

	d, err := h.store.decide(r.Context(), reqs)
	if err != nil {
		for _, i := range held {
			policies[i].release()
		}
		h.warnStoreFailure(err)
		return h.serveWithoutStore(w, r, next, o, policies, reqs)
	}
	count(policies, d, outcomeAllowed, outcomeDenied)
	if !d.admitted {
		for _, i := range held {
			policies[i].release()
		}
		return h.deny(w, o, policies, d, outcomeDenied)
	}
	outcome := outcomeAllowed
	for i, v := range d.verdicts {
		if !v.allowed {
			outcome = outcomeShadowDenied
			h.logger.Debug("shadow policy would deny", zap.String("policy", policies[i].Name))
		}
	}
	if d.delay > 0 {
		outcome = outcomeDelayed
	}
	h.report(w, o, policies, d, outcome, 0)
	if !h.holdForSlot(r, policies, held, d) {
		return nil // the client went away; its slot stays consumed
	}
	return next.ServeHTTP(w, r)
}

// holdForSlot holds an admitted request until the slot it reserved, and
// frees the places it took in its policies. It returns false when the
// client went away first.
func (h *Handler) holdForSlot(r *http.Request, policies []*Policy, held []int, d decision) bool {
	var waiting []*Policy
	for _, i := range held {
		if d.verdicts[i].delay > 0 {
			waiting = append(waiting, policies[i])
			policies[i].waiting.Inc()
		} else {
			policies[i].release()
		}
	}
	if len(waiting) == 0 {
		return true
	}
	defer func() {
		for _, p := range waiting {
			p.waiting.Dec()
			p.release()
		}
	}()
	timer := time.NewTimer(time.Duration(d.delay) * time.Microsecond)
	defer timer.Stop()
	select {
	case <-timer.C:
		return true
	case <-r.Context().Done():
		return false
	}
}

// serveWithoutStore applies each policy's on_error when Redis could not
// decide: one fail_closed policy answers 503 for the request; local
// policies are decided by in-process buckets; fail_open policies admit.
func (h *Handler) serveWithoutStore(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, o *requestOutcome, policies []*Policy, reqs []bucketRequest) error {
	var local []bucketRequest
	var localPolicies []*Policy
	for i, p := range policies {
		switch {
		case p.onError == failClosed && !p.shadow:
			p.decisions[outcomeFailClosed].Inc()
			ra := retryAfter(time.Second.Microseconds(), h.jitter)
			*o = requestOutcome{decision: outcomeFailClosed, policy: p.Name, remaining: -1, retryAfter: ra}
			w.Header().Set("Retry-After", strconv.FormatInt(ra, 10))
			return writeProblem(w, reducedCapacity())
		case p.onError == failLocal:
			local = append(local, h.localRequest(reqs[i]))
			localPolicies = append(localPolicies, p)
		}
	}
	d := decision{admitted: true}
	outcome := outcomeFailOpen
	if len(local) > 0 {
		d, _ = processMemory.decide(r.Context(), local)
		count(localPolicies, d, outcomeLocalAllowed, outcomeLocalDenied)
		if !d.admitted {
			return h.deny(w, o, localPolicies, d, outcomeLocalDenied)
		}
		outcome = outcomeLocalAllowed
	}
	for _, p := range policies {
		if p.onError != failLocal {
			p.decisions[outcomeFailOpen].Inc()
		}
	}
	h.report(w, o, localPolicies, d, outcome, 0)
	return next.ServeHTTP(w, r)
}

// localRequest is a policy's request to its in-process fallback bucket,
// which holds 1/instances of the policy's budget. It never waits: while
// Redis is away, a request that does not fit now is denied.
func (h *Handler) localRequest(rq bucketRequest) bucketRequest {
	rq.wait = 0
	if n := int64(h.Instances); n > 1 {
		rq.limit.interval = min(rq.limit.interval, maxBucketSpan/n) * n
		rq.limit.burst = max(1, rq.limit.burst/n)
	}
	return rq
}

// count adds a decision to each policy's decisions_total: a policy that
// denied counts as denied (shadow_denied for a shadow policy); one that
// admitted counts as allowed when the request was admitted and it was
// charged, and not at all when another policy denied the request.
func count(policies []*Policy, d decision, allowed, denied outcome) {
	for i, v := range d.verdicts {
		switch {
		case !v.allowed && policies[i].shadow:
			policies[i].decisions[outcomeShadowDenied].Inc()
		case !v.allowed:
			policies[i].decisions[denied].Inc()
		case d.admitted && v.delay > 0:
			policies[i].decisions[outcomeDelayed].Inc()
		case d.admitted:
			policies[i].decisions[allowed].Inc()
		}
	}
}

// deny writes the 429 response of a denied request.
func (h *Handler) deny(w http.ResponseWriter, o *requestOutcome, policies []*Policy, d decision, outcome outcome) error {
	var violated []string
	var wait int64
	var denier *Policy // the last policy that denied
	for i, v := range d.verdicts {
		if v.allowed || policies[i].shadow {
			continue
		}
		denier = policies[i]
		violated = append(violated, policies[i].Name)
		if v.wait == neverWait || wait == neverWait {
			wait = neverWait
		} else {
			wait = max(wait, v.wait)
		}
	}
	var ra int64
	if wait != neverWait {
		ra = retryAfter(wait, h.jitter)
		w.Header().Set("Retry-After", strconv.FormatInt(ra, 10))
	}
	h.report(w, o, policies, d, outcome, ra)
	if ce := h.logger.Check(zap.DebugLevel, "rate limit exceeded"); ce != nil {
		ce.Write(zap.Strings("policies", violated), zap.Int64("retry_after", ra))
	}
	if len(violated) == 1 {
		return writeProblemBody(w, http.StatusTooManyRequests, denier.deniedBody)
	}
	return writeProblem(w, quotaExceeded(violated))
}

// report sets the placeholders and the RateLimit fields. Every placeholder
// is set (possibly empty), so access logs never show a raw placeholder.
func (h *Handler) report(w http.ResponseWriter, o *requestOutcome, policies []*Policy, d decision, outcome outcome, retryAfter int64) {
	o.decision, o.retryAfter, o.policy, o.remaining = outcome, retryAfter, "", -1
	// The tightest enforced policy; among shadow ones only when no policy is
	// enforced, so a dry run still says which policy would deny.
	tightest, enforced := -1, false
	for i, v := range d.verdicts {
		e := !policies[i].shadow
		if tightest < 0 || e && !enforced || e == enforced && tighter(v, d.verdicts[tightest]) {
			tightest, enforced = i, e
		}
	}
	if tightest < 0 { // fail_open: nothing was decided
		return
	}
	o.policy, o.remaining = policies[tightest].Name, d.verdicts[tightest].remaining
	if !h.headers || !enforced { // shadow policies never show in responses
		return
	}
	// Most requests match every policy: their RateLimit-Policy is fixed.
	var pbuf, lbuf [256]byte
	pol, lim := pbuf[:0], lbuf[:0]
	all := len(d.verdicts) == len(h.Policies) && h.allPolicyHdr != ""
	for i, v := range d.verdicts {
		if policies[i].shadow {
			continue
		}
		if len(lim) > 0 {
			pol = append(pol, ", "...)
			lim = append(lim, ", "...)
		}
		if !all {
			pol = append(pol, policies[i].policyHdr...)
		}
		lim = limitMember(lim, policies[i].Name, v.remaining, v.wait)
	}
	policyHdr := h.allPolicyHdr
	if !all {
		policyHdr = string(pol)
	}
	hdr := w.Header()
	hdr["Ratelimit-Policy"] = []string{policyHdr}
	hdr["Ratelimit"] = []string{string(lim)}
}

// requestOutcome holds one request's placeholders, formatted only when a
// later handler or log reads them.
type requestOutcome struct {
	decision   outcome
	policy     string
	remaining  int64 // -1: not decided
	retryAfter int64
}

// outcomeVar is where a request keeps its requestOutcome, so that a second
// rate_limit on the same request updates the same placeholders.
const outcomeVar = "\x00rate_limit"

// outcomeOf returns the request's requestOutcome, registering its
// placeholders the first time.
func outcomeOf(r *http.Request, repl *caddy.Replacer) *requestOutcome {
	if o, ok := caddyhttp.GetVar(r.Context(), outcomeVar).(*requestOutcome); ok {
		return o
	}
	o := &requestOutcome{remaining: -1}
	caddyhttp.SetVar(r.Context(), outcomeVar, o)
	repl.Map(o.placeholder)
	return o
}

func (o *requestOutcome) placeholder(key string) (any, bool) {
	switch key {
	case "http.rate_limit.decision":
		return outcomeNames[o.decision], true
	case "http.rate_limit.policy":
		return o.policy, true
	case "http.rate_limit.remaining":
		if o.remaining < 0 {
			return "", true
		}
		return strconv.FormatInt(o.remaining, 10), true
	case "http.rate_limit.retry_after":
		return strconv.FormatInt(o.retryAfter, 10), true
	}
	return nil, false
}

// tighter orders verdicts for {http.rate_limit.policy}: a denial before an
// admission, then the longer wait, then the fewer tokens left.
func tighter(a, b verdict) bool {
	if a.allowed != b.allowed {
		return !a.allowed
	}
	if !a.allowed {
		return a.wait == neverWait || (b.wait != neverWait && a.wait > b.wait)
	}
	return a.remaining < b.remaining
}

// warnStoreFailure logs a store failure at most once every 10 seconds:
// when Redis is down every request fails the same way.
func (h *Handler) warnStoreFailure(err error) {
	if errors.Is(err, errCircuitOpen) { // the breaker logs its own transitions
		return
	}
	now := time.Now().UnixNano()
	last := h.lastWarn.Load()
	if now-last < int64(10*time.Second) || !h.lastWarn.CompareAndSwap(last, now) {
		return
	}
	h.logger.Warn("rate limit store unavailable; policies follow on_error", zap.Error(err))
}

// Interface guards.
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.Validator             = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)
