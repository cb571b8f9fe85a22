package ratelimit

import (
	"context"
	"net/http"
)

// The operator's handles on a shed policy (admin.go): inspect shows its
// fleet-wide slots in use and this instance's adaptive limit; reset drops
// its stale leases.

// shed inspects (or resets) a shed policy: its fleet-wide slots in use,
// and this instance's adaptive limit and requests in flight under it. A
// reset drops stale leases, as for a concurrent policy; the adaptive limit
// is learned, not reset.
func (a adminAPI) shed(ctx context.Context, action string, def definition, req adminRequest, key string) (*bucketState, error) {
	p, h := def.policy, def.handler
	if action == "grant" {
		return nil, apiError(http.StatusBadRequest, "policy %q sheds load: it has capacity, not tokens, to grant", p.Name)
	}
	st := &bucketState{Policy: p.Name, Kind: p.kindName(), Identity: req.Identity, Key: key, Store: h.storeName()}
	if p.capacity().has(slotCapacity) {
		var err error
		if st, err = a.slots(ctx, action, def, req, key); err != nil {
			return nil, err
		}
	}
	if p.capacity().has(adaptiveCapacity) {
		limit, in := p.shed.limiter.Limit(), p.shed.limiter.InFlight()
		st.ShedLimit, st.ShedInFlight = &limit, &in
	}
	return st, nil
}
