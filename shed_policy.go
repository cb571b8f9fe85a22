package ratelimit

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/shed"
)

// Load shedding. A shed policy protects the service, not a caller's
// budget: when the service is at capacity it turns requests away with 503
// (the caller broke no policy), lowest priority class first, so that the
// last of the capacity is always kept for the higher classes.
//
// Two capacities, either or both:
//
//   - shed { concurrent N }: fleet-wide, at most N requests in flight on all
//     instances together. They are concurrency slots (slots.go), one set
//     for all classes, taken in the request's one atomic decision: a
//     request of a class is admitted only while fewer than its class's
//     slots (shed.ClassLimit of N for its share) are in use, so a burst of the
//     lowest class never takes the slots a higher class needs. In Redis
//     they are the sorted set of leases a `concurrent` policy keeps, under
//     the policy's own key: no new kind of value. The previous release
//     (v0.2) never reads it: its configs cannot hold a shed policy.
//   - shed { latency D }: adaptive, on each instance alone, by the
//     controller of internal/shed: checked before the store is asked (a request
//     it sheds costs no Redis call), its slot given back unmeasured when
//     another policy denies the request, measured when the handler chain
//     returns.

// shedCapacity is what a shed policy keeps the service within, either or
// both: an adaptive limit of the requests in flight on this instance
// (shed { latency }), and slots the fleet shares (shed { concurrent }).
type shedCapacity uint8

const (
	adaptiveCapacity shedCapacity = 1 << iota
	slotCapacity
)

// capacity is what the policy keeps the service within: none unless it is
// a shed policy.
func (p *Policy) capacity() shedCapacity {
	var c shedCapacity
	if p.shed != nil && p.shed.limiter != nil {
		c |= adaptiveCapacity
	}
	if p.Shed != nil && p.Shed.Concurrent > 0 {
		c |= slotCapacity
	}
	return c
}

// has reports whether the capacity includes k.
func (c shedCapacity) has(k shedCapacity) bool { return c&k != 0 }

// Shed is the capacity a shed policy keeps the service within: one or
// both of `concurrent` and `latency`.
type Shed struct {
	// Fleet-wide: at most this many requests in flight at once, on all
	// instances and of all classes together: what the upstreams can run at
	// once. Each admitted request holds a lease on one of these slots in
	// Redis, taken in the same atomic decision as the request's other
	// policies and renewed while it runs, as a `concurrent` policy's (the
	// policy's `lease` is how soon the slots of an instance that died come
	// back, default 30s). A request of a class is admitted only while fewer
	// than its class's share of the slots are in use.
	Concurrent int64 `json:"concurrent,omitempty"`

	// Adaptive, per instance: the latency to keep the requests this
	// instance passes within. Each instance learns how many requests it
	// may let in flight from the latency of those it passed (from being
	// passed on until the handler chain returns): the limit comes down when
	// their p90 is above this, and grows while their p95 is within it and
	// the limit is used, never below 4 (what the highest class always has)
	// nor above 1000. No Redis call. Set it above the route's normal p95,
	// e.g. 1.5 × its unloaded median. 1ms to 1h.
	Latency caddy.Duration `json:"latency,omitempty"`
}

// Priority sorts a shed policy's requests into classes.
type Priority struct {
	// The placeholder whose value names the request's class, e.g.
	// `{http.request.header.X-Priority}`. A client can send any header: take
	// the class from authentication where a client must not choose it (see
	// docs/load-shedding.md). A value that names no class (empty, unknown,
	// in another case) is the lowest class. Required.
	From string `json:"from"`

	// The classes, highest first, each with the share of the capacity its
	// requests may use: a request of a class is admitted only while the
	// requests in flight, all classes together, are fewer than its share of
	// the limit. The first class's share is 100%; each next one's is lower.
	Classes []PriorityClass `json:"classes"`
}

// PriorityClass is one priority class of a shed policy.
type PriorityClass struct {
	// The value that puts a request in this class, and the `class` label
	// of its decisions: 1 to 64 letters, digits, `_`, `-` or `.`.
	Name string `json:"name"`

	// The share of the capacity the class may use: a percentage above 0%
	// and at most 100%, with at most two decimals, e.g. "50%" or "12.5%".
	Share string `json:"share"`
}

// Bounds of shed { latency }: the controller's windows are 2 × latency,
// clamped to 10ms..1s (internal/shed).
const (
	minShedLatency = time.Millisecond
	maxShedLatency = time.Hour
)

// shedState is a shed policy's provisioned state.
type shedState struct {
	from    template      // the priority value (Priority.From)
	limiter *shed.Limiter // shed { latency }; nil without
	// byClass is the policy as each class's requests see it: its slots
	// (shed { concurrent }: shed.ClassLimit of N for the class's share) and its
	// decisions_total children, labelled with the class. A request's
	// admission holds its class's policy in place of the policy.
	byClass []*Policy
}

