package ratelimit

import (
	"context"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"go.uber.org/zap"
)

// The operator's handles on a quota (admin.go): inspect shows the units
// used in the current period, the quota and the period's bounds; reset
// zeroes the period's count; grant gives units back (never below 0 used).
// Like a rate bucket's, they run through the policy's store, script and
// clock, and reset and grant are announced to every instance.

// quota inspects, resets or grants units back to one quota's count.
func (adminAPI) quota(ctx context.Context, action string, def definition, req adminRequest, key string) (*bucketState, error) {
	p, h := def.policy, def.handler
	// A grant reads the count and gives units back in one decision, as a
	// rate bucket's grant does: the first request says what it found.
	inspect := bucketRequest{key: key, limit: p.limit, op: opInspect, quota: p.quota}
	p.markOverridable(&inspect, true) // shows the override in force
	reqs := []bucketRequest{inspect}
	switch action {
	case "reset":
		reqs[0].op = opReset
	case "grant":
		tokens, err := p.grantAmount(req) // admin_money.go
		if err != nil {
			return nil, err
		}
		grant := inspect
		grant.op, grant.delta = opAdjust, -tokens
		reqs = append(reqs, grant)
	}
	d, err := h.store.decide(ctx, reqs)
	if err != nil {
		return nil, storeAPIError(err)
	}
	v := d.verdicts[len(reqs)-1]
	n := v.limit.burst // the plan's N, or an override's
	used := n - v.remaining
	text := v.period.Text(p.quota.loc)
	st := &bucketState{
		Policy: p.Name, Kind: p.kindName(), Identity: req.Identity, Key: key, Store: h.storeName(),
		Tokens: v.remaining, Quota: n, Unit: p.quota.unit.String(), Used: &used, Period: &text,
		Plan: p.planLabel(), Currency: p.unit.currency(),
	}
	showOverride(ctx, h, key, v, st)
	if action == "inspect" {
		return st, nil
	}
	var granted int64
	if action == "grant" {
		granted = v.remaining - d.verdicts[0].remaining
		st.Granted = &granted
	}
	announced := true
	if a, ok := h.store.(announcer); ok {
		if err := a.announce(ctx, h.keyPrefix, key); err != nil {
			announced = false
			h.logger.Warn("announcing a rate-limit change", zap.String("policy", p.Name), zap.String("key", key), zap.Error(err))
		}
	}
	st.Announced = &announced
	h.logger.Info("rate limit quota "+action, zap.String("policy", p.Name), zap.String("key", key), zap.Int64("used", used),
		zap.Int64("granted", granted), zap.String("period_end", text.End))
	return st, nil
}

// printQuota writes an admin API answer about a quota for a person.
func printQuota(w io.Writer, action string, st bucketState) error {
	var used int64
	if st.Used != nil {
		used = *st.Used
	}
	var p calendar.PeriodText
	if st.Period != nil {
		p = *st.Period
	}
	n := st.amounts() // dollars for a money policy
	switch action {
	case "reset":
		fmt.Fprintf(w, "%s %q: reset; %s of %s used in the period that ends %s.\n", st.Policy, st.Identity, n(used), n(st.Quota), p.EndZone)
	case "grant":
		var granted int64
		if st.Granted != nil {
			granted = *st.Granted
		}
		fmt.Fprintf(w, "%s %q: granted %s; %s of %s used now, in the period that ends %s.\n", st.Policy, st.Identity, unitsOf(st, granted, "units"), n(used), n(st.Quota), p.EndZone)
	default:
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "policy\t%s (%s: %s per %s, %s)\n", st.Policy, st.Kind, n(st.Quota), st.Unit, p.Zone)
		fmt.Fprintf(tw, "identity\t%q\n", st.Identity)
		fmt.Fprintf(tw, "key\t%s\n", st.Key)
		fmt.Fprintf(tw, "store\t%s\n", st.Store)
		fmt.Fprintf(tw, "used\t%s of %s; %s left\n", n(used), n(st.Quota), n(max(st.Tokens, 0)))
		fmt.Fprintf(tw, "period\t%s to %s (%s to %s)\n", p.StartZone, p.EndZone, p.Start, p.End)
		printPlanAndOverride(tw, st) // command_override.go
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if st.Announced != nil && !*st.Announced {
		fmt.Fprintln(w, "Other instances may take up to a second to see it (the announcement through Redis was not confirmed).")
	}
	return nil
}
