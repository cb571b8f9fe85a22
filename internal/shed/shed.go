// Package shed is the adaptive, per-instance part of a shed policy
// (shed { latency D }): how many requests this instance lets in flight,
// learned from the latency of the requests it passed, with priority classes
// that keep the last places for the higher classes. No Redis: each
// instance measures what it sees. The policy's side (its config, the
// request path, metrics) is the root's shed_policy.go.
package shed

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Priority classes: priority <placeholder> { <class> <share>% ... }, highest
// first. A share is kept in basis points (1/100 of a percent), so a class's
// slots are integer arithmetic that the script can repeat exactly for
// shed { concurrent N }.

// Whole is a share of 100%, in basis points.
const Whole = 10000

// ParseShare reads a class's share: "80%", "12.5%" (at most two decimals),
// above 0% and at most 100%. It returns basis points.
func ParseShare(s string) (int64, error) {
	num, ok := strings.CutSuffix(s, "%")
	if !ok {
		return 0, fmt.Errorf("share %q: want a percentage such as 80%%", s)
	}
	whole, frac, dotted := strings.Cut(num, ".")
	if whole == "" || len(frac) > 2 || (dotted && frac == "") || strings.Trim(whole+frac, "0123456789") != "" || len(whole) > 3 {
		return 0, fmt.Errorf("share %q: want a percentage above 0%% and at most 100%%, with at most two decimals", s)
	}
	w, _ := strconv.ParseInt(whole, 10, 64)
	f, _ := strconv.ParseInt((frac + "00")[:2], 10, 64)
	bp := w*100 + f
	if bp <= 0 || bp > Whole {
		return 0, fmt.Errorf("share %q: want a percentage above 0%% and at most 100%%", s)
	}
	return bp, nil
}

// Classes are a policy's priority classes, highest first. A value that
// names no class (empty, unknown, hostile) is the lowest class.
type Classes struct {
	names  []string
	shares []int64 // basis points, strictly decreasing
	index  map[string]int
}

// NewClasses checks the classes as configured: at least one, names
// non-empty and distinct, shares (basis points, from ParseShare) above 0,
// at most 100% and strictly decreasing. Without a priority block a policy
// has one class: NewClasses([]string{""}, []int64{Whole}).
func NewClasses(names []string, shares []int64) (*Classes, error) {
	if len(names) == 0 || len(names) != len(shares) {
		return nil, fmt.Errorf("priority: want one share per class, at least one class")
	}
	c := &Classes{names: names, shares: shares, index: make(map[string]int, len(names))}
	for i, name := range names {
		if name == "" && len(names) > 1 {
			return nil, fmt.Errorf("priority: class %d has no name", i+1)
		}
		if _, dup := c.index[name]; dup {
			return nil, fmt.Errorf("priority: class %q is listed twice", name)
		}
		c.index[name] = i
		if shares[i] <= 0 || shares[i] > Whole {
			return nil, fmt.Errorf("priority: class %q: share must be above 0%% and at most 100%%", name)
		}
		if i > 0 && shares[i] >= shares[i-1] {
			return nil, fmt.Errorf("priority: class %q: share %s is not below %q's %s: list classes highest first, shares decreasing",
				name, FormatShare(shares[i]), names[i-1], FormatShare(shares[i-1]))
		}
	}
	return c, nil
}

// FormatShare writes a share in basis points as a percentage: 80%, 12.5%.
func FormatShare(bp int64) string {
	if bp%100 == 0 {
		return strconv.FormatInt(bp/100, 10) + "%"
	}
	return strconv.FormatFloat(float64(bp)/100, 'f', -1, 64) + "%"
}

// Of is the class of a request's priority value: its index, or the lowest
// class's when the value names none.
func (c *Classes) Of(value string) int {
	if i, ok := c.index[value]; ok {
		return i
	}
	return len(c.names) - 1
}

// Name is a class's configured name: a metric label may carry it.
func (c *Classes) Name(class int) string { return c.names[class] }

