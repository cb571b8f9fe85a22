package sim

import (
	"fmt"
	"math"
)

// Window checks one bucket's admissions against what a token bucket
// promises over every interval [a, b]: at most its burst plus what its
// rate refills in b − a, plus what an operator added within it (a reset,
// a grant; Bonus, for what instances held at a reset). An admission counts the tokens it kept: its cost, less what
// was given back to the store for it later (a response charge_if did not
// match, a settle below its reservation), attributed to when it was
// admitted. Where limits change (a reload, a plan, an override) the bound
// is the most generous in force: the largest burst the bucket ever had,
// and the fastest rate in force at each instant (a limit being replaced
// stays in force for as long as the caller says: the instances still
// deciding under it). Each admission is checked against every interval
// ending at it, in O(1) amortized time: C_j − F_j ≤ B + min over i ≤ j of
// (C_{i−1} − F_i), where C counts the tokens kept and F the refill and
// the operators' additions.
type Window struct {
	limits []inForce
	burst  int64   // the largest burst in force so far
	at     int64   // µs to which f is integrated
	f      float64 // the refill to at, plus the additions so far
	total  int64   // tokens kept by every admission
	kept   []int64 // per admission
	times  []int64 // per admission, µs
	mins   prefixMins
	bonus  []bonus
}

// bonus is what intervals starting within [from, until] may admit more.
type bonus struct{ tokens, from, until int64 }

type inForce struct {
	interval int64 // µs a token
	until    int64 // µs it stays in force until; 0: until replaced
}

// epsilon absorbs the float sums of the refill.
const epsilon = 1e-6

// NewWindow is a bucket of the given limit, full at the µs at.
func NewWindow(interval, burst, at int64) *Window {
	return &Window{limits: []inForce{{interval: interval}}, burst: burst, at: at}
}

// Limit puts a new limit in force from the µs at; the limits in force
// before stay in force until keepOld (at the latest; 0: until EndOld).
func (w *Window) Limit(interval, burst, at, keepOld int64) {
	w.advance(at)
	for i := range w.limits {
		if keepOld != 0 && (w.limits[i].until == 0 || w.limits[i].until > keepOld) {
			w.limits[i].until = max(keepOld, at)
		}
	}
	w.limits = append(w.limits, inForce{interval: interval})
	w.burst = max(w.burst, burst)
}

// EndOld ends, at the µs at (or later, when they were kept longer), the
// limits in force before the last: the store reads a bucket under a new
// limit only when a decision writes it, and until then it refills at the
// rate it was written under.
func (w *Window) EndOld(at int64) {
	at = max(at, w.at) // integrated to w.at already
	for i := range w.limits[:len(w.limits)-1] {
		if l := &w.limits[i]; l.until == 0 || l.until < at {
			l.until = at
		}
	}
}

// Add adds tokens at the µs at: a reset (a whole burst: Burst) or a grant.
func (w *Window) Add(tokens, at int64) {
	w.advance(at)
	w.f += float64(tokens)
}

// Bonus lets intervals that start within [from, until] (µs) admit tokens
// more: a reset makes the bucket full while instances still hold tokens
// taken before it, which they spend until the reset reaches them.
func (w *Window) Bonus(tokens, from, until int64) {
	w.bonus = append(w.bonus, bonus{tokens, from, until})
}

// Burst is the largest burst in force so far.
func (w *Window) Burst() int64 { return w.burst }

// Admit records an admission of tokens at the µs at (never before the
// last) and checks every interval ending at it. It returns the
// admission's id, for Refund, and the worst interval when one is over.
func (w *Window) Admit(tokens, at int64) (id int, over *Over) {
	w.advance(at)
	id = len(w.kept)
	extra := int64(0)
	for _, b := range w.bonus {
		if b.from <= at && at <= b.until {
			extra += b.tokens
		}
	}
	w.mins.push(float64(w.total+extra) - w.f)
	w.kept = append(w.kept, tokens)
	w.times = append(w.times, at)
	w.total += tokens
	m, i := w.mins.min()
	if excess := float64(w.total) - w.f - m - float64(w.burst); excess > epsilon {
		var in int64
		for k := i; k <= id; k++ {
			in += w.kept[k]
		}
		return id, &Over{From: w.times[i], To: at, Tokens: in, Bound: float64(in) - excess, Admissions: id - i + 1}
	}
	return id, nil
}

