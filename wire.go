package ratelimit

import (
	"encoding/binary"
	"fmt"
	"math"
	"time"
)

// The script's wire format: how a call of lua/decide.lua is laid out
// (KEYS, then ARGV: the format, the numbers packed in one argument, the
// strings) and how many numbers its reply has per request and per bucket.
// The protocol header at the top of lua/decide.lua is the reference; this
// file is its Go side, and the two change together.

// learnsOp flags, in a script call's op, a bucket whose key learns its
// usage (learned_usage.go).
const learnsOp = 128

// encodeCall is the EVALSHA of lua/decide.lua for the requests of a batch,
// whose buckets it writes in the given format (see format.go): the keys,
// the format, the numbers packed in one argument, then the strings.
func encodeCall(batch []*pending, format int) []any {
	n, touched := 0, 0
	for _, p := range batch {
		n += len(p.reqs)
		for i := range p.reqs {
			if p.reqs[i].overridable {
				touched++
			}
			if p.reqs[i].learns {
				touched++
			}
		}
	}
	args := make([]any, 3, 5+n+touched)
	args[0], args[1] = "evalsha", decideSHAArg
	for _, p := range batch {
		for _, rq := range p.reqs {
			args = append(args, rq.key)
		}
	}
	args = declareTouched(args, batch)
	args[2] = len(args) - 3
	args = append(args, format, nil) // the numbers, once packed
	argv := len(args) - 2            // ARGV[1]'s index in args
	nums := make(callNumbers, 0, 8*(len(batch)+8*n))
	now := time.Now() // quotas' bounds are taken around it
	for _, p := range batch {
		nums = nums.add(int64(len(p.reqs)))
		for _, rq := range p.reqs {
			op := 4 * int64(rq.op)
			if rq.kind() == quotaBucket {
				op = 4 * quotaCode(rq.op)
			}
			if rq.overridable {
				op += 2
			}
			if rq.shadow {
				op++
			}
			if rq.learns {
				op += learnsOp
			}
			if rq.kind() == quotaBucket {
				nums = quotaNumbers(nums.add(op), rq, now)
				if rq.overridable { // the policy's rule for an override's slack (override.go)
					nums = nums.add(rq.overrideWait).add(rq.overrideDebt)
				}
				continue
			}
			// A string goes after the numbers, which give its ARGV index.
			amount, wait := rq.cost, rq.wait
			switch {
			case rq.op == opAdjust:
				amount, wait = rq.delta, rq.due // a give-back's tokens' due (bucket.go, givenBack)
			case rq.op == opFree:
				args = append(args, rq.events)
				amount, wait = rq.delta, int64(len(args)-argv)
			case rq.kind() == slotsBucket:
				args = append(args, rq.lease, rq.events)
				amount, wait = int64(len(args)-1-argv), int64(len(args)-argv)
			}
			nums = nums.add(op).add(rq.limit.interval).add(rq.limit.burst).add(rq.limit.slack).add(amount).add(wait)
			if rq.overridable { // the policy's rule for an override's slack (override.go)
				nums = nums.add(rq.overrideWait).add(rq.overrideDebt)
			}
			if rq.learns { // the class of a take, or of a settle's reservation and what it remembers (learned_usage.go)
				class := rq.class
				if rq.op != opAdjust {
					class = reservationClass(rq.cost)
				}
				nums = nums.add(class).add(rq.record)
			}
		}
	}
	args[argv+1] = []byte(nums)
	return args
}

// declareTouched appends to a call's KEYS (args, the buckets' keys) the
// other keys its script touches: each bucket's override (an overridable
// bucket, override.go) and learned usage (one that learns,
// learned_usage.go), once each. The script names them from the bucket's
// key (touchedKeys); declaring them is what lets a server that refuses
// undeclared keys (Dragonfly, by default) run it, and what a Redis
// Cluster's one slot per call rests on. The common bucket, a rate take
// without overrides, adds nothing.
func declareTouched(args []any, batch []*pending) []any {
	from := len(args)
	for _, p := range batch {
		for i := range p.reqs {
			rq := &p.reqs[i]
			if !rq.overridable && !rq.learns {
				continue
			}
			for _, k := range touchedKeys(rq) {
				if k != "" && !declared(args[from:], k) {
					args = append(args, k)
				}
			}
		}
	}
	return args
}

