package ratelimit

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

//go:embed lua/decide.lua
var decideLua string

var decideSHA = redis.NewScript(decideLua).Hash()

var (
	// errCircuitOpen: the decision skipped Redis, which recently failed.
	errCircuitOpen = errors.New("rate limit store: circuit open after repeated Redis failures")
	// errScriptReply: the script's reply is not what bucket.go expects.
	errScriptReply = errors.New("rate limit script reply")
)

// redisStore decides against buckets in Redis with one script call.
type redisStore struct {
	conn    *redisConn
	timeout time.Duration
	cluster bool       // keys in several slots take one script call per slot
	denials *denyCache // nil in cluster mode, whose refunds move TATs back
}

func (s *redisStore) decide(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.denials != nil {
		if d, ok := s.denials.deny(reqs); ok {
			return d, nil
		}
	}
	gen, ok := s.conn.breaker.allow()
	if !ok {
		circuitOpenErrors.Inc()
		return decision{}, errCircuitOpen
	}
	outcome := breakerFailure // unless the decision returns: a panic is a failure
	defer func() { s.conn.breaker.done(gen, outcome) }()
	d, err := s.decideGuarded(ctx, reqs)
	switch {
	// Our own script disagreeing with bucket.go is not an outage.
	case err == nil || errors.Is(err, errScriptReply):
		outcome = breakerSuccess
	// A client that went away says nothing about Redis.
	case errors.Is(err, context.Canceled):
		outcome = breakerIgnored
	}
	return d, err
}

// decideGuarded is the decision the breaker guards.
func (s *redisStore) decideGuarded(ctx context.Context, reqs []bucketRequest) (decision, error) {
	if s.cluster {
		if groups := slotGroups(reqs); len(groups) > 1 {
			ctx, cancel := context.WithTimeout(ctx, s.timeout)
			defer cancel()
			return s.decideAcrossSlots(ctx, reqs, groups)
		}
	}
	return s.decideOnce(ctx, reqs)
}

// decideOnce decides buckets that one script call can reach: a single
// Redis, or one Redis Cluster slot.
func (s *redisStore) decideOnce(ctx context.Context, reqs []bucketRequest) (decision, error) {
	p := newPendingDecision(reqs, s.timeout)
	if s.conn.batches != nil {
		s.conn.batches.decide(p)
	} else {
		ctx, cancel := context.WithDeadline(ctx, p.deadline)
		s.conn.decideBatch(ctx, p.one[:])
		cancel()
	}
	d, err := p.d, p.err
	if err == nil && s.denials != nil {
		s.denials.learn(reqs, d, p.tats, p.sent, p.received)
	}
	p.release()
	return d, err
}

// decideBatch decides the requests of a batch, in order, in one call of
// lua/decide.lua.
func (c *redisConn) decideBatch(ctx context.Context, batch []*pendingDecision) {
	args := scriptCall(batch)
	sent := monotonicMicros()
	cmd := redis.NewIntSliceCmd(ctx, args...)
	_ = c.client.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		// A restarted or flushed Redis: EVAL loads the script again. The
		// script did not run, so nothing was charged twice.
		args[0], args[1] = "eval", decideLua
		cmd = redis.NewIntSliceCmd(ctx, args...)
		_ = c.client.Process(ctx, cmd)
	}
	received := monotonicMicros()
	res, err := cmd.Result()
	if err == nil {
		err = decisionsFromScript(res, batch)
	}
	end := time.Now()
	for _, p := range batch {
		p.sent, p.received = sent, received
		if err != nil {
			p.err = err
		}
		storeDuration.Observe(end.Sub(p.queued).Seconds())
		if p.err != nil {
			storeErrors.WithLabelValues(errorKind(p.err)).Inc()
		}
	}
}

// scriptCall is the EVALSHA of lua/decide.lua for the requests of a batch.
func scriptCall(batch []*pendingDecision) []any {
	n := 0
	for _, p := range batch {
		n += len(p.reqs)
	}
	args := make([]any, 3, 3+n+len(batch)+5*n)
	args[0], args[1], args[2] = "evalsha", decideSHA, n
	for _, p := range batch {
		for _, rq := range p.reqs {
			args = append(args, rq.key)
		}
	}
	for _, p := range batch {
		args = append(args, len(p.reqs))
		for _, rq := range p.reqs {
			shadow := 0
			if rq.shadow {
				shadow = 1
			}
			args = append(args, rq.limit.interval, rq.limit.burst, rq.cost, rq.wait, shadow)
		}
	}
	return args
}

// decisionsFromScript reads the script's reply into each request's
// decision, computing the remaining tokens and waits from the stored state
// with the Go algorithm, and the TATs the script stored.
func decisionsFromScript(res []int64, batch []*pendingDecision) error {
	if len(res) == 0 {
		return fmt.Errorf("%w: empty", errScriptReply)
	}
	now, off := res[0], 1
	for _, p := range batch {
		m := len(p.reqs)
		if len(res) < off+1+2*m {
			return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
		}
		p.d, p.tats, p.err = decisionFromScript(now, res[off:off+1+2*m], p.reqs)
		off += 1 + 2*m
	}
	if off != len(res) {
		return fmt.Errorf("%w: %d numbers for %d requests", errScriptReply, len(res), len(batch))
	}
	return nil
}

// decisionFromScript turns the script's reply for one request, {admitted,
// allowed_1, tat_1, ...}, into its decision and the TATs the script stored.
func decisionFromScript(now int64, res []int64, reqs []bucketRequest) (decision, []int64, error) {
	tats := make([]int64, len(reqs))
	for i := range reqs {
		tats[i] = res[2+2*i]
	}
	d, next := decideBuckets(tats, now, reqs)
	// Redis's own verdict is the one that was charged; the Go algorithm is the
	// same one, so they agree unless the script and bucket.go drift apart.
	if d.admitted != (res[0] == 1) {
		return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree (admitted %d); is lua/decide.lua in step with bucket.go?", errScriptReply, res[0])
	}
	for i := range reqs {
		if d.verdicts[i].allowed != (res[1+2*i] == 1) {
			return decision{}, nil, fmt.Errorf("%w: Lua and Go disagree on bucket %d", errScriptReply, i)
		}
	}
	return d, next, nil
}
