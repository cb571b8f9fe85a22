package ratelimit

import (
	"math"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// TestBoundaryRetryAfter: a quota's denial is never sent back before its
// boundary, and the spread past it is jitter of the period, at most an hour.
func TestBoundaryRetryAfter(t *testing.T) {
	minute := calendar.Period{Start: 0, End: 60 * sec}
	month := calendar.Period{Start: 0, End: 31 * 86400 * sec}
	for _, c := range []struct {
		name     string
		p        calendar.Period
		jitter   float64
		wait     int64
		min, max int64 // seconds
	}{
		{"a minute, 10.2 s left, 20%", minute, 0.2, 10_200_000, 11, 11 + 12},
		{"a minute, 1 µs left, 20%", minute, 0.2, 1, 1, 1 + 12},
		{"a minute, jitter 0", minute, 0, 10_200_000, 11, 11},
		{"a month, 20 days left, 20%: at most an hour past", month, 0.2, 20 * 86400 * sec, 20 * 86400, 20*86400 + 3600},
		{"a month, 1000%", month, 10, 5 * sec, 5, 5 + 3600},
	} {
		spread := boundarySpread(c.p, c.jitter)
		var lo, hi int64 = math.MaxInt64, 0
		for range 2000 {
			ra := boundaryRetryAfter(c.wait, spread)
			lo, hi = min(lo, ra), max(hi, ra)
		}
		if lo < c.min || hi > c.max || c.max > c.min && hi-lo < (c.max-c.min)/2 {
			t.Errorf("%s: Retry-After from %d to %d s over 2000 denials, want within [%d, %d] and spread", c.name, lo, hi, c.min, c.max)
		}
	}
}
