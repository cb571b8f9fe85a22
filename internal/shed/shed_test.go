package shed

import (
	"container/heap"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

// A deterministic simulation in virtual time: an upstream that serves at
// most c requests at once at a service time S (the others wait in its FIFO
// queue), driven open-loop (Poisson arrivals) by classes in a fixed mix,
// with or without a Limiter in front. Nothing sleeps: the limiter reads
// the virtual clock.

type simPhase struct {
	until   time.Duration // the phase ends at this virtual time
	rate    float64       // arrivals per second
	service time.Duration // the upstream's service time for requests starting in it
}

type simConfig struct {
	c          int
	phases     []simPhase
	mix        []float64 // share of arrivals per class, highest class first
	shares     []int64   // the classes' shares (basis points)
	target     time.Duration
	shed       bool  // false: every request goes to the upstream
	fixed      int64 // with shed: a fixed limit instead of the controller
	measure    [2]time.Duration
	seed       uint64
	traceEvery time.Duration
}

type simClass struct {
	offered, admitted, shed int
	latencies               []time.Duration // of admitted requests, arrival to finish
	firstShed               time.Duration   // -1: never
}

type simResult struct {
	classes   []simClass
	busy      time.Duration   // upstream service time spent within the measured span
	completed int             // requests the upstream finished within the measured span
	trace     []simPoint      // the limit over time
	lastShed  time.Duration   // of any class
	sheds     []time.Duration // when each shed request arrived
	arrivals  []time.Duration // when each request arrived
}

// shedFraction is the share of the requests arriving in [from, to) that
// were shed.
func (r simResult) shedFraction(from, to time.Duration) (shed, offered int) {
	for _, at := range r.sheds {
		if at >= from && at < to {
			shed++
		}
	}
	for _, at := range r.arrivals {
		if at >= from && at < to {
			offered++
		}
	}
	return shed, offered
}

type simPoint struct {
	at    time.Duration
	limit int64
}

type simEvent struct {
	at   time.Duration
	seq  int
	kind int // 0 arrival, 1 finish
	req  *simReq
}

type simReq struct {
	class   int
	arrival time.Duration
	ticket  Ticket
	admit   bool
}

type simQueue []simEvent

func (q simQueue) Len() int { return len(q) }
func (q simQueue) Less(i, j int) bool {
	if q[i].at != q[j].at {
		return q[i].at < q[j].at
	}
	return q[i].seq < q[j].seq
}
func (q simQueue) Swap(i, j int) { q[i], q[j] = q[j], q[i] }
func (q *simQueue) Push(x any)   { *q = append(*q, x.(simEvent)) }
func (q *simQueue) Pop() any {
	old := *q
	e := old[len(old)-1]
	*q = old[:len(old)-1]
	return e
}

func simulate(cfg simConfig) simResult {
	rng := rand.New(rand.NewPCG(cfg.seed, 1))
	base := time.Unix(1_700_000_000, 0)
	var now time.Duration
	l := NewLimiter(cfg.target, cfg.shares, func() time.Time { return base.Add(now) })
	res := simResult{classes: make([]simClass, len(cfg.mix)), lastShed: -1}
	for i := range res.classes {
		res.classes[i].firstShed = -1
	}
	var events simQueue
	seq := 0
	push := func(e simEvent) {
		seq++
		e.seq = seq
		heap.Push(&events, e)
	}
	phaseAt := func(t time.Duration) (simPhase, bool) {
		for _, p := range cfg.phases {
			if t < p.until {
				return p, true
			}
		}
		return simPhase{}, false
	}
	nextArrival := func(t time.Duration) {
		p, ok := phaseAt(t)
		if !ok {
			return
		}
		gap := time.Duration(rng.ExpFloat64() / p.rate * float64(time.Second))
		push(simEvent{at: t + gap, kind: 0})
	}
	inMeasure := func(t time.Duration) bool { return t >= cfg.measure[0] && t < cfg.measure[1] }
	busy, fixedInFlight := 0, int64(0)
	var queue []*simReq
	start := func(r *simReq) {
		p, _ := phaseAt(now)
		if p.service == 0 {
			p = cfg.phases[len(cfg.phases)-1]
		}
		busy++
		end := now + p.service
		// Busy time within the measured span.
		lo, hi := max(now, cfg.measure[0]), min(end, cfg.measure[1])
		if hi > lo {
			res.busy += hi - lo
		}
		push(simEvent{at: end, kind: 1, req: r})
	}
	nextArrival(0)
	nextTrace := time.Duration(0)
	for events.Len() > 0 {
		e := heap.Pop(&events).(simEvent)
		now = e.at
		for cfg.traceEvery > 0 && nextTrace <= now {
			res.trace = append(res.trace, simPoint{nextTrace, l.Limit()})
			nextTrace += cfg.traceEvery
		}
		switch e.kind {
		case 0:
			nextArrival(now)
			if _, ok := phaseAt(now); !ok {
				continue
			}
			x, class := rng.Float64(), len(cfg.mix)-1
			for i, m := range cfg.mix {
				if x < m {
					class = i
					break
				}
				x -= m
			}
			r := &simReq{class: class, arrival: now}
			res.arrivals = append(res.arrivals, now)
			sc := &res.classes[class]
			if inMeasure(now) {
				sc.offered++
			}
			if cfg.shed {
				if cfg.fixed > 0 {
					r.admit = fixedInFlight < ClassLimit(cfg.fixed, cfg.shares[class], class == 0, minLimit)
					if r.admit {
						fixedInFlight++
					}
				} else {
					r.ticket, r.admit = l.Admit(class)
				}
				if !r.admit {
					res.sheds = append(res.sheds, now)
					res.lastShed = now
					if sc.firstShed < 0 {
						sc.firstShed = now
					}
					if inMeasure(now) {
						sc.shed++
					}
					continue
				}
			}
			if inMeasure(now) {
				sc.admitted++
			}
			if busy < cfg.c {
				start(r)
			} else {
				queue = append(queue, r)
			}
		case 1:
			r := e.req
			switch {
			case cfg.shed && cfg.fixed > 0:
				fixedInFlight--
			case cfg.shed:
				r.ticket.Done()
			}
			if inMeasure(r.arrival) {
				res.classes[r.class].latencies = append(res.classes[r.class].latencies, now-r.arrival)
			}
			if inMeasure(now) {
				res.completed++
			}
			busy--
			if len(queue) > 0 {
				next := queue[0]
				queue = queue[1:]
				start(next)
			}
		}
	}
	for i := range res.classes {
		slices.Sort(res.classes[i].latencies)
	}
	return res
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(math.Ceil(p*float64(len(sorted)))) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func (c simClass) success() float64 {
	if c.offered == 0 {
		return 1
	}
	return float64(len(c.latencies)) / float64(c.offered)
}

var simClassNames = []string{"critical", "default", "batch"}

func (r simResult) table(label string, c int, service, span time.Duration) string {
	var b strings.Builder
	for i, sc := range r.classes {
		fmt.Fprintf(&b, "%-8s %-8s offered %5d  success %6.2f%%  shed %5d  p50 %7v  p99 %7v\n", label, simClassNames[i],
			sc.offered, 100*sc.success(), sc.shed, percentile(sc.latencies, 0.50).Round(time.Millisecond), percentile(sc.latencies, 0.99).Round(time.Millisecond))
	}
	fmt.Fprintf(&b, "%-8s goodput %.1f%% of c (%d done in %v, capacity %d/s); upstream busy %.1f%%\n", label,
		100*float64(r.completed)/(float64(c)*span.Seconds()/service.Seconds()), r.completed, span, int(float64(c)/service.Seconds()),
		100*r.busy.Seconds()/(float64(c)*span.Seconds()))
	return b.String()
}

// The scenario of TestShedSimulation and TestShedRecovery: an upstream of
// c = 10 slots at S = 100 ms, a capacity of 100 requests/s.
const (
	simC = 10
	simS = 100 * time.Millisecond
)

var simCapacity = float64(simC) / simS.Seconds()

// simOverload is calm (0.5 × c/S) for 10 s, 3 × c/S for 30 s, calm for 20 s.
func simOverload(mix []float64, target time.Duration, shed bool, seed uint64) simConfig {
	return simConfig{
		c: simC, mix: mix, shares: []int64{10000, 8000, 5000}, target: target, shed: shed, seed: seed,
		phases: []simPhase{
			{until: 10 * time.Second, rate: 0.5 * simCapacity, service: simS},
			{until: 40 * time.Second, rate: 3 * simCapacity, service: simS},
			{until: 60 * time.Second, rate: 0.5 * simCapacity, service: simS},
		},
		measure:    [2]time.Duration{10 * time.Second, 40 * time.Second},
		traceEvery: 100 * time.Millisecond,
	}
}

// TestShedSimulation drives the upstream open-loop at 3 × c/S for 30 s of
// virtual time with the design's classes (critical 100%, default 80%,
// batch 50%), offered 10% critical, 45% default, 45% batch. D = 1.5 × S:
// what a user who sees 100 ms unloaded and wants the critical p99 within
// 200 ms sets, since the controller holds the p90 of what it passes at D
// and the critical requests, admitted above the others' share, wait a
// little longer than most. Also shown, not asserted: D = 2 × S (the limit
// then settles where latency is near 2 × S, so the critical p99 is above
// it), and 20% critical: 60% of the upstream's capacity, more than the 20%
// of the limit that default's 80% leaves it, so critical's bursts are shed.
//
// The critical p99 within 2 × the unloaded latency is asserted from 1 s
// into the overload, and within 2.5 × S over all of it: the overload
// starts from the limit calm traffic left (where the lowest class's share
// covers its bursts: 22 to 32 here, more the longer the calm lasted), so
// its first few hundred ms queue up to 3 × S before the controller cuts.
func TestShedSimulation(t *testing.T) {
	mix := []float64{0.10, 0.45, 0.45}
	target := 3 * simS / 2
	span := 30 * time.Second
	for _, seed := range []uint64{25} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			calm := simOverload(mix, target, false, seed)
			calm.phases = calm.phases[:1]
			calm.measure = [2]time.Duration{0, 10 * time.Second}
			calmRes := simulate(calm)
			var all []time.Duration
			for _, c := range calmRes.classes {
				all = append(all, c.latencies...)
			}
			slices.Sort(all)
			unloaded := percentile(all, 0.5)

			with := simulate(simOverload(mix, target, true, seed))
			steadyCfg := simOverload(mix, target, true, seed)
			steadyCfg.measure[0] += time.Second
			steady := simulate(steadyCfg)
			without := simulate(simOverload(mix, target, false, seed))
			d2 := simulate(simOverload(mix, 2*simS, true, seed))
			heavy := simulate(simOverload([]float64{0.2, 0.4, 0.4}, target, true, seed))
			t.Logf("unloaded (0.5 × c/S, no shedding): p50 %v, p99 %v", unloaded, percentile(all, 0.99))
			t.Logf("3 × c/S for %v, c = %d, S = %v, D = %v, mix 10/45/45:\n%s%s"+
				"not asserted: D = 2 × S:\n%s"+
				"not asserted: mix 20/40/40, D = %v:\n%s", span, simC, simS, target,
				with.table("shed", simC, simS, span), without.table("no-shed", simC, simS, span),
				d2.table("D=2S", simC, simS, span), target, heavy.table("20%crit", simC, simS, span))

			crit, def, batch := with.classes[0], with.classes[1], with.classes[2]
			if s := crit.success(); s < 0.99 {
				t.Errorf("critical success %.2f%%, want >= 99%%", 100*s)
			}
			p99, steadyP99 := percentile(crit.latencies, 0.99), percentile(steady.classes[0].latencies, 0.99)
			t.Logf("critical p99 %v over the whole overload, %v from 1 s in", p99, steadyP99)
			if steadyP99 > 2*unloaded {
				t.Errorf("critical p99 from 1 s into the overload %v, want within 2 × the unloaded %v", steadyP99, unloaded)
			}
			if p99 > 5*simS/2 {
				t.Errorf("critical p99 over the whole overload %v, want within 2.5 × S", p99)
			}
			if !(batch.success() < def.success() && def.success() < crit.success()) {
				t.Errorf("success batch %.1f%%, default %.1f%%, critical %.1f%%: want batch shed most, then default",
					100*batch.success(), 100*def.success(), 100*crit.success())
			}
			if batch.firstShed < 0 || (def.firstShed >= 0 && def.firstShed < batch.firstShed) ||
				(crit.firstShed >= 0 && (def.firstShed < 0 || crit.firstShed < def.firstShed)) {
				t.Errorf("first shed: batch %v, default %v, critical %v: want batch first, then default", batch.firstShed, def.firstShed, crit.firstShed)
			}
			if g := float64(with.completed) / (float64(simC) * span.Seconds() / simS.Seconds()); g < 0.85 {
				t.Errorf("goodput %.1f%% of c, want >= 85%%", 100*g)
			}
			for i, sc := range without.classes {
				if p50 := percentile(sc.latencies, 0.5); p50 < 5*simS {
					t.Errorf("without shedding, %s p50 %v: want the queue to show (>= 5 × S)", simClassNames[i], p50)
				}
			}
			// After the overload the limit stays near what the upstream
			// served; at the calm rate only Poisson bursts past batch's
			// share of it (in flight >= c: the upstream is full) are shed.
			shed, offered := with.shedFraction(41*time.Second, 60*time.Second)
			t.Logf("limit: %s", traceString(with.trace, 9*time.Second, 43*time.Second, 500*time.Millisecond))
			t.Logf("after the overload (40 s): %d of %d requests shed from 41 s to 60 s at 0.5 × c/S (%.2f%%); last shed at %v",
				shed, offered, 100*float64(shed)/float64(offered), with.lastShed)
			if float64(shed) > 0.01*float64(offered) {
				t.Errorf("%d of %d requests shed at the calm rate after the overload, want at most 1%%", shed, offered)
			}
		})
	}
}

