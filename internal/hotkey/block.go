// Package hotkey holds the pure parts of deciding a hot key's requests on
// one instance from blocks of the key's tokens: a block is taken from the
// shared bucket in one atomic decision (debited there first, on the
// store's clock) and then spent here, token by token, only while the
// bucket's own schedule would have let each go. It never imports the
// module's root: the store, the clock and the metrics are the caller's.
//
// The bucket is GCRA: its state is a theoretical arrival time (TAT); taking
// k tokens moves it k intervals forward, and a take is admitted while the
// TAT it leaves is at most tau (burst × interval) ahead of now, or tau plus
// a wait when the take may reserve future tokens. A block of B tokens taken
// from a TAT base (the TAT before, or now when that is in the past) holds
// the tokens due at s_j = base + (j+1)·interval, j = 0 … B−1. Token j may be
// spent while the store's clock is within [s_j − tau, s_j − interval]:
// exactly when a request taking it alone would have been admitted (a take
// at t leaves a TAT within [t + interval, t + tau]). A token held past that
// lapses: it is neither spent nor given back once due (the bucket has
// refilled through it; giving it back would hand it out twice). Every
// token admitted at time t, by a block or by the store, then has its due
// within [t + interval, t + tau], one token a due; so over any interval T
// the tokens admitted are at most burst + rate × T, as one bucket's. See
// the module's docs/hot-keys.md.
package hotkey

// Block is a run of tokens one decision took from a bucket, and which of
// them this instance has spent. Token j (0-based) may be spent from the
// local time First + j·Interval until Last + j·Interval, inclusive.
type Block struct {
	ID       uint64
	First    int64 // local µs from which token 0 may be spent
	Last     int64 // local µs until which token 0 may be spent: the store's clock has not passed its due yet
	Interval int64 // µs between two tokens (the limit the block was decided under)
	Size     int64 // tokens taken
	// End is the store's µs at which the last token is due (the TAT the
	// take left): what a give-back of the block's tokens says of them.
	End int64
	// Spent: the first Spent tokens are spent or lapsed, but for the
	// holes: runs below Spent that a take put back (PutBack).
	Spent int64
	holes [maxHoles]span
	nh    int
	Taken int64 // local µs at which the block was taken: its age
}

// maxHoles bounds the runs a block keeps of tokens put back out of order;
// beyond it, a run put back goes to the caller (gone).
const maxHoles = 2

// span is a run of a block's tokens: n from index start.
type span struct{ start, n int64 }

// Spendable is the local µs from which token 0 of a block may be spent, and
// until which it may be. tatBefore is the bucket's TAT before the take,
// redisNow the store's clock in that decision (both in the store's µs);
// sent is a local µs at or before which the call was sent, received one at
// or after which its reply came back; interval and tau are the limit the
// take was decided under. The store read its clock after sent and before
// received, so at local time L its clock reads at least redisNow + (L −
// received) and at most redisNow + (L − sent): token 0, due at base +
// interval, may go from base + interval − tau, which the lower bound
// reaches at first, until base, which the upper bound reaches at last.
// The window is tau less an interval and the round trip: a round trip that
// long leaves nothing to spend (last < first).
func Spendable(tatBefore, redisNow, sent, received, interval, tau int64) (first, last int64) {
	base := max(tatBefore, redisNow)
	return received + (base + interval - tau - redisNow), sent + (base - redisNow)
}

// Schedule is the local µs from which token 0 of a block may be spent (see
// Spendable, whose first it is).
func Schedule(tatBefore, redisNow, received, interval, tau int64) int64 {
	base := max(tatBefore, redisNow)
	return received + (base + interval - tau - redisNow)
}

// readyBy is how many of the block's tokens may be spent by now (spent,
// lapsed or not): those whose window has opened.
func (b *Block) readyBy(now int64) int64 {
	if now < b.First {
		return 0
	}
	return min(b.Size, (now-b.First)/b.Interval+1)
}

// lapsedBy is how many of the block's first tokens lapsed by now: their
// window closed.
func (b *Block) lapsedBy(now int64) int64 {
	if now <= b.Last {
		return 0
	}
	return min(b.Size, (now-b.Last-1)/b.Interval+1)
}

// valid is how many unspent tokens of the block may be spent at now.
func (b *Block) valid(now int64) int64 {
	lo, hi := b.lapsedBy(now), b.readyBy(now)
	n := max(0, hi-max(lo, b.Spent))
	for _, h := range b.holes[:b.nh] {
		n += max(0, min(h.start+h.n, hi)-max(h.start, lo))
	}
	return n
}

// live is the block's tokens neither spent nor lapsed at now, ready or not.
func (b *Block) live(now int64) int64 {
	lo := b.lapsedBy(now)
	n := b.Size - max(lo, b.Spent)
	for _, h := range b.holes[:b.nh] {
		n += max(0, h.start+h.n-max(h.start, lo))
	}
	return n
}

// Ready is how many unspent tokens of the block may be spent at now.
func (b *Block) Ready(now int64) int64 { return b.valid(now) }

// Left is the block's unspent tokens at now, ready or not (lapsed ones are
// gone).
func (b *Block) Left(now int64) int64 { return b.live(now) }

// nextReady is the local µs from which the next of its unspent tokens
// (not lapsed by then) may be spent, and false when none will be.
func (b *Block) nextReady(now int64) (int64, bool) {
	best, ok := int64(0), false
	consider := func(j int64) {
		if j >= b.Size {
			return
		}
		at := max(now, b.First+j*b.Interval)
		if at > b.Last+j*b.Interval {
			return // lapsed by the time it is ready: never
		}
		if !ok || at < best {
			best, ok = at, true
		}
	}
	lo := b.lapsedBy(now)
	for _, h := range b.holes[:b.nh] {
		if j := max(h.start, lo); j < h.start+h.n {
			consider(j)
		}
	}
	consider(max(b.Spent, lo))
	return best, ok
}

// due is the store's µs at which token j is due.
func (b *Block) due(j int64) int64 { return b.End - (b.Size-1-j)*b.Interval }
