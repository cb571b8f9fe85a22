package hotkey

import (
	"math"
	"testing"
)

func TestSize(t *testing.T) {
	for _, tc := range []struct {
		name                  string
		rate                  float64 // tokens/s asked
		interval, burst, line int64
		block, lead           int64
	}{
		{"2,000/s of a 5,000/s burst 500 key", 2_000, 200, 500, 0, 100, 51},
		{"the block capped at a quarter of the burst; the lead makes up", 10_000, 200, 500, 0, 125, 438},
		{"a quiet instance", 1_000, 200, 500, 0, 50, 26},
		{"a trickle: one token, one ahead", 10, 200, 500, 0, 1, 1},
		{"burst 10: too small for blocks", 5_000, 200, 10, 0, 0, 0},
		{"20/s: too slow for blocks", 5_000, 50_000, 1_000, 0, 0, 0},
		{"the lead within half the horizon", 1e7, 1, 1_000_000, 0, 125_000, 250_000},
		{"a line of twice the target: half the rate held", 10_000, 200, 500, 2 * LineTarget, 125, 188},
		{"a line within the target: as if none", 2_000, 200, 500, LineTarget, 100, 51},
	} {
		t.Run(tc.name, func(t *testing.T) {
			block, lead := Size(tc.rate, tc.interval, tc.burst, tc.line)
			if block != tc.block || lead != tc.lead {
				t.Errorf("Size(%.0f, %d, %d) = %d, %d; want %d, %d", tc.rate, tc.interval, tc.burst, block, lead, tc.block, tc.lead)
			}
		})
	}
}

// TestSizeInProportion: over the budget, what an instance admits follows
// what it has in the line on average, lead + block/2 − 1/2 (see Size); that
// follows its rate (within a token), capped block or not, so instances
// admit in proportion to their requests: up to 5 times the key's rate on
// one instance (the lead at half the horizon).
func TestSizeInProportion(t *testing.T) {
	const interval, burst = 200, 500
	for _, rate := range []float64{400, 1_000, 5_000, 10_000, 20_000, 25_000} {
		block, lead := Size(rate, interval, burst, 0)
		avg := float64(lead) + float64(block)/2 - 0.5
		if want := rate * (LeadPeriod + BlockPeriod/2) / 1e6; math.Abs(avg-want) > 1 {
			t.Errorf("at %.0f/s: lead %d + block %d/2 - 1/2 = %.1f in the line on average, want %.1f", rate, lead, block, avg, want)
		}
	}
}

func TestNext(t *testing.T) {
	for _, tc := range []struct {
		name                           string
		held, ready, lead, block, need int64
		size                           int64
		fetch                          bool
	}{
		{"enough in the line", 200, 0, 150, 100, 0, 0, false},
		{"below the lead", 100, 0, 150, 100, 0, 100, true},
		{"ready tokens do not count", 200, 100, 150, 100, 0, 100, true},
		{"but a pile does", 360, 300, 150, 100, 0, 0, false},
		{"no lead: only when needed", 0, 0, 0, 1, 0, 0, false},
		{"a request needs more than held", 0, 0, 0, 1, 1, 1, true},
		{"a costly request: a block its size", 3, 3, 10, 5, 8, 8, true},
		{"held covers the request", 8, 8, 0, 5, 8, 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			size, fetch := Next(tc.held, tc.ready, tc.lead, tc.block, tc.need)
			if size != tc.size || fetch != tc.fetch {
				t.Errorf("Next(%d, %d, %d, %d, %d) = %d, %v; want %d, %v", tc.held, tc.ready, tc.lead, tc.block, tc.need, size, fetch, tc.size, tc.fetch)
			}
		})
	}
}

func TestLine(t *testing.T) {
	line := int64(0)
	for range 20 {
		line = Line(line, 200_000)
	}
	if line < 190_000 || line > 200_000 {
		t.Errorf("after 20 blocks that each waited 200 ms: %d µs, want about 200,000", line)
	}
	if got := Line(100_000, -5_000); got != 75_000 {
		t.Errorf("a block there at once moves 100 ms a quarter toward 0: %d, want 75,000", got)
	}
}