// TestShedSimulationSeeds runs the asserted scenario of TestShedSimulation
// on 40 other seeds (Poisson arrivals and the class of each request). Every
// seed must keep critical at 99% or more, goodput at 85% or more and the
// classes in order; the critical p99 is within 2 × S from 1 s into the
// overload on all seeds, and over the whole overload on most, not all (an
// overload that starts right after calm traffic grew the limit lets the
// first few hundred ms through at up to 2.4 × S): at least 85% of the
// seeds, and within 2.5 × S on all.
func TestShedSimulationSeeds(t *testing.T) {
	n := 40
	if testing.Short() {
		n = 10
	}
	mix := []float64{0.10, 0.45, 0.45}
	var p99s []time.Duration
	var successes []float64
	within := 0
	for seed := uint64(100); seed < uint64(100+n); seed++ {
		r := simulate(simOverload(mix, 3*simS/2, true, seed))
		crit, def, batch := r.classes[0], r.classes[1], r.classes[2]
		p99 := percentile(crit.latencies, 0.99)
		steadyCfg := simOverload(mix, 3*simS/2, true, seed)
		steadyCfg.measure[0] += time.Second
		if sp := percentile(simulate(steadyCfg).classes[0].latencies, 0.99); sp > 2*simS {
			t.Errorf("seed %d: critical p99 from 1 s into the overload %v, want within 2 × S", seed, sp)
		}
		p99s = append(p99s, p99.Round(time.Millisecond))
		successes = append(successes, crit.success())
		if p99 <= 2*simS {
			within++
		}
		if p99 > 5*simS/2 {
			t.Errorf("seed %d: critical p99 %v, want within 2.5 × S", seed, p99)
		}
		if crit.success() < 0.99 {
			t.Errorf("seed %d: critical success %.2f%%, want >= 99%%", seed, 100*crit.success())
		}
		if !(batch.success() < def.success() && def.success() < crit.success()) {
			t.Errorf("seed %d: success batch %.1f%%, default %.1f%%, critical %.1f%%: out of order", seed, 100*batch.success(), 100*def.success(), 100*crit.success())
		}
		if g := float64(r.completed) / 3000; g < 0.85 {
			t.Errorf("seed %d: goodput %.1f%% of c, want >= 85%%", seed, 100*g)
		}
	}
	slices.Sort(p99s)
	slices.Sort(successes)
	t.Logf("%d seeds: critical p99 within 2 × S on %d; p99s %v; lowest critical success %.2f%%", n, within, p99s, 100*successes[0])
	if within*20 < n*17 {
		t.Errorf("critical p99 within 2 × S on %d of %d seeds, want 85%%", within, n)
	}
}

