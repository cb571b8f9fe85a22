package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/breaker"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// Durable quotas: `durable replicas <n>` and `durable aof`. A Redis primary
// acknowledges a write before its replicas have it and before it is on
// disk, so a failover (or a crash without a synced AOF) can lose usage that
// was counted and admitted. A durable quota's admission counts only once
// Redis confirms the script call's writes reached n replicas (WAIT) or the
// append-only file (WAITAOF, Redis 7.2 and later), within the redis block's
// timeout; otherwise the request's decision is undone (refunded) and its
// policies follow their on_error, as if Redis had not answered:
// fail_closed answers 503 rather than admit usage Redis may lose.
//
// WAIT and WAITAOF wait for the writes of their own connection, and inside
// a script Redis 7 answers them at once without waiting; so they are sent
// as commands of their own, right after the EVALSHA, pipelined on the same
// connection (go-redis runs a pipeline on one connection: a single server's
// client and Sentinel's failover client are one pool of connections to the
// primary; in a Cluster the pipeline goes to the master of the call's hash slot).
// One confirmation per script call: a call carrying many durable requests
// sends one WAIT. Durable requests are coalesced apart from the others, so
// a request that needs no confirmation never waits for one.
//
// Best effort, as Redis defines it: a confirmed write can still be lost if
// the replicas that had it are not the one promoted, and WAIT says nothing
// of disk. See docs/quotas.md.

// confirmation is what a request's (or a call's) admissions must wait for:
// the most replicas any of its durable quotas asks (WAIT), and whether one
// asks for the AOF, with its own count of replicas (WAITAOF's replicas are
// those that fsynced theirs).
type confirmation struct {
	replicas    int // WAIT
	aof         bool
	aofReplicas int // WAITAOF 1 <aofReplicas>
}

func (c confirmation) wanted() bool { return c.replicas > 0 || c.aof }

// add asks for what durability d asks too.
func (c confirmation) add(d durability) confirmation {
	if d.aof {
		c.aof, c.aofReplicas = true, max(c.aofReplicas, d.replicas)
	} else {
		c.replicas = max(c.replicas, d.replicas)
	}
	return c
}

// confirms reports whether the replies got (replicas that acknowledged the
// WAIT; local and replica fsyncs of the WAITAOF) confirm what c asks.
func (c confirmation) confirms(got confirmed) bool {
	if c.aof && (got.local < 1 || got.aofReplicas < int64(c.aofReplicas)) {
		return false
	}
	return !(c.replicas > 0 && got.replicas < int64(c.replicas))
}

type confirmed struct{ replicas, local, aofReplicas int64 }

// requestConfirmation is what one request's admission waits for: its
// enforced quota takes' durability.
func requestConfirmation(reqs []bucketRequest) confirmation {
	return confirmation{}.of(reqs)
}

// of adds what the requests' durable quota takes ask.
func (c confirmation) of(reqs []bucketRequest) confirmation {
	for _, rq := range reqs {
		if rq.quota != nil && rq.quota.durable.wanted() && rq.op == opTake && !rq.shadow {
			c = c.add(rq.quota.durable)
		}
	}
	return c
}

// batchConfirmation is what a script call must confirm: all its requests'.
func batchConfirmation(batch []*pending) confirmation {
	var c confirmation
	for _, p := range batch {
		c = c.of(p.reqs)
	}
	return c
}

// durableCalls is a connection's coalescing of durable requests, apart from
// the others (coalescerFor), and the clients whose pipelines carry a script
// call and its confirmation (confirmingClient).
type durableCalls struct {
	once      sync.Once
	coalescer *coalescer
	clients   sync.Map // *redis.Client -> *redis.Client with room for the waits
}

// coalescerFor is the coalescer a request's call goes through: durable
// requests have their own, so that no other request waits for a
// confirmation.
func (c *redisStore) coalescerFor(reqs []bucketRequest) *coalescer {
	if !requestConfirmation(reqs).wanted() {
		return c.coalescer
	}
	c.durable.once.Do(func() {
		c.durable.coalescer = &coalescer{call: c.call, maxCalls: c.coalescer.maxCalls}
	})
	return c.durable.coalescer
}

