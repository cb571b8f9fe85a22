package ratelimit

import (
	"fmt"
	"net/http"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
)

// Plans: one policy whose limit depends on the request. A policy with a
// `plan` reads, per request, which plan the request is on (a placeholder,
// such as a claim an authentication handler set) and decides it under that
// plan's limit, in the same bucket whatever the plan: one bucket per key,
// read against the limit of the request (rebase, as across a reload), so
// that a tenant who upgrades is freed on its next request on every
// instance, one who downgrades is held to the new limit at once, and no
// plan change hands out a full bucket. A value that names no plan gets the
// policy's own limit.
//
// Each plan is provisioned as a copy of its policy that differs only in its
// limit, its RateLimit-Policy member and its decisions_total children (plan
// label): the request path decides a request of plan pro with the pro copy,
// as if it were the policy, and everything downstream (the fields, the
// metrics, charges after the response, waits) reads that copy's limit.

// Plan picks, per request, the limit a policy decides it under.
type Plan struct {
	// Which plan a request is on: a placeholder, e.g. `{http.auth.user.plan}`,
	// or `{http.request.header.X-Plan}` set by `forward_auth` (`copy_headers
	// X-Plan`, which removes the client's own). It must come from a source
	// the client cannot set: a client that names its plan chooses its
	// limit. A value that names no plan (empty, unknown, anything else) gets
	// the policy's own limit, never more. Plan names are matched exactly.
	// Required.
	From string `json:"from"`

	// The plans, by name: 1 to 64 letters, digits, `_`, `-` and `.`; not
	// `default`, which stands for the policy's own limit in the plan label
	// of caddy_rate_limit_decisions_total. Each is a limit of the policy's
	// kind: `rate`, `burst` and `max_cost` for a rate policy (a field left
	// out is the policy's: a plan with a rate and no burst has the burst of
	// its rate's N, as a policy has), `concurrent` for a concurrency policy,
	// `quota` and `max_cost` for a quota policy. At least one.
	Plans map[string]*PlanLimit `json:"plans"`
}

// PlanLimit is one plan's limit.
type PlanLimit struct {
	// `N/duration`, as the policy's rate. Default: the policy's rate.
	Rate string `json:"rate,omitempty"`

	// The bucket's capacity. Default: the plan's N when the plan sets a
	// rate, the policy's burst otherwise.
	Burst float64 `json:"burst,omitempty"`

	// The most one request is charged (the policy's cost stays what a
	// request costs). Default: the policy's max_cost, or the plan's burst.
	MaxCost float64 `json:"max_cost,omitempty"`

	// A concurrency policy's slots under this plan.
	Concurrent int64 `json:"concurrent,omitempty"`

	// A quota policy's N under this plan: `N`, or `N/<unit>` with the
	// policy's own unit (`5000/month` on a `quota 1000/month` policy). The
	// period and the timezone are the policy's: a plan changes how much a
	// period holds, not the period. The key's usage so far in the period
	// counts against it: a downgrade below the usage denies until the
	// boundary, an upgrade admits at once. Default: the policy's N.
	Quota string `json:"quota,omitempty"`
}

// defaultPlan is the plan label of a request that names no plan: it is
// decided under the policy's own limit.
const defaultPlan = "default"

// planLabel is the policy's plan label in decisions_total: its plan's name,
// "default" for a planned policy's own limit, "" for a policy without plans.
func (p *Policy) planLabel() string {
	switch {
	case p.planName != "":
		return p.planName
	case p.Plan != nil:
		return defaultPlan
	}
	return ""
}

// planField is the field of a plan's mistakes: in the Caddyfile, the plan's
// line is recorded under it (see section.fail).
func planField(name string) string { return "plan:" + name }

// checkPlans checks the policy's plans, once the policy's own fields are
// checked: each plan is checked as the policy with the plan's limit, so a
// plan's mistake is any policy's, named by the plan.
func (p *Policy) checkPlans() error {
	p.planTmpl = template{}
	if p.Plan == nil {
		return nil
	}
	pl := p.Plan
	switch {
	case pl.From == "":
		return fieldErr("plan", "plan: the placeholder that names the request's plan is required, as in plan {http.auth.user.plan} { pro rate 2000/1m }")
	case newTemplate(pl.From).constant():
		return fieldErr("plan", "plan: %q is not a placeholder, so every request would be on one plan: give the policy that limit instead", pl.From)
	case len(pl.Plans) == 0:
		return fieldErr("plan", "plan: at least one plan is required, as in plan %s { pro %s }", pl.From, p.planExample())
	}
	names := make([]string, 0, len(pl.Plans))
	for name := range pl.Plans {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if _, err := p.planPolicy(name, pl.Plans[name]); err != nil {
			return err
		}
	}
	p.planTmpl = newTemplate(pl.From)
	return nil
}

// planExample is a plan line of the policy's kind, for messages.
func (p *Policy) planExample() string {
	if p.kind == kindConcurrent {
		return "concurrent 10"
	}
	if p.kind == kindQuota {
		return "quota 5000"
	}
	return "rate 2000/1m burst 200"
}