// TestShedSimulationCapacities: the same overload against upstreams of
// c = 4 and c = 40 slots (S = 100 ms): the controller finds each one's
// limit (median over the last 25 s between c and 2.5 × c), where a fixed
// limit of 20 (right for c = 10) queues the small one and starves the large
// one. At c = 4 the limit starts five times too high and takes about a
// second to come down (a quarter per decision at most): the critical p99 is
// asserted from 2 s into the overload, its success over all of it.
func TestShedSimulationCapacities(t *testing.T) {
	mix := []float64{0.10, 0.45, 0.45}
	span := 30 * time.Second
	for _, c := range []int{4, 40} {
		t.Run(fmt.Sprint("c=", c), func(t *testing.T) {
			capacity := float64(c) / simS.Seconds()
			cfg := simOverload(mix, 3*simS/2, true, 3)
			cfg.c = c
			for i := range cfg.phases {
				cfg.phases[i].rate *= capacity / simCapacity
			}
			adaptive := simulate(cfg)
			settled := cfg
			settled.measure[0] = 12 * time.Second
			settledRes := simulate(settled)
			cfg.fixed = 20
			fixed := simulate(cfg)
			var limits []int64
			for _, p := range adaptive.trace {
				if p.at >= 15*time.Second && p.at < 40*time.Second {
					limits = append(limits, p.limit)
				}
			}
			slices.Sort(limits)
			median := limits[len(limits)/2]
			t.Logf("c = %d, 3 × c/S: median limit %d\n%s%s", c, median, adaptive.table("adaptive", c, simS, span), fixed.table("fixed20", c, simS, span))
			goodput := func(r simResult) float64 {
				return float64(r.completed) / (float64(c) * span.Seconds() / simS.Seconds())
			}
			if median < int64(c) || float64(median) > 2.5*float64(c) {
				t.Errorf("median limit %d, want between c = %d and 2.5 × c", median, c)
			}
			if s := adaptive.classes[0].success(); s < 0.98 {
				t.Errorf("critical success %.2f%%, want >= 98%%", 100*s)
			}
			if p99 := percentile(settledRes.classes[0].latencies, 0.99); p99 > 5*simS/2 {
				t.Errorf("critical p99 from 2 s into the overload %v, want within 2.5 × S", p99)
			}
			if g := goodput(adaptive); g < 0.85 {
				t.Errorf("goodput %.1f%% of c, want >= 85%%", 100*g)
			}
			switch {
			case c < 20:
				if p99 := percentile(fixed.classes[0].latencies, 0.99); p99 < 4*simS {
					t.Errorf("fixed limit 20 on c = %d: critical p99 %v, expected the queue (>= 4 × S)", c, p99)
				}
			default:
				if g := goodput(fixed); g > 0.6 {
					t.Errorf("fixed limit 20 on c = %d: goodput %.1f%%, expected it starved (<= 60%%)", c, 100*g)
				}
			}
		})
	}
}

