package hotkey

import "slices"

// MaxBlocks bounds the blocks one key holds on an instance: one more is
// fetched only while what is held is below the lead (see Size), so a
// ledger at its bound holds several leads' worth.
const MaxBlocks = 16

// Ledger is one key's blocks on this instance, in the order they were
// taken. It is not safe for concurrent use: its owner locks it.
type Ledger struct {
	blocks [MaxBlocks]Block
	n      int
	nextID uint64
}

// Taken is what one take spent, run by run, so that it can be put back (a
// request whose other buckets denied it).
type Taken struct {
	parts [maxParts]part
	n     int
	due   int64 // the store's µs at which the last token taken is due
}

// maxParts bounds the runs one take spends: of each block, its holes and
// its unspent tail.
const maxParts = MaxBlocks * (maxHoles + 1)

type part struct {
	id     uint64
	start  int64 // the run's first token, in its block
	tokens int64
	due    int64 // the store's µs at which the run's last token is due
}

// Tokens is the tokens the take spent.
func (t Taken) Tokens() int64 {
	var n int64
	for _, p := range t.parts[:t.n] {
		n += p.tokens
	}
	return n
}

// Due is the store's µs at which the last token the take spent is due: a
// give-back of them is worth the tokens still due when it reaches the
// store (see Return).
func (t Taken) Due() int64 { return t.due }

// Return is tokens to give back to the store: Tokens of a bucket whose
// last is due at the store's µs Due. The store gives back only those still
// due when the give-back reaches it: one that comes later would hand out
// again tokens the bucket has refilled since.
type Return struct{ Tokens, Due int64 }

// Add appends a block (dropping those with nothing left at now); false
// when the ledger holds MaxBlocks already.
func (l *Ledger) Add(b Block, now int64) bool {
	l.compact(now)
	if l.n == MaxBlocks || b.Size <= 0 {
		return false
	}
	l.nextID++
	b.ID, b.Spent, b.nh = l.nextID, 0, 0
	l.blocks[l.n] = b
	l.n++
	return true
}

// End is the store's µs at which the last token held is due (0: none).
func (l *Ledger) End() int64 {
	var end int64
	for i := range l.n {
		end = max(end, l.blocks[i].End)
	}
	return end
}

// Blocks is the number of blocks held.
func (l *Ledger) Blocks() int { return l.n }

// Unspent is the tokens of every block neither spent nor lapsed at now,
// ready or not.
func (l *Ledger) Unspent(now int64) int64 {
	var n int64
	for i := range l.n {
		n += l.blocks[i].live(now)
	}
	return n
}

// Ready is the unspent tokens that may be spent at now.
func (l *Ledger) Ready(now int64) int64 {
	var n int64
	for i := range l.n {
		n += l.blocks[i].valid(now)
	}
	return n
}

// Next is the local µs (now or later) from which one more unspent token
// may be spent, and false when none will be.
func (l *Ledger) Next(now int64) (int64, bool) {
	at, ok := int64(0), false
	for i := range l.n {
		if t, has := l.blocks[i].nextReady(now); has && (!ok || t < at) {
			at, ok = t, true
		}
	}
	return at, ok
}

// When is the earliest local µs, now or later, at which cost unspent
// tokens may all be spent at once, and false when that never comes (fewer
// are held, or they lapse before enough are ready).
func (l *Ledger) When(cost, now int64) (int64, bool) {
	if cost <= 0 {
		return now, true
	}
	at := now
	for {
		if l.Ready(at) >= cost {
			return at, true
		}
		// The next instant a token's window opens: only then can more be
		// spendable at once.
		next, ok := int64(0), false
		for i := range l.n {
			b := &l.blocks[i]
			if j := b.readyBy(at); j < b.Size {
				if t := b.First + j*b.Interval; !ok || t < next {
					next, ok = t, true
				}
			}
		}
		if !ok || l.Unspent(next) < cost {
			return 0, false
		}
		at = next
	}
}