// Names are the classes' names, highest first; not to be changed.
func (c *Classes) Names() []string { return c.names }

// Shares are the classes' shares in basis points, highest first; not to be
// changed.
func (c *Classes) Shares() []int64 { return c.shares }

// ClassLimit is how many requests, all classes together, may be in flight
// when one of a class with share bp is admitted, out of limit: its share,
// rounded down, so the last slots stay for the higher classes; but the
// highest class (top) always gets at least floor, however small its share.
// The same rule serves shed { concurrent N } (with floor 1).
func ClassLimit(limit, bp int64, top bool, floor int64) int64 {
	n := limit / Whole * bp // exact for a large limit, no overflow
	n += limit % Whole * bp / Whole
	if top {
		n = max(n, min(floor, limit))
	}
	return n
}

// The controller follows Netflix concurrency-limits' Gradient2Limit inside
// its WindowedLimit (github.com/Netflix/concurrency-limits) and Envoy's
// adaptive concurrency gradient controller (envoyproxy.io, http filter
// adaptive_concurrency), adapted to an absolute latency target D: where
// those compare a window's latency with a baseline they learn (Gradient2's
// long-term average, which drifts up under sustained load; Envoy's minRTT,
// re-measured with the limit pinned low, which its docs warn causes 503
// bursts), admission here shrinks when the upstream's latency rises above D.
//
// Per window of latencies of the requests passed (admission to done):
//
//   - p90 > D: the upstream queues. The limit becomes what Little's law
//     says keeps latency at D: the window's throughput (finished per
//     second) × D. A saturated upstream's throughput is its capacity, so
//     that many in flight wait about D; unlike Gradient2's limit × gradient
//     it does not depend on the limit being what binds (a limit far above
//     what is in flight is not cut by a mere gradient). Never below half
//     the limit (Gradient2's gradient floor of 0.5, against outliers),
//     never above it (a decrease never grows it).
//   - p95 <= D and the limit used: grow by √limit (Envoy's headroom). Used
//     is Gradient2's "app limited" rule (at least half the limit in
//     flight), widened to the classes: or some request was shed, a lower
//     class shed while latency is within D being a limit too low. So an
//     idle instance does not inflate its limit. Until the first window
//     above D, growth doubles the limit while it binds (up to twice the
//     most in flight: TCP's slow start): a fresh instance in front of an
//     upstream that runs hundreds at once finds its limit in seconds,
//     where √limit steps from the initial 20 take tens of them, shedding
//     the lower classes meanwhile (simulated, at 0.7 × the capacity of
//     c = 100 with the design's classes: 66% shed in the first second,
//     11% in the fourth, none from the seventh, against 75%, 50% and 22%
//     in the eighth). A lower class shed while the limit does not bind
//     grows it by √limit only: doubling then (up to twice the limit) only
//     brings forward the limit an overload after calm traffic starts from
//     (the share that covers the lowest class's bursts), and with it the
//     first second's queue.
//   - between: hold. The band between p90 and p95 is what keeps the limit
//     from cycling around D.
//
// Each move goes half way (Gradient2 smooths by 0.2; half is quicker to
// recover and still damps the window's lag), so a decision takes at most a
// quarter off; the limit stays within [minLimit, maxLimit].
//
// Why p90 and p95, not Envoy's p50: queueing delays every request, so the
// tail sees it as early as the median does, and the latency a tenth of the
// requests get is what users feel. A minority of naturally slow requests
// (an export route) does not stop growth up to 5% of them, and above 10%
// moves the limit only to throughput × D, which stays above what is in
// flight while the mean latency is within D: no collapse to the floor, as
// a p99 rule would do for 1% of slow requests. Set D above the normal p95.
//
// A window lasts 2·D (WindowedLimit waits twice the sample latency, so a
// window sees requests admitted under the last limit), between 10 ms and
// 1 s, and decides on at least minSamples latencies, or on any after
// ten windows' time at a trickle. It closes early, once D has passed, when
// more than a tenth of minSamples or more exceed D: an overload's first
// window does not wait its full length, and a decrease is never decided on
// latencies that all finished within D of the last one. It keeps at most
// maxSamples latencies (reservoir sampling): fixed memory whatever the
// rate.
const (
	minLimit   = 4    // the least the limit goes to: the highest class always has that many slots
	Initial    = 20   // the limit before any window (Gradient2's initial limit)
	maxLimit   = 1000 // the most the limit grows to (Envoy's default max_concurrency_limit)
	maxSamples = 256  // latencies kept per window: 2 KiB
	minSamples = 10   // a window decides on at least this many (WindowedLimit's windowSize)
	smoothing  = 0.5  // how far a window moves the limit towards its new value
	minWindow  = 10 * time.Millisecond
	maxWindow  = time.Second
	lowTraffic = 10 // windows' time after which fewer samples decide
)