// TestShedRecovery: the upstream slows down (S → 5 × S for 10 s) under a
// steady 0.5 × c/S: latency far above D drives the limit to its floor.
// When S is back, the limit climbs back above the upstream's c and
// shedding stops within a few seconds.
func TestShedRecovery(t *testing.T) {
	for _, seed := range []uint64{7, 1, 2} {
		t.Run(fmt.Sprint("seed ", seed), func(t *testing.T) {
			cfg := simOverload([]float64{0.10, 0.45, 0.45}, 3*simS/2, true, seed)
			cfg.phases = []simPhase{
				{until: 10 * time.Second, rate: 0.5 * simCapacity, service: simS},
				{until: 20 * time.Second, rate: 0.5 * simCapacity, service: 5 * simS},
				{until: 40 * time.Second, rate: 0.5 * simCapacity, service: simS},
			}
			cfg.traceEvery = 50 * time.Millisecond
			res := simulate(cfg)
			low := int64(math.MaxInt64)
			for _, p := range res.trace {
				if p.at >= 10*time.Second && p.at < 20*time.Second {
					low = min(low, p.limit)
				}
			}
			if low != minLimit {
				t.Errorf("lowest limit while slow %d, want the floor %d", low, minLimit)
			}
			recovered := time.Duration(-1)
			for _, p := range res.trace {
				if p.at >= 20*time.Second && p.limit >= simC {
					recovered = p.at - 20*time.Second
					break
				}
			}
			// Shedding, second by second, from the upstream's recovery.
			var perSecond []string
			for from := 20 * time.Second; from < 30*time.Second; from += time.Second {
				shed, offered := res.shedFraction(from, from+time.Second)
				perSecond = append(perSecond, fmt.Sprintf("%d/%d", shed, offered))
			}
			shed, offered := res.shedFraction(25*time.Second, 40*time.Second)
			t.Logf("limit: %s", traceString(res.trace, 9*time.Second, 26*time.Second, 250*time.Millisecond))
			t.Logf("after the upstream recovered (20 s): limit back to c = %d in %v; shed/offered per second from 20 s: %s; from 25 s to 40 s: %d/%d",
				simC, recovered, strings.Join(perSecond, " "), shed, offered)
			if recovered < 0 || recovered > 3*time.Second {
				t.Errorf("limit back to c after %v, want within 3 s", recovered)
			}
			if float64(shed) > 0.01*float64(offered) {
				t.Errorf("%d of %d requests shed from 5 s after the upstream recovered, want under 1%%", shed, offered)
			}
		})
	}
}