// touchedKeys are the keys lua/decide.lua touches for a bucket beyond its
// own ("" where it touches none): the names the script builds, and so the
// one place they are declared from.
func touchedKeys(rq *bucketRequest) [2]string {
	var out [2]string
	switch {
	case rq.overridable && rq.learns: // both from one allocation
		both := rq.key + overrideSuffix + rq.key + learnedSuffix
		cut := len(rq.key) + len(overrideSuffix)
		out[0], out[1] = both[:cut], both[cut:]
	case rq.overridable:
		out[0] = overrideKey(rq.key)
	case rq.learns:
		out[1] = learnedKey(rq.key)
	}
	return out
}

// declared reports whether k is among keys. Calls declare few such keys
// (a call carries some 8 requests): a scan beats a map.
func declared(keys []any, k string) bool {
	for _, d := range keys {
		if d.(string) == k {
			return true
		}
	}
	return false
}

// callNumbers are a call's numbers as the script reads them: little-endian
// doubles in one argument, exact for every value it is sent (all below
// 2^53). Redis's handling of an argument cost more than what the script
// then does with a rate take (see lua/decide.lua).
type callNumbers []byte

func (c callNumbers) add(v int64) callNumbers {
	return binary.LittleEndian.AppendUint64(c, math.Float64bits(float64(v)))
}

// quotaCode is the script's code of a quota bucket's op: 12 (take) to 16
// (reset), in the order of the rate verbs.
func quotaCode(op bucketOp) int64 { return int64(op) - int64(opTake) + 12 }

// quotaNumbers are the numbers of a quota bucket after its op: the quota,
// the slack, the amount (cost, or adjust's delta), the period a charge
// belongs to (0 0: the current one), and the four bounds around the Go
// clock now.
func quotaNumbers(nums callNumbers, rq bucketRequest, now time.Time) callNumbers {
	amount := rq.cost
	if rq.op == opAdjust {
		amount = rq.delta
	}
	b := rq.quota.periods.Bounds(now)
	nums = nums.add(rq.limit.burst).add(rq.limit.slack).add(amount).add(rq.period.Start).add(rq.period.End)
	return nums.add(b[0]).add(b[1]).add(b[2]).add(b[3])
}

// decodeReply reads the script's reply into each request's decision,
// computing the remaining tokens and waits from the stored state with the
// Go algorithm, and the TATs the script stored.
func decodeReply(res []int64, batch []*pending) error {
	if len(res) == 0 {
		return fmt.Errorf("%w: empty", errScriptReply)
	}
	now, off := res[0], 1
	for _, p := range batch {
		n := replyLen(p.reqs)
		if len(res) < off+n {
			return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
		}
		p.d, p.tats, p.err = decodeRequest(now, res[off:off+n], p.reqs)
		off += n
	}
	if off != len(res) {
		return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
	}
	return nil
}

// Statuses of a request in the script's reply.
const (
	scriptDenied    = 0
	scriptAdmitted  = 1
	scriptWrongType = -1
	scriptCorrupt   = -2
	// scriptClock: Redis's clock is outside a quota bucket's bounds (see
	// quota.go).
	scriptClock = -3
)

// replyWidth is the numbers per bucket in the script's reply: allowed and
// tat, and for slots, the leases held and those that expired.
func replyWidth(op bucketOp) int {
	if op.slots() {
		return 3
	}
	return 2
}

// bucketReplyWidth is the numbers per bucket in the script's reply: a
// quota's are allowed, the units used before the request (in the period
// Redis picked) and that period's start, which Go checks against its own
// pick.
func bucketReplyWidth(rq bucketRequest) int {
	if rq.kind() == quotaBucket {
		return 3
	}
	return replyWidth(rq.op)
}

// Widths of an overridable bucket in a script call: the ARGV it takes
// after those of its code (the policy's wait and debt rule), and the
// numbers its reply has after those of its op (the interval, burst and
// slack it was decided under).
const (
	overrideArgs  = 2
	overrideReply = 3
)

