package ratelimit

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/hotkey"
)

// Hot keys, the policy's side: whether a rate policy's keys may be decided
// from blocks of their tokens (hotkeys_store.go does it, in front of the
// Redis store), from which decision rate on one key, and what a policy's
// buckets may owe because of it. See docs/hot-keys.md.

// defaultHotKeys is the decision rate on one key, on one instance, from
// which it takes blocks: below it, a key's decisions are few enough that
// coalesced calls carry them cheaply.
const defaultHotKeys = "200/1s"

// hotKeysOff turns hot keys off for a policy.
const hotKeysOff = "off"

// hotRule is a rate policy's use of hot keys, set when its config is
// checked (checkHotKeys) and provisioned (provisionHotKeys).
type hotRule struct {
	// shared: its handler's buckets are in Redis, where keys may be hot.
	shared bool
	// threshold: hot_keys in decisions a second; 0: off.
	threshold float64
	// reach is how far, in µs beyond a full refill, the policy's buckets
	// may be reserved: by `wait`'s turns, and by blocks.
	reach int64
	// use is sent with each of its bucket requests; nil: off.
	use *hotPolicy
}

// hotPolicy is what the Redis store needs of a policy's use of hot keys.
type hotPolicy struct {
	// threshold: decisions a second on one key, on this instance, from
	// which the key is hot.
	threshold float64
	// unspent: tokens this instance holds in blocks of the policy's keys, not
	// yet spent; blocks: blocks taken.
	unspent prometheus.Gauge
	blocks  prometheus.Counter
}

var (
	hotTokensUnspent = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "hot_tokens_unspent",
		Help: "Tokens this instance holds in blocks of its hot keys (taken from the shared buckets ahead of their requests, debited there first) and has not spent yet, by policy: the budget other instances cannot reach until it is spent or given back. See docs/hot-keys.md.",
	}, []string{"policy"})
	hotBlocksTaken = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "hot_blocks_total",
		Help: "Blocks of hot keys' tokens this instance took from the shared buckets, by policy: one Redis script call's worth each.",
	}, []string{"policy"})
)

// checkHotKeys checks a rate policy's hot_keys and lets its buckets owe
// the blocks' reach: a block may reserve tokens up to hotkey.Horizon beyond
// a full refill, and every decision reading the bucket must keep what it
// owes (the slack, as for `wait`), or it would forgive tokens that blocks
// hold. Called once the policy's held.wait is known, with its limit's
// interval and burst.
func (p *Policy) checkHotKeys(interval, burst int64) error {
	p.hot.threshold, p.hot.reach = 0, p.held.wait
	switch {
	case p.HotKeys == hotKeysOff:
		return nil
	case p.learns():
		// Each reservation is raised in the script to what the key learned
		// (learned_usage.go): blocks would reserve the request's own cost.
		if p.HotKeys != "" {
			return fieldErr("hot_keys", "hot_keys: a settle policy's keys learn their usage, which each reservation reads in Redis: they are decided call by call (remove hot_keys, or set it off)")
		}
		return nil
	case p.ChargeIf != nil:
		// Its responses give tokens back to the bucket: a give-back moves
		// the bucket's line forward under the blocks other instances hold,
		// which are spent on the schedule they were taken on, so that the
		// two would spend the same due times (over burst + rate × T).
		if p.HotKeys != "" {
			return fieldErr("hot_keys", "hot_keys: a charge_if policy gives tokens back after its responses, which blocks held by other instances cannot follow: its keys are decided call by call (remove hot_keys, or set it off)")
		}
		return nil
	}
	switch p.HotKeys {
	case "":
		p.hot.threshold = hotThreshold(defaultHotKeys)
	default:
		n, per, err := parseRate(p.HotKeys)
		if err != nil {
			return fieldErr("hot_keys", "hot_keys: %v; or off", err)
		}
		p.hot.threshold = float64(n) / per.Seconds()
	}
	if !p.hot.shared || hotkey.Cap(interval, burst) < hotkey.MinBlock || burst*interval > maxBucketSpan-p.held.wait-hotkey.Horizon {
		// In process, every decision is local already; a bucket too small
		// or too slow for blocks (see hotkey.Size) is never hot, nor one
		// that takes decades to refill: its buckets owe no more.
		p.hot.threshold = 0
		return nil
	}
	p.hot.reach += hotkey.Horizon
	return nil
}

// hotThreshold is the decisions a second of a valid hot_keys rate.
func hotThreshold(rate string) float64 {
	n, per, _ := parseRate(rate)
	return float64(n) / per.Seconds()
}

// noHotKeys fails a policy of another kind than rate that sets hot_keys.
func (p *Policy) noHotKeys() error {
	if p.kind != kindRate && p.HotKeys != "" {
		return fieldErr("hot_keys", "hot_keys: a %s policy has no tokens to take ahead: hot keys are for rate policies", p.kind)
	}
	return nil
}

// provisionHotKeys gives the policy its metrics' children.
func (p *Policy) provisionHotKeys() {
	p.hot.use = nil
	if p.hot.threshold > 0 && p.kind == kindRate {
		p.hot.use = &hotPolicy{threshold: p.hot.threshold, unspent: hotTokensUnspent.WithLabelValues(p.Name), blocks: hotBlocksTaken.WithLabelValues(p.Name)}
	}
}

// hotSweep is how often an instance looks over its hot keys: blocks past
// their age go back, keys that cooled give back what they hold.
const hotSweep = 100 * time.Millisecond

// blocksHere is what inspect shows of a hot key's blocks on the instance
// answering.
type blocksHere struct {
	Blocks int   `json:"blocks"`
	Tokens int64 `json:"tokens"`
}
