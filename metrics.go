package ratelimit

import (
	"context"
	"errors"
	"net"
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
		Help: "Rate-limit decisions by policy and outcome (allowed, delayed, denied, shadow_denied, fail_open, fail_closed, local_allowed, local_denied).",
	}, []string{"policy", "outcome"})
	waiting = prometheus.NewGaugeVec(prometheus.GaugeOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "waiting",
		Help: "Requests held by a policy's wait setting right now.",
	}, []string{"policy"})
	storeDuration = prometheus.NewHistogram(prometheus.HistogramOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "store_duration_seconds",
		Help:    "Round-trip time of decisions in Redis, failed ones included.",
		Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
	})
	storeErrors = prometheus.NewCounterVec(prometheus.CounterOpts{
		Namespace: "caddy", Subsystem: "rate_limit", Name: "store_errors_total",
		Help: "Decisions Redis could not make, by kind (timeout, connection, redis, script, circuit_open).",
	}, []string{"kind"})
	// circuitOpenErrors is the circuit_open child, counted on the path
	// that must stay cheapest while Redis is down.
	circuitOpenErrors = storeErrors.WithLabelValues("circuit_open")
	circuitOpen       = prometheus.NewGauge(prometheus.GaugeOpts{
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
	for _, c := range []prometheus.Collector{decisionsTotal, waiting, storeDuration, storeErrors, circuitOpen} {
		if err := reg.Register(c); err != nil {
			var are prometheus.AlreadyRegisteredError
			if !errors.As(err, &are) {
				return err
			}
		}
	}
	return nil
}

// errorKind classifies a store error for store_errors_total.
func errorKind(err error) string {
	var netErr net.Error
	var redisErr redis.Error
	switch {
	case errors.Is(err, errCircuitOpen):
		return "circuit_open"
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &netErr) && netErr.Timeout():
		return "timeout"
	case errors.Is(err, errScriptReply):
		return "script"
	case errors.As(err, &redisErr):
		return "redis"
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
	numOutcomes
)

var outcomeNames = [numOutcomes]string{
	"allowed", "delayed", "denied", "shadow_denied", "fail_open", "fail_closed", "local_allowed", "local_denied",
}

// policyCounters resolves a policy's decisions_total children once, so that
// counting a decision is a single atomic add.
func policyCounters(name string) (c [numOutcomes]prometheus.Counter) {
	for o := range numOutcomes {
		c[o] = decisionsTotal.WithLabelValues(name, outcomeNames[o])
	}
	return c
}
