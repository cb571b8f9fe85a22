package hotkey

// How an instance sizes what it takes of a hot key, from its own rate on
// the key (the tokens its decisions ask for per second, admitted or not).
const (
	// BlockPeriod is what one block covers of the instance's own rate: at
	// 2,500 tokens a second, 125 tokens, 20 store calls a second.
	BlockPeriod = 50_000 // µs
	// LeadPeriod is how far ahead of its rate the instance keeps tokens
	// taken: the next block is fetched while a lead of about this much of
	// the rate is still unspent, long before the round trip it takes.
	LeadPeriod = 25_000 // µs
	// BurstShare: a block is at most 1/BurstShare of the bucket's burst, so
	// that one instance never takes the whole of a full bucket at once.
	BurstShare = 4
	// Horizon is how far beyond a full refill a block may reach: the
	// furthest ahead of the store's clock a bucket's TAT goes because of
	// blocks is tau + Horizon. A policy with hot keys lets its buckets owe
	// that much more (its slack).
	Horizon = 500_000 // µs
	// MinBlock: a key whose block could not hold this many tokens (a small
	// burst, or a slow rate) is decided call by call: blocks would save
	// nothing.
	MinBlock = 4
	// LineTarget is how long a block may wait in the bucket's line before
	// instances hold less: over the budget, the line is the tokens the
	// instances hold ahead, which grows with their rates; past this, each
	// instance scales what it holds by LineTarget/line, the same for all of
	// them (the line is the bucket's), so that the line stays within the
	// horizon (up to some 80 times the key's rate asked of the fleet at
	// 5,000/s) and the shares in proportion.
	LineTarget = 125_000 // µs
	// MaxAge is the longest a block is spent from: older, its unspent tokens
	// go back to the bucket. A change to the bucket (a reset, a grant, an
	// override, a plan) therefore reaches the blocks taken before it within
	// MaxAge, as it reaches what the deny cache remembers.
	MaxAge = 1_000_000 // µs
)

// Size is the block an instance takes of a bucket of the given interval and
// burst when its decisions ask for tokensPerSec, and the lead: the tokens
// unspent below which it fetches the next block. line is how long, in µs, its
// last block waited in the bucket's line for its first token (0 or less:
// none). block is 0 when the bucket is too small or too slow for blocks
// (see MinBlock).
//
// Over the budget, the instances' blocks line up in the bucket's schedule
// and each is served in turn: what an instance admits is in proportion to
// what it holds on average, lead + block/2. Both follow its own rate, so
// each admits in proportion to the requests it receives; when a block is
// capped (at the burst's share), the lead makes up for it, so that the
// average stays in proportion. The lead is at most half the horizon's
// tokens, so that two instances at their most leave room for the others
// (in proportion, then, up to 5 times the key's rate on one instance).
func Size(tokensPerSec float64, interval, burst, line int64) (block, lead int64) {
	if line > LineTarget {
		tokensPerSec *= float64(LineTarget) / float64(line)
	}
	reach := Horizon / interval / 2 // the lead at most half the horizon
	cap := Cap(interval, burst)
	if cap < MinBlock {
		return 0, 0
	}
	block = min(max(1, int64(tokensPerSec*BlockPeriod/1e6+0.5)), cap)
	// One more block is sent for once a token fewer than the lead is in
	// the line, and lands with block more: on average the instance has lead
	// + block/2 − 1/2 in the line, which is what average asks for.
	average := tokensPerSec * (LeadPeriod + BlockPeriod/2) / 1e6
	lead = min(max(0, int64(average-float64(block)/2+1)), reach)
	return block, lead
}

// Cap is the most one block of a bucket of the given interval and burst
// holds: a BurstShare of its burst, and a quarter of the horizon's tokens
// (0 for a bucket of no tokens).
func Cap(interval, burst int64) int64 {
	if interval <= 0 || burst <= 0 {
		return 0
	}
	return min(burst/BurstShare, Horizon/interval/4)
}

// Next says whether an instance holding unspent tokens of a key (ready
// of them spendable now) sends for one more block, and of what size. It
// does while its tokens still in the bucket's line (unspent − ready) are
// fewer than its lead: the tokens it holds ready do not count, as what it
// admits over the budget follows what it has in the line, which is what
// keeps its share in proportion to its rate; but not while it holds lead
// + 2 blocks or more, so that a lull does not pile tokens up. A request
// that needs more than is unspent (need > unspent) sends for a block of at least
// need at once.
func Next(unspent, ready, lead, block, need int64) (size int64, fetch bool) {
	if need > unspent {
		return max(block, need), true
	}
	if block <= 0 || unspent-ready >= lead || unspent >= lead+2*block {
		return 0, false
	}
	return block, true
}

// Line is the estimate of the bucket's line, in µs, after a block whose
// first token waited wait µs (negative: it was there at once), given the
// estimate before: an average that moves a quarter of the way each block,
// so that instances that fetch at different times read about the same
// line.
func Line(before, wait int64) int64 {
	return before + (max(0, wait)-before)/4
}
