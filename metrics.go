package ratelimit

import (
	"context"
	"errors"
	"net"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// The limiter's Prometheus metrics. They live for the process and are
// registered into the registry Caddy gives each config load, so counters
// carry on across reloads. Labels are policy names, outcomes and error
// kinds: never an identity, key or path.
var (
	decisionsTotal = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "decisions_total",
		Help: "Rate-limit decisions by policy and outcome (allowed, delayed, denied, shadow_denied, fail_open, fail_closed, local_allowed, local_denied, shed), with the class of a shed policy's request and the plan of a planned policy's (config names; empty otherwise).",
	}, []string{"policy", "outcome", "class", "plan"})
	chargesLost = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "charges_lost_total",
		Help: "Charges after the response (charge_if, settle) not made as measured, by reason: no_usage (the response reported none), unreadable (a body whose coding or data could not be read), client_gone (the client left before the usage came), store_unreachable (the store did not take the charge). A lost settle leaves its reservation standing, or charges the estimate of what the response delivered when that is more.",
	}, []string{"policy", "reason"})
	inFlight = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "in_flight",
		Help: "Requests holding a concurrency policy's slot on this instance now.",
	}, []string{"policy"})
	leasesExpired = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "leases_expired_total",
		Help: "Concurrency slots reclaimed from holders that vanished (their lease expired unrenewed): the leak signal.",
	}, []string{"policy"})
	releaseRetries = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "release_retries_total",
		Help: "Releases of concurrency slots sent again because Redis did not confirm them: each is retried until it is made or its lease has run out (the slot is free then anyway).",
	}, []string{"policy"})
	waiting = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "waiting",
		Help: "Requests held by a policy's wait setting right now: for their reserved turn (rate), or for a free one (concurrent).",
	}, []string{"policy"})
	storeDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "store_duration_seconds",
		Help:    "How long requests waited for Redis: queued behind other calls, and their call; failed ones included.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
	})
	storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "store_errors_total",
		Help: "Redis calls that failed, by kind (timeout, connection, wrongpass, noauth, noperm, readonly, oom, loading, busy, masterdown, clusterdown, undeclared, redis, script); requests that skipped Redis (circuit_open); requests whose own bucket key holds something else (wrongtype, corrupt), or whose quota's bounds Redis's clock is outside of (clock); calls whose durable quotas Redis did not confirm (not_durable, waitaof_unsupported, aof_disabled).",
	}, []string{"kind"})
	// circuitOpenErrors is the circuit_open child, counted on the path
	// that must stay cheapest while Redis is down.
	circuitOpenErrors = storeErrors.WithLabelValues("circuit_open")
	// buckets counts the buckets of the in-process stores when scraped.
	buckets = bucketsCollector{prometheus.NewDesc("caddy_rate_limit_buckets",
		"Buckets held in this process, by store: in_process (handlers without a redis block), local (the on_error local fallback). Bounded; see memoryMaxBuckets.",
		[]string{"store"}, nil)}
	// fleetDisagreements: the policies of this instance that another live
	// instance of its fleet enforces differently (fleet.go).
	fleetDisagreements = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "fleet_disagreements",
		Help: "Policies of this instance that another live instance of its fleet (the same Redis database and key_prefix) enforces with another limit, key or key_secret: they do not share one budget. 0 when the fleet agrees; caddy rate-limit fleet shows who differs and how.",
	})
	// spendUSD and unpricedModels: money policies' dollars charged and the
	// models they found no price for (money.go).
	spendUSD = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "spend_usd_total",
		Help: "Dollars charged by money policies (unit usd), by policy and by the model priced (the listed name a request's or a response's model was priced as; empty for a policy that prices no model): settled usage, or what stood (the reservation, or the estimate of a response without usage). Never an identity.",
	}, []string{"policy", "model"})
	unpricedModels = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "unpriced_models_total",
		Help: "Models the prices do not list, by policy and where they were named: request (refused under unknown deny, priced as the unknown model otherwise), response (a response naming a model the prices lack, priced as its request's model).",
	}, []string{"policy", "at"})
	// quotaUsed is the share of its quota a quota policy's request found
	// used: a distribution over requests, never per identity.
	quotaUsed = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "quota_used_ratio",
		Help:    "For each decision of a quota policy, the share of the quota its identity had used in the current period once decided (1: all of it). A distribution over requests: how near callers run to their quotas, with no identity.",
		Buckets: []float64{.1, .25, .5, .75, .9, .95, .99, 1},
	}, []string{"policy"})
	// slots is each concurrency policy's N, read when scraped.
	slots = slotsCollector{prometheus.NewDesc("caddy_rate_limit_slots",
		"The slots of a concurrent policy (its N), or of a shed policy's concurrent capacity, fleet-wide: the bound of caddy_rate_limit_in_flight summed over instances. A plan or an override may set another N for some identities.",
		[]string{"policy"}, nil)}
	circuitOpen = prometheus.NewGauge(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "circuit_open",
		Help: "1 while the circuit breaker to Redis is open (decisions skip Redis and follow on_error); with several Redis connections, how many are open.",
	})
)

// registerMetrics adds the collectors to this config load's registry.
// Several handlers of one config share them, so a second registration is
// not an error.
func registerMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return nil
	}
	for _, c := range []prometheus.Collector{decisionsTotal, chargesLost, inFlight, leasesExpired, releaseRetries, waiting, storeDuration, storeErrors, circuitOpen, fleetDisagreements, buckets, quotaUsed, slots, emptyKeys, hotTokensUnspent, hotBlocksTaken, spendUSD, unpricedModels} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// bucketsCollector reports the in-process stores' sizes, read when scraped.
