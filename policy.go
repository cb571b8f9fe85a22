package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/shed"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/topk"
)

// Policy is one named budget: the requests that match it are counted, per
// resolved key, in a token bucket of `burst` tokens that refills at `rate`.
// Every policy that matches a request is decided with the others in one
// atomic step: the request is admitted and charged by all of them, or
// denied and charged by none.
type Policy struct {
	// The policy's name, in storage keys, response fields, metrics and logs:
	// 1 to 64 letters, digits, `_`, `-` and `.`. Unique in the handler; the
	// same name in another handler is the same budget.
	Name string `json:"name"`

	// Limits the policy to requests that match all these request matchers:
	// one route class, never a raw path. Default: every request.
	MatchRaw caddy.ModuleMap `json:"match,omitempty" caddy:"namespace=http.matchers"`

	// What partitions the budget: one bucket per distinct value. Accepts
	// placeholders, e.g. `{http.auth.user.id}` or `{client_ip}`; a fixed
	// string such as `global` makes one bucket for everyone. A client
	// address in it (`{client_ip}`, `{remote_host}` or
	// `{http.request.remote}`, alone or among other parts; in JSON by
	// these names or their long forms) is kept as its network: see
	// `ipv6_prefix` and `ipv4_prefix`. Requests whose key resolves to the
	// empty string share one bucket. Required.
	Key string `json:"key"`

	// How fast the bucket refills: `N/duration`, N tokens (a positive
	// integer) per duration, e.g. `100/1m` or `10/1s`. Required, unless the
	// policy is `concurrent`.
	Rate string `json:"rate,omitempty"`

	// Makes the policy a concurrency limit instead of a rate: at most this
	// many requests with the same key in flight at once, across all
	// instances. A request takes a slot in the same atomic decision as its
	// other policies, holds it on a lease renewed while it runs, and frees
	// it when its handler chain returns (completion, error, client gone);
	// the slots of an instance that died come back within `lease`.
	Concurrent int64 `json:"concurrent,omitempty"`

	// How long a concurrency slot is held without renewal: the time within
	// which the slots of an instance that died come back. Renewed every
	// third of it while the request runs, so a request may run for hours.
	// At least 1s. Default 30s.
	Lease caddy.Duration `json:"lease,omitempty"`

	// What the policy's rate, burst, quota, cost, max_cost and settle's max
	// and debt count: `tokens` (the default: requests, or an LLM's tokens)
	// or `usd`, dollars with up to 6 decimals, kept exactly as integer
	// micro-dollars. A money policy prices an LLM request with the
	// handler's `prices` (`cost openai` reserves its model's price of the
	// tokens it may use, `settle openai` charges the price of what it
	// used), and takes no `weights`. Rate and quota policies only. See
	// docs/money.md.
	Unit string `json:"unit,omitempty"`

	// The bucket's capacity: how many unit requests may pass at once after
	// a quiet period (in dollars, under `unit usd`). Default: the rate's N.
	Burst float64 `json:"burst,omitempty"`

	// The tokens one request takes: an integer (a JSON number or string), a
	// placeholder such as `{http.request.header.X-Cost}`, or `openai`: what
	// an LLM request's JSON body asks for, its `max_tokens`,
	// `max_completion_tokens` or `max_output_tokens` (the largest) plus an
	// estimate of its prompt (the bytes of its strings, 4 a token), weighed
	// as the policy's `settle` weighs usage, read from the first 64 KiB of
	// the body, which reaches the upstream unchanged. A value that does not
	// resolve to a positive integer, or resolves above `max_cost` (for
	// `openai`: a body without those fields, not JSON, compressed, or
	// longer than 64 KiB without a Content-Length), is charged at
	// `max_cost`. A request that costs more than `burst` can never pass
	// (429 without Retry-After). Default 1.
	Cost caddyhttp.WeakString `json:"cost,omitempty"`

	// The most one request is charged. Default: burst.
	MaxCost float64 `json:"max_cost,omitempty"`

	// With `cost openai`, what a request whose answer the body does not
	// bound does: one without `max_tokens`, `max_completion_tokens` or
	// `max_output_tokens` (a model that reasons may then generate far more
	// than it shows), or with `"background": true` (answered at once, its
	// usage null, billed as the work runs: its usage is never seen here).
	// `max` reserves `max_cost` and keeps it, as for input the body does
	// not show; `refuse` answers it 400 before the provider, asking for a
	// ceiling. Default `max`.
	Unbounded string `json:"unbounded,omitempty"`

	// What this policy does when the shared store cannot decide (Redis down
	// or not answering): `fail_open`, `fail_closed` or `local`. Default: the
	// handler's `on_error`.
	OnError string `json:"on_error,omitempty"`

	// Evaluates and reports this policy without ever rejecting for it.
	Shadow bool `json:"shadow,omitempty"`

	// The body of a 429 this policy denies: `problem`, `openai` or
	// `anthropic` (see the handler's error_format). Default: the
	// handler's.
	ErrorFormat string `json:"error_format,omitempty"`

	// Delays instead of rejecting: a request that cannot pass now but could
	// within this duration reserves its slot (atomically, across all
	// instances) and is held until then, as NGINX `limit_req` without
	// `nodelay`. Beyond it, the request is denied as usual. A request whose
	// client goes away while held keeps its slot consumed: refunding it could
	// admit more than the budget. With `concurrent`, a request that finds no
	// free slot waits up to this long for one to be freed on any instance.
	// At most 24h. Default 0: never wait.
	Wait caddy.Duration `json:"wait,omitempty"`

	// The most requests this policy holds at once on this instance (with
	// `wait`); beyond it, requests that would have to wait are denied.
	// Default 1024.
	MaxHeld int `json:"max_held,omitempty"`

	// Charges only the responses that match this response matcher (status
	// codes or classes such as 4xx, headers), e.g. failed logins. The cost
	// is reserved before the request, as any policy charges it: the request
	// is denied when the bucket cannot cover it, so an attacker's parallel
	// attempts are counted while they run, and at most burst of them reach
	// the handlers behind. A response that does not match gives the cost
	// back; a matching one, or a request whose client went away before any
	// response, keeps it. A request whose handler fails with a Caddy error
	// is matched by the error's status.
	ChargeIf *caddyhttp.ResponseMatcher `json:"charge_if,omitempty"`

	// How many leading bits of an IPv6 client address the key keeps, where
	// it uses one ({client_ip}, {remote_host}, {http.request.remote}): all
	// the addresses of one network share a bucket. One subscriber line or
	// one cloud VM is given a /64, 2^64 addresses, so a key of whole IPv6
	// addresses would let one client take a fresh bucket per request;
	// Cloudflare counts IPv6 clients by /64 too. 1 to 128 (128: one bucket
	// per address). Default: the handler's, or 64.
	IPv6Prefix int `json:"ipv6_prefix,omitempty"`

	// How many leading bits of an IPv4 client address the key keeps, e.g.
	// 24 for one bucket per /24. 1 to 32. Default: the handler's, or 32
	// (one bucket per address).
	IPv4Prefix int `json:"ipv4_prefix,omitempty"`

	// Settles the request's cost against the usage the response reports:
	// `cost` is reserved before the request, as always; then usage below it
	// is given back (never beyond a full bucket) and usage above it charged
	// as debt. With no usage reported (a stream cut before it, an upstream
	// that sends none, a body that cannot be read, or the store
	// unreachable) the reservation stands, or, for `openai` and
	// `anthropic`, the estimate of what the response delivered when that is
	// more (its text at 4 bytes a token, and the prompt's estimate of
	// `cost openai`); counted in caddy_rate_limit_charges_lost_total by
	// reason.
	Settle *Settle `json:"settle,omitempty"`

	// Makes the policy a quota instead of a rate: `N/<period>`, N units (a
	// positive integer up to 2^53) per calendar minute, hour, day, week
	// (from Monday 00:00), month (from the 1st) or year of `timezone`, e.g.
	// `1000000/month`. A request of cost k is admitted while the units
	// used in the current period plus k are at most N; at the boundary,
	// on Redis time, usage starts again from 0 on every instance at once.
	// `cost`, `settle`, `charge_if`, `shadow` and `on_error` work as for a
	// rate; `burst` and `wait` do not apply. See docs/quotas.md.
	Quota string `json:"quota,omitempty"`

	// The IANA time zone whose calendar a quota's periods follow, e.g.
	// `America/New_York`: daylight-saving changes move the boundary as the
	// clock does (a day may last 23 or 25 hours). Time zone data is built
	// in. Default `UTC`.
	Timezone string `json:"timezone,omitempty"`

	// Admits a quota's requests only once Redis confirms their usage
	// reached replicas (`replicas`, WAIT) and/or the append-only file
	// (`aof`, WAITAOF, Redis 7.2 and later), within the redis block's
	// timeout; otherwise the policy's `on_error` applies (`fail_closed`
	// answers 503). Best effort as Redis defines it: see docs/quotas.md.
	// Needs a redis block. Default: not waited for.
	Durable *Durable `json:"durable,omitempty"`

	// Takes blocks of a busy key's tokens ahead of its requests: when this
	// instance decides one key of the policy more often than this
	// (`N/duration`, decisions a second on one key here), it takes a block
	// of the key's tokens from the shared bucket in one decision (debited
	// there first, on Redis time), decides the key's requests from it
	// without a round trip, spending each token no earlier than the bucket
	// would have let it go, and fetches the next block before it runs out:
	// never more is admitted than the bucket hands out, across the fleet.
	// Blocks follow the instance's own rate on the key; what it holds and
	// has not spent goes back when the key cools, at reload, at shutdown,
	// and after a second. `off` decides every request in Redis. Only for
	// rate policies, not those that settle. Default `200/1s`. See docs/hot-keys.md.
	HotKeys string `json:"hot_keys,omitempty"`

	// Gives the policy a limit per plan: which plan a request is on, read
	// from a placeholder, and each plan's limit. One bucket per key whatever
	// the plan: a plan change is read against the bucket's state on the
	// next request, on every instance, as a reload's change of limit is. A
	// request that names no plan gets the policy's own limit.
	Plan *Plan `json:"plan,omitempty"`

	// Protects the service rather than a caller's budget: requests beyond
	// the capacity it sets are turned away with 503, lowest priority class
	// first. Instead of `rate` and `concurrent`. See shed_policy.go.
	Shed *Shed `json:"shed,omitempty"`

	// Which priority class a request of a shed policy is in, and the share
	// of the capacity each class may use. Without it, every request is in
	// one class, which may use all of it.
	Priority *Priority `json:"priority,omitempty"`

	// Provisioned state, of every kind.
	kind policyKind // from the fields given (check)
	unit unit       // what its amounts count (check)
	// prices are the handler's (a money policy's LLM requests), nil without;
	// money its counters (money.go).
	prices *price.Table
	money  moneyMetrics
	// keyModel: the key uses {http.rate_limit.model}, read from the body.
	keyModel  bool
	matchers  caddyhttp.MatcherSet
	limit     limit
	onError   string
	shadow    bool
	keyPrefix string // <key_prefix><name>:
	keyTmpl   template
	fixedKey  string // the storage key when Key has no placeholder
	policyHdr []byte // this policy's RateLimit-Policy member
	// deniedBody is the 429 body when this policy alone denies, the common
	// case: built once rather than per denial, which an abusive client makes
	// the hot path.
	deniedBody []byte
	decisions  [numOutcomes]prometheus.Counter
	top        *topk.Sketch // the identities it denied most, this instance
	// addrMask is what the key keeps of a client address.
	addrMask clientaddr.Mask
	// emptyKey counts the requests whose key resolved empty (credential.go);
	// nil for a fixed key.
	emptyKey *emptyKeyWatch
	// keys are the storage keys of recent identities (see storageKey).
	keys *keyCache
	// Plans (plan.go): each plan's copy of the policy, by name; planName is
	// the plan a copy decides (empty for the policy itself); planTmpl reads
	// the request's plan.
	plans    map[string]*Policy
	planName string
	planTmpl template
	// overrides says which of the policy's buckets the store may hold an
	// operator's override of (override_store.go): the store's, shared.
	overrides overrideFilter

	rate  rateSpec     // a rate: its N per duration
	costs costRule     // a rate or a quota: what a request costs
	held  heldRequests // `wait`: the requests it holds on this instance
	after afterRule    // charge_if, settle: the charges after the response
	slots slotMetrics  // concurrent, shed { concurrent }: slots in use
	hot   hotRule      // a rate: its keys decided from blocks when hot
	// A quota: its calendar and durability, and where the Caddyfile set
	// durable.
	quota       *quotaSpec
	durableLine *sourceLine
	// A shed policy: its classes (check) and its provisioned state.
	classes *shed.Classes
	shed    *shedState
}

