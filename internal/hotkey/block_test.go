package hotkey

import (
	"math/rand/v2"
	"slices"
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
		// Token j of a full bucket's block is due an interval after the one
		// before: spendable until its due less an interval.
		{"full bucket: all at once, lapsing one an interval", 0, 1_000_000, 5_000, 100, []int64{5_000, 5_001, 5_000 + 50*interval + 1}, []int64{100, 99, 49}},
		{"a TAT in the past is a full bucket", 900_000, 1_000_000, 5_000, 100, []int64{5_000}, []int64{100}},
		{"10 tokens left: those at once, then one an interval", 1_000_000 + tau - 10*interval, 1_000_000, 5_000,
			20, []int64{5_000, 5_000 + interval - 1, 5_000 + interval, 5_000 + 10*interval, 5_000 + 100*interval}, []int64{10, 10, 11, 20, 20}},
		{"empty bucket: the first an interval after the reply", 1_000_000 + tau, 1_000_000, 5_000,
			3, []int64{5_000, 5_000 + interval - 1, 5_000 + interval, 5_000 + 3*interval}, []int64{0, 0, 1, 3}},
		{"reserved ahead by others: after their tokens", 1_000_000 + tau + 100*interval, 1_000_000, 5_000,
			3, []int64{5_000 + 100*interval, 5_000 + 101*interval}, []int64{0, 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			first, last := Spendable(tc.tatBefore, tc.redisNow, tc.recvAt, tc.recvAt, interval, tau)
			if first != Schedule(tc.tatBefore, tc.redisNow, tc.recvAt, interval, tau) || last != first+tau-interval {
				t.Fatalf("Spendable = %d, %d; Schedule %d: a round trip of 0 leaves tau less an interval", first, last, Schedule(tc.tatBefore, tc.redisNow, tc.recvAt, interval, tau))
			}
			b := Block{First: first, Last: last, Interval: interval, Size: tc.size}
			for i, at := range tc.at {
				if got := b.Ready(at); got != tc.ready[i] {
					t.Errorf("at %d: %d ready, want %d", at, got, tc.ready[i])
				}
			}
		})
	}
}

// TestNeverOverBudget: instances taking blocks ahead of the bucket's
// schedule, spending them as this package lets them, putting takes back,
// giving back what is left at random (the give-backs reaching the store a
// while later) and dropping blocks by age, alongside requests decided one
// by one, never spend more than burst + rate × T over any interval T of
// the store's clock, whatever their clocks' offsets and the round trips'
// lengths.
func TestNeverOverBudget(t *testing.T) {
	for seed := range 40 {
		rng := rand.New(rand.NewPCG(uint64(seed), 7))
		interval := int64(50 + rng.IntN(400))
		burst := int64(4 + rng.IntN(200))
		horizon := int64(rng.IntN(3)) * Horizon / 2
		b := &gcra{interval: interval, burst: burst, slack: horizon}
		type inst struct {
			offset int64 // local = store + offset
			led    Ledger
			// a fetch in flight: the local µs it was sent at, the store
			// time it runs at and lands at, and what it took
			sentAt, runsAt, landsAt int64
			tat, redisNow, size     int64
			fetching, ran, got      bool
		}
		type giveBack struct{ at, tokens, due int64 }
		var pending []giveBack // give-backs on their way to the store
		send := func(now int64, rs []Return) {
			for _, r := range rs {
				pending = append(pending, giveBack{now + rng.Int64N(3*interval), r.Tokens, r.Due})
			}
		}
		fleet := make([]*inst, 1+rng.IntN(5))
		for i := range fleet {
			fleet[i] = &inst{offset: rng.Int64N(1_000_000_000)}
		}
		var spent []int64 // store µs of each token spent, by blocks or one by one
		const end = 3_000_000
		for now := int64(0); now < end; now += 1 + rng.Int64N(interval) {
			k := 0
			for _, g := range pending {
				if g.at <= now {
					b.giveBack(now, g.tokens, g.due)
					continue
				}
				pending[k] = g
				k++
			}
			pending = pending[:k]
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
						first, last := Spendable(in.tat, in.redisNow, in.sentAt, local+rng.Int64N(50), interval, b.tau())
						if first <= last {
							in.led.Add(Block{First: first, Last: last, Interval: interval, Size: in.size, Taken: local,
								End: max(in.tat, in.redisNow) + in.size*interval}, local)
						}
					}
				}
				if !in.fetching && in.led.Unspent(local) < 2*burst/BurstShare && rng.IntN(3) == 0 {
					// The call is sent now (or was, a while before: the local
					// clock may read a sent time earlier than the truth);
					// Redis runs it a while later, and the reply lands later
					// still.
					in.size = 1 + rng.Int64N(max(1, burst/BurstShare))
					in.sentAt = local - rng.Int64N(20)
					in.runsAt, in.fetching, in.ran = now+rng.Int64N(300), true, false
				}
				switch rng.IntN(20) {
				case 0:
					send(now, in.led.Drop(local))
				case 1:
					send(now, in.led.Expire(local, int64(rng.IntN(2))*MaxAge))
				}
				cost := 1 + rng.Int64N(3)
				if ok, at, taken := in.led.Take(cost, local, 0); ok {
					if at > local {
						t.Fatalf("seed %d: a take without wait spent tokens ready at %d, now %d", seed, at, local)
					}
					if rng.IntN(10) == 0 { // another policy denied the request
						send(now, in.led.PutBack(taken))
					} else {
						for range cost {
							spent = append(spent, now)
						}
					}
				}
			}
			if rng.IntN(4) == 0 { // a request decided by the store itself
				if _, ok := b.take(now, 1, 0); ok {
					spent = append(spent, now)
				}
			}
		}
		if len(spent) == 0 {
			continue
		}
		slices.Sort(spent)
		if i, j, ok := overWindow(spent, burst, interval); !ok {
			t.Fatalf("seed %d (interval %d, burst %d, horizon %d, %d instances): %d tokens spent from %d to %d µs, over burst + rate × T = %d",
				seed, interval, burst, horizon, len(fleet), j-i+1, spent[i], spent[j], burst+(spent[j]-spent[i])/interval)
		}
		t.Logf("seed %d: interval %d, burst %d, %d instances: %d spent of a budget of %d", seed, interval, burst, len(fleet), len(spent), burst+end/interval)
	}
}

// overWindow checks sorted spend times against burst + T / interval over
// every interval: false and the worst interval's first and last spends
// when one holds more. For spends i..j: (j−i+1) − (s_j − s_i)/interval ≤
// burst, i.e. (j+1)·interval − s_j + max over i ≤ j of (s_i − i·interval) ≤
// burst·interval.
func overWindow(spent []int64, burst, interval int64) (int, int, bool) {
	best, bestAt := int64(0), -1
	for j, s := range spent {
		if v := s - int64(j)*interval; bestAt < 0 || v > best {
			best, bestAt = v, j
		}
		if int64(j+1)*interval-s+best > burst*interval {
			return bestAt, j, false
		}
	}
	return 0, 0, true
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

// giveBack gives back a block's tokens the last of which is due at due:
// those still due, and only when no token was taken after them (the
// script's givenBack for a block's give-back).
func (g *gcra) giveBack(now, tokens, due int64) {
	if max(g.tat, now) != due {
		tokens = 0 // not the end of the line: they stay, and lapse
	}
	if due > now {
		tokens = min(tokens, (due-now+g.interval-1)/g.interval)
	} else {
		tokens = 0
	}
	if tokens == 0 {
		return
	}
	base := min(max(g.tat, now), now+g.tau()+g.slack)
	g.tat = max(now, base-tokens*g.interval)
}