// planPolicy is the policy as plan name decides it: a copy with the plan's
// limit, checked. Called on a provisioned policy, the copy is provisioned
// but for its limit's own field and counters (see provisionPlans).
func (p *Policy) planPolicy(name string, lim *PlanLimit) (*Policy, error) {
	switch {
	case !policyName.MatchString(name):
		return nil, fieldErr(planField(name), "plan %q: a plan name is 1 to 64 letters, digits, '_', '-' or '.'", name)
	case name == defaultPlan:
		return nil, fieldErr(planField(name), "plan %q: default names the policy's own limit (the requests that name no plan): give this plan another name, or set the policy's own limit", name)
	case lim == nil || *lim == PlanLimit{}:
		return nil, fieldErr(planField(name), "plan %q: a limit is required, e.g. %s %s", name, name, p.planExample())
	case p.kind == kindQuota && (lim.Rate != "" || lim.Burst != 0 || lim.Concurrent != 0):
		return nil, fieldErr(planField(name), "plan %q: policy %q is a quota: its plans take quota <N> and cost max, not rate, burst or concurrent (a rate limit is a policy of its own)", name, p.Name)
	case p.kind == kindConcurrent && (lim.Rate != "" || lim.Burst != 0 || lim.MaxCost != 0 || lim.Quota != ""):
		return nil, fieldErr(planField(name), "plan %q: policy %q is a concurrency limit: its plans take concurrent <n>, not rate, burst, cost or quota", name, p.Name)
	case p.kind == kindRate && lim.Concurrent != 0:
		return nil, fieldErr(planField(name), "plan %q: policy %q is a rate limit: its plans take rate, burst and cost max, not concurrent (a concurrency limit is a policy of its own)", name, p.Name)
	case p.kind != kindQuota && lim.Quota != "":
		return nil, fieldErr(planField(name), "plan %q: policy %q is a rate limit: its plans take rate, burst and cost max, not quota (a quota is a policy of its own, decided with this one at once)", name, p.Name)
	}
	q := *p
	q.Plan, q.plans, q.planName = nil, nil, name
	if lim.Rate != "" {
		q.Rate, q.Burst = lim.Rate, 0 // the burst of the plan's rate, unless it sets one
	}
	if lim.Burst != 0 {
		q.Burst = lim.Burst
	}
	if lim.MaxCost != 0 {
		q.MaxCost = lim.MaxCost
	}
	if lim.Concurrent != 0 {
		q.Concurrent = lim.Concurrent
	}
	if lim.Quota != "" {
		n, err := p.quotaOf(lim.Quota)
		if err != nil {
			return nil, fieldErr(planField(name), "plan %q: %v", name, err)
		}
		q.Quota = p.quotaWith(n)
	}
	if err := q.check(); err != nil {
		return nil, fieldErr(planField(name), "plan %q: %v", name, err)
	}
	return &q, nil
}

// provisionPlans provisions the policy's plans, once the policy is: each
// plan's copy, its RateLimit-Policy member and its decisions_total
// children.
func (p *Policy) provisionPlans() error {
	p.plans = nil
	if p.Plan == nil {
		return nil
	}
	p.plans = make(map[string]*Policy, len(p.Plan.Plans))
	for name, lim := range p.Plan.Plans {
		q, err := p.planPolicy(name, lim)
		if err != nil {
			return err
		}
		if q.kind == kindConcurrent {
			q.policyHdr = slotsMember(nil, q.Name, q.Concurrent)
		} else if q.kind == kindQuota {
			q.policyHdr = nil // a member per period: quotaSpec.policyMember
		} else {
			qq, w := fieldQuota(q.rate.n, q.rate.per)
			q.policyHdr = policyMember(nil, q.Name, qq, w, q.unit)
		}
		q.decisions = policyCounters(q.Name, "", name)
		q.provisionHotKeys() // a plan's limit may be hot where the policy's is not, or the other way
		p.plans[name] = q
	}
	return nil
}

// maxPlanName is the longest plan name: a longer value names no plan,
// whatever it holds, and is not even looked up.
const maxPlanName = 64

// planned is the policy as the request's plan decides it: the plan's copy,
// or the policy itself when the request names no plan.
func (p *Policy) planned(r *http.Request, repl *caddy.Replacer) *Policy {
	if p.plans == nil {
		return p
	}
	v := p.planTmpl.resolve(r, repl, p.addrMask)
	if len(v) > maxPlanName {
		return p
	}
	if q := p.plans[v]; q != nil {
		return q
	}
	return p
}

// planNamed is the policy under the named plan, for the admin API: the
// policy itself for "" or "default".
func (p *Policy) planNamed(name string) (*Policy, bool) {
	if name == "" || name == defaultPlan {
		return p, true
	}
	q, ok := p.plans[name]
	return q, ok
}