// replyWidthOf is the numbers of a bucket's reply (see replyWidth), an
// overridable bucket's limit included.
func replyWidthOf(rq bucketRequest) int {
	n := bucketReplyWidth(rq)
	if rq.overridable {
		n += overrideReply
	}
	if rq.learns {
		n++ // what its key learned (learned_usage.go)
	}
	return n
}

// replyLen is the numbers of a request's reply: its status, then each
// bucket's.
func replyLen(reqs []bucketRequest) int {
	n := 1
	for _, rq := range reqs {
		n += replyWidthOf(rq)
	}
	return n
}

// decodeRequest turns the script's reply for one request, {status, then
// per bucket: allowed, tat (or the leases held) [, expired leases]}, into
// its decision and the TATs the script stored.
func decodeRequest(now int64, res []int64, reqs []bucketRequest) (decision, []int64, error) {
	var allowedAt [8]int
	at := allowedAt[:0]
	for i, off := 0, 1; i < len(reqs); i++ {
		at = append(at, off)
		off += replyWidthOf(reqs[i])
	}
	switch res[0] {
	case scriptWrongType, scriptCorrupt, scriptClock:
		kind := "wrongtype"
		switch res[0] {
		case scriptCorrupt:
			kind = "corrupt"
		case scriptClock:
			kind = "clock"
		}
		key := reqs[0].key
		for i := range reqs {
			if res[at[i]] < 0 {
				key = reqs[i].key
			}
		}
		return decision{}, nil, &badBucketError{kind: kind, key: key}
	}
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = res[at[i]+1]
	}
	reqs = decidedUnder(res, at, reqs) // an override's limit, where the script found one
	var learned []int64
	for i, rq := range reqs {
		if rq.learns {
			if learned == nil {
				learned = make([]int64, len(reqs))
			}
			learned[i] = res[at[i]+replyWidthOf(rq)-1] // its last number
		}
	}
	if learned != nil {
		reqs = withLearned(reqs, learned) // a take raised to what its key learned, as the script raised it
	}
	d, next := decideBuckets(tats, now, reqs)
	for i := range learned {
		d.verdicts[i].learned = learned[i]
	}
	for i, rq := range reqs {
		if rq.kind() == slotsBucket {
			d.verdicts[i].expired = res[at[i]+2]
			// Wherever a lease is found expired (an acquire admitted or
			// denied, a renewal, an inspect, a reset), it is counted.
			if n := d.verdicts[i].expired; n > 0 && rq.leasesExpired != nil {
				rq.leasesExpired.Add(float64(n))
			}
		}
		if rq.op == opRenew { // allowed says the lease was still held
			d.verdicts[i].allowed = res[at[i]] == 1
		}
		if rq.kind() == quotaBucket && res[at[i]+2] != d.verdicts[i].period.Start {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on the period of quota bucket %d (%d, %d)", errScriptReply, i, res[at[i]+2], d.verdicts[i].period.Start)
		}
	}
	// Redis's own verdict is the one that was charged; the Go algorithm is the
	// same one, so they agree unless the script and bucket.go drift apart.
	if d.admitted != (res[0] == scriptAdmitted) {
		return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree (admitted %d); is lua/decide.lua in step with bucket.go?", errScriptReply, res[0])
	}
	for i := range reqs {
		if d.verdicts[i].allowed != (res[at[i]] == 1) {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on bucket %d", errScriptReply, i)
		}
	}
	return d, next, nil
}

// decidedUnder is reqs with the limits their buckets were decided under,
// which the reply res carries for overridable buckets after the numbers of
// their op (at[i] is where bucket i's begin): reqs itself when no override
// was in force.
func decidedUnder(res []int64, at []int, reqs []bucketRequest) []bucketRequest {
	out := reqs
	for i, rq := range reqs {
		if !rq.overridable {
			continue
		}
		o := at[i] + bucketReplyWidth(rq)
		l := limit{interval: res[o], burst: res[o+1], slack: res[o+2]}
		if l == rq.limit {
			continue
		}
		out = ownCopy(out, reqs)
		out[i].limit = l
	}
	return out
}