// rateSpec is a rate's `N/duration`: n tokens per duration.
type rateSpec struct {
	n   int64
	per time.Duration
}

// costRule is what one request costs under a rate or quota policy.
type costRule struct {
	fixed    int64    // 0 when Cost holds a placeholder, or is openai
	fromBody bool     // Cost is openai
	refuse   bool     // Unbounded is refuse: a body that does not bound its answer is refused
	max      int64    // max_cost, or its default
	tmpl     template // Cost, when it is a placeholder
}

// heldRequests are the requests a `wait` policy holds on this instance
// until the time each reserved (at most MaxHeld).
type heldRequests struct {
	wait  int64         // Wait in µs
	n     *atomic.Int64 // held now
	gauge prometheus.Gauge
}

// afterRule bounds what a response may charge after it (settle), and
// counts what was not charged as measured.
type afterRule struct {
	// maxUsage caps the usage one response settles (Settle.Max, or its
	// default); debt is the most tokens the bucket may owe beyond empty
	// (Settle.Debt, or its default: see debt.go).
	maxUsage int64
	debt     int64
	lost     [numLostReasons]prometheus.Counter
	logs     *[numLostReasons]lostLog
	// failed limits the lines of the provider's errors given back
	// (charge_failed.go).
	failed *lostLog
}

