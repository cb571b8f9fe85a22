package ratelimit

import (
	"errors"
	"net"
	"strconv"
	"time"

	"go.uber.org/zap"
)

// A provider's failure costs nothing. Providers bill no request they refuse
// or fail (a 400 for a context too long, a 401, a 429, a 500, a 503, an
// Anthropic 529), and Caddy's own 502 or 504 means the provider was not
// reached or did not answer (a 504 only when the dial timed out: one
// waiting for an answer keeps the rule of a cut stream, as the provider may
// be generating). So a settle whose response is not a 2xx and reports no
// usage gives its whole reservation back: the tenant is never
// locked out by the provider's failure, and its SDK, which retries such
// errors by itself, sees the provider's error on every attempt rather than
// the gateway's 429. A usage reported with an error is settled as any
// (the debt rule applies to usage reported, or delivered: a cut 2xx stream
// keeps the estimate of cut_estimate.go). What bounds a client that
// provokes errors: it costs the provider nothing, and its requests are
// counted by the policies that count requests (docs/after-admission.md).

// unreached reports whether a handler chain's error says the upstream was
// never reached: a dial that failed or timed out. A 504 otherwise is a
// timeout waiting for an answer the provider may be generating (and
// billing): it keeps the rule of a cut stream.
func unreached(err error) bool {
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// succeeded reports whether a response status is a success, which a
// provider bills.
func succeeded(status int) bool { return status >= 200 && status <= 299 }

// failedLog logs, at most once per lostLogInterval per policy, that an
// error response without usage gave its reservation back, naming the
// status.
func (w *afterResponse) failedLog(p *Policy) {
	if p.after.failed == nil {
		return
	}
	n, due := p.after.failed.due(time.Now())
	if !due {
		return
	}
	w.logger.Warn("settle: the upstream answered "+strconv.Itoa(w.status)+" with no usage: its reservation was given back, as providers bill no failed request",
		zap.String("policy", p.Name), zap.String("settle", p.Settle.describe()), zap.Int("status", w.status),
		zap.Int64("responses_since_last_line", n), zap.Duration("one_line_per", lostLogInterval))
}