// Take spends cost tokens if they may all be spent at once by now + wait:
// ok, the local µs at which they are (at most now + wait; now when they all
// may be already) and what was spent, to put back. When they cannot, at is
// when they could (false ok, at 0 when that never comes).
func (l *Ledger) Take(cost, now, wait int64) (ok bool, at int64, t Taken) {
	at, held := l.When(cost, now)
	if !held {
		return false, 0, t
	}
	if at > now+wait {
		return false, at, t
	}
	left := cost
	for i := 0; i < l.n && left > 0; i++ {
		b := &l.blocks[i]
		lo, hi := b.lapsedBy(at), b.readyBy(at)
		// The runs put back first: their tokens lapse before the tail's.
		for k := 0; k < b.nh && left > 0; k++ {
			h := &b.holes[k]
			from := max(h.start, lo)
			n := min(left, max(0, min(h.start+h.n, hi)-from))
			if n == 0 {
				continue
			}
			t.add(part{id: b.ID, start: from, tokens: n, due: b.due(from + n - 1)})
			left -= n
			// What is left of the hole: before the run taken (lapsed by
			// now, gone) and after it.
			if end := h.start + h.n; from+n < end {
				h.start, h.n = from+n, end-(from+n)
			} else {
				h.n = 0
			}
		}
		b.dropEmptyHoles()
		from := max(b.Spent, lo)
		n := min(left, max(0, hi-from))
		if n == 0 {
			continue
		}
		t.add(part{id: b.ID, start: from, tokens: n, due: b.due(from + n - 1)})
		b.Spent = from + n
		left -= n
	}
	return true, at, t
}

// add records a run spent.
func (t *Taken) add(p part) {
	t.parts[t.n] = p
	t.n++
	t.due = max(t.due, p.due)
}

// PutBack returns what a take spent to the blocks it came from: a run is
// unspent again in its own place, so its tokens keep their own windows.
// What cannot be (its block gone since: dropped, given back; or a block
// with too many runs put back already) is returned for the caller to give
// back to the store itself.
func (l *Ledger) PutBack(t Taken) (gone []Return) {
	for _, p := range t.parts[:t.n] {
		b := l.byID(p.id)
		switch {
		case b == nil:
		case p.start+p.tokens == b.Spent:
			b.Spent = p.start // the tail again
			b.mergeHoles()
			continue
		case b.nh < maxHoles:
			b.holes[b.nh] = span{p.start, p.tokens}
			b.nh++
			continue
		}
		gone = append(gone, Return{Tokens: p.tokens, Due: p.due})
	}
	return gone
}

// byID is the block of the given id, or nil.
func (l *Ledger) byID(id uint64) *Block {
	for i := range l.n {
		if l.blocks[i].ID == id {
			return &l.blocks[i]
		}
	}
	return nil
}

// mergeHoles folds into the tail the holes that now end where it begins.
func (b *Block) mergeHoles() {
	for again := true; again; {
		again = false
		for k := 0; k < b.nh; k++ {
			if h := b.holes[k]; h.n > 0 && h.start+h.n == b.Spent {
				b.Spent = h.start
				b.holes[k].n = 0
				again = true
			}
		}
	}
	b.dropEmptyHoles()
}

// dropEmptyHoles removes holes with no token left.
func (b *Block) dropEmptyHoles() {
	k := 0
	for i := 0; i < b.nh; i++ {
		if b.holes[i].n > 0 {
			b.holes[k] = b.holes[i]
			k++
		}
	}
	b.nh = k
}

// Expire drops the blocks taken before now − maxAge, and those with
// nothing left at now, and returns what is left of them, for the caller to
// give back, the latest taken first (see Drop).
func (l *Ledger) Expire(now, maxAge int64) (returned []Return) {
	k := 0
	for i := range l.n {
		b := l.blocks[i]
		left := b.live(now)
		if now-b.Taken > maxAge || left == 0 {
			if left > 0 {
				returned = append(returned, Return{Tokens: left, Due: b.End})
			}
			continue
		}
		l.blocks[k] = b
		k++
	}
	l.n = k
	slices.Reverse(returned)
	return returned
}

// Drop drops every block and returns what is left of them at now, the
// latest taken first: a block's tokens go back only while they end the
// bucket's line, which the later blocks' going back first leaves them
// doing.
func (l *Ledger) Drop(now int64) (returned []Return) {
	for i := l.n - 1; i >= 0; i-- {
		if left := l.blocks[i].live(now); left > 0 {
			returned = append(returned, Return{Tokens: left, Due: l.blocks[i].End})
		}
	}
	l.n = 0
	return returned
}

// compact drops the blocks with nothing left at now (a take put back
// later finds its block gone: its caller gives them back to the store).
func (l *Ledger) compact(now int64) {
	k := 0
	for i := range l.n {
		if l.blocks[i].live(now) > 0 {
			l.blocks[k] = l.blocks[i]
			k++
		}
	}
	l.n = k
}

// Total is the tokens of returns.
func Total(rs []Return) int64 {
	var n int64
	for _, r := range rs {
		n += r.Tokens
	}
	return n
}