// Refund records that tokens of admission id went back to the store.
func (w *Window) Refund(id int, tokens int64) {
	if tokens <= 0 {
		return
	}
	w.kept[id] -= tokens
	w.total -= tokens
	w.mins.addAfter(id, -float64(tokens))
}

// Admitted is the tokens kept so far.
func (w *Window) Admitted() int64 { return w.total }

// advance integrates the fastest rate in force up to the µs to.
func (w *Window) advance(to int64) {
	for w.at < to {
		end := to
		rate := 0.0
		for _, l := range w.limits {
			if l.until != 0 && l.until <= w.at {
				continue
			}
			rate = math.Max(rate, 1/float64(l.interval))
			if l.until != 0 && l.until < end {
				end = l.until
			}
		}
		w.f += float64(end-w.at) * rate
		w.at = end
		k := 0
		for _, l := range w.limits {
			if l.until == 0 || l.until > w.at {
				w.limits[k] = l
				k++
			}
		}
		w.limits = w.limits[:k]
	}
}

// Limits says the limits in force, for a failure's message.
func (w *Window) Limits() string {
	var b []byte
	for _, l := range w.limits {
		b = fmt.Appendf(b, "[%d µs a token until %d] ", l.interval, l.until)
	}
	return fmt.Sprintf("%sburst %d, at %d µs", b, w.burst, w.at)
}

// Over is an interval over the bound.
type Over struct {
	From, To   int64 // µs of its first and last admission
	Tokens     int64 // kept by its admissions
	Bound      float64
	Admissions int
}

func (o *Over) String() string {
	return fmt.Sprintf("%d tokens kept by %d admissions from %d to %d µs (%.3f s), over the bound of %.2f (burst + rate × T + added)",
		o.Tokens, o.Admissions, o.From, o.To, float64(o.To-o.From)/1e6, o.Bound)
}

// prefixMins keeps values, one per admission, with additions to every
// value after an index, and answers the least of them all: blocks of
// values, each with its own addition and least value.
type prefixMins struct {
	vals   []float64
	blocks []minBlock
}

type minBlock struct {
	add, min float64
}

const blockLen = 64

func (p *prefixMins) push(v float64) {
	i := len(p.vals)
	if i%blockLen == 0 {
		p.blocks = append(p.blocks, minBlock{min: math.Inf(1)})
	}
	b := &p.blocks[i/blockLen]
	p.vals = append(p.vals, v-b.add)
	b.min = math.Min(b.min, v-b.add)
}

// addAfter adds d to every value after index id.
func (p *prefixMins) addAfter(id int, d float64) {
	from := id + 1
	if from >= len(p.vals) {
		return
	}
	bi := from / blockLen
	if from%blockLen != 0 { // the rest of a partial block, one by one
		b := &p.blocks[bi]
		end := min(len(p.vals), (bi+1)*blockLen)
		for k := from; k < end; k++ {
			p.vals[k] += d
		}
		b.min = math.Inf(1)
		for k := bi * blockLen; k < end; k++ {
			b.min = math.Min(b.min, p.vals[k])
		}
		bi++
	}
	for ; bi < len(p.blocks); bi++ {
		p.blocks[bi].add += d
	}
}

// min is the least value and its index.
func (p *prefixMins) min() (float64, int) {
	best, at := math.Inf(1), -1
	for bi, b := range p.blocks {
		if v := b.min + b.add; v < best {
			best, at = v, bi
		}
	}
	if at < 0 {
		return 0, 0
	}
	end := min(len(p.vals), (at+1)*blockLen)
	for k := at * blockLen; k < end; k++ {
		if p.vals[k]+p.blocks[at].add == best {
			return best, k
		}
	}
	return best, at * blockLen
}