// confirmingClient is the client whose one connection carries the call and
// its confirmation: the primary's (in a Cluster, the master of the call's
// hash slot: a MOVED during resharding fails the call), with a read timeout that
// leaves room for the script and both waits.
func (c *redisStore) confirmingClient(ctx context.Context, batch []*pending) (*redis.Client, error) {
	var base *redis.Client
	switch cl := c.client.(type) {
	case *redis.Client: // a single server, or Sentinel's failover client
		base = cl
	case *redis.ClusterClient:
		node, err := cl.MasterForKey(ctx, batch[0].reqs[0].key)
		if err != nil {
			return nil, err
		}
		base = node
	default:
		return nil, fmt.Errorf("durable: a %T cannot confirm writes", c.client)
	}
	if v, ok := c.durable.clients.Load(base); ok {
		return v.(*redis.Client), nil
	}
	v, _ := c.durable.clients.LoadOrStore(base, base.WithTimeout(3*c.timeout+100*time.Millisecond))
	return v.(*redis.Client), nil
}

// waitMillis is the wait of WAIT and WAITAOF: the redis block's timeout,
// at least 1 ms (0 would wait for ever).
func (c *redisStore) waitMillis() int64 { return max(1, c.timeout.Milliseconds()) }

// evalDurable is eval for a call whose requests include durable ones: the
// script and its confirmation pipelined on one connection. The accounting
// is eval's; then each admitted request whose confirmation fell short gets
// an error (its policies follow on_error) and its charges are refunded.
func (c *redisStore) evalDurable(batch []*pending, want confirmation) breaker.Result {
	ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
	defer cancel()
	args := encodeCall(batch, c.format.current())
	sent := monotonicMicros()
	var cmd *redis.IntSliceCmd
	var wait, waitAOF *redis.Cmd
	client, err := c.confirmingClient(ctx, batch)
	if err == nil {
		run := func() {
			pipe := client.Pipeline()
			cmd = redis.NewIntSliceCmd(ctx, args...)
			_ = pipe.Process(ctx, cmd)
			wait, waitAOF = nil, nil
			if want.replicas > 0 {
				wait = pipe.Do(ctx, "wait", want.replicas, c.waitMillis())
			}
			if want.aof {
				waitAOF = pipe.Do(ctx, "waitaof", 1, want.aofReplicas, c.waitMillis())
			}
			_, _ = pipe.Exec(ctx)
		}
		run()
		if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
			args[0], args[1] = "eval", decideLua // the script did not run: nothing was charged
			run()
		}
		err = cmd.Err()
	}
	received := monotonicMicros()
	if err == nil {
		var res []int64
		if res, err = cmd.Result(); err == nil {
			err = decodeReply(res, batch)
		}
	}
	end := time.Now()
	for _, p := range batch {
		p.sent, p.received = sent, received
		p.d.call = callStats{calls: 1, requests: len(batch), redisUS: received - sent}
		if err != nil {
			p.err = err
		}
		storeDuration.Observe(end.Sub(p.queued).Seconds())
		var bad *badBucketError
		if errors.As(p.err, &bad) {
			storeErrors.WithLabelValues(bad.kind).Inc()
			c.report(bad.kind, p.err)
		}
	}
	if err != nil {
		kind := errorKind(err)
		storeErrors.WithLabelValues(kind).Inc()
		c.report(kind, err)
		return resultOf(err)
	}
	got, cerr := readConfirmation(wait, waitAOF)
	var refunds []bucketRequest
	var short []string // the durable policies of the requests not confirmed
	for _, p := range batch {
		need := requestConfirmation(p.reqs)
		if p.err != nil || !p.d.admitted || !need.wanted() || cerr == nil && need.confirms(got) {
			continue
		}
		short = durablePolicies(short, p.reqs)
		if cerr != nil {
			p.err = cerr
		} else {
			p.err = &durabilityError{kind: "not_durable", want: need, got: got, timeout: c.timeout}
		}
		refunds = append(refunds, undo(p.reqs, p.d)...)
	}
	if len(short) > 0 {
		// Counted per call, as every store error is.
		kind := "not_durable"
		var de *durabilityError
		if errors.As(cerr, &de) {
			kind = de.kind
		}
		storeErrors.WithLabelValues(kind).Inc()
		e := cerr
		if e == nil {
			e = &durabilityError{kind: kind, want: want, got: got, timeout: c.timeout}
		}
		c.reportDurable(kind, e, short)
	}
	if len(refunds) > 0 {
		// Not waited for: a lost refund over-denies, never over-admits.
		go func() { _, _ = (c).decide(context.Background(), refunds) }()
	}
	return breaker.Answered
}