// slotMetrics are a slot policy's metrics: in flight on this instance,
// the leases reclaimed from holders that vanished, and the releases sent
// again.
type slotMetrics struct {
	inFlight prometheus.Gauge
	expired  prometheus.Counter
	retries  prometheus.Counter
}

var policyName = regexp.MustCompile(`^[A-Za-z0-9_.-]{1,64}$`)

// Failure modes, for on_error.
const (
	failOpen   = "fail_open"
	failClosed = "fail_closed"
	failLocal  = "local"
)

func validOnError(s string) bool { return s == failOpen || s == failClosed || s == failLocal }

// parseRate parses `N/duration` in the unit: N, the duration, and the µs
// per token (per micro-dollar) it refills at.
func (u unit) parseRate(s string) (n int64, per time.Duration, interval int64, err error) {
	if u == unitUSD {
		text, d, ok := strings.Cut(s, "/")
		if !ok {
			return 0, 0, 0, fmt.Errorf("%q is not <dollars>/<duration>, e.g. 5/1h", s)
		}
		if n, err = u.amount(text); err != nil {
			return 0, 0, 0, fmt.Errorf("%q: %v", s, err)
		}
		if per, err = caddy.ParseDuration(d); err != nil || per <= 0 {
			return 0, 0, 0, fmt.Errorf("%q: bad duration %q", s, d)
		}
		interval, err = exactInterval(s, n, per.Microseconds())
		return n, per, interval, err
	}
	if n, per, err = parseRate(s); err != nil {
		return 0, 0, 0, err
	}
	return n, per, int64(per / time.Microsecond / time.Duration(n)), nil
}