// shedAdmission is a request's place under a shed policy's adaptive limit.
type shedAdmission struct {
	policy *Policy // the class's (shedState.byClass)
	class  int
	ticket shed.Ticket
	taken  bool // ticket is the request's place under the adaptive limit
}

// checkShed checks a shed policy and derives its classes and slots: as a
// concurrency policy's, a limit of Shed.Concurrent slots whose interval is
// the lease.
func (p *Policy) checkShed() error {
	s := p.Shed
	switch {
	case s == nil:
		return fieldErr("priority", "priority: only a shed policy has priority classes (shed { concurrent <n> } or shed { latency <duration> }); "+
			"to split a caller's budget, give each kind of request its own policy with a match")
	case p.Rate != "":
		return fieldErr("rate", "rate: a policy is a rate or shed, not both: a shed policy protects the service, a rate policy a caller's budget; "+
			"give each its own policy (a request matching both is decided by both at once)")
	case p.Concurrent != 0:
		return fieldErr("concurrent", "concurrent: a shed policy's fleet-wide capacity is shed { concurrent <n> }; "+
			"a concurrent policy limits what one key runs at once: give it its own policy")
	case p.Quota != "" || p.Timezone != "" || p.Durable != nil:
		return fieldErr("quota", "quota: a policy is a quota or shed, not both: a shed policy protects the service, a quota a caller's budget; "+
			"give each its own policy (a request matching both is decided by both at once)")
	case p.Plan != nil:
		return fieldErr("plan", "plan: a shed policy protects the service, whatever the caller's plan: to give plans their share, name them in priority classes")
	case p.Burst != 0:
		return fieldErr("burst", "burst: a shed request takes one slot: burst and cost are for rate policies")
	case p.Cost != "" || p.MaxCost != 0:
		return fieldErr("cost", "cost: a shed request takes one slot: burst and cost are for rate policies")
	case p.ChargeIf != nil:
		return fieldErr("charge_if", "charge_if: a shed policy counts requests in flight, it charges nothing")
	case p.Settle != nil:
		return fieldErr("settle", "settle: a shed policy counts requests in flight, it charges nothing")
	case p.Wait != 0:
		return fieldErr("wait", "wait: a shed policy answers at once: holding requests in Caddy is the queueing that shedding avoids")
	case s.Concurrent == 0 && s.Latency == 0:
		return fieldErr("shed", "shed: concurrent <n> or latency <duration> (or both) is required")
	case s.Concurrent < 0 || s.Concurrent > maxJSONInteger:
		return fieldErr("shed", "shed: concurrent %d must be from 1 to %d", s.Concurrent, int64(maxJSONInteger))
	case s.Latency < 0 || s.Latency != 0 && (time.Duration(s.Latency) < minShedLatency || time.Duration(s.Latency) > maxShedLatency):
		return fieldErr("shed", "shed: latency %s must be from %s to %s", time.Duration(s.Latency), minShedLatency, maxShedLatency)
	case s.Concurrent == 0 && p.Lease != 0:
		return fieldErr("lease", "lease: only shed { concurrent <n> } holds leases (shed { latency } has no Redis state)")
	case p.OnError != "" && !validOnError(p.OnError):
		return fieldErr("on_error", "on_error: %q is not fail_open, fail_closed or local", p.OnError)
	}
	if s.Latency != 0 && !newTemplate(p.Key).constant() {
		return fieldErr("key", "key: shed { latency } learns one limit per policy on each instance, so its key is a fixed string such as global; "+
			"for a per-route or per-upstream limit, give each its own policy with a match")
	}
	classes, err := p.Priority.check()
	if err != nil {
		return err
	}
	for i := 1; s.Concurrent > 0 && i < len(classes.Names()); i++ {
		if shed.ClassLimit(s.Concurrent, classes.Shares()[i], false, 1) == 0 {
			return fieldErr("priority", "priority: class %q: %s of concurrent %d is less than one slot: its requests would always be shed",
				classes.Name(i), shed.FormatShare(classes.Shares()[i]), s.Concurrent)
		}
	}
	lease := time.Duration(p.Lease)
	if lease == 0 {
		lease = defaultLease
	}
	if lease < minLease || lease > maxWait {
		return fieldErr("lease", "lease: %s must be from %s to %s", lease, minLease, maxWait)
	}
	p.classes = classes
	p.limit = limit{interval: int64(lease / time.Microsecond), burst: s.Concurrent}
	p.costs.fixed, p.costs.max, p.held.wait, p.after.debt, p.after.maxUsage = 1, 1, 0, 0, 0
	p.keyTmpl, p.costs.tmpl = newTemplate(p.Key), newTemplate("")
	return nil
}

