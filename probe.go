package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// prober is a store that may be unable to decide for a policy (unreachable,
// refused by an ACL, without scripting), which a probe finds out before a
// request does: at start, with require_redis, and in `caddy rate-limit
// check` (probe.go, check.go). Implemented by redisStore.
type prober interface {
	probe(defs []definition) []probeResult
	// serverInfo is who the server says it is (redis_server.go).
	serverInfo(ctx context.Context) (redisinfo.Server, error)
}

var _ prober = (*redisStore)(nil)

// Loud at start. Once a config with a redis block runs (the fleet's
// goroutine notices it, fleet.go), each of its policies on the connection
// is probed with one read-only decision sent straight to Redis (past the
// circuit breaker and the coalescer): a Redis that cannot be reached,
// refuses the password or the ACL (EVALSHA, EVAL, TIME, the commands and
// keys of the script), or runs no scripts is one ERROR line per cause,
// with the fix and what each policy does until then. Caddy starts anyway;
// with require_redis, the handler's policies are probed while it is
// provisioned, and a failure fails the config. `caddy rate-limit check`
// (check.go) runs the same probe.

// probeIdentity is the identity whose bucket a probe reads.
const probeIdentity = "rate_limit probe"

// probeResult is what the probe of one policy found: kind is "" when
// Redis decided.
type probeResult struct {
	def  definition
	kind string
	err  error
}

// probeTries is how many times a probe that timed out is made.
const probeTries = 3

// probe runs one read-only decision per policy, each within callTimeout
// (probeTries times while it times out);
// after a failure that is the connection's (Redis unreachable, a wrong
// password, no scripting), the rest fail alike without a call.
func (c *redisStore) probe(defs []definition) []probeResult {
	out := make([]probeResult, len(defs))
	var wide *probeResult
	for i, d := range defs {
		out[i].def = d
		if wide != nil {
			out[i].kind, out[i].err = wide.kind, wide.err
			continue
		}
		var err error
		for try := 1; ; try++ {
			ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
			err = c.decideDirect(ctx, []bucketRequest{d.policy.probeRequest(d.handler)})
			cancel()
			// A timeout is tried again: the first call also connects and
			// loads the script, and one slow answer of a busy host is not
			// Redis away; probeTries in a row are.
			if err == nil || try == probeTries || probeKind(err) != "timeout" {
				break
			}
		}
		if err == nil {
			continue
		}
		out[i].kind, out[i].err = probeKind(err), err
		if connectionWide(out[i].kind) {
			wide = &out[i]
		}
	}
	return out
}

// probeRequest reads the policy's bucket of probeIdentity (or its one
// bucket): a decision that charges nothing. Slots are counted as inspect
// counts them: the expired leases found go, as in any decision, and are
// counted in leases_expired_total.
func (p *Policy) probeRequest(h *Handler) bucketRequest {
	key := p.fixedKey
	if key == "" {
		key = p.newStorageKey(h.hasher, probeIdentity)
	}
	rq := bucketRequest{key: key, limit: p.limit, op: opInspect, quota: p.quota}
	if p.kind.slots() {
		rq.op, rq.leasesExpired = opCount, p.slots.expired
	}
	return rq
}

// decideDirect makes one script call for reqs, past the breaker and the
// coalescer, and reports nothing: the probe says what it found.
func (c *redisStore) decideDirect(ctx context.Context, reqs []bucketRequest) error {
	p := newPending(reqs, nil)
	defer p.recycle()
	args := encodeCall(p.one[:], c.format.current())
	cmd := redis.NewIntSliceCmd(ctx, args...)
	_ = c.client.Process(ctx, cmd)
	if redis.HasErrorPrefix(cmd.Err(), "NOSCRIPT") {
		args[0], args[1] = "eval", decideLua
		cmd = redis.NewIntSliceCmd(ctx, args...)
		_ = c.client.Process(ctx, cmd)
	}
	res, err := cmd.Result()
	if err != nil {
		return err
	}
	if err := decodeReply(res, p.one[:]); err != nil {
		return err
	}
	return p.err
}