// parseRate parses `N/duration`, N tokens.
func parseRate(s string) (n int64, per time.Duration, err error) {
	text, d, ok := strings.Cut(s, "/")
	if !ok {
		return 0, 0, fmt.Errorf("%q is not N/duration, e.g. 100/1m", s)
	}
	n, err = strconv.ParseInt(text, 10, 64)
	if err != nil || n < 1 || strings.HasPrefix(text, "+") {
		return 0, 0, fmt.Errorf("%q: N must be a positive integer", s)
	}
	per, err = caddy.ParseDuration(d)
	if err != nil {
		if hint := rateHint(text, d); hint != "" {
			return 0, 0, fmt.Errorf("%q: bad duration %q: %s", s, d, hint)
		}
		return 0, 0, fmt.Errorf("%q: bad duration: %v", s, err)
	}
	if per <= 0 {
		return 0, 0, fmt.Errorf("%q: duration must be positive", s)
	}
	if per/time.Duration(n) < time.Microsecond {
		return 0, 0, fmt.Errorf("%q: at most one token per microsecond", s)
	}
	return n, per, nil
}

// parseCost parses a fixed cost in the unit; fixed is false for a
// placeholder.
func (u unit) parseCost(s string) (cost int64, fixed bool, err error) {
	if strings.Contains(s, "{") {
		return 0, false, nil
	}
	if u == unitUSD {
		cost, err = u.amount(s)
		return cost, true, err
	}
	cost, err = strconv.ParseInt(s, 10, 64)
	if err != nil || cost < 1 || strings.HasPrefix(s, "+") {
		return 0, true, fmt.Errorf("%q must be a positive integer or a placeholder", s)
	}
	return cost, true, nil
}