// check checks the priority classes and returns them; a policy without
// priority has one class, which may use all the capacity.
func (pr *Priority) check() (*shed.Classes, error) {
	if pr == nil {
		return shed.NewClasses([]string{""}, []int64{shed.Whole})
	}
	if err := pr.checkFrom(); err != nil {
		return nil, err
	}
	if len(pr.Classes) == 0 {
		return nil, fieldErr("priority", "priority: at least one class is required, highest first, e.g. critical 100%%")
	}
	names, shares := make([]string, len(pr.Classes)), make([]int64, len(pr.Classes))
	for i, c := range pr.Classes {
		if !policyName.MatchString(c.Name) {
			return nil, fieldErr("priority", "priority: class %q: a class name is 1 to 64 letters, digits, '_', '-' or '.'", c.Name)
		}
		bp, err := shed.ParseShare(c.Share)
		if err != nil {
			return nil, fieldErr("priority", "priority: class %q: %v", c.Name, err)
		}
		if i == 0 && bp != shed.Whole {
			return nil, fieldErr("priority", "priority: class %q: the first class is the highest, which may use all the capacity: its share is 100%% (got %s)",
				c.Name, c.Share)
		}
		names[i], shares[i] = c.Name, bp
	}
	classes, err := shed.NewClasses(names, shares)
	if err != nil {
		return nil, fieldErr("priority", "%v", err)
	}
	return classes, nil
}

// checkFrom checks the placeholder that names a request's class.
func (pr *Priority) checkFrom() error {
	switch {
	case pr.From == "":
		return fieldErr("priority", "priority: the placeholder that names the class is required, e.g. priority {http.request.header.X-Priority} { ... }")
	case newTemplate(pr.From).constant():
		return fieldErr("priority", "priority: %q has no placeholder: every request would be in the same class", pr.From)
	}
	return nil
}

// provisionShed makes a checked shed policy's state: its classes' views
// of it and its adaptive limiter. Its on_error is fail_open unless it sets
// its own: shedding must not take the service down with Redis (the
// handler's on_error is for budgets).
func (p *Policy) provisionShed(ctx caddy.Context, h *Handler) {
	if p.OnError == "" {
		p.onError = failOpen
	}
	p.policyHdr = nil // not in the RateLimit fields
	st := &shedState{}
	if p.Priority != nil {
		st.from = newTemplate(p.Priority.From)
	}
	if p.Shed.Latency > 0 {
		st.limiter = shedLimiterOf(p.Name, time.Duration(p.Shed.Latency), p.classes.Shares())
	}
	p.shed = st
	st.byClass = make([]*Policy, len(p.classes.Names()))
	for i := range st.byClass {
		cp := *p
		cp.decisions = policyCounters(p.Name, p.classes.Name(i), "")
		cp.limit.burst = shed.ClassLimit(p.limit.burst, p.classes.Shares()[i], i == 0, 1)
		st.byClass[i] = &cp
	}
	if err := registerShedMetrics(ctx); err != nil {
		h.logger.Warn("registering caddy_rate_limit_shed_limit: " + err.Error())
	}
}

// classOf is the class of the request: the index of the class its
// priority value names, or the lowest.
func (st *shedState) classOf(p *Policy, r *http.Request, repl *caddy.Replacer) int {
	if p.Priority == nil {
		return 0
	}
	return p.classes.Of(st.from.resolve(r, repl, p.addrMask))
}

// shedShape is what two definitions of one shed policy must share.
func (p *Policy) shedShape() string {
	var parts []string
	if p.Shed.Concurrent > 0 {
		parts = append(parts, fmt.Sprintf("concurrent %d, lease %s", p.Shed.Concurrent, time.Duration(p.limit.interval)*time.Microsecond))
	}
	if p.Shed.Latency > 0 {
		parts = append(parts, "latency "+time.Duration(p.Shed.Latency).String())
	}
	if p.Priority != nil {
		classes := make([]string, len(p.classes.Names()))
		for i, name := range p.classes.Names() {
			classes[i] = name + " " + shed.FormatShare(p.classes.Shares()[i])
		}
		parts = append(parts, "priority "+p.Priority.From+" { "+strings.Join(classes, ", ")+" }")
	}
	return strings.Join(parts, ", ")
}

// shedLimiters keeps each shed policy's adaptive limiter for the process,
// by name, so that what it learned survives config reloads (one name is
// one policy, budgets.go). A reload that changes the policy's latency or
// classes starts a new limiter at the limit the old one reached; requests
// admitted under the old one finish on it. Its size is the number of shed
// policy names in configs.
var shedLimiters = struct {
	mu sync.Mutex
	m  map[string]*shed.Limiter
}{m: map[string]*shed.Limiter{}}

func shedLimiterOf(name string, target time.Duration, shares []int64) *shed.Limiter {
	shedLimiters.mu.Lock()
	defer shedLimiters.mu.Unlock()
	old := shedLimiters.m[name]
	if old != nil && old.Target() == target && slices.Equal(old.Shares(), shares) {
		return old
	}
	l := shed.NewLimiter(target, shares, time.Now)
	if old != nil {
		l.Resume(old.Limit())
	}
	shedLimiters.m[name] = l
	return l
}