// probeKind classifies a probe's failure as errorKind does, and names a
// Redis that runs no scripts (a command renamed away, a proxy without
// them).
func probeKind(err error) string {
	var re redis.Error
	if errors.As(err, &re) {
		msg := strings.ToLower(re.Error())
		if strings.Contains(msg, "unknown command") || strings.Contains(msg, "scripting") {
			return "noscripting"
		}
	}
	return errorKind(err)
}

// connectionWide reports whether a kind of failure is the connection's,
// every policy's alike; otherwise it may be one policy's (an ACL without
// a command only some policies use, a key that is not a bucket).
func connectionWide(kind string) bool {
	return away(kind) || kind == "wrongpass" || kind == "noauth" || kind == "noscripting"
}

// away reports whether a kind of failure is Redis not answering (yet),
// rather than refusing: the probe is made again once it answers.
func away(kind string) bool {
	switch kind {
	case "connection", "timeout", "loading", "busy", "masterdown", "clusterdown":
		return true
	}
	return false
}

// probeCauses say what a kind of failure means at start.
var probeCauses = map[string]string{
	"connection":  "Redis cannot be reached",
	"timeout":     "Redis did not answer within the redis timeout",
	"wrongpass":   "Redis refuses the username or password",
	"noauth":      "Redis requires a password",
	"noperm":      "the Redis user's ACL refuses the limiter's commands or keys",
	"noscripting": "Redis runs no scripts",
	"loading":     "Redis is loading its data",
	"readonly":    "the address is a read-only replica",
}

// probeFixes complete errorFixes with the fixes of failures seen at start.
var probeFixes = map[string]string{
	"connection":  "check the redis address (a Caddyfile {$VAR:default} falls back to its default when VAR is unset; an unset {env.VAR} is empty) and that Redis runs and accepts connections from this host",
	"timeout":     "check that Redis runs and is not overloaded, and the network to it; or raise the redis timeout",
	"noscripting": "the limiter decides with one atomic Lua script (EVALSHA, then EVAL): use Redis 6.2 or later, or a Redis-compatible server or proxy that runs scripts",
	"loading":     "wait until Redis has loaded its data",
}

func fixOf(kind string) string {
	if fix, ok := probeFixes[kind]; ok {
		return fix
	}
	if fix, ok := errorFixes[kind]; ok {
		return fix
	}
	return "see docs/troubleshooting.md"
}

// probeFailure is one cause of failure and the policies it stops.
type probeFailure struct {
	kind     string
	err      error
	policies []*Policy
}

// failuresOf groups a probe's failures by cause, in the order found.
func failuresOf(results []probeResult) []probeFailure {
	var out []probeFailure
	for _, r := range results {
		if r.kind == "" {
			continue
		}
		i := 0
		for i < len(out) && out[i].kind != r.kind {
			i++
		}
		if i == len(out) {
			out = append(out, probeFailure{kind: r.kind, err: r.err})
		}
		out[i].policies = append(out[i].policies, r.def.policy)
	}
	return out
}

// describe says what stops Redis deciding, and what to change.
func (f probeFailure) describe() string { return f.describeOn("") }

// describeOn is describe naming the server, when it said who it is.
func (f probeFailure) describeOn(server string) string {
	return fmt.Sprintf("Redis cannot decide for %s: %s: %s", policiesText(f.policies), causeOf(f.kind, server), fixOf(f.kind))
}

// causeOf says what a kind of probe failure means; server names the
// server (from INFO server), or is "" when it did not say.
func causeOf(kind, server string) string {
	if kind == "noscripting" {
		return scriptsRefused(server)
	}
	if cause, ok := probeCauses[kind]; ok {
		return cause
	}
	return "Redis answered an error (" + kind + ")"
}

