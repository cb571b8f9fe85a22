package ratelimit

import (
	"context"
	"net/http"
	"strconv"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
)

// The operator's view of money policies: inspect, reset and grant answer
// in the policy's unit (micro-dollars for `unit usd`, with the currency
// named, so the CLI prints dollars), a grant takes dollars, and top shows
// what each identity it lists has left, in dollars.

// currency is the currency a policy's amounts are in, for the admin API:
// USD (micro-dollars) for a money policy, none for tokens.
func (u unit) currency() string {
	if u == unitUSD {
		return "USD"
	}
	return ""
}

// grantAmount is what a grant gives back, in the policy's unit: the
// request's amount (dollars for a money policy, as the CLI sends what it
// was given), or its tokens.
func (p *Policy) grantAmount(req adminRequest) (int64, error) {
	if req.Amount == "" {
		if req.Tokens < 1 || req.Tokens > maxJSONInteger {
			return 0, apiError(http.StatusBadRequest, "tokens: %d is not a positive integer", req.Tokens)
		}
		if p.unit == unitUSD {
			return 0, apiError(http.StatusBadRequest, "policy %q counts dollars: give the amount in dollars (\"amount\": \"1.50\"), not tokens", p.Name)
		}
		return req.Tokens, nil
	}
	n, err := p.unit.amount(req.Amount)
	if err != nil {
		return 0, apiError(http.StatusBadRequest, "amount: %v", err)
	}
	return n, nil
}

// amounts writes the state's amounts for a person: dollars ($1.50) for a
// money policy's, integers otherwise.
func (st bucketState) amounts() func(int64) string {
	if st.Currency == "USD" {
		return unitUSD.format
	}
	return func(n int64) string { return strconv.FormatInt(n, 10) }
}

// topBudgets fills in what each identity top lists has left of a money
// policy's budget (one store call each: their buckets may be in different
// Redis Cluster slots); an identity listed truncated, or whose bucket
// cannot be read, has none.
func (a adminAPI) topBudgets(ctx context.Context, def definition, ids []topEntry) {
	if def.policy.unit != unitUSD {
		return
	}
	for i, e := range ids {
		if e.Truncated {
			continue
		}
		st, err := a.bucket(ctx, "inspect", def, adminRequest{Policy: def.policy.Name, Identity: e.Identity})
		if err != nil {
			continue
		}
		limit := st.Burst
		if st.Quota > 0 {
			limit = st.Quota
		}
		ids[i].Left, ids[i].Limit = price.FormatUSD(max(st.Tokens, 0)), price.FormatUSD(limit)
	}
}

// unitsOf writes an amount granted for a person: "$1.50", or "5 tokens"
// (of the word given).
func unitsOf(st bucketState, n int64, word string) string {
	if st.Currency == "USD" {
		return unitUSD.format(n)
	}
	return strconv.FormatInt(n, 10) + " " + word
}
