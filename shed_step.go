package ratelimit

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// The shed step of the request's decision (admission.go): its places under
// shed policies' adaptive limits, taken before the store decides and given
// back when its handler chain returns, and the 503 of a shed request.

// admitAdaptive takes the request's places under the adaptive limits,
// before anything else is decided. It returns the policy that sheds the
// request, nil when all admit it (a shadow policy that would shed it is
// counted so, and lets it through without a place).
func (res *admission) admitAdaptive() *Policy {
	for i := range res.adaptive {
		a := &res.adaptive[i]
		tk, ok := a.policy.shed.limiter.Admit(a.class)
		switch {
		case ok:
			a.ticket, a.taken = tk, true
		case a.policy.shadow:
			a.policy.decisions[outcomeShadowDenied].Inc()
		default:
			a.policy.decisions[outcomeShed].Inc()
			return a.policy // finishAdaptive gives back the places taken
		}
	}
	return nil
}

// passAdaptive is called as the admitted request is passed on: its
// latency is measured from now.
func (res *admission) passAdaptive() {
	res.passed = true
	for i := range res.adaptive {
		a := &res.adaptive[i]
		if !a.taken {
			continue
		}
		a.ticket.Passed()
		if !a.policy.capacity().has(slotCapacity) { // otherwise counted with its slots (count)
			a.policy.decisions[outcomeAllowed].Inc()
		}
	}
}

// finishAdaptive gives back the request's places once its handler chain
// returned: measured if the request was passed on, unmeasured if it was
// not (another policy denied it, its client went away before).
func (res *admission) finishAdaptive() {
	for i := range res.adaptive {
		a := &res.adaptive[i]
		if !a.taken {
			continue
		}
		a.taken = false
		if res.passed {
			a.ticket.Done()
		} else {
			a.ticket.Cancel()
		}
	}
}

// errShed is the error of a shed request handed to a site's handle_errors.
var errShed = errors.New("service overloaded: request shed")

// overloaded is the problem a shed request is answered with: the service,
// not the limiter, is short of capacity.
func overloaded() problem {
	return problem{
		Type:   problemReducedCapacity,
		Title:  "Temporary Reduced Capacity",
		Status: http.StatusServiceUnavailable,
		Detail: "The service is overloaded: it turned this request away to keep serving the others. Try again shortly.",
	}
}

// shedBody is the body of every shed response: shedding is the path an
// overload makes hot, so it is built once.
var shedBody, _ = json.Marshal(overloaded())

// shed answers a request that a shed policy's adaptive limit turned away,
// before anything else was decided: no store call, no RateLimit fields.
func (h *Handler) shed(w http.ResponseWriter, r *http.Request, rs *requestState, p *Policy) error {
	ra := retryAfter(slotWait, h.jitter)
	rs.decidedAs(outcomeShed, p.Name, p.fixedKey, -1, ra)
	return writeShed(w, r, ra)
}

// denyShed answers a request that only shed policies' slots denied (shed
// { concurrent }): 503, with the RateLimit fields of its other policies,
// none of which charged it.
func (h *Handler) denyShed(w http.ResponseWriter, r *http.Request, rs *requestState, res *admission) error {
	ra := retryAfter(slotWait, h.jitter)
	h.report(w, rs, res, ra)
	return writeShed(w, r, ra)
}

// writeShed writes the 503 of a shed request, whose Retry-After is spread
// as a 429's is (slots come free when requests end, which nobody can
// tell: a second, spread by jitter); a site with handle_errors gets it as
// an error, as a fail_closed 503.
func writeShed(w http.ResponseWriter, r *http.Request, ra int64) error {
	setRetryFields(w.Header(), ra, true)
	if handlesErrors(r, http.StatusServiceUnavailable) {
		return caddyhttp.Error(http.StatusServiceUnavailable, errShed)
	}
	return writeProblemBody(w, http.StatusServiceUnavailable, shedBody)
}
