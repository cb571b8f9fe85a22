package ratelimit

import (
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// The configuration of quota policies: `quota N/<period>`, `timezone`,
// `durable`, checked as a rate policy's fields are (Policy.check), in the
// Caddyfile and in JSON alike.

// Durable is what a quota's admissions wait for before they count.
type Durable struct {
	// The replicas that must have the usage (Redis WAIT) before the request
	// is admitted: at least 1.
	Replicas int `json:"replicas,omitempty"`

	// Waits for the primary's append-only file to be written to disk (Redis
	// WAITAOF, Redis 7.2 and later; with `replicas`, the replicas' too).
	// Redis needs `appendonly yes`.
	AOF bool `json:"aof,omitempty"`
}

// maxReplicas bounds durable replicas: beyond any deployment.
const maxReplicas = 1000

// parseQuota parses `N/<period>`, N tokens.
func parseQuota(s string) (n int64, unit calendar.Unit, err error) { return unitTokens.parseQuota(s) }

// parseQuota parses `N/<period>`, N in the unit.
func (u unit) parseQuota(s string) (n int64, unit calendar.Unit, err error) {
	num, name, ok := strings.Cut(s, "/")
	if !ok {
		if u == unitUSD {
			return 0, 0, fmt.Errorf("%q is not <dollars>/<minute|hour|day|week|month|year>, e.g. 500/month", s)
		}
		return 0, 0, fmt.Errorf("%q is not N/<minute|hour|day|week|month|year>, e.g. 1000000/month", s)
	}
	if u == unitUSD {
		if n, err = u.amount(num); err != nil {
			return 0, 0, fmt.Errorf("%q: %v", s, err)
		}
	} else if n, err = strconv.ParseInt(num, 10, 64); err != nil || n < 1 || n > maxJSONInteger || strings.HasPrefix(num, "+") {
		return 0, 0, fmt.Errorf("%q: N must be an integer from 1 to %d", s, int64(maxJSONInteger))
	}
	if unit, err = calendar.ParseUnit(name); err != nil {
		if hint := periodHint(num, name); hint != "" {
			return 0, 0, fmt.Errorf("%q: %v; %s", s, err, hint)
		}
		return 0, 0, fmt.Errorf("%q: %v", s, err)
	}
	return n, unit, nil
}

// checkQuota checks a quota policy and derives its bucket: a limit of N
// units (burst) with the room a settle has beyond it (slack), and its
// calendar.
func (p *Policy) checkQuota() error {
	switch {
	case p.Quota == "" && p.Timezone != "":
		return fieldErr("timezone", "timezone: only a quota policy has a calendar (quota N/<period>)")
	case p.Quota == "":
		return fieldErr("durable", "durable: only a quota policy's usage is made durable (quota N/<period>)")
	case p.Rate != "":
		return fieldErr("rate", "rate: a policy is a rate or a quota, not both: give each its own policy (a request matching both is decided by both at once)")
	case p.Concurrent != 0 || p.Lease != 0:
		return fieldErr("concurrent", "concurrent: a policy is a quota or concurrent, not both: give each its own policy")
	case p.Burst != 0:
		return fieldErr("burst", "burst: a quota has no burst (its N is what a period holds): pair it with a rate policy to bound bursts")
	case p.Wait != 0:
		return fieldErr("wait", "wait: a quota frees units only at its period's end: there is no slot to wait for")
	}
	n, unit, err := p.unit.parseQuota(p.Quota)
	if err != nil {
		return fieldErr("quota", "quota: %v", err)
	}
	loc, err := calendar.ParseZone(p.Timezone)
	if err != nil {
		return fieldErr("timezone", "timezone: %v", err)
	}
	var d durability
	if p.Durable != nil {
		switch {
		case p.Durable.Replicas < 0 || p.Durable.Replicas > maxReplicas:
			return fieldErr("durable", "durable: replicas %d must be from 1 to %d", p.Durable.Replicas, maxReplicas)
		case p.Durable.Replicas == 0 && !p.Durable.AOF:
			return fieldErr("durable", "durable: replicas <n> (at least 1) or aof is required")
		}
		d = durability{replicas: p.Durable.Replicas, aof: p.Durable.AOF}
	}
	p.after.debt, p.after.maxUsage = 0, 0
	switch {
	case p.ChargeIf != nil && p.Settle != nil:
		return fieldErr("settle", "charge_if and settle exclude each other: charge_if charges the cost of matching responses, settle the usage of every response")
	case p.Settle != nil:
		if err = p.Settle.check(p.unit); err != nil {
			return err
		}
		// Counts stay below 2^53.
		if p.after.maxUsage, p.after.debt, err = p.Settle.settleLimits(n, 0, maxJSONInteger-n); err != nil {
			return err
		}
	}
	if err := p.checkCost(n, "quota"); err != nil {
		return err
	}
	if p.OnError != "" && !validOnError(p.OnError) {
		return fieldErr("on_error", "on_error: %q is not fail_open, fail_closed or local", p.OnError)
	}
	p.rate.n, p.rate.per, p.held.wait = 0, 0, 0
	p.limit = limit{burst: n, slack: p.after.debt}
	p.quota = &quotaSpec{periods: calendar.New(unit, loc), unit: unit, loc: loc, durable: d, name: p.Name, counts: p.unit, used: quotaUsed.WithLabelValues(p.Name)}
	p.keyTmpl, p.costs.tmpl = newTemplate(p.Key), newTemplate("")
	if !p.costs.fromBody {
		p.costs.tmpl = newTemplate(string(p.Cost))
	}
	return p.checkPlans()
}

// quotaOf reads the N of a plan's or an override's quota on a checked quota
// policy: `N`, or `N/<unit>` with the policy's own unit. The period and the
// timezone are the policy's (one count per key and period, whatever the
// plan), so another unit is a mistake, not a conversion: 5000/day on a
// monthly quota would have to become a daily one.
func (p *Policy) quotaOf(s string) (int64, error) {
	if !strings.Contains(s, "/") {
		if p.unit == unitUSD {
			n, err := p.unit.amount(s)
			if err != nil {
				return 0, fmt.Errorf("quota: %v", err)
			}
			return n, nil
		}
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil || n < 1 || n > maxJSONInteger || strings.HasPrefix(s, "+") {
			return 0, fmt.Errorf("quota: %q: N must be an integer from 1 to %d", s, int64(maxJSONInteger))
		}
		return n, nil
	}
	n, unit, err := p.unit.parseQuota(s)
	if err != nil {
		return 0, fmt.Errorf("quota: %v", err)
	}
	if unit != p.quota.unit {
		return 0, fmt.Errorf("quota: %q: the period is the policy's (quota %s, timezone %s): a plan or an override sets N only, as quota %s or quota %s/%s",
			s, p.Quota, p.quota.loc, p.unit.number(n), p.unit.number(n), p.quota.unit)
	}
	return n, nil
}

// quotaWith is the policy's quota with n in place of its N: the same unit.
func (p *Policy) quotaWith(n int64) string {
	return p.unit.number(n) + "/" + p.quota.unit.String()
}

// unmarshalDurable reads `durable replicas <n> [aof]` or `durable aof
// [replicas <n>]`.
func (s *section) unmarshalDurable(d *caddyfile.Dispenser, p *Policy) error {
	args := d.RemainingArgs()
	dur := new(Durable)
	for len(args) > 0 {
		switch args[0] {
		case "replicas":
			if len(args) < 2 {
				return s.errf(d, "durable: replicas: a number of replicas is required, e.g. durable replicas 1")
			}
			n, err := strconv.Atoi(args[1])
			if err != nil || n < 1 || strings.HasPrefix(args[1], "+") {
				return s.errf(d, "durable: replicas %q must be a positive integer", args[1])
			}
			dur.Replicas, args = n, args[2:]
		case "aof":
			dur.AOF, args = true, args[1:]
		default:
			return s.errf(d, "durable: unknown option %q: expected durable replicas <n> and/or aof", args[0])
		}
	}
	if dur.Replicas == 0 && !dur.AOF {
		return s.errf(d, "durable: expected durable replicas <n> and/or aof")
	}
	p.Durable, p.durableLine = dur, &sourceLine{file: d.File(), line: d.Line()}
	return nil
}

// checkDurableStore fails a durable quota without a redis block: an
// in-process count lives and dies with the process, and nothing could
// confirm it.
func (h *Handler) checkDurableStore() error {
	if h.Redis != nil {
		return nil
	}
	for _, p := range h.Policies {
		if p == nil || p.Durable == nil {
			continue
		}
		msg := fmt.Sprintf("policy %q: durable: needs a redis block (in-process usage lives and dies with the process: nothing can confirm it)", p.Name)
		if p.durableLine != nil {
			return fmt.Errorf("%s, at %s:%d", msg, p.durableLine.file, p.durableLine.line)
		}
		return errors.New(msg)
	}
	return nil
}

// quotaKind names a quota policy's kind, as Policy.kind names the others'.
func (p *Policy) quotaKind() string {
	switch {
	case p.ChargeIf != nil:
		return "quota, charged if the response matches"
	case p.Settle != nil:
		return "quota, " + p.Settle.shape()
	}
	return "quota"
}