// probeStarted probes the policies of a config that started running and
// logs, once per cause, what stops Redis deciding; the first time Redis
// decides (or again after a failure), one INFO line.
func (c *redisStore) probeStarted(hs []*Handler) {
	defs := storeDefinitions(hs)
	if len(defs) == 0 {
		return
	}
	var ps []*Policy
	for _, d := range defs {
		ps = append(ps, d.policy)
	}
	failures := failuresOf(c.probe(defs))
	v := &c.fleet
	v.probeAgain = len(failures) > 0
	for _, f := range failures {
		v.probeAgain = v.probeAgain && away(f.kind)
	}
	if !v.probeAgain { // it answered: who is it? (not asked of a Redis away, which would only wait again)
		c.identify(ps)
	}
	if len(failures) == 0 {
		if !v.probeOK {
			c.logger.Info("Redis decides for "+policiesText(ps), zap.String("redis", c.name), zap.Int("db", c.db),
				zap.String("server", c.serverName()))
		}
		v.probeOK = true
		return
	}
	v.probeOK = false
	for _, f := range failures {
		// A permanent cause the requests already reported is not repeated;
		// one of Redis away is an ERROR at start even after their WARN.
		_, permanent := errorFixes[f.kind]
		if !c.claimReport(f.kind, permanent) {
			continue
		}
		c.logger.Error(f.describeOn(c.serverName())+". "+failureModes(f.policies),
			zap.String("redis", c.name), zap.Int("db", c.db), zap.String("kind", f.kind), zap.Error(f.err))
	}
}

// storeDefinitions are the policies of hs whose buckets are in their
// store.
func storeDefinitions(hs []*Handler) []definition {
	var defs []definition
	for _, h := range hs {
		for _, p := range h.Policies {
			if p.usesStore() {
				defs = append(defs, definition{p, h})
			}
		}
	}
	return defs
}

// requireRedis probes the handler's policies while it is provisioned:
// with require_redis, a Redis that cannot decide for them fails the
// config.
func (h *Handler) requireRedis() error {
	pr, ok := h.store.(prober)
	if !ok {
		return nil
	}
	failures := failuresOf(pr.probe(storeDefinitions([]*Handler{h})))
	if len(failures) == 0 {
		return nil
	}
	f := failures[0]
	return fmt.Errorf("require_redis: %s (%v)", f.describe(), f.err)
}

// failureModes says what the policies do until Redis decides: "policy api
// will fail_open (admit every request) until Redis answers; ...".
func failureModes(ps []*Policy) string {
	var modes []string
	byMode := map[string][]*Policy{}
	for _, p := range ps {
		if byMode[p.onError] == nil {
			modes = append(modes, p.onError)
		}
		byMode[p.onError] = append(byMode[p.onError], p)
	}
	var parts []string
	for _, m := range modes {
		what := map[string]string{
			failOpen:   "fail_open (admit every request)",
			failClosed: "fail_closed (answer 503)",
			failLocal:  "decide locally (each instance alone, on its share: see instances)",
		}[m]
		if what == "" {
			what = m
		}
		parts = append(parts, policiesText(byMode[m])+" will "+what+" until Redis answers")
	}
	return strings.Join(parts, "; ")
}

// policiesText names policies: "policy api", "policies api, login".
func policiesText(ps []*Policy) string {
	var names []string
	for _, p := range ps {
		names = append(names, p.Name)
	}
	if len(names) == 1 {
		return "policy " + names[0]
	}
	return "policies " + strings.Join(names, ", ")
}

// claimReport reports whether a failure of kind is to be logged now, and
// marks it logged: with onlyOnce, not when it was within reportInterval.
// The requests' reports (redisStore.report) and the probe's share it.
func (c *redisStore) claimReport(kind string, onlyOnce bool) bool {
	now := time.Now()
	c.reported.mu.Lock()
	defer c.reported.mu.Unlock()
	if c.reported.last == nil {
		c.reported.last = map[string]time.Time{}
	}
	if onlyOnce && now.Sub(c.reported.last[kind]) < reportInterval {
		return false
	}
	c.reported.last[kind] = now
	return true
}
