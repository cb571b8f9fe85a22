package ratelimit

import (
	"fmt"
	"slices"
	"sync"
	"time"
)

// A policy's buckets are named by key prefix and policy name, so the same
// name in two handlers (two sites, two routes) is one budget, on purpose.
// budgets keeps, for each loaded config, the policies by name: two
// definitions of one name must agree on what makes the budget (its rate,
// burst, key, kind and store), or the config fails to load; the admin API
// finds a policy by its name here.
var budgets = budgetBook{configs: map[any]map[string][]definition{}}

type budgetBook struct {
	mu      sync.Mutex
	configs map[any]map[string][]definition // by config (see Provision), then name
	order   []any                           // configs, the latest last
}

// definition is one handler's policy of a name.
type definition struct {
	policy  *Policy
	handler *Handler
}

// budgetShape is what two definitions of one policy name must share: its
// limit, its key and its store.
func (d definition) budgetShape() string {
	return d.policy.limitShape() + ", key " + d.policy.keyShape() + ", store " + d.handler.storeName()
}

// limitShape is the policy's kind and limit, as its config says it: what
// instances sharing its buckets must agree on besides the key (see
// fleet.go).
func (p *Policy) limitShape() string { return p.limitShapeOf(false) }

// limitShapeOf is limitShape, or with previous as the release before this
// one (v0.4.0) wrote it (planShapeOf).
func (p *Policy) limitShapeOf(previous bool) string {
	switch p.kind {
	case kindQuota:
		return fmt.Sprintf("kind %s, quota %s, timezone %s", p.kindName(), p.Quota, p.quota.loc) + p.unitShape() + p.planShapeOf(previous)
	case kindShed:
		return fmt.Sprintf("kind %s, %s", p.kindName(), p.shedShape())
	case kindConcurrent:
		return fmt.Sprintf("kind %s, %d slots, lease %s", p.kindName(), p.Concurrent, time.Duration(p.limit.interval)*time.Microsecond) + p.planShapeOf(previous)
	}
	return fmt.Sprintf("kind %s, rate %s, burst %d", p.kindName(), p.Rate, p.limit.burst) + p.unitShape() + p.planShapeOf(previous)
}

// unitShape is a money policy's unit, in its shape (a token policy's shape
// says none, as before money).
func (p *Policy) unitShape() string {
	if p.unit == unitUSD {
		return ", unit usd"
	}
	return ""
}

// keyShape is the policy's key template, with the mask of a client
// address in it: another mask makes other buckets.
func (p *Policy) keyShape() string {
	if p.keyTmpl.usesAddr() {
		return p.Key + " (" + p.addrMask.String() + ")"
	}
	return p.Key
}

// kindName names the policy's kind as operators read it: for a rate, how it is charged.
func (p *Policy) kindName() string {
	switch {
	case p.kind == kindQuota:
		return p.quotaKind()
	case p.kind != kindRate:
		return p.kind.String()
	case p.charging() == chargedIfMatched:
		return "rate, charged if the response matches"
	case p.charging() == chargedBySettle:
		return "rate, " + p.Settle.shape()
	}
	return "rate"
}

// add records the handler's policies under config, failing (and recording
// nothing) when one disagrees with a definition of the same name.
func (b *budgetBook) add(config any, h *Handler) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	byName := b.configs[config]
	for _, p := range h.Policies {
		if defs := byName[p.Name]; len(defs) > 0 {
			mine, theirs := definition{p, h}.budgetShape(), defs[0].budgetShape()
			if mine != theirs {
				return fmt.Errorf("policy %q: defined differently by two rate_limit handlers of this config: %s in one, %s in the other; "+
					"a policy name is one budget (its buckets are named by it): give one of them another name", p.Name, mine, theirs)
			}
		}
	}
	if byName == nil {
		byName = map[string][]definition{}
		b.configs[config] = byName
		b.order = append(b.order, config)
	}
	for _, p := range h.Policies {
		byName[p.Name] = append(byName[p.Name], definition{p, h})
	}
	return nil
}

// remove forgets the handler's policies under config.
func (b *budgetBook) remove(config any, h *Handler) {
	b.mu.Lock()
	defer b.mu.Unlock()
	byName := b.configs[config]
	for name, defs := range byName {
		defs = slices.DeleteFunc(defs, func(d definition) bool { return d.handler == h })
		if len(defs) == 0 {
			delete(byName, name)
		} else {
			byName[name] = defs
		}
	}
	if len(byName) == 0 {
		delete(b.configs, config)
		b.order = slices.DeleteFunc(b.order, func(c any) bool { return c == config })
	}
}

// find returns a definition of the named policy in the config loaded last
// that has one.
func (b *budgetBook) find(name string) (definition, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for i := len(b.order) - 1; i >= 0; i-- {
		if defs := b.configs[b.order[i]][name]; len(defs) > 0 {
			return defs[0], true
		}
	}
	return definition{}, false
}

// policies returns the policies of the config loaded last, one per name
// (a name is one policy).
func (b *budgetBook) policies() []*Policy {
	var ps []*Policy
	for _, h := range b.handlers() {
		for _, p := range h.Policies {
			if !slices.ContainsFunc(ps, func(q *Policy) bool { return q.Name == p.Name }) {
				ps = append(ps, p)
			}
		}
	}
	return ps
}

// handlers returns the handlers of the config loaded last.
func (b *budgetBook) handlers() []*Handler {
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.order) == 0 {
		return nil
	}
	var hs []*Handler
	for _, defs := range b.configs[b.order[len(b.order)-1]] {
		for _, d := range defs {
			if !slices.Contains(hs, d.handler) {
				hs = append(hs, d.handler)
			}
		}
	}
	return hs
}