// durablePolicies adds to names those of the durable quotas of reqs.
func durablePolicies(names []string, reqs []bucketRequest) []string {
	for _, rq := range reqs {
		if rq.quota != nil && rq.quota.durable.wanted() && rq.op == opTake && !rq.shadow && !slices.Contains(names, rq.quota.name) {
			names = append(names, rq.quota.name)
		}
	}
	return names
}

// reportDurable logs, at most once per 10 s per kind, a durable quota whose
// usage Redis did not confirm. Redis answered: it is not "unavailable", and
// only the durable policies' requests follow on_error; the line says which,
// why, and what to change.
func (c *redisStore) reportDurable(kind string, err error, policies []string) {
	if !c.claimReport(kind, true) {
		return
	}
	var names []string
	for _, n := range policies {
		names = append(names, strconv.Quote(n))
	}
	which := "policy " + strings.Join(names, ", ")
	if len(names) > 1 {
		which = "policies " + strings.Join(names, ", ")
	}
	fields := []zap.Field{zap.String("redis", c.name), zap.String("kind", kind), zap.Strings("policies", policies), zap.Error(err)}
	meanwhile := ". Meanwhile each of its requests follows the policy's on_error (fail_closed answers 503, fail_open admits it uncounted), its usage given back. "
	switch kind {
	case "waitaof_unsupported":
		c.logger.Error(which+": durable aof needs WAITAOF, which this Redis does not have (it came with Redis 7.2)"+meanwhile+
			"Upgrade Redis to 7.2 or later, use durable replicas <n> instead, or remove durable from the policy", fields...)
	case "aof_disabled":
		c.logger.Error(which+": durable aof needs Redis's append-only file, which is off on this Redis (appendonly no)"+meanwhile+
			"Set appendonly yes on Redis, use durable replicas <n> instead, or remove durable from the policy", fields...)
	default:
		c.logger.Warn(which+": Redis answered, but did not confirm the usage as durable asks: "+durableShortfall(err)+meanwhile+
			"durable replicas <n> needs n replicas connected to this Redis (INFO replication: connected_slaves) that acknowledge within the redis timeout: "+
			"add a replica, raise the redis timeout, or remove durable from the policy", fields...)
	}
}

// durableShortfall is what Redis confirmed of what a durability error asked.
func durableShortfall(err error) string {
	var de *durabilityError
	if !errors.As(err, &de) || de.err != nil {
		return err.Error()
	}
	var parts []string
	if de.want.replicas > 0 {
		parts = append(parts, fmt.Sprintf("%d of %d replicas had it", de.got.replicas, de.want.replicas))
	}
	if de.want.aof {
		parts = append(parts, fmt.Sprintf("the append-only file was fsynced on %d of 1 primary and %d of %d replicas", de.got.local, de.got.aofReplicas, de.want.aofReplicas))
	}
	return strings.Join(parts, ", ") + " within the redis timeout (" + de.timeout.String() + ")"
}

