package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Charging after the response. A `charge_if` policy checks its bucket
// before the request (the request is denied when the cost does not fit)
// and charges the cost only when the response matches; a `settle` policy
// reserves its cost before the request, as any policy charges it, and
// settles it against the usage the response reports: the difference is
// given back, or charged as debt. The charge or settle of a request is one
// script call once its handler chain returns, on the store that admitted
// it (reservation.decidedBy).

// Settle takes a policy's true cost from the response.
type Settle struct {
	// Where the usage is: `header` (a response header, read when the
	// response's headers are written), `trailer` (an HTTP trailer, read
	// after the body) or `openai` (`usage.total_tokens` of an OpenAI-style
	// JSON body, or of the final `data:` event of a server-sent-events
	// stream, read as the body streams past, unbuffered).
	From string `json:"from"`

	// The header or trailer field holding the usage, a non-negative
	// integer. Required for `header` and `trailer`.
	Field string `json:"field,omitempty"`

	// The most usage one response settles, so that a broken upstream cannot
	// bury a tenant in debt. Default: twice the burst.
	Max int64 `json:"max,omitempty"`
}

const (
	settleHeader  = "header"
	settleTrailer = "trailer"
	settleOpenAI  = "openai"
)

// check checks the settle options of a policy of burst tokens.
func (s *Settle) check(burst int64) (max int64, err error) {
	switch s.From {
	case settleHeader, settleTrailer:
		if s.Field == "" {
			return 0, fieldErr("settle", "settle: %s: the field that holds the usage is required, e.g. settle %s X-Usage-Tokens", s.From, s.From)
		}
	case settleOpenAI:
		if s.Field != "" {
			return 0, fieldErr("settle", "settle: openai reads usage.total_tokens of the body, and takes no field (got %q)", s.Field)
		}
	default:
		return 0, fieldErr("settle", "settle: %q is not header, trailer or openai", s.From)
	}
	if s.Max < 0 || s.Max > maxJSONInteger {
		return 0, fieldErr("settle", "settle: max %d must be from 1 to %d", s.Max, int64(maxJSONInteger))
	}
	max = s.Max
	if max == 0 {
		max = 2 * burst
	}
	return max, nil
}

// afterResponse watches a response for what the policies charged after it
// need: its status and headers (charge_if, settle header), its trailers
// (settle trailer) or the usage in its body (settle openai). Bytes are
// forwarded as they come, flushes included.
type afterResponse struct {
	caddyhttp.ResponseWriterWrapper
	res         *reservation
	h           *Handler
	rs          *requestState
	wroteHeader bool
	status      int
	usage       *usageScanner // settle openai
}

func (w *afterResponse) WriteHeader(status int) {
	if !w.wroteHeader && status >= 200 || status == http.StatusSwitchingProtocols {
		w.wroteHeader, w.status = true, status
		w.res.responseKnown(status, w.Header())
		// The RateLimit fields with this response's own charge, as far as
		// it is known now.
		if w.res.fieldsSent {
			w.h.writeFields(w.Header(), w.rs, w.res, true)
		}
		if w.usage != nil {
			w.usage.sse = strings.HasPrefix(w.Header().Get("Content-Type"), "text/event-stream")
		}
	}
	w.ResponseWriter.WriteHeader(status)
}

func (w *afterResponse) Write(b []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(b)
	if w.usage != nil && n > 0 {
		w.usage.Write(b[:n])
	}
	return n, err
}

// ReadFrom copies through Write, so the body is scanned (a ReadFrom of the
// wrapped writer would bypass it).
func (w *afterResponse) ReadFrom(r io.Reader) (int64, error) {
	if w.usage == nil {
		if !w.wroteHeader {
			w.WriteHeader(http.StatusOK)
		}
		return w.ResponseWriterWrapper.ReadFrom(r)
	}
	return io.Copy(writerOnly{w}, r)
}

// writerOnly hides a writer's other methods from io.Copy.
type writerOnly struct{ io.Writer }

// afterCharge is what one policy charges after the response.
type afterCharge struct {
	i       int   // the policy's index in the reservation
	charge  bool  // charge_if matched: charge the cost
	usage   int64 // settle: the usage reported, capped; -1 none
	settled bool  // the usage is known
}

// watchResponse wraps w when a policy of the admitted request charges
// after the response.
func (h *Handler) watchResponse(w http.ResponseWriter, rs *requestState, res *reservation) http.ResponseWriter {
	res.after = res.afterbuf[:0]
	var usage *usageScanner
	for i, p := range res.shown {
		if !res.d.verdicts[i].allowed || p.ChargeIf == nil && p.Settle == nil {
			continue
		}
		res.after = append(res.after, afterCharge{i: i, usage: -1})
		if p.Settle != nil && p.Settle.From == settleOpenAI && usage == nil {
			usage = new(usageScanner)
		}
	}
	if len(res.after) == 0 {
		return w
	}
	return &afterResponse{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, res: res, h: h, rs: rs, usage: usage}
}

