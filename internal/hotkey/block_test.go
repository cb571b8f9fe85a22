package hotkey

import (
	"math/rand/v2"
	"testing"
)

func TestSchedule(t *testing.T) {
	const interval, burst = 200, 500 // 5,000/s
	const tau = interval * burst
	for _, tc := range []struct {
		name                        string
		tatBefore, redisNow, recvAt int64
		size                        int64
		// ready: how many tokens may be spent at each local time
		at    []int64
		ready []int64
	}{
		{"full bucket: all at once", 0, 1_000_000, 5_000, 100, []int64{5_000, 5_001}, []int64{100, 100}},
		{"a TAT in the past is a full bucket", 900_000, 1_000_000, 5_000, 100, []int64{5_000}, []int64{100}},
		{"10 tokens left: those at once, then one an interval", 1_000_000 + tau - 10*interval, 1_000_000, 5_000,
			20, []int64{5_000, 5_000 + interval - 1, 5_000 + interval, 5_000 + 10*interval, 5_000 + 100*interval}, []int64{10, 10, 11, 20, 20}},
		{"empty bucket: the first an interval after the reply", 1_000_000 + tau, 1_000_000, 5_000,
			3, []int64{5_000, 5_000 + interval - 1, 5_000 + interval, 5_000 + 3*interval}, []int64{0, 0, 1, 3}},
		{"reserved ahead by others: after their tokens", 1_000_000 + tau + 100*interval, 1_000_000, 5_000,
			3, []int64{5_000 + 100*interval, 5_000 + 101*interval}, []int64{0, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := Block{First: Schedule(tc.tatBefore, tc.redisNow, tc.recvAt, interval, tau), Interval: interval, Size: tc.size}
			for i, at := range tc.at {
				if got := b.Ready(at); got != tc.ready[i] {
					t.Errorf("at %d: %d ready, want %d", at, got, tc.ready[i])
				}
			}
		})
	}
}

// TestNeverOverBudget: instances taking blocks ahead of the bucket's
// schedule, spending them as this package lets them, giving back what is
// left at random and dropping blocks by age, alongside requests decided
// one by one, never spend more than burst + rate × elapsed by any instant
// of the store's clock, whatever their clocks' offsets and the round
// trips' lengths.
func TestNeverOverBudget(t *testing.T) {
	for seed := range 20 {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		interval := int64(50 + rng.IntN(400))
		burst := int64(4 + rng.IntN(200))
		horizon := int64(rng.IntN(3)) * Horizon / 2
		b := &gcra{interval: interval, burst: burst, slack: horizon}
		type inst struct {
			offset int64 // local = store + offset
			led    Ledger
			// a fetch in flight: the store time it runs at, and lands at,
			// and what it took
			runsAt, landsAt     int64
			tat, redisNow, size int64
			fetching, ran, got  bool
			spent               []int64 // store µs of each token spent
		}
		fleet := make([]*inst, 1+rng.IntN(5))
		for i := range fleet {
			fleet[i] = &inst{offset: rng.Int64N(1_000_000_000)}
		}
		var perRequest []int64 // store µs of the tokens taken one by one
		const end = 3_000_000
		for now := int64(0); now < end; now += 1 + rng.Int64N(interval) {
			for _, in := range fleet {
				local := now + in.offset
				if in.fetching && !in.ran && now >= in.runsAt {
					// The store runs the take when its turn comes, on its
					// clock: calls are decided one after the other.
					in.tat, in.got = b.take(now, in.size, horizon)
					in.redisNow, in.landsAt, in.ran = now, now+rng.Int64N(300), true
				}
				if in.fetching && in.ran && now >= in.landsAt {
					in.fetching = false
					if in.got {
						// received: the reply comes back when it lands (or later)
						first := Schedule(in.tat, in.redisNow, local+rng.Int64N(50), interval, b.tau())
						in.led.Add(Block{First: first, Interval: interval, Size: in.size, Taken: local})
					}
				}
				if !in.fetching && in.led.Unspent() < 2*burst/BurstShare && rng.IntN(3) == 0 {
					// The call is sent now; Redis runs it a while later, and
					// the reply lands later still.
					in.size = 1 + rng.Int64N(max(1, burst/BurstShare))
					in.runsAt, in.fetching, in.ran = now+rng.Int64N(300), true, false
				}
				switch rng.IntN(20) {
				case 0:
					b.giveBack(now, in.led.Drop())
				case 1:
					b.giveBack(now, in.led.Expire(local, int64(rng.IntN(2))*MaxAge))
				}
				cost := 1 + rng.Int64N(3)
				if ok, at, taken := in.led.Take(cost, local, 0); ok {
					if at > local {
						t.Fatalf("seed %d: a take without wait spent tokens ready at %d, now %d", seed, at, local)
					}
					if rng.IntN(10) == 0 { // another policy denied the request
						b.giveBack(now, in.led.PutBack(taken))
					} else {
						for range cost {
							in.spent = append(in.spent, now)
						}
					}
				}
			}
			if rng.IntN(4) == 0 { // a request decided by the store itself
				if _, ok := b.take(now, 1, 0); ok {
					perRequest = append(perRequest, now)
				}
			}
		}
		// Every instant's count: burst + rate × elapsed from the first take.
		var all []int64
		for _, in := range fleet {
			all = append(all, in.spent...)
		}
		all = append(all, perRequest...)
		if len(all) == 0 {
			continue
		}
		counts := map[int64]int64{}
		for _, at := range all {
			counts[at]++
		}
		var spent int64
		for at := int64(0); at < end; at++ {
			spent += counts[at]
			if budget := burst + at/interval; spent > budget {
				t.Fatalf("seed %d (interval %d, burst %d, %d instances): %d spent by %d µs, budget %d", seed, interval, burst, len(fleet), spent, at, budget)
			}
		}
		t.Logf("seed %d: interval %d, burst %d, %d instances: %d spent of a budget of %d", seed, interval, burst, len(fleet), spent, burst+end/interval)
	}
}

// gcra is the store's bucket, as the module's script decides it: a take
// of cost (reserving up to wait ahead) and a give-back.
type gcra struct {
	interval, burst, slack, tat int64
}

func (g *gcra) tau() int64 { return g.interval * g.burst }

// take returns the TAT before and whether cost fit within wait.
func (g *gcra) take(now, cost, wait int64) (int64, bool) {
	base := max(g.tat, now)
	base = min(base, now+g.tau()+g.slack) // rebase: never beyond what the limit lets it owe
	if cost > g.burst || base+cost*g.interval-now > g.tau()+wait {
		return base, false
	}
	before := base
	g.tat = base + cost*g.interval
	return before, true
}

func (g *gcra) giveBack(now, tokens int64) {
	if tokens == 0 {
		return
	}
	base := min(max(g.tat, now), now+g.tau()+g.slack)
	g.tat = max(now, base-tokens*g.interval)
}
