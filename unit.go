package ratelimit

import (
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
)

// A policy's unit: what its rate, burst, quota, cost, max and debt count.
// Tokens by default; under `unit usd`, dollars (up to 6 decimals), which
// the policy keeps as integer micro-dollars: a money budget is a token
// bucket whose token is a micro-dollar, so the script, what Redis holds
// and the decision are the same as for any token bucket, every value below
// 2^53. Prices (prices.go) turn an LLM request's tokens into micro-dollars.

// unit is a policy's unit.
type unit int8

const (
	unitTokens unit = iota
	unitUSD
)

// The names of the units, in the config.
const (
	unitTokensName = "tokens"
	unitUSDName    = "usd"
)

// parseUnit reads a policy's `unit`.
func parseUnit(s string) (unit, error) {
	switch s {
	case "", unitTokensName:
		return unitTokens, nil
	case unitUSDName:
		return unitUSD, nil
	}
	return unitTokens, fieldErr("unit", "unit: %q is not tokens or usd", s)
}

// amount reads a whole amount of the unit written as text (the N of a rate
// or a quota, a fixed cost): a positive integer of tokens, or dollars with
// up to 6 decimals, as micro-dollars; at least 1 (a micro-dollar), at most
// 2^53.
func (u unit) amount(s string) (int64, error) {
	if u == unitUSD {
		v, err := price.ParseUSD(s)
		if err == nil && v < 1 {
			err = fmt.Errorf("%q: must be more than 0 dollars", s)
		}
		return v, err
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 1 || n > maxJSONInteger || strings.HasPrefix(s, "+") {
		return 0, fmt.Errorf("%q must be an integer from 1 to %d", s, int64(maxJSONInteger))
	}
	return n, nil
}

// count reads a number field of the config (burst, max_cost, settle's max
// and debt) in the unit: 0 is the field's default; otherwise a whole
// number of tokens, or dollars with up to 6 decimals. Its error says what
// is wrong with the value, for the caller to name the field.
func (u unit) count(v float64) (int64, error) {
	if v == 0 {
		return 0, nil
	}
	text := strconv.FormatFloat(v, 'f', -1, 64)
	if math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
		if u == unitUSD {
			return 0, fmt.Errorf("%s must be more than 0 dollars", text)
		}
		return 0, fmt.Errorf("%s must be at least 1", text)
	}
	if u == unitUSD {
		n, err := price.ParseUSD(text)
		switch {
		case err != nil:
			return 0, err
		case n < 1:
			return 0, fmt.Errorf("%s must be at least 0.000001 dollars", text)
		}
		return n, nil
	}
	if v != math.Trunc(v) || v > maxJSONInteger {
		return 0, fmt.Errorf("%s must be a whole number of tokens from 1 to %d", text, int64(maxJSONInteger))
	}
	return int64(v), nil
}

// quantity writes an amount of the unit with its unit, for messages: 100
// tokens, $1.50.
func (u unit) quantity(n int64) string {
	if u == unitUSD {
		return u.format(n)
	}
	return strconv.FormatInt(n, 10) + " tokens"
}

// format writes an amount of the unit for people: tokens as an integer,
// micro-dollars as dollars ($1.50).
func (u unit) format(n int64) string {
	if u == unitUSD {
		if n < 0 {
			return "-$" + price.FormatUSD(-n)
		}
		return "$" + price.FormatUSD(n)
	}
	return strconv.FormatInt(n, 10)
}

// number writes an amount of the unit as the config does: tokens as an
// integer, micro-dollars as dollars (1.50), without the sign.
func (u unit) number(n int64) string {
	if u == unitUSD {
		return price.FormatUSD(n)
	}
	return strconv.FormatInt(n, 10)
}

// String names the unit as the config does.
func (u unit) String() string {
	if u == unitUSD {
		return unitUSDName
	}
	return unitTokensName
}

// fieldUnit is the quota unit (qu) of the RateLimit fields of a policy in
// the unit: none for tokens (the fields say q tokens, as before), and
// micro-dollars for usd, the integer unit the fields need.
func (u unit) fieldUnit() string {
	if u == unitUSD {
		return "usd-micros"
	}
	return ""
}

// exactInterval is the µs per micro-dollar of a money rate of n µ$ per
// per: a whole number, or an error saying which rates near it are exact.
// A token rate's interval is rounded (one token in a bucket of tokens is
// worth little); a micro-dollar's would round a rate of $1,000 an hour (3.6
// µs per µ$) to 3 µs, a fifth more than the budget.
func exactInterval(text string, n int64, perUS int64) (int64, error) {
	if perUS%n == 0 {
		return perUS / n, nil
	}
	if perUS < n {
		return 0, fmt.Errorf("%q is more than a dollar a second, the most a money rate refills: use a quota, or a longer duration", text)
	}
	// The exact rates nearest: perUS / k micro-dollars, for the whole k
	// nearest perUS/n that divide perUS into whole micro-dollars.
	x := perUS / n
	var below, above int64
	for k := x + 1; k <= 2*x+1 && k < x+1_000_000; k++ {
		if perUS%k == 0 {
			below = perUS / k
			break
		}
	}
	for k := x; k >= 1 && k > x-1_000_000; k-- {
		if perUS%k == 0 {
			above = perUS / k
			break
		}
	}
	msg := fmt.Sprintf("%q does not refill a whole micro-dollar every whole microsecond (%.4g µs), so it could not be kept exactly", text, float64(perUS)/float64(n))
	var near []string
	for _, v := range []int64{below, above} {
		if v > 0 {
			near = append(near, "$"+price.FormatUSD(v))
		}
	}
	if len(near) > 0 {
		msg += "; the nearest exact amounts for this duration are " + strings.Join(near, " and ")
	}
	return 0, fmt.Errorf("%s, or use a quota (quota <dollars>/day or /month) for a calendar budget", msg)
}