// fieldError is a mistake in one field of a config: the JSON path names
// the field, the Caddyfile parser the line of the subdirective that set it.
type fieldError struct {
	field string // the JSON field
	msg   string // the whole message, which names the field
}

func (e *fieldError) Error() string { return e.msg }

func fieldErr(field, format string, args ...any) error {
	return &fieldError{field: field, msg: fmt.Sprintf(format, args...)}
}

// maxJSONInteger is the largest integer a config may hold: Caddy keeps the
// loaded config as JSON values, whose numbers are doubles, and a larger
// integer does not survive the round trip (it fails to load).
const maxJSONInteger = 1 << 53

// check checks the policy's own fields and derives its bucket: all that
// needs no Caddy context, so that `caddy adapt` (through the Caddyfile
// parser) and `caddy validate` report the same mistakes, each naming its
// field. The caller names the policy.
func (p *Policy) check() error {
	if !policyName.MatchString(p.Name) {
		return fieldErr("name", "name %q: use 1 to 64 letters, digits, '_', '-' or '.'", p.Name)
	}
	if p.Key == "" {
		return fieldErr("key", "key: required (e.g. {client_ip}, {http.auth.user.id} or global)")
	}
	if err := checkPrefix("ipv6_prefix", p.IPv6Prefix, 128); err != nil {
		return err
	}
	if err := checkPrefix("ipv4_prefix", p.IPv4Prefix, 32); err != nil {
		return err
	}
	if err := checkErrorFormat(p.ErrorFormat); err != nil {
		return err
	}
	p.quota = nil
	p.kind = kindOf(p)
	var err error
	if p.unit, err = parseUnit(p.Unit); err != nil {
		return err
	}
	if err := p.noHotKeys(); err != nil {
		return err
	}
	if p.unit == unitUSD && (p.kind == kindShed || p.kind == kindConcurrent) {
		return fieldErr("unit", "unit: usd is for rate and quota policies: a %s policy counts requests in flight", p.kindName())
	}
	if err := p.checkUnbounded(); err != nil {
		return err
	}
	switch p.kind {
	case kindShed:
		return p.checkShed()
	case kindQuota:
		return p.checkQuota()
	case kindConcurrent:
		if err := p.checkConcurrent(); err != nil {
			return err
		}
		return p.checkPlans()
	}
	if p.Rate == "" {
		return fieldErr("rate", "rate: required (e.g. 100/1m), or concurrent <n>")
	}
	var interval int64
	if p.rate.n, p.rate.per, interval, err = p.unit.parseRate(p.Rate); err != nil {
		return fieldErr("rate", "rate: %v", err)
	}
	burst, err := p.unit.count(p.Burst)
	if err != nil {
		return fieldErr("burst", "burst: %v", err)
	}
	if burst == 0 {
		burst = p.rate.n
	}
	if burst > maxBucketSpan/interval {
		return fieldErr("burst", "burst: %s take too long to refill at %s", p.unit.quantity(burst), p.Rate)
	}
	if err := p.checkWait(); err != nil {
		return err
	}
	p.held.wait = int64(time.Duration(p.Wait) / time.Microsecond)
	if err := p.checkHotKeys(interval, burst); err != nil {
		return err
	}
	p.after.debt, p.after.maxUsage = 0, 0
	switch {
	case p.ChargeIf != nil && p.Settle != nil:
		return fieldErr("settle", "charge_if and settle exclude each other: charge_if charges the cost of matching responses, settle the usage of every response")
	case p.ChargeIf != nil:
		if p.Wait != 0 {
			return fieldErr("wait", "wait: a charge_if policy gives back what a response does not owe, so it has no turn to reserve")
		}
	case p.Settle != nil:
		if err := p.Settle.check(p.unit); err != nil {
			return err
		}
		if p.after.maxUsage, p.after.debt, err = p.Settle.settleLimits(burst, interval, (maxBucketSpan-burst*interval-p.held.wait)/interval); err != nil {
			return err
		}
	}
	if p.after.debt > (maxBucketSpan-burst*interval-p.hot.reach)/interval {
		return fieldErr("burst", "burst: %s and a debt of %s take too long to refill at %s", p.unit.quantity(burst), p.unit.quantity(p.after.debt), p.Rate)
	}
	p.limit = limit{interval: interval, burst: burst, slack: p.hot.reach + p.after.debt*interval}
	if err := p.checkCost(burst, "burst"); err != nil {
		return err
	}
	if p.OnError != "" && !validOnError(p.OnError) {
		return fieldErr("on_error", "on_error: %q is not fail_open, fail_closed or local", p.OnError)
	}
	p.keyTmpl, p.costs.tmpl = newTemplate(p.Key), newTemplate("")
	if !p.costs.fromBody {
		p.costs.tmpl = newTemplate(string(p.Cost))
	}
	return p.checkPlans()
}