// readConfirmation reads the replies of WAIT (replicas that acknowledged)
// and WAITAOF ([local fsyncs, replica fsyncs]).
func readConfirmation(wait, waitAOF *redis.Cmd) (confirmed, error) {
	var got confirmed
	if wait != nil {
		n, err := wait.Int64()
		if err != nil {
			return got, confirmError("WAIT", err)
		}
		got.replicas = n
	}
	if waitAOF != nil {
		v, err := waitAOF.Int64Slice()
		if err != nil {
			return got, confirmError("WAITAOF", err)
		}
		if len(v) != 2 {
			return got, &durabilityError{kind: "not_durable", err: fmt.Errorf("WAITAOF answered %v", v)}
		}
		got.local, got.aofReplicas = v[0], v[1]
	}
	return got, nil
}

// confirmError classifies a WAIT or WAITAOF that Redis refused.
func confirmError(command string, err error) error {
	msg := strings.ToLower(err.Error())
	switch {
	case strings.Contains(msg, "unknown command"):
		return &durabilityError{kind: "waitaof_unsupported", err: err}
	case strings.Contains(msg, "appendonly"):
		return &durabilityError{kind: "aof_disabled", err: err}
	}
	return &durabilityError{kind: "not_durable", err: fmt.Errorf("%s: %w", command, err)}
}

// durabilityError is a durable request whose usage Redis did not confirm:
// it follows its policies' on_error, and its decision is undone.
type durabilityError struct {
	kind    string // not_durable, waitaof_unsupported or aof_disabled
	want    confirmation
	got     confirmed
	timeout time.Duration
	err     error // what Redis said, if it refused
}

func (e *durabilityError) Error() string {
	switch {
	case e.kind == "waitaof_unsupported":
		return "rate limit store: durable aof: this Redis has no WAITAOF (it came with Redis 7.2): " + e.err.Error()
	case e.kind == "aof_disabled":
		return "rate limit store: durable aof: Redis's append-only file is off (appendonly no): " + e.err.Error()
	case e.err != nil:
		return "rate limit store: durable: " + e.err.Error()
	}
	var parts []string
	if e.want.replicas > 0 {
		parts = append(parts, fmt.Sprintf("%d of %d replicas had it", e.got.replicas, e.want.replicas))
	}
	if e.want.aof {
		parts = append(parts, fmt.Sprintf("the AOF fsynced on %d of 1 primary and %d of %d replicas", e.got.local, e.got.aofReplicas, e.want.aofReplicas))
	}
	return "rate limit store: durable: Redis did not confirm the usage within " + e.timeout.String() + ": " + strings.Join(parts, "; ")
}

func (e *durabilityError) Unwrap() error { return e.err }

// storeErrorKind names the error in store_errors_total.
func (e *durabilityError) storeErrorKind() string { return e.kind }

// undo is what gives back a decision the store made but the request cannot
// keep: the cost of each bucket it charged (a quota's in the period it was
// counted in), and the concurrency slots it took.
func undo(reqs []bucketRequest, d decision) []bucketRequest {
	var out []bucketRequest
	for i, rq := range reqs {
		if !applied(reqs, d, i) {
			continue
		}
		switch rq.op {
		case opTake:
			back := rq
			back.op, back.delta, back.cost, back.wait = opAdjust, -rq.cost, 0, 0
			back.period = d.verdicts[i].period
			out = append(out, back)
		case opAcquire:
			back := rq
			back.op = opRelease
			out = append(out, back)
		}
	}
	return out
}

func init() {
	errorFixes["waitaof_unsupported"] = "durable aof waits with WAITAOF, which came with Redis 7.2, and this Redis is older: upgrade Redis, or use durable replicas <n>; until then the requests of durable aof policies follow on_error"
	errorFixes["aof_disabled"] = "durable aof waits for the append-only file, and this Redis has appendonly no: CONFIG SET appendonly yes (and in redis.conf), or use durable replicas <n>; until then the requests of durable aof policies follow on_error"
}