// planShapeOf is what two definitions of one policy name must share of
// their plans (see budgetShape), each plan's limit as the Caddyfile writes
// it, or with previous as the release before this one (v0.4.0) wrote it,
// a Go struct's dump (see fleet.Policy.Previous).
func (p *Policy) planShapeOf(previous bool) string {
	if p.Plan == nil {
		return ""
	}
	names := make([]string, 0, len(p.Plan.Plans))
	for name := range p.Plan.Plans {
		names = append(names, name)
	}
	slices.Sort(names)
	var b strings.Builder
	fmt.Fprintf(&b, ", plan %s {", p.Plan.From)
	for _, name := range names {
		lim := p.Plan.Plans[name]
		if lim == nil {
			continue
		}
		if previous {
			// v0.4.0's dump of its PlanLimit, whose burst and max were
			// integers (a token policy's are whole: checked).
			v04 := struct {
				Rate           string
				Burst, MaxCost int64
				Concurrent     int64
				Quota          string
			}{lim.Rate, int64(lim.Burst), int64(lim.MaxCost), lim.Concurrent, lim.Quota}
			fmt.Fprintf(&b, " %s %+v;", name, v04)
			continue
		}
		fmt.Fprintf(&b, " %s %s;", name, fleet.PlanLimit(lim.Rate, lim.Burst, lim.MaxCost, lim.Concurrent, lim.Quota)) // as the Caddyfile writes it
	}
	b.WriteString(" }")
	return b.String()
}

// provisionPlans provisions the handler's plans once its store is open:
// each policy gets the store's filter of its overrides (which the plans'
// copies share), then its plans.
func (h *Handler) provisionPlans() error {
	for _, p := range h.Policies {
		p.overrides = overrideFilterOf(h.store, p.keyPrefix)
		if err := p.provisionPlans(); err != nil {
			return fmt.Errorf("policy %q: %v", p.Name, err)
		}
	}
	return nil
}

// planArg reads a policy's plan block:
//
//	plan <placeholder> {
//	    <name> [rate <N>/<duration>] [burst <n>] [cost max <n>]
//	    <name> concurrent <n>
//	    <name> quota <N>[/<the policy's unit>] [cost max <n>]
//	}
//
// Each plan's line is recorded, so that a mistake found when the policy is
// checked (a value out of range, a limit of another kind) is reported at
// it.
func (s *section) planArg(d *caddyfile.Dispenser, p *Policy) error {
	pl := &Plan{Plans: map[string]*PlanLimit{}}
	if !d.NextArg() {
		return s.errf(d, "plan: the placeholder that names the request's plan is required, as in plan {http.auth.user.plan} { ... }")
	}
	pl.From = d.Val()
	if d.NextArg() {
		return s.errf(d, "plan: one placeholder expected, got another: %q", d.Val())
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		if name == "{" || name == "}" {
			return s.errf(d, "plan: a plan is one line, <name> <limit>, not a block")
		}
		if first, dup := s.seen[planField(name)]; dup {
			return s.errf(d, "plan %q: defined twice (first at line %d)", name, first.Line())
		}
		s.seen[planField(name)] = *d
		lim := new(PlanLimit)
		seen := map[string]bool{}
		for d.NextArg() {
			word := d.Val()
			if seen[word] {
				return s.errf(d, "plan %q: %s given twice", name, word)
			}
			seen[word] = true
			switch word {
			case "rate":
				if !d.NextArg() {
					return s.errf(d, "plan %q: rate: a value is required, e.g. rate 2000/1m", name)
				}
				lim.Rate = d.Val()
			case "quota": // checked with the policy, whose unit it must have
				if !d.NextArg() {
					return s.errf(d, "plan %q: quota: a value is required, e.g. quota 5000", name)
				}
				lim.Quota = d.Val()
			case "burst":
				if !d.NextArg() {
					return s.errf(d, "plan %q: %s: a value is required", name, word)
				}
				n, ok := positiveAmount(d.Val())
				if !ok {
					return s.errf(d, "plan %q: %s: %q must be a positive number", name, word, d.Val())
				}
				lim.Burst = n
			case "concurrent":
				if !d.NextArg() {
					return s.errf(d, "plan %q: %s: a value is required", name, word)
				}
				n, ok := positive(d.Val())
				if !ok {
					return s.errf(d, "plan %q: %s: %q must be a positive integer", name, word, d.Val())
				}
				lim.Concurrent = n
			case "cost":
				if !d.NextArg() || d.Val() != "max" || !d.NextArg() {
					return s.errf(d, "plan %q: cost: a plan sets the most a request is charged, as cost max <n> (what a request costs is the policy's cost)", name)
				}
				n, ok := positiveAmount(d.Val())
				if !ok {
					return s.errf(d, "plan %q: cost: max %q must be a positive number", name, d.Val())
				}
				lim.MaxCost = n
			default:
				return s.errf(d, "plan %q: unknown %q: a plan line takes rate <N>/<duration>, burst <n> and cost max <n> (or concurrent <n>, or quota <N>)", name, word)
			}
		}
		if *lim == (PlanLimit{}) {
			return s.errf(d, "plan %q: a limit is required, e.g. %s rate 2000/1m burst 200 (or %s concurrent 10, or %s quota 5000)", name, name, name, name)
		}
		pl.Plans[name] = lim
	}
	p.Plan = pl
	return nil
}