// checkCost checks what a request costs under a rate or quota policy whose
// buckets hold capacity (a burst, a quota's N, named what): a fixed cost,
// a placeholder, or the body's (`openai`, `anthropic`), at most max_cost.
func (p *Policy) checkCost(capacity int64, what string) error {
	var err error
	if p.costs.max, err = p.unit.count(p.MaxCost); err != nil {
		return fieldErr("max_cost", "max_cost: %v", err)
	}
	if p.costs.max == 0 {
		p.costs.max = capacity
	}
	if p.costs.max > capacity {
		return maxAboveCapacity(p.unit, p.costs.max, what, capacity)
	}
	cost := string(p.Cost)
	if cost == "" {
		cost = "1"
		if p.unit == unitUSD {
			return fieldErr("cost", "cost: required with unit usd: what a request costs, in dollars (cost 0.01), or what an LLM request's body asks for at its model's price (cost openai or cost anthropic)")
		}
	}
	var fixed bool
	p.costs.fromBody = cost == costOpenAI || cost == costAnthropic
	if p.costs.fromBody {
		p.costs.fixed = 0
	} else if p.costs.fixed, fixed, err = p.unit.parseCost(cost); err != nil {
		return fieldErr("cost", "cost: %v", err)
	}
	if fixed && p.costs.fixed > min(p.costs.max, capacity) {
		return fieldErr("cost", "cost: %s is more than max %s or %s %s: no request could ever pass",
			p.unit.format(p.costs.fixed), p.unit.format(p.costs.max), what, p.unit.format(capacity))
	}
	return nil
}