func traceString(trace []simPoint, from, to, step time.Duration) string {
	var b strings.Builder
	next := from
	for _, p := range trace {
		if p.at >= next && p.at < to {
			fmt.Fprintf(&b, "%v:%d ", p.at, p.limit)
			next = p.at + step
		}
	}
	return b.String()
}

// fakeClock is a clock a test moves by hand.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) add(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func TestParseShare(t *testing.T) {
	for _, c := range []struct {
		in   string
		want int64
	}{
		{"100%", 10000}, {"80%", 8000}, {"50%", 5000}, {"12.5%", 1250}, {"0.01%", 1}, {"7.25%", 725}, {"099%", 9900},
	} {
		if got, err := ParseShare(c.in); err != nil || got != c.want {
			t.Errorf("ParseShare(%q) = %d, %v; want %d", c.in, got, err, c.want)
		}
	}
	for _, in := range []string{"", "%", "80", "0%", "0.00%", "100.01%", "101%", "-5%", "+5%", "1e2%", "12.345%", "12.%", ".5%", "5 %", "½%", "1000%", "80%%", "0x10%"} {
		if got, err := ParseShare(in); err == nil {
			t.Errorf("ParseShare(%q) = %d, want an error", in, got)
		}
	}
}

func TestShedClasses(t *testing.T) {
	c, err := NewClasses([]string{"critical", "default", "batch"}, []int64{10000, 8000, 5000})
	if err != nil {
		t.Fatal(err)
	}
	for value, want := range map[string]int{"critical": 0, "default": 1, "batch": 2, "": 2, "CRITICAL": 2, "unknown": 2, "critical ": 2} {
		if got := c.Of(value); got != want {
			t.Errorf("of(%q) = %d, want %d", value, got, want)
		}
	}
	if c.Name(1) != "default" {
		t.Errorf("name(1) = %q", c.Name(1))
	}
	for _, e := range []struct {
		name   string
		names  []string
		shares []int64
		want   string
	}{
		{"no class", nil, nil, "at least one class"},
		{"shares missing", []string{"a", "b"}, []int64{10000}, "one share per class"},
		{"repeated", []string{"a", "b", "a"}, []int64{10000, 8000, 5000}, `"a" is listed twice`},
		{"share 0", []string{"a", "b"}, []int64{10000, 0}, "above 0%"},
		{"share above 100%", []string{"a"}, []int64{10001}, "at most 100%"},
		{"not decreasing", []string{"a", "b", "c"}, []int64{10000, 5000, 8000}, `"c": share 80% is not below "b"'s 50%`},
		{"equal", []string{"a", "b"}, []int64{8000, 8000}, "not below"},
		{"unnamed", []string{"a", ""}, []int64{10000, 5000}, "class 2 has no name"},
	} {
		if _, err := NewClasses(e.names, e.shares); err == nil || !strings.Contains(err.Error(), e.want) {
			t.Errorf("%s: error %v, want one saying %q", e.name, err, e.want)
		}
	}
	if _, err := NewClasses([]string{""}, []int64{Whole}); err != nil {
		t.Errorf("the one class of a policy without priority: %v", err)
	}
}

func TestClassSlots(t *testing.T) {
	for _, c := range []struct {
		name  string
		limit int64
		bp    int64
		top   bool
		floor int64
		want  int64
	}{
		{"all of it", 20, 10000, true, 4, 20},
		{"80% rounds down", 19, 8000, false, 4, 15},
		{"50% rounds down", 19, 5000, false, 4, 9},
		{"a lower class at the floor", 4, 5000, false, 4, 2},
		{"a small lower class gets none", 4, 2000, false, 4, 0},
		{"the top class has the floor whatever its share", 4, 1000, true, 4, 4},
		{"the top class never above the limit", 2, 1000, true, 4, 2},
		{"fleet-wide: 50% of 200", 200, 5000, false, 1, 100},
		{"fleet-wide: 12.5% of 7", 7, 1250, false, 1, 0},
		{"large limit: exact, no overflow", 1 << 62, 3333, false, 1, (1 << 62 / 10000 * 3333) + (1<<62%10000)*3333/10000},
	} {
		if got := ClassLimit(c.limit, c.bp, c.top, c.floor); got != c.want {
			t.Errorf("%s: ClassLimit(%d, %d, %v, %d) = %d, want %d", c.name, c.limit, c.bp, c.top, c.floor, got, c.want)
		}
	}
}

