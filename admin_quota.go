package ratelimit

import (
	"context"

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