// checkConcurrent checks a concurrency policy and derives its slots: a
// limit of Concurrent slots whose interval is the lease.
func (p *Policy) checkConcurrent() error {
	switch {
	case p.Concurrent == 0:
		return fieldErr("lease", "lease: only a concurrent policy has leases")
	case p.Concurrent < 1 || p.Concurrent > maxJSONInteger:
		return fieldErr("concurrent", "concurrent: %d must be from 1 to %d", p.Concurrent, int64(maxJSONInteger))
	case p.Rate != "":
		return fieldErr("rate", "rate: a policy is a rate or concurrent, not both: give each its own policy (a request matching both is decided by both at once)")
	case p.Burst != 0 || p.Cost != "" || p.MaxCost != 0:
		return fieldErr("concurrent", "concurrent: a request takes one slot: burst and cost are for rate policies")
	case p.ChargeIf != nil || p.Settle != nil:
		return fieldErr("concurrent", "concurrent: charge_if and settle are for rate policies")
	}
	lease := time.Duration(p.Lease)
	if lease == 0 {
		lease = defaultLease
	}
	if lease < minLease || lease > maxWait {
		return fieldErr("lease", "lease: %s must be from %s to %s", lease, minLease, maxWait)
	}
	if err := p.checkWait(); err != nil {
		return err
	}
	p.limit = limit{interval: int64(lease / time.Microsecond), burst: p.Concurrent}
	p.costs.fixed, p.costs.max, p.held.wait, p.after.debt, p.after.maxUsage, p.costs.fromBody = 1, 1, 0, 0, 0, false
	p.keyTmpl, p.costs.tmpl = newTemplate(p.Key), newTemplate("")
	return nil
}

// checkWait checks wait and max_held, the same for rate and concurrency
// policies.
func (p *Policy) checkWait() error {
	if p.Wait < 0 || time.Duration(p.Wait) > maxWait {
		return fieldErr("wait", "wait: %s must be between 0 and %s", time.Duration(p.Wait), maxWait)
	}
	if p.MaxHeld < 0 || p.MaxHeld > maxHeld {
		return fieldErr("max_held", "max_held: %d must be from 1 to %d", p.MaxHeld, maxHeld)
	}
	return nil
}

// maxWait bounds how far ahead a request may reserve a slot.
const maxWait = 24 * time.Hour

// Requests a policy with `wait` holds at once per instance, by default and
// at most.
const (
	defaultMaxHeld = 1024
	maxHeld        = 1 << 20
)