// TestShedAdmit: a class is admitted while in flight (all classes
// together) is below its share of the limit; done and cancel free slots.
func TestShedAdmit(t *testing.T) {
	clock := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	l := NewLimiter(100*time.Millisecond, []int64{10000, 8000, 5000}, clock.now)
	if l.Limit() != Initial {
		t.Fatalf("initial limit %d, want %d", l.Limit(), Initial)
	}
	var tickets []Ticket
	admitAll := func(class int) int {
		n := 0
		for {
			tk, ok := l.Admit(class)
			if !ok {
				return n
			}
			tickets = append(tickets, tk)
			n++
		}
	}
	// Limit 20: batch (50%) while under 10, default (80%) under 16, critical under 20.
	if n := admitAll(2); n != 10 {
		t.Errorf("batch admitted %d from empty, want 10", n)
	}
	if n := admitAll(7); n != 0 {
		t.Errorf("a class out of range (the lowest) admitted %d more, want 0", n)
	}
	if n := admitAll(1); n != 6 {
		t.Errorf("default admitted %d on top, want 6", n)
	}
	if n := admitAll(0); n != 4 {
		t.Errorf("critical admitted %d on top, want 4", n)
	}
	if l.InFlight() != 20 {
		t.Errorf("in flight %d, want 20", l.InFlight())
	}
	if !l.denied.Load() {
		t.Error("a shed request did not mark the window")
	}
	// cancel frees a slot and takes no sample.
	tickets[len(tickets)-1].Cancel()
	tickets = tickets[:len(tickets)-1]
	if _, ok := l.Admit(0); !ok {
		t.Error("critical not admitted after a cancel freed a slot")
	}
	l.mu.Lock()
	seen := l.seen
	l.mu.Unlock()
	if seen != 0 {
		t.Errorf("cancel took %d samples", seen)
	}
	// done measures the latency on the injected clock.
	clock.add(70 * time.Millisecond)
	tickets[0].Done()
	l.mu.Lock()
	got := l.samples[0]
	l.mu.Unlock()
	if got != 70*time.Millisecond {
		t.Errorf("latency sample %v, want 70ms", got)
	}
	if l.InFlight() != 19 {
		t.Errorf("in flight %d after a cancel, an admit and a done, want 19", l.InFlight())
	}
}

// TestShedAdmitConcurrent: under -race, goroutines admitting and finishing
// never hold more than the highest class's slots, and leave nothing in
// flight.
func TestShedAdmitConcurrent(t *testing.T) {
	l := NewLimiter(time.Millisecond, []int64{10000, 5000}, time.Now)
	var wg sync.WaitGroup
	var mu sync.Mutex
	most := int64(0)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 3000 {
				tk, ok := l.Admit((g + i) % 2)
				if !ok {
					continue
				}
				in := l.InFlight()
				mu.Lock()
				most = max(most, in)
				mu.Unlock()
				if i%3 == 0 {
					tk.Cancel()
				} else {
					tk.Done()
				}
			}
		}()
	}
	wg.Wait()
	if l.InFlight() != 0 {
		t.Errorf("in flight %d after all finished", l.InFlight())
	}
	if most > maxLimit {
		t.Errorf("%d in flight at once, above the ceiling", most)
	}
	if lim := l.Limit(); lim < minLimit || lim > maxLimit {
		t.Errorf("limit %d outside [%d, %d]", lim, minLimit, maxLimit)
	}
}

// shedWindow feeds the controller one window's latencies directly: n
// finishes spread evenly over span, with inflight in flight at each, and
// whether a request was shed in it.
type shedWindow struct {
	n        int
	span     time.Duration
	latency  func(i int) time.Duration
	inflight int64
	shed     bool
}

func feedShed(l *Limiter, now *time.Time, w shedWindow) {
	if w.shed {
		l.denied.Store(true)
	}
	for i := range w.n {
		*now = now.Add(w.span / time.Duration(w.n))
		l.mu.Lock()
		l.record(*now, w.latency(i), w.inflight)
		l.mu.Unlock()
	}
}

func constLatency(d time.Duration) func(int) time.Duration {
	return func(int) time.Duration { return d }
}

// slowShare: the first `slow` of every 100 latencies are 3 × D, the rest D/2.
func slowShare(d time.Duration, slow int) func(int) time.Duration {
	return func(i int) time.Duration {
		if i%100 < slow {
			return 3 * d
		}
		return d / 2
	}
}

