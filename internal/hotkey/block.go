// Package hotkey holds the pure parts of deciding a hot key's requests on
// one instance from blocks of the key's tokens: a block is taken from the
// shared bucket in one atomic decision (debited there first, on the
// store's clock) and then spent here, token by token, no earlier than the
// bucket's own schedule would have let each go. It never imports the
// module's root: the store, the clock and the metrics are the caller's.
//
// The bucket is GCRA: its state is a theoretical arrival time (TAT); taking
// k tokens moves it k intervals forward, and a take is admitted while the
// TAT it leaves is at most tau (burst × interval) ahead of now, or tau plus
// a wait when the take may reserve future tokens. A block of B tokens taken
// from a TAT base (the TAT before, or now when that is in the past) holds
// the tokens due at base + (j+1)·interval, j = 0 … B−1; one due at s may be
// spent from the store's time s − tau on, exactly when a request taking it alone would
// have been admitted. However other instances take, reserve or give back,
// the tokens spent by any time t are then at most burst + rate × (t − t0):
// admitted never exceeds the budget.
package hotkey

// Block is a run of tokens one decision took from a bucket, and how many
// of them this instance has spent. Token j (0-based) may be spent from the
// local time First + j·Interval on.
type Block struct {
	ID       uint64
	First    int64 // local µs from which token 0 may be spent
	Interval int64 // µs between two tokens (the limit the block was decided under)
	Size     int64 // tokens taken
	Spent    int64 // tokens spent here: the first Spent of the block
	Taken    int64 // local µs at which the block was taken: its age
}

// Schedule is the local µs from which token 0 of a block may be spent.
// tatBefore is the bucket's TAT before the take, redisNow the store's clock
// in that decision (both in the store's µs), received a local µs at or
// after which the reply came back, and interval and tau the limit the take
// was decided under. The store read its clock before it replied, so at
// local time L its clock reads at least redisNow + (L − received): token j,
// due at base + (j+1)·interval and let go by the bucket at the store's time
// base + (j+1)·interval − tau, may go here once that bound reaches it. A later received only
// makes the schedule later.
func Schedule(tatBefore, redisNow, received, interval, tau int64) int64 {
	base := max(tatBefore, redisNow)
	return received + (base + interval - tau - redisNow)
}

// ready is how many of the block's tokens may be spent by now, spent or
// not.
func (b *Block) ready(now int64) int64 {
	if now < b.First {
		return 0
	}
	return min(b.Size, (now-b.First)/b.Interval+1)
}

// Ready is how many unspent tokens of the block may be spent by now.
func (b *Block) Ready(now int64) int64 { return max(0, b.ready(now)-b.Spent) }

// Left is the block's unspent tokens, ready or not.
func (b *Block) Left() int64 { return b.Size - b.Spent }

// next is the local µs from which the next unspent token may be spent.
func (b *Block) next() int64 { return b.First + b.Spent*b.Interval }
