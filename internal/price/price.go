// Package price prices LLM usage in money: a table of models' prices
// (USD per million tokens, in lines or from a price list in LiteLLM's
// JSON format), the model a request or a response names matched to it,
// and dollar amounts kept exactly as integers (decimal.go).
//
// A price is kept in pico-dollars per token (10^-12 USD: a millionth of a
// micro-dollar), so a usage priced in micro-dollars is tokens × price /
// 10^6, rounded up: the same arithmetic, in the same units, as the weights
// of a token budget (internal/llm's Weights, in millionths). A price of
// USD 2.50 per million tokens is 2,500,000 pico-dollars a token.
package price

import (
	"errors"
	"fmt"
	"strings"
)

// Price is what one model's tokens cost, in pico-dollars a token: prompt
// tokens (input), answer tokens (output), prompt tokens written to the
// provider's cache and prompt tokens read from it.
type Price struct{ Input, Output, CacheWrite, CacheRead int64 }

// MaxPrice bounds a price: a dollar a token (a million dollars per million
// tokens), far above any model's, so that usage × price stays in range.
const MaxPrice = 1_000_000_000_000

// maxModelName is the longest model name priced: a longer one is no
// model's.
const maxModelName = 256

// ParsePerMillion reads a price in USD per million tokens with up to 6
// decimals (2.50, 0.075) as pico-dollars a token, exactly.
func ParsePerMillion(s string) (int64, error) {
	v, exact, err := scaled(s, 6, MaxPrice)
	switch {
	case errors.Is(err, errNegative):
		return 0, fmt.Errorf("%q is negative", s)
	case errors.Is(err, errTooLarge):
		return 0, fmt.Errorf("%q is more than %s per million tokens", s, FormatPerMillion(MaxPrice))
	case err != nil:
		return 0, fmt.Errorf("%q is not a price in USD per million tokens such as 2.50", s)
	case !exact:
		return 0, fmt.Errorf("%q has more than 6 decimal places", s)
	}
	return v, nil
}

// FormatPerMillion writes a price in pico-dollars a token as USD per
// million tokens: 2500000 is 2.5.
func FormatPerMillion(pico int64) string {
	s := FormatUSD(pico)
	s = strings.TrimRight(s, "0")
	return strings.TrimSuffix(s, ".")
}

// Table is the prices of the models a gateway serves, by name: what a
// request's or a response's model is priced at.
type Table struct {
	models map[string]Price
	// unknown is the listed model a model the table lacks is priced as;
	// empty: such a model has no price (refused).
	unknown string
}

// NewTable is the table of models, where a model the table lacks is priced
// as unknown (a listed model), or has no price (unknown empty).
func NewTable(models map[string]Price, unknown string) (*Table, error) {
	t := &Table{models: models}
	if unknown != "" {
		name, _, ok := t.Lookup(unknown)
		if !ok {
			return nil, fmt.Errorf("unknown %s: that model has no price: list it, or use unknown deny", unknown)
		}
		t.unknown = name
	}
	return t, nil
}

// Len is the number of models listed.
func (t *Table) Len() int { return len(t.models) }

// Lookup finds a model's price: by its exact name, else by the longest
// listed name that the model's name starts with followed by '-', ':' or
// '@', so that a dated snapshot (gpt-4.1-2025-04-14,
// claude-sonnet-4-5-20250929) or a tagged variant (llama3:8b,
// model@version) is priced as its listed family. It returns the listed
// name the model is priced as, and false when no listed name matches.
func (t *Table) Lookup(model string) (string, Price, bool) {
	if t == nil || model == "" || len(model) > maxModelName {
		return "", Price{}, false
	}
	if p, ok := t.models[model]; ok {
		return model, p, true
	}
	for i := len(model) - 1; i > 0; i-- {
		switch model[i] {
		case '-', ':', '@':
			if p, ok := t.models[model[:i]]; ok {
				return model[:i], p, true
			}
		}
	}
	return "", Price{}, false
}

// Of is the price of a model, the model the table lacks priced as unknown:
// the listed name it is priced as and its price; listed is false when the
// table lacks the model (priced as unknown), ok false when it has no price
// at all (unknown deny).
func (t *Table) Of(model string) (name string, p Price, listed, ok bool) {
	if name, p, ok := t.Lookup(model); ok {
		return name, p, true, true
	}
	if t == nil || t.unknown == "" {
		return "", Price{}, false, false
	}
	return t.unknown, t.models[t.unknown], false, true
}

// Unknown is the listed model a model the table lacks is priced as, or
// empty when such a model is refused.
func (t *Table) Unknown() string { return t.unknown }