// Limiter is one shed policy's adaptive in-flight limit on this
// instance. Admit costs an atomic load and a compare-and-swap, Done an
// atomic add and a short mutex; safe for concurrent use.
type Limiter struct {
	target time.Duration
	window time.Duration
	shares []int64 // basis points, highest class first
	now    func() time.Time

	current  atomic.Int64 // the limit, as admit reads it
	inflight atomic.Int64 // all classes together
	denied   atomic.Bool  // a request was shed in this window

	mu        sync.Mutex
	estimate  float64   // the limit, unrounded
	congested bool      // a window was above the target: slow start is over
	start     time.Time // of the window
	samples   [maxSamples]time.Duration
	kept      int   // samples[:kept] hold latencies
	seen      int   // latencies offered in this window
	over      int   // of which above the target
	peak      int64 // most in flight seen at a finish in this window
	rng       uint64
}

// NewLimiter makes the controller of shed { latency target } for the
// classes' shares (basis points, highest first: Classes.Shares, or
// []int64{Whole} without classes). now is the clock: time.Now outside
// tests.
func NewLimiter(target time.Duration, shares []int64, now func() time.Time) *Limiter {
	l := &Limiter{
		target:   target,
		window:   min(max(2*target, minWindow), maxWindow),
		shares:   shares,
		now:      now,
		estimate: Initial,
		rng:      0x9e3779b97f4a7c15,
	}
	l.current.Store(Initial)
	return l
}

// Target is the latency the limiter keeps its upstream within: its D.
func (l *Limiter) Target() time.Duration { return l.target }

// Shares are the classes' shares it was made for; not to be changed.
func (l *Limiter) Shares() []int64 { return l.shares }

// Limit is the current adaptive limit: caddy_rate_limit_shed_limit.
func (l *Limiter) Limit() int64 { return l.current.Load() }

// InFlight is how many admitted requests have not finished.
func (l *Limiter) InFlight() int64 { return l.inflight.Load() }

// slots is how many may be in flight, all classes together, when a request
// of class is admitted. A class out of range is the lowest.
func (l *Limiter) slots(class int) int64 {
	if class < 0 || class >= len(l.shares) {
		class = len(l.shares) - 1
	}
	return ClassLimit(l.current.Load(), l.shares[class], class == 0, minLimit)
}

// Ticket is an admitted request's slot. Exactly one of Done or Cancel
// must be called on it, once.
type Ticket struct {
	l     *Limiter
	start time.Time
}

// Admit lets a request of class in while fewer than its class's slots are
// in flight. Shed (false) otherwise.
func (l *Limiter) Admit(class int) (Ticket, bool) {
	n := l.slots(class)
	for {
		in := l.inflight.Load()
		if in >= n {
			if !l.denied.Load() { // one store per window, not a shared write per shed request
				l.denied.Store(true)
			}
			return Ticket{}, false
		}
		if l.inflight.CompareAndSwap(in, in+1) {
			return Ticket{l: l, start: l.now()}, true
		}
	}
}