// provision fills in the policy's defaults and derived state; check has
// passed.
func (p *Policy) provision(ctx caddy.Context, h *Handler) error {
	p.onError = p.OnError
	if p.onError == "" {
		p.onError = h.OnError
	}
	p.shadow = p.Shadow || h.Shadow
	p.keyPrefix = h.keyPrefix + p.Name + ":"
	if h.Prices != nil {
		p.prices = h.Prices.table
	}
	p.provisionMoney()
	p.keyModel = readsModel(p.Key)
	p.keys = &keyCache{ids: newBucketIDs()}
	p.addrMask = clientaddr.MaskOf(p.IPv4Prefix, p.IPv6Prefix, h.IPv4Prefix, h.IPv6Prefix)
	if p.keyTmpl.constant() { // e.g. `key global`: one bucket, one storage key
		p.fixedKey = p.storageKey(h.hasher, p.keyTmpl.text)
	} else {
		p.emptyKey = newEmptyKeyWatch(p.Name)
	}
	if p.kind == kindConcurrent {
		p.policyHdr = slotsMember(nil, p.Name, p.Concurrent)
	} else if p.kind == kindQuota {
		p.policyHdr = nil // a member per period: quotaSpec.policyMember
	} else {
		q, w := fieldQuota(p.rate.n, p.rate.per)
		p.policyHdr = policyMember(nil, p.Name, q, w, p.unit)
	}
	var err error
	if p.deniedBody, err = json.Marshal(quotaExceeded([]string{p.Name})); err != nil {
		return err
	}
	p.decisions = policyCounters(p.Name, "", p.planLabel())
	p.top = topOf(p.Name)
	for reason := range numLostReasons {
		p.after.lost[reason] = chargesLost.WithLabelValues(p.Name, lostReasonNames[reason])
	}
	p.after.logs, p.after.failed = new([numLostReasons]lostLog), new(lostLog)
	p.slots.inFlight = inFlight.WithLabelValues(p.Name)
	p.slots.expired = leasesExpired.WithLabelValues(p.Name)
	p.slots.retries = releaseRetries.WithLabelValues(p.Name)
	p.held.n = new(atomic.Int64)
	p.held.gauge = waiting.WithLabelValues(p.Name)
	p.provisionHotKeys()
	if p.MaxHeld == 0 {
		p.MaxHeld = defaultMaxHeld
	}

	if p.MatchRaw != nil {
		mods, err := ctx.LoadModule(p, "MatchRaw")
		if err != nil {
			return fmt.Errorf("match: %v", err)
		}
		for name, m := range mods.(map[string]any) {
			switch m.(type) {
			case caddyhttp.RequestMatcherWithError, caddyhttp.RequestMatcher:
				p.matchers = append(p.matchers, m)
			default:
				return fmt.Errorf("match: %s is not a request matcher", name)
			}
		}
	}
	if p.kind == kindShed {
		p.provisionShed(ctx, h)
	}
	return nil
}

// admissionOp is what the policy does to its bucket before the request:
// take a slot, or take the cost (which charge_if and settle may give back
// after the response).
func (p *Policy) admissionOp() bucketOp {
	if p.kind.slots() { // shed { concurrent } too
		return opAcquire
	}
	return opTake
}

// givesBack reports whether the policy's buckets may be given tokens back
// after the response (charge_if, settle): what a decision said of them is
// then no lower bound on their state, and the deny cache leaves them alone.
func (p *Policy) givesBack() bool { return p.charging() != chargedAtAdmission }

// cost resolves what this request costs under the policy.
func (p *Policy) cost(r *http.Request, repl *caddy.Replacer) int64 {
	if p.costs.fixed > 0 {
		return p.costs.fixed
	}
	if p.costs.fromBody {
		rs, _ := caddyhttp.GetVar(r.Context(), stateVar).(*requestState)
		if p.unit == unitUSD {
			return p.moneyCost(requestBodyOf(r, rs))
		}
		return requestBodyOf(r, rs).Reservation(p.usageWeights(), p.costs.max)
	}
	v, err := strconv.ParseInt(p.costs.tmpl.resolve(r, repl, p.addrMask), 10, 64)
	if err != nil || v < 1 || v > p.costs.max {
		return p.costs.max
	}
	return v
}

// usageWeights are the weights of the policy's settle, which its
// reservation from the body is weighed with too.
func (p *Policy) usageWeights() llm.Weights {
	if p.Settle != nil && p.Settle.Weights != nil {
		return p.Settle.w
	}
	return llm.UnitWeights
}

// key resolves the policy's key template for this request, its client
// address masked to the policy's prefix lengths.
func (p *Policy) key(r *http.Request, repl *caddy.Replacer) string {
	return p.keyTmpl.resolve(r, repl, p.addrMask)
}

func (p *Policy) matches(r *http.Request) (bool, error) {
	if p.matchers == nil {
		return true, nil
	}
	return p.matchers.MatchWithError(r)
}