// responseKnown records what the status and headers of the response say.
func (res *reservation) responseKnown(status int, hdr http.Header) {
	for k := range res.after {
		a := &res.after[k]
		p := res.shown[a.i]
		switch {
		case p.ChargeIf != nil:
			a.charge = p.ChargeIf.Match(status, hdr)
		case p.Settle.From == settleHeader:
			a.usage, a.settled = parseUsage(hdr.Get(p.Settle.Field), p.settleMax)
		}
	}
}

// parseUsage reads a usage value: a non-negative integer, capped at max;
// anything else is no usage (-1).
func parseUsage(v string, max int64) (int64, bool) {
	u, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
	if err != nil || u < 0 {
		return -1, false
	}
	return min(u, max), true
}

// charge makes the charges and settles of the request once its handler
// chain returned (err is what it returned): one store call. What cannot be
// charged (no usage reported, the store unreachable) is counted as lost: a
// lost settle leaves the reservation standing.
func (h *Handler) charge(ctx context.Context, w http.ResponseWriter, rs *requestState, res *reservation, err error) {
	aw, _ := w.(*afterResponse)
	if aw == nil {
		return
	}
	if !aw.wroteHeader {
		// No response was written: a Caddy error's status stands for it, or,
		// when the client went away first, no response at all: a charge_if
		// attempt then keeps its charge (aborting must not be a way to try
		// for free).
		gone := ctx.Err() != nil
		status := http.StatusInternalServerError
		var he caddyhttp.HandlerError
		if errors.As(err, &he) && he.StatusCode != 0 {
			status = he.StatusCode
		} else if err == nil {
			status = http.StatusOK
		}
		res.responseKnown(status, w.Header())
		for k := range res.after {
			if gone && res.shown[res.after[k].i].ChargeIf != nil {
				res.after[k].charge = true
			}
		}
		if res.fieldsSent {
			h.writeFields(w.Header(), rs, res, true) // Caddy writes the error's response with them
		}
	}
	var reqs []bucketRequest
	var charged []int
	for k := range res.after {
		a := &res.after[k]
		p, rq := res.shown[a.i], res.shownReqs[a.i]
		delta := int64(0)
		switch {
		case p.ChargeIf != nil:
			if a.charge {
				continue // the reservation is the charge
			}
			delta = -rq.cost // a response that does not match owes nothing
		default:
			switch p.Settle.From {
			case settleTrailer:
				v := w.Header().Get(http.TrailerPrefix + p.Settle.Field)
				if v == "" {
					v = w.Header().Get(p.Settle.Field)
				}
				a.usage, a.settled = parseUsage(v, p.settleMax)
			case settleOpenAI:
				if aw.usage != nil && aw.usage.found {
					a.usage, a.settled = min(aw.usage.total, p.settleMax), true
				}
			}
			if !a.settled || ctx.Err() != nil && p.Settle.From != settleHeader {
				// Nothing reported, or the client went away mid-stream: the
				// reservation stands.
				p.chargesLost.Inc()
				continue
			}
			if delta = a.usage - rq.cost; delta == 0 {
				continue
			}
		}
		rq.op, rq.delta, rq.cost, rq.wait = opAdjust, delta, 0, 0
		reqs = append(reqs, rq)
		charged = append(charged, a.i)
	}
	if len(reqs) == 0 {
		return
	}
	// The charge is owed even if the client went away.
	d, serr := res.decidedBy.decide(context.WithoutCancel(ctx), reqs)
	if serr != nil {
		for _, i := range charged {
			res.shown[i].chargesLost.Inc()
		}
		return
	}
	// The placeholders, which access logs read after the response, say
	// what the request was charged in the end.
	for k, i := range charged {
		res.d.verdicts[i].remaining, res.d.verdicts[i].untilFits = d.verdicts[k].remaining, d.verdicts[k].untilFits
	}
	h.setPlaceholders(rs, res, rs.retryAfter)
}

// predicted is what a charged-after policy's bucket holds once this
// response's own charge is made, as far as it is known when the headers
// are written: its whole tokens, and the µs until the next (0 when full).
func (res *reservation) predicted(i int) (remaining, untilNext int64) {
	v := res.d.verdicts[i]
	for _, a := range res.after {
		if a.i != i {
			continue
		}
		p, rq := res.shown[i], res.shownReqs[i]
		switch {
		case p.ChargeIf != nil && !a.charge:
			return res.decidedLimit(i, p).adjusted(v, -rq.cost)
		case p.Settle != nil && a.settled:
			return res.decidedLimit(i, p).adjusted(v, a.usage-rq.cost)
		}
	}
	return v.remaining, v.untilFits
}

// adjusted is what a bucket of verdict v holds after delta more tokens are
// charged (given back when negative): whole tokens move the time to the
// next token only when the bucket becomes full (none), or was full (a whole
// interval: a full bucket holds no fraction of a token).
func (l limit) adjusted(v verdict, delta int64) (remaining, untilNext int64) {
	remaining, untilNext = v.remaining-delta, v.untilFits
	switch {
	case remaining >= l.burst:
		return l.burst, 0
	case untilNext == 0 && delta != 0:
		untilNext = l.interval
	}
	return remaining, untilNext
}

// describe is the Caddyfile form of a settle, for messages.
func (s *Settle) describe() string {
	if s.Field == "" {
		return "settle " + s.From
	}
	return fmt.Sprintf("settle %s %s", s.From, s.Field)
}