// Done frees the slot when the handler chain has returned and counts the
// time since admission as a latency sample.
func (t Ticket) Done() {
	l := t.l
	now := l.now()
	in := l.inflight.Add(-1) + 1
	l.mu.Lock()
	l.record(now, now.Sub(t.start), in)
	l.mu.Unlock()
}

// Cancel frees the slot of a request that never reached the upstream (a
// policy decided with this one denied it): no latency sample.
func (t Ticket) Cancel() { t.l.inflight.Add(-1) }

// Passed restarts the ticket's clock when its request is passed on: the
// latency the controller learns from is the upstream's, not the time the
// request spent being decided (a Redis call, a `wait` of another policy).
// The slot is held from admission all the same.
func (t *Ticket) Passed() { t.start = t.l.now() }

// Resume starts the limit where another limiter of the same policy left it:
// a reload that changes the policy's target or classes keeps what was
// learned of the upstream.
func (l *Limiter) Resume(limit int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.estimate = float64(min(max(limit, minLimit), maxLimit))
	l.current.Store(int64(l.estimate))
}

// Latencies are the latencies the current window holds (every one up to
// maxSamples, in the order taken; a uniform sample past that), a copy:
// what its decision will read. For tests of what a policy's requests make
// the limiter measure.
func (l *Limiter) Latencies() []time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(l.samples[:l.kept])
}

// record takes one latency, finished at now with inflight in flight
// (itself included), and closes the window when it is due. Under l.mu.
func (l *Limiter) record(now time.Time, latency time.Duration, inflight int64) {
	if l.start.IsZero() {
		l.start = now
	}
	l.seen++
	if l.kept < len(l.samples) {
		l.samples[l.kept] = latency
		l.kept++
	} else if j := l.random(l.seen); j < len(l.samples) {
		l.samples[j] = latency // reservoir: every latency of the window equally likely kept
	}
	if latency > l.target {
		l.over++
	}
	l.peak = max(l.peak, inflight)
	elapsed := now.Sub(l.start)
	due := elapsed >= l.window && l.seen >= minSamples ||
		elapsed >= lowTraffic*l.window ||
		elapsed >= l.target && l.over >= minSamples && l.over*10 > l.seen
	if !due {
		return
	}
	s := l.samples[:l.kept]
	slices.Sort(s)
	throughput := float64(l.seen) / max(elapsed, time.Millisecond).Seconds()
	l.adapt(quantileOf(s, 0.90), quantileOf(s, 0.95), throughput, l.peak, l.denied.Swap(false))
	l.start, l.kept, l.seen, l.over, l.peak = now, 0, 0, 0, 0
}

// adapt moves the limit once per window from its latencies' p90 and p95,
// its throughput (finished per second), the most it saw in flight and
// whether it shed any.
func (l *Limiter) adapt(p90, p95 time.Duration, throughput float64, peak int64, denied bool) {
	est := l.estimate
	next := est
	switch {
	case p90 > l.target:
		next = min(max(throughput*l.target.Seconds(), est/2), est)
		l.congested = true
	case p95 <= l.target && (float64(peak) >= est/2 || denied):
		next = est + math.Sqrt(est)
		if !l.congested { // slow start: doubling while the limit itself binds
			next = max(next, min(2*est, 2*float64(peak)))
		}
	}
	est += (next - est) * smoothing
	est = min(max(est, minLimit), maxLimit)
	l.estimate = est
	l.current.Store(int64(est))
}

// random is uniform in [0, n): xorshift64*, under l.mu.
func (l *Limiter) random(n int) int {
	l.rng ^= l.rng >> 12
	l.rng ^= l.rng << 25
	l.rng ^= l.rng >> 27
	return int((l.rng * 2685821657736338717 >> 33) % uint64(n))
}

// quantileOf is the q-quantile of sorted s (nearest rank), 0 when empty.
func quantileOf(s []time.Duration, q float64) time.Duration {
	if len(s) == 0 {
		return 0
	}
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}