// TestShedController: the controller's reaction to series of windows. D is
// 100 ms, so a window lasts 200 ms.
func TestShedController(t *testing.T) {
	const D = 100 * time.Millisecond
	const W = 2 * D
	type step struct {
		w    shedWindow
		reps int
		want []int64 // the limit after each repetition; nil: not checked
	}
	cases := []struct {
		name      string
		start     float64
		slowStart bool // a fresh limiter's: no window above D yet
		steps     []step
		final     int64
		assert    func(t *testing.T, limits []int64)
	}{
		{name: "slow start, the limit binding: doubles, half way (× 1.5) per window", start: 20, slowStart: true, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 1000}, reps: 4, want: []int64{30, 45, 67, 101}},
		}},
		{name: "slow start up to twice the most in flight: 2 × 30 = 60", start: 20, slowStart: true, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 30}, reps: 4, want: []int64{30, 45, 52, 56}},
		}},
		{name: "slow start, the limit not binding: grows by √limit", start: 20, slowStart: true, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 12}, reps: 2, want: []int64{22, 24}},
		}},
		{name: "slow start ends at the first window above D", start: 20, slowStart: true, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 1000}, reps: 1, want: []int64{30}},
			{w: shedWindow{n: 40, span: W, latency: constLatency(2 * D), inflight: 1000}, reps: 1, want: []int64{22}},     // two windows closed early
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 1000}, reps: 2, want: []int64{24, 27}}, // not 33: √limit
		}},
		{name: "within D and used: grows by √limit, half way, per window", start: 20, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 15}, reps: 3, want: []int64{22, 24, 27}},
		}},
		{name: "within D but app limited: holds", start: 20, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 9}, reps: 5, want: []int64{20, 20, 20, 20, 20}},
		}},
		{name: "within D, app limited, a lower class shed: grows", start: 20, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 9, shed: true}, reps: 2, want: []int64{22, 24}},
		}},
		{name: "queueing: goes to throughput × D (Little), 150/s × 100 ms = 15, deciding every D while over", start: 40, steps: []step{
			{w: shedWindow{n: 30, span: W, latency: constLatency(2 * D), inflight: 30}, reps: 8, want: []int64{30, 18, 15, 15, 15, 15, 15, 15}},
		}},
		{name: "far above D, 10/s × 100 ms = 1: a quarter off per window at most, down to the floor", start: 20, steps: []step{
			{w: shedWindow{n: 10, span: 5 * W, latency: constLatency(10 * D), inflight: 20}, reps: 8, want: []int64{15, 11, 8, 6, 4, 4, 4, 4}},
		}},
		{name: "far above D, 50/s × 100 ms = 5: settles at 5", start: 20, steps: []step{
			{w: shedWindow{n: 10, span: W, latency: constLatency(10 * D), inflight: 20}, reps: 8, want: []int64{15, 11, 8, 6, 5, 5, 5, 5}},
		}},
		{name: "a slow 7%: p90 within D, p95 above: holds", start: 20, steps: []step{
			{w: shedWindow{n: 100, span: W, latency: slowShare(D, 7), inflight: 20}, reps: 4, want: []int64{20, 20, 20, 20}},
		}},
		{name: "a slow 3% and the limit used: grows", start: 20, steps: []step{
			{w: shedWindow{n: 100, span: W, latency: slowShare(D, 3), inflight: 20}, reps: 2, want: []int64{22, 24}},
		}},
		{name: "a slow 15%, mean within D: p90 above D, but Little's law (500/s × 100 ms = 50) keeps the limit", start: 40, steps: []step{
			{w: shedWindow{n: 100, span: W, latency: slowShare(D, 15), inflight: 40}, reps: 3, want: []int64{40, 40, 40}},
		}},
		{name: "a slow 15% at a lower throughput (250/s × 100 ms = 25): shrinks towards 25", start: 40, steps: []step{
			{w: shedWindow{n: 50, span: W, latency: slowShare(D, 15), inflight: 40}, reps: 3, want: []int64{32, 28, 25}},
		}},
		{name: "recovers from the floor past 10 in 5 windows (1 s)", start: minLimit, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: 10}, reps: 5, want: []int64{5, 6, 7, 8, 10}},
		}},
		{name: "never above the ceiling", start: maxLimit - 3, steps: []step{
			{w: shedWindow{n: 40, span: W, latency: constLatency(D / 2), inflight: maxLimit}, reps: 2, want: []int64{maxLimit, maxLimit}},
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			now := time.Unix(1_700_000_000, 0)
			l := NewLimiter(D, []int64{Whole}, func() time.Time { return now })
			l.estimate = c.start
			l.current.Store(int64(c.start))
			l.congested = !c.slowStart
			// The first record opens the window: start it now.
			l.start = now
			for _, s := range c.steps {
				var got []int64
				for range s.reps {
					feedShed(l, &now, s.w)
					got = append(got, l.Limit())
				}
				if s.want != nil && !slices.Equal(got, s.want) {
					t.Errorf("limits %v, want %v", got, s.want)
				}
			}
		})
	}
}

