package ratelimit

// policyKind is what a policy limits. It is set once, when the policy's
// config is checked, from the fields the config gives; the request path
// switches on it where the kinds behave differently.
type policyKind uint8

const (
	// kindRate: tokens that refill at a rate (`rate`, `burst`); `charge_if`
	// and `settle` are ways of charging it.
	kindRate policyKind = iota
	// kindConcurrent: requests in flight at once (`concurrent`), each on a
	// slot held on a lease.
	kindConcurrent
	// kindQuota: units per calendar period (`quota`).
	kindQuota
	// kindShed: the service's capacity (`shed`): slots of the fleet
	// (`shed { concurrent }`) and an adaptive limit per instance.
	kindShed
)

func (k policyKind) String() string {
	return [...]string{"rate", "concurrent", "quota", "shed"}[k]
}

// slots reports whether the kind's buckets are concurrency slots.
func (k policyKind) slots() bool { return k == kindConcurrent || k == kindShed }

// caller reports whether the kind is a caller's budget (a denial is 429,
// the RateLimit fields show it), not the service's capacity (shed: 503, no
// fields).
func (k policyKind) caller() bool { return k != kindShed }

// kindOf is the kind the policy's config asks for, by the fields it gives:
// each kind's check then says what else it may not give.
func kindOf(p *Policy) policyKind {
	switch {
	case p.Shed != nil || p.Priority != nil:
		return kindShed
	case p.Quota != "" || p.Timezone != "" || p.Durable != nil:
		return kindQuota
	case p.Concurrent != 0 || p.Lease != 0:
		return kindConcurrent
	}
	return kindRate
}
