package hotkey

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

// Taken is what one take spent, block by block, so that it can be put back
// (a request whose other buckets denied it).
type Taken struct {
	parts [MaxBlocks]part
	n     int
}

type part struct {
	id     uint64
	tokens int64
}

// Tokens is the tokens the take spent.
func (t Taken) Tokens() int64 {
	var n int64
	for _, p := range t.parts[:t.n] {
		n += p.tokens
	}
	return n
}

// Add appends a block (dropping those all spent); false when the ledger
// holds MaxBlocks already.
func (l *Ledger) Add(b Block) bool {
	l.compact()
	if l.n == MaxBlocks || b.Size <= 0 {
		return false
	}
	l.nextID++
	b.ID, b.Spent = l.nextID, 0
	l.blocks[l.n] = b
	l.n++
	return true
}

// Blocks is the number of blocks held.
func (l *Ledger) Blocks() int { return l.n }

// Unspent is the tokens of every block not spent yet, ready or not.
func (l *Ledger) Unspent() int64 {
	var n int64
	for i := range l.n {
		n += l.blocks[i].Left()
	}
	return n
}

// Ready is the unspent tokens that may be spent by now.
func (l *Ledger) Ready(now int64) int64 {
	var n int64
	for i := range l.n {
		n += l.blocks[i].Ready(now)
	}
	return n
}

// Next is the local µs from which one more unspent token may be spent,
// and false when none is held.
func (l *Ledger) Next() (int64, bool) {
	at, ok := int64(0), false
	for i := range l.n {
		b := &l.blocks[i]
		if b.Left() > 0 && (!ok || b.next() < at) {
			at, ok = b.next(), true
		}
	}
	return at, ok
}

// When is the earliest local µs by which cost unspent tokens may be spent
// (now when they may be already), and false when fewer than cost are held.
func (l *Ledger) When(cost, now int64) (int64, bool) {
	if cost <= 0 {
		return now, true
	}
	if l.Unspent() < cost {
		return 0, false
	}
	if l.Ready(now) >= cost {
		return now, true
	}
	// The latest token held is ready by hi: search the first µs at which
	// cost are.
	lo, hi := now, now
	for i := range l.n {
		b := &l.blocks[i]
		if b.Left() > 0 {
			hi = max(hi, b.First+(b.Size-1)*b.Interval)
		}
	}
	for lo < hi {
		mid := lo + (hi-lo)/2
		if l.Ready(mid) >= cost {
			hi = mid
		} else {
			lo = mid + 1
		}
	}
	return hi, true
}

// Take spends cost tokens if they may all be spent by now + wait: ok, the
// local µs by which the last of them may be (at most now + wait; now when
// they all may be already) and what was spent, to put back. When they
// cannot, at is when they could (false ok, at 0 when fewer are held).
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
		k := min(left, max(0, b.ready(at)-b.Spent))
		if k == 0 {
			continue
		}
		b.Spent += k
		left -= k
		t.parts[t.n] = part{b.ID, k}
		t.n++
	}
	return true, at, t
}

// PutBack returns what a take spent to the blocks it came from, and
// returns the tokens of blocks that are gone since (dropped, given back):
// the caller gives those back to the store itself.
func (l *Ledger) PutBack(t Taken) (gone int64) {
	for _, p := range t.parts[:t.n] {
		found := false
		for i := range l.n {
			if b := &l.blocks[i]; b.ID == p.id {
				b.Spent -= p.tokens
				found = true
				break
			}
		}
		if !found {
			gone += p.tokens
		}
	}
	return gone
}

// Expire drops the blocks taken before now − maxAge, and those all spent,
// and returns their unspent tokens, for the caller to give back.
func (l *Ledger) Expire(now, maxAge int64) (returned int64) {
	k := 0
	for i := range l.n {
		b := l.blocks[i]
		if now-b.Taken > maxAge || b.Left() == 0 {
			returned += b.Left()
			continue
		}
		l.blocks[k] = b
		k++
	}
	l.n = k
	return returned
}

// Drop drops every block and returns their unspent tokens.
func (l *Ledger) Drop() (returned int64) {
	returned = l.Unspent()
	l.n = 0
	return returned
}

// compact drops the blocks whose tokens are all spent (a take put back
// later finds its block gone: its caller gives them back to the store).
func (l *Ledger) compact() {
	k := 0
	for i := range l.n {
		if l.blocks[i].Left() > 0 {
			l.blocks[k] = l.blocks[i]
			k++
		}
	}
	l.n = k
}