// TestShedWindowClosing: when a window decides.
func TestShedWindowClosing(t *testing.T) {
	const D = 100 * time.Millisecond
	t0 := time.Unix(1_700_000_000, 0)
	t.Run("a trickle waits for 10 latencies, or 10 windows' time", func(t *testing.T) {
		now := t0
		l := NewLimiter(D, []int64{Whole}, func() time.Time { return now })
		l.start = now
		feedShed(l, &now, shedWindow{n: 5, span: 5 * 2 * D, latency: constLatency(5 * D), inflight: 1})
		if l.Limit() != Initial {
			t.Fatalf("decided on 5 latencies after 5 windows: limit %d", l.Limit())
		}
		feedShed(l, &now, shedWindow{n: 1, span: 5 * 2 * D, latency: constLatency(5 * D), inflight: 1})
		if l.Limit() >= Initial {
			t.Errorf("6 slow latencies over 10 windows' time did not shrink the limit: %d", l.Limit())
		}
	})
	t.Run("a burst of slow latencies closes the window early", func(t *testing.T) {
		now := t0
		l := NewLimiter(D, []int64{Whole}, func() time.Time { return now })
		l.start = now
		feedShed(l, &now, shedWindow{n: 5, span: D, latency: constLatency(D / 2), inflight: 20})
		feedShed(l, &now, shedWindow{n: 12, span: D / 10, latency: constLatency(3 * D), inflight: 20})
		if l.Limit() >= Initial {
			t.Errorf("12 latencies of 3 × D after D: limit %d, want it shrunk before the window's end (2 × D)", l.Limit())
		}
		l2 := NewLimiter(D, []int64{Whole}, func() time.Time { return now })
		l2.start = now
		feedShed(l2, &now, shedWindow{n: 12, span: D / 10, latency: constLatency(3 * D), inflight: 20})
		if l2.Limit() != Initial {
			t.Errorf("decided %d on latencies that finished within D of the last decision", l2.Limit())
		}
	})
	t.Run("fast latencies wait for the window's end", func(t *testing.T) {
		now := t0
		l := NewLimiter(D, []int64{Whole}, func() time.Time { return now })
		l.start = now
		feedShed(l, &now, shedWindow{n: 100, span: D, latency: constLatency(D / 2), inflight: 20})
		if l.Limit() != Initial {
			t.Errorf("decided %d in half a window", l.Limit())
		}
		feedShed(l, &now, shedWindow{n: 1, span: D, latency: constLatency(D / 2), inflight: 20})
		if l.Limit() <= Initial {
			t.Errorf("no growth at the window's end: %d", l.Limit())
		}
	})
	t.Run("memory is fixed: a window of 100000 latencies keeps 256", func(t *testing.T) {
		now := t0
		l := NewLimiter(time.Hour, []int64{Whole}, func() time.Time { return now })
		l.start = now
		feedShed(l, &now, shedWindow{n: 100000, span: time.Millisecond, latency: constLatency(D), inflight: 1})
		l.mu.Lock()
		defer l.mu.Unlock()
		if l.kept != maxSamples || l.seen != 100000 {
			t.Errorf("kept %d of %d", l.kept, l.seen)
		}
	})
}

// BenchmarkShed: the hot path, admit then done, on the real clock (two
// clock readings per request are part of it), from one goroutine and from
// all at once on one limiter.
func BenchmarkShed(b *testing.B) {
	newLimiter := func() *Limiter {
		l := NewLimiter(100*time.Millisecond, []int64{10000, 8000, 5000}, time.Now)
		l.estimate = maxLimit
		l.current.Store(maxLimit)
		return l
	}
	b.Run("serial", func(b *testing.B) {
		l := newLimiter()
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if tk, ok := l.Admit(i % 3); ok {
				tk.Done()
			}
			i++
		}
	})
	b.Run("parallel", func(b *testing.B) {
		l := newLimiter()
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			i := 0
			for pb.Next() {
				if tk, ok := l.Admit(i % 3); ok {
					tk.Done()
				}
				i++
			}
		})
	})
	b.Run("shed", func(b *testing.B) { // a request shed: no slot, no clock
		l := newLimiter()
		l.inflight.Store(maxLimit)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				l.Admit(2)
			}
		})
	})
}

// TestShedSlowStart: a fresh limiter in front of an upstream of c = 100
// slots (S = 100 ms) at 0.7 × its capacity, no overload: from the initial
// limit of 20, slow start finds the limit that lets every class through
// (batch, at 50%, needs about 2 × 70 in flight) within seconds, and nothing
// is shed from the seventh second on.
func TestShedSlowStart(t *testing.T) {
	const c = 100
	capacity := float64(c) / simS.Seconds()
	cfg := simConfig{c: c, mix: []float64{0.10, 0.45, 0.45}, shares: []int64{10000, 8000, 5000}, target: 3 * simS / 2, shed: true, seed: 3,
		phases:     []simPhase{{until: 10 * time.Second, rate: 0.7 * capacity, service: simS}},
		measure:    [2]time.Duration{0, 10 * time.Second},
		traceEvery: 100 * time.Millisecond}
	r := simulate(cfg)
	var perSecond []string
	for from := time.Duration(0); from < 10*time.Second; from += time.Second {
		shed, offered := r.shedFraction(from, from+time.Second)
		perSecond = append(perSecond, fmt.Sprintf("%.1f%%", 100*float64(shed)/float64(offered)))
	}
	t.Logf("shed per second: %s; limit: %s", strings.Join(perSecond, " "), traceString(r.trace, 0, 10*time.Second, time.Second))
	if shed, offered := r.shedFraction(6*time.Second, 10*time.Second); float64(shed) > 0.01*float64(offered) {
		t.Errorf("%d of %d shed from 6 s on at 0.7 × capacity, want under 1%%", shed, offered)
	}
}
