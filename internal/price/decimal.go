package price

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
)

// Decimal amounts, exactly: a price or a dollar amount is written as a
// decimal (2.50, 0.075, 2.5e-06) and kept as an integer count of a small
// unit, with no float in between, so that what the script in Redis and
// what Go compute agree to the unit.

// MaxAmount bounds every amount kept: below 2^53, where a double (a Lua
// number, a JSON number) holds every integer exactly.
const MaxAmount = 1 << 53

// Micro is the micro-dollars of one dollar: money budgets count in
// micro-dollars (µ$).
const Micro = 1_000_000

// errNotDecimal is the error of a text that is not a decimal number.
var errNotDecimal = errors.New("not a number")

// scaled is the non-negative decimal s (digits, an optional fraction and an
// optional exponent, as JSON writes numbers) times 10^shift, as an integer
// of at most limit: exact reports whether no non-zero digit was dropped
// (the value is then rounded down). A sign, a value above limit or a text
// that is not such a number is an error.
func scaled(s string, shift int, limit int64) (v int64, exact bool, err error) {
	if strings.HasPrefix(s, "-") {
		v, exact, err := scaled(s[1:], shift, limit)
		switch {
		case err == nil && v == 0 && exact: // -0
			return 0, true, nil
		case err == nil || errors.Is(err, errTooLarge):
			return 0, false, errNegative
		}
		return 0, false, err
	}
	mant, exp := s, 0
	if i := strings.IndexAny(s, "eE"); i >= 0 {
		mant = s[:i]
		e := s[i+1:]
		e = strings.TrimPrefix(e, "+")
		n, err := strconv.Atoi(e)
		if err != nil || e == "" || e[0] == '+' || n < -400 || n > 400 {
			return 0, false, errNotDecimal
		}
		exp = n
	}
	whole, frac, _ := strings.Cut(mant, ".")
	if whole == "" && frac == "" {
		return 0, false, errNotDecimal
	}
	digits := whole + frac
	if digits == "" || strings.Trim(digits, "0123456789") != "" {
		return 0, false, errNotDecimal
	}
	digits = strings.TrimLeft(digits, "0")
	// value = digits × 10^k
	k := exp - len(frac) + shift
	exact = true
	if k < 0 {
		drop := min(-k, len(digits))
		if strings.Trim(digits[len(digits)-drop:], "0") != "" {
			exact = false
		}
		digits, k = digits[:len(digits)-drop], 0
	}
	if digits == "" {
		return 0, exact, nil
	}
	if len(digits)+k > 19 {
		return 0, false, errTooLarge
	}
	u, err := strconv.ParseUint(digits, 10, 64)
	if err != nil {
		return 0, false, errTooLarge
	}
	for ; k > 0; k-- {
		if u > math.MaxUint64/10 {
			return 0, false, errTooLarge
		}
		u *= 10
	}
	if u > uint64(limit) {
		return 0, false, errTooLarge
	}
	return int64(u), exact, nil
}

var (
	errNegative = errors.New("is negative")
	errTooLarge = errors.New("is too large")
)

// ParseUSD reads an amount of dollars with up to 6 decimals, e.g. 5,
// 1.50 or 0.000001, as micro-dollars: exactly, from 0 to MaxAmount µ$
// (about nine billion dollars).
func ParseUSD(s string) (int64, error) {
	v, exact, err := scaled(s, 6, MaxAmount)
	switch {
	case errors.Is(err, errNegative):
		return 0, fmt.Errorf("%q is negative", s)
	case errors.Is(err, errTooLarge):
		return 0, fmt.Errorf("%q is more than $%s", s, FormatUSD(MaxAmount))
	case err != nil:
		return 0, fmt.Errorf("%q is not an amount of dollars such as 5 or 1.50", s)
	case !exact:
		return 0, fmt.Errorf("%q has more than 6 decimal places (a micro-dollar)", s)
	}
	return v, nil
}

// ParseUSDUp reads an amount of dollars as micro-dollars, rounded up: a
// cost an upstream reports (0.000123456, 1.2e-05), which may be more
// precise than a micro-dollar. Non-negative, at most MaxAmount µ$.
func ParseUSDUp(s string) (int64, error) {
	v, exact, err := scaled(s, 6, MaxAmount)
	if err != nil {
		return 0, fmt.Errorf("%q is not an amount of dollars", s)
	}
	if !exact {
		v++
	}
	return v, nil
}

// FormatUSD writes micro-dollars as dollars: 1500000 is 1.50, 1234567 is
// 1.234567, 100 is 0.0001 (two decimals at least, no trailing zeros
// beyond). A negative amount (a debt) keeps its sign.
func FormatUSD(micros int64) string {
	neg := micros < 0
	u := uint64(micros)
	if neg {
		u = -u
	}
	s := strconv.FormatUint(u/Micro, 10) + "." + fmt.Sprintf("%06d", u%Micro)
	s = strings.TrimRight(s, "0")
	if i := strings.IndexByte(s, '.'); len(s)-i-1 < 2 {
		s += strings.Repeat("0", 2-(len(s)-i-1))
	}
	if neg {
		return "-" + s
	}
	return s
}
