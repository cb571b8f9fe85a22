package hotkey

import (
	"math"
	"testing"
)

func TestEstimator(t *testing.T) {
	for _, tc := range []struct {
		name      string
		every     int64 // µs between decisions
		amount    int64
		for_      int64 // µs of decisions
		at        int64 // read at (after the start)
		decisions float64
	}{
		{"1,000 a second, steady", 1_000, 1, 1_000_000, 1_000_000, 1_000},
		{"5,000 a second of cost 3", 200, 3, 500_000, 500_000, 5_000},
		{"stopped for two windows: 0", 1_000, 1, 500_000, 500_000 + 2*Window, 0},
		{"stopped half a window ago: half the rate", 1_000, 1, 500_000, 500_000 + Window/2, 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var e Estimator
			for at := int64(0); at < tc.for_; at += tc.every {
				e.Add(tc.amount, at)
			}
			decisions, amount := e.Rate(tc.at)
			if math.Abs(decisions-tc.decisions) > 0.03*tc.decisions+1 {
				t.Errorf("%.1f decisions/s, want %.1f", decisions, tc.decisions)
			}
			if math.Abs(amount-float64(tc.amount)*tc.decisions) > 0.03*float64(tc.amount)*tc.decisions+1 {
				t.Errorf("amount %.1f/s, want %.1f", amount, float64(tc.amount)*tc.decisions)
			}
		})
	}
}

// TestRatesBounded: however many keys are observed, the table stays its
// size; a busy key keeps its entry while idle ones come and go, and one
// marked contended keeps its mark.
func TestRatesBounded(t *testing.T) {
	var r Rates
	const hot = uint64(12345)
	now := int64(0)
	for i := range 200_000 {
		now += 20
		r.Observe(uint64(i)*2654435761+1, 1, now) // a crowd of one-off keys
		if i%10 == 0 {
			r.Observe(hot, 1, now) // 5,000 a second
		}
	}
	est, _, tracked := r.Observe(hot, 1, now)
	decisions, _ := est.Rate(now)
	if !tracked || math.Abs(decisions-5_000) > 300 {
		t.Errorf("the busy key reads %.0f/s among the crowd, want about 5,000", decisions)
	}
	r.Contend(hot, now+1_000_000, now)
	if _, contended, _ := r.Observe(hot, 1, now+1); !contended {
		t.Error("a contended key does not read contended")
	}
	if _, contended, _ := r.Observe(hot, 1, now+2_000_000); contended {
		t.Error("a contended mark outlived its time")
	}
}