type bucketsCollector struct{ desc *prometheus.Desc }

func (c bucketsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c bucketsCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(processMemory.len()), "in_process")
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(localFallback.len()), "local")
}

// slotsCollector reports the slots of the concurrency policies of the
// config loaded last, read when scraped.
type slotsCollector struct{ desc *prometheus.Desc }

func (c slotsCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c slotsCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range budgets.policies() {
		n := p.Concurrent
		if p.kind == kindShed {
			n = p.Shed.Concurrent
		}
		if n > 0 {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), p.Name)
		}
	}
}

// observeQuotaUsed records the share of its quota a decision found used:
// of the N it was decided under (an override's, a plan's or the policy's).
func observeQuotaUsed(obs prometheus.Observer, v verdict, rq bucketRequest) {
	n := rq.limit.burst
	if v.limit != (limit{}) {
		n = v.limit.burst
	}
	if obs == nil || n <= 0 {
		return
	}
	obs.Observe(min(1, max(0, float64(n-v.remaining)/float64(n))))
}

// errorKind classifies a store error for store_errors_total: what Redis
// said (its error's first word, for the errors an operator must fix), a
// request's own bad key, or what went wrong on the way.
func errorKind(err error) string {
	var bad *badBucketError
	var netErr net.Error
	var redisErr redis.Error
	var kinded interface{ storeErrorKind() string }
	switch {
	case errors.As(err, &kinded): // a durable quota's confirmation (durable.go)
		return kinded.storeErrorKind()
	case errors.As(err, &bad):
		return bad.kind
	case errors.Is(err, errCircuitOpen):
		return "circuit_open"
	case errors.Is(err, errScriptReply):
		return "script"
	case errors.As(err, &redisErr):
		msg := redisErr.Error()
		word, _, _ := strings.Cut(msg, " ")
		if i := strings.LastIndex(msg, ": -"); i >= 0 && strings.HasPrefix(msg, "ERR Error running script") {
			// Redis 6.2 wraps an error a command of the script
			// answered: "ERR Error running script (…): @user_script:1:
			// @user_script: 1: -READONLY You can't write …".
			word, _, _ = strings.Cut(msg[i+3:], " ")
		}
		switch word = strings.ToLower(word); word {
		case "wrongpass", "noauth", "noperm", "readonly", "oom", "loading", "busy", "masterdown", "clusterdown":
			return word
		}
		if strings.Contains(redisErr.Error(), "user executing the script can't") || strings.Contains(redisErr.Error(), "ACL failure in script") {
			// An ACL without a command the script runs: ERR, not NOPERM
			// (Redis; Valkey says "ACL failure in script").
			return "noperm"
		}
		if strings.Contains(redisErr.Error(), "OOM command not allowed") {
			return "oom" // raised inside a script: Redis 6.2 wraps it in ERR
		}
		if strings.Contains(redisErr.Error(), "undeclared key") {
			return "undeclared" // Dragonfly: a script touched a key its call did not declare
		}
		return "redis"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return "timeout"
	default:
		return "connection"
	}
}

// observeStore records one round trip to Redis.
func observeStore(start time.Time, err error) {
	storeDuration.Observe(time.Since(start).Seconds())
	if err != nil {
		storeErrors.WithLabelValues(errorKind(err)).Inc()
	}
}

// outcome is what became of a request under one policy; its name is the
// `outcome` label and the value of {http.rate_limit.decision}.
type outcome int

const (
	outcomeAllowed outcome = iota
	outcomeDelayed
	outcomeDenied
	outcomeShadowDenied
	outcomeFailOpen
	outcomeFailClosed
	outcomeLocalAllowed
	outcomeLocalDenied
	// outcomeShed: a shed policy turned the request away (503), the
	// service being at capacity (shed_policy.go).
	outcomeShed
	numOutcomes
)

var outcomeNames = [numOutcomes]string{
	"allowed", "delayed", "denied", "shadow_denied", "fail_open", "fail_closed", "local_allowed", "local_denied",
	"shed",
}

// policyCounters resolves a policy's decisions_total children once (for a
// class of a shed policy, a plan of a planned one: config names, or ""), so
// that counting a decision is a single atomic add.
func policyCounters(name, class, plan string) (c [numOutcomes]prometheus.Counter) {
	for o := range numOutcomes {
		c[o] = decisionsTotal.WithLabelValues(name, outcomeNames[o], class, plan)
	}
	return c
}

// shedLimitGauge is caddy_rate_limit_shed_limit{policy}: the adaptive
// limit of each shed policy of the config loaded last, read when scraped.
var shedLimitGauge = shedLimitCollector{prometheus.NewDesc("caddy_rate_limit_shed_limit",
	"The adaptive in-flight limit of a shed { latency } policy on this instance: the most requests of its highest class it lets in flight now (a lower class gets its share of it).",
	[]string{"policy"}, nil)}

type shedLimitCollector struct{ desc *prometheus.Desc }

func (c shedLimitCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c shedLimitCollector) Collect(ch chan<- prometheus.Metric) {
	for _, p := range budgets.policies() {
		if p.capacity().has(adaptiveCapacity) {
			ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(p.shed.limiter.Limit()), p.Name)
		}
	}
}

// registerShedMetrics adds the shed gauge to this config load's registry,
// once (see registerMetrics).
func registerShedMetrics(ctx caddy.Context) error {
	reg := ctx.GetMetricsRegistry()
	if reg == nil {
		return nil
	}
	var are prometheus.AlreadyRegisteredError
	if err := reg.Register(shedLimitGauge); err != nil && !errors.As(err, &are) {
		return err
	}
	return nil
}
