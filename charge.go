package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
	"go.uber.org/zap"
)

// Charging after the response. A `charge_if` policy checks its bucket
// before the request (the request is denied when the cost does not fit)
// and charges the cost only when the response matches; a `settle` policy
// reserves its cost before the request, as any policy charges it, and
// settles it against the usage the response reports: the difference is
// given back, or charged as debt. The charge or settle of a request is one
// script call once its handler chain returns (or panics, as reverse_proxy
// does when a stream is cut), on the store that admitted it
// (admission.decidedBy).

// chargeKind is when a policy's requests are charged: at admission (the
// default), after the response when it matches charge_if, or by the usage
// the response reports (settle).
type chargeKind uint8

const (
	chargedAtAdmission chargeKind = iota
	chargedIfMatched              // charge_if
	chargedBySettle               // settle
)

// charging is when the policy's requests are charged (a config sets one
// of charge_if and settle at most, checkRate).
func (p *Policy) charging() chargeKind {
	switch {
	case p.ChargeIf != nil:
		return chargedIfMatched
	case p.Settle != nil:
		return chargedBySettle
	}
	return chargedAtAdmission
}

// Settle takes a policy's true cost from the response.
type Settle struct {
	// Where the usage is: `header` (a response header, read when the
	// response's headers are written), `trailer` (an HTTP trailer, read
	// after the body), `openai` (the `usage` of an OpenAI chat completion
	// or Responses API response: a JSON body, or the events of a
	// server-sent-events stream) or `anthropic` (the `usage` of an
	// Anthropic Messages response, JSON or stream). `openai` and
	// `anthropic` read the body as it streams past, unbuffered, compressed
	// (gzip, deflate, br, zstd) or not.
	From string `json:"from"`

	// The header or trailer field holding the usage, a non-negative
	// integer. Required for `header` and `trailer`.
	Field string `json:"field,omitempty"`

	// The most usage one response settles (in dollars, under `unit
	// usd`). Default: no cap but the debt's (burst + debt: a response
	// cannot take more than a full bucket and all the debt it may owe).
	Max float64 `json:"max,omitempty"`

	// The most tokens (dollars, under `unit usd`) a key may owe beyond an
	// empty bucket, charged by responses that used more than they
	// reserved: the key is denied until the rate has paid it back. It
	// bounds how long a broken upstream reporting an absurd usage can lock
	// a key out. Default: what the rate refills in 24 hours, at least
	// twice the burst; for a quota, twice its N.
	Debt float64 `json:"debt,omitempty"`

	// Weighs input, output and cached prompt tokens apart (`openai` and
	// `anthropic` only): the usage is input × `input` + output × `output`
	// + cache writes × `cache_write` + cache reads × `cache_read`, rounded
	// up. Default: input and output count 1; cache writes (Anthropic's
	// cache_creation_input_tokens) count as input; cache reads count as
	// input for `openai` (prompt_tokens_details.cached_tokens, which
	// OpenAI's rate limits count), 0 for `anthropic`
	// (cache_read_input_tokens, which Anthropic's input-token rate limits
	// do not count). Without weights, `openai` settles `total_tokens`.
	Weights *SettleWeights `json:"weights,omitempty"`

	// Makes a streaming chat completions request ask for its usage
	// (`openai` only): a request with `"stream": true` that does not set
	// `"stream_options": {"include_usage": true}` gets it on its way to
	// the provider, and the chunk of usage this adds (and each chunk's
	// `"usage": null`) is taken out of what its client receives: the
	// client gets the stream it asked for, byte for byte, and the request
	// is settled at its usage, not an estimate. For upstreams that take
	// stream_options (OpenAI, Azure OpenAI, most OpenAI-compatible
	// servers); applies to requests whose path ends in /chat/completions.
	IncludeUsage bool `json:"include_usage,omitempty"`

	w         llm.Weights // provisioned: Weights with their defaults
	max, debt int64       // Max and Debt in the policy's unit
	unit      unit        // the policy's
}

// SettleWeights are the prices of input (prompt) and output (completion)
// tokens, and of prompt tokens written to or read from the provider's
// cache, in the policy's tokens: decimals from 0 to 1000, at most 6
// decimal places; input and output are required, not both 0.
type SettleWeights struct {
	Input  *float64 `json:"input,omitempty"`
	Output *float64 `json:"output,omitempty"`
	// Default: input's. Anthropic only (OpenAI reports no cache writes).
	CacheWrite *float64 `json:"cache_write,omitempty"`
	// Default: input's for openai, 0 for anthropic.
	CacheRead *float64 `json:"cache_read,omitempty"`
}

const (
	settleHeader    = "header"
	settleTrailer   = "trailer"
	settleOpenAI    = "openai"
	settleAnthropic = "anthropic"
)

// maxWeight bounds a weight.
const maxWeight = 1000

// fromBody reports whether the usage is read from the body.
func (s *Settle) fromBody() bool { return s.From == settleOpenAI || s.From == settleAnthropic }

// provider is whose usage format the body has.
func (s *Settle) provider() llm.Provider { return providerOf(s.From) }

// providerOf is the provider of a settle from `from`.
func providerOf(from string) llm.Provider {
	if from == settleAnthropic {
		return llm.Anthropic
	}
	return llm.OpenAI
}

// check checks the settle options of a policy in unit u; settleLimits
// gives their caps.
func (s *Settle) check(u unit) (err error) {
	switch s.From {
	case settleHeader, settleTrailer:
		if s.Field == "" {
			return fieldErr("settle", "settle: %s: the field that holds the usage is required, e.g. settle %s X-Usage-Tokens", s.From, s.From)
		}
		if s.Weights != nil {
			return fieldErr("settle", "settle: %s reports one number: weights are for openai and anthropic, whose responses count input and output tokens apart", s.From)
		}
	case settleOpenAI, settleAnthropic:
		if s.Field != "" {
			return fieldErr("settle", "settle: %s reads the usage of the body, and takes no field (got %q)", s.From, s.Field)
		}
	default:
		return fieldErr("settle", "settle: %q is not header, trailer, openai or anthropic", s.From)
	}
	s.unit = u
	if s.max, err = u.count(s.Max); err != nil {
		return fieldErr("settle", "settle: max %v", err)
	}
	if s.debt, err = u.count(s.Debt); err != nil {
		return fieldErr("settle", "settle: debt %v", err)
	}
	if s.IncludeUsage && s.From != settleOpenAI {
		return fieldErr("settle", "settle: include_usage is for openai: it asks OpenAI's streamed chat completions for their usage (other APIs stream theirs)")
	}
	if u == unitUSD && s.Weights != nil {
		return fieldErr("settle", "settle: weights and unit usd do not mix: a money policy prices each model's input, output and cached tokens with the handler's prices")
	}
	s.w, err = s.Weights.check(s.From)
	return err
}

// check checks the weights of a settle from `from`, and returns them in
// millionths with their defaults (see Settle.Weights).
func (sw *SettleWeights) check(from string) (llm.Weights, error) {
	if sw == nil {
		return llm.Weights{Input: llm.WeightUnit, Output: llm.WeightUnit, CacheWrite: -1, CacheRead: -1}.Defaults(providerOf(from)), nil
	}
	if sw.Input == nil || sw.Output == nil {
		return llm.Weights{}, fieldErr("settle", "settle: weights: input and output are both required, as in weights input 1 output 4")
	}
	if sw.CacheWrite != nil && from == settleOpenAI {
		return llm.Weights{}, fieldErr("settle", "settle: weights: cache_write is for anthropic: OpenAI reports the prompt tokens read from its cache (cache_read), no writes")
	}
	var w [4]int64
	for i, p := range [4]*float64{sw.Input, sw.Output, sw.CacheWrite, sw.CacheRead} {
		if p == nil {
			w[i] = -1 // its default
			continue
		}
		v, name := *p, [4]string{"input", "output", "cache_write", "cache_read"}[i]
		if !(v >= 0 && v <= maxWeight) {
			return llm.Weights{}, fieldErr("settle", "settle: weights: %s %s must be from 0 to %d", name, strconv.FormatFloat(v, 'f', -1, 64), maxWeight)
		}
		m := math.Round(v * llm.WeightUnit)
		if math.Abs(v*llm.WeightUnit-m) > 1e-3 {
			return llm.Weights{}, fieldErr("settle", "settle: weights: %s %s has more than 6 decimal places", name, strconv.FormatFloat(v, 'f', -1, 64))
		}
		w[i] = int64(m)
	}
	if w[0] == 0 && w[1] == 0 {
		return llm.Weights{}, fieldErr("settle", "settle: weights: input and output are both 0: every response would settle at 0")
	}
	return llm.Weights{Input: w[0], Output: w[1], CacheWrite: w[2], CacheRead: w[3]}.Defaults(providerOf(from)), nil
}

// afterResponse watches a response for what the policies charged after it
// need: its status and headers (charge_if, settle header), its trailers
// (settle trailer) or the usage in its body (settle openai, anthropic).
// Bytes are forwarded as they come, flushes included.
type afterResponse struct {
	caddyhttp.ResponseWriterWrapper
	res         *admission
	rs          *requestState
	logger      *zap.Logger // for charges lost
	wroteHeader bool
	status      int
	body        *llm.Response // settle openai, anthropic
	// filter gives the client the stream without the usage asked for it
	// (settle openai include_usage; money.go), nil when there is none.
	filter *llm.UsageFilter
	// wantTrailers: the client takes trailers, and a settle is known only
	// after the body; trailers: the response declared the RateLimit
	// trailer, sent with the settled state.
	wantTrailers, trailers bool
	http1                  bool
	// The end of the response, which the client must not see before the
	// store has what the request leaves (finish.go): ctx is the request's;
	// head: a HEAD request, whose response has no body; length: the bytes
	// the response declared, -1 when its end is only known when the
	// handler chain returns; written: the body bytes passed on; finished:
	// the work after the response is done.
	ctx         context.Context
	head        bool
	endAtReturn bool
	length      int64
	written     int64
	finished    bool
}

func (w *afterResponse) WriteHeader(status int) {
	// The response's status: its first final one, or a 101 Switching
	// Protocols (below 200, yet the response an upgrade gets).
	if (!w.wroteHeader && status >= 200) || status == http.StatusSwitchingProtocols {
		w.wroteHeader, w.status = true, status
		hdr := w.Header()
		w.res.responseKnown(status, hdr)
		// The RateLimit fields with this response's own charge, as far as
		// it is known now.
		if w.res.fieldsSent {
			w.res.writeFields(hdr, w.rs, true)
		}
		if w.body != nil {
			w.body.Start(hdr)
		}
		w.filter = usageFilterFor(w.rs, hdr, w.ResponseWriter)
		if w.trailers = w.wantTrailers && w.res.fieldsSent && hasBody(status); w.trailers {
			// Declared, RateLimit is sent again after the body, from what
			// the header map holds when the handler returns.
			hdr.Add("Trailer", "RateLimit")
			if w.http1 {
				hdr.Del("Content-Length") // HTTP/1.1 carries trailers in a chunked body only
			}
		}
		w.length = w.declaredLength(status, hdr)
		if w.length == 0 {
			// Its headers are the whole response.
			w.finish(nil)
		}
	}
	w.ResponseWriter.WriteHeader(status)
}

// hasBody reports whether a response of the status has a body.
func hasBody(status int) bool {
	return status >= 200 && status != http.StatusNoContent && status != http.StatusNotModified
}

func (w *afterResponse) Write(b []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	if !w.finished && w.length > 0 && w.written+int64(len(b)) >= w.length {
		// The last bytes: what they carry (a usage) is read, and the work
		// after the response done, before the client can have them.
		if w.body != nil {
			w.body.Write(b)
		}
		w.finish(nil)
		n, err := w.ResponseWriter.Write(b)
		w.written += int64(n)
		return n, err
	}
	var n int
	var err error
	if w.filter != nil {
		n, err = w.filter.Write(b)
	} else {
		n, err = w.ResponseWriter.Write(b)
	}
	w.written += int64(n)
	if w.body != nil && n > 0 && !w.finished {
		w.body.Write(b[:n])
	}
	return n, err
}

// ReadFrom copies through Write, so the body is scanned and its end seen
// (a ReadFrom of the wrapped writer would bypass both).
func (w *afterResponse) ReadFrom(r io.Reader) (int64, error) {
	if w.body == nil && (w.finished || w.wroteHeader && w.length < 0) { // nothing to read, no end to find
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
	i       int    // the policy's part in the admission (res.parts)
	charge  bool   // charge_if matched: charge the cost
	usage   int64  // settle: the usage reported, capped; -1 none
	settled bool   // the usage is known
	lost    int    // why the charge was not made as measured (lostReason), or -1
	model   string // a money policy's: the model priced (money.go)
}

// serveWatched runs the rest of the handler chain with the response
// watched when a policy charges after it, then makes those charges: also
// when the chain panics, as reverse_proxy does (http.ErrAbortHandler) when
// the client or the upstream cut a stream, so that a cut stream is
// charged.
func (h *Handler) serveWatched(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler, rs *requestState, res *admission) error {
	aw := h.watchResponse(w, r, rs, res)
	if aw == nil {
		return next.ServeHTTP(w, r)
	}
	returned := false
	defer func() {
		if !returned { // panicking: charge, and let the panic go on
			aw.finish(errAborted)
		}
		if aw.body != nil {
			aw.body.Finish()
		}
	}()
	err := next.ServeHTTP(aw, r)
	returned = true
	aw.finish(err)
	if aw.filter != nil {
		_ = aw.filter.Close() // what a cut stream held, after the settle
	}
	return err
}

// errAborted stands for the error of a handler chain that panicked.
var errAborted = errors.New("the handler chain aborted")

// watchResponse wraps w when the admitted request leaves work for after
// its response: a policy charged after it (charge_if, settle), or a
// concurrency slot to free (see finish.go); nil when there is none.
func (h *Handler) watchResponse(w http.ResponseWriter, r *http.Request, rs *requestState, res *admission) *afterResponse {
	res.after = res.afterbuf[:0]
	var body *llm.Response
	afterBody, fromTrailer := false, false
	for i, pt := range res.decidedParts() {
		p := pt.policy
		if !pt.v.allowed || p.charging() == chargedAtAdmission {
			continue
		}
		res.after = append(res.after, afterCharge{i: i, usage: -1, lost: -1})
		if p.charging() != chargedBySettle {
			continue
		}
		afterBody = afterBody || p.Settle.From != settleHeader
		fromTrailer = fromTrailer || p.Settle.From == settleTrailer
		if p.Settle.fromBody() && body == nil {
			body = new(llm.Response)
		}
	}
	if len(res.after) == 0 && !res.holdsClientSlots() {
		return nil
	}
	if body != nil {
		// The upstream may answer only in a coding whose usage is read.
		if vs := r.Header.Values("Accept-Encoding"); len(vs) > 0 {
			switch filtered, changed := llm.ReadableAcceptEncoding(strings.Join(vs, ",")); {
			case changed && filtered == "":
				r.Header.Del("Accept-Encoding") // identity only
			case changed:
				r.Header.Set("Accept-Encoding", filtered)
			}
		}
	}
	aw := &afterResponse{ResponseWriterWrapper: caddyhttp.ResponseWriterWrapper{ResponseWriter: w}, res: res, rs: rs, logger: h.logger, body: body,
		wantTrailers: afterBody && acceptsTrailers(r), http1: r.ProtoMajor == 1,
		ctx: r.Context(), head: r.Method == http.MethodHead, length: -1}
	aw.endAtReturn = fromTrailer // the usage comes after the body
	return aw
}

// acceptsTrailers reports whether the client said it takes trailers
// (`TE: trailers`) on a request whose response can carry them.
func acceptsTrailers(r *http.Request) bool {
	if r.Method == http.MethodHead || !r.ProtoAtLeast(1, 1) {
		return false
	}
	for _, v := range r.Header["Te"] {
		for part := range strings.SplitSeq(v, ",") {
			coding, _, _ := strings.Cut(part, ";")
			if strings.EqualFold(strings.TrimSpace(coding), "trailers") {
				return true
			}
		}
	}
	return false
}

// responseKnown records what the status and headers of the response say.
func (res *admission) responseKnown(status int, hdr http.Header) {
	for k := range res.after {
		a := &res.after[k]
		p := res.parts[a.i].policy
		switch {
		case p.charging() == chargedIfMatched:
			a.charge = p.ChargeIf.Match(status, hdr)
		case p.Settle.From == settleHeader:
			a.usage, a.settled = p.unit.usage(hdr.Get(p.Settle.Field), p.after.maxUsage)
		}
	}
}

// usage reads a usage value of a header or trailer in the unit: a
// non-negative integer of tokens, or dollars (micro-dollars, rounded up:
// an upstream may report a cost more precisely), capped at max; anything
// else is no usage (-1).
func (u unit) usage(v string, max int64) (int64, bool) {
	if u == unitUSD {
		micros, err := price.ParseUSDUp(strings.TrimSpace(v))
		if err != nil {
			return -1, false
		}
		return min(micros, max), true
	}
	return parseUsage(v, max)
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

// charges are the charges and settles of the request once its response is
// known (err is what its handler chain returned, if it has): the store
// requests that make them, and the policies of those. A settle without
// usage charges what the response delivered implies, at least its
// reservation (estimate). What was not charged as measured (no usage, a
// body that cannot be read, the client gone) is counted as lost here; a
// charge the store does not take, by the caller.
func (aw *afterResponse) charges(err error) (reqs []bucketRequest, policies []*Policy) {
	ctx, rs, res := aw.ctx, aw.rs, aw.res
	failed := aw.wroteHeader && !succeeded(aw.status) // the upstream's error (charge_failed.go)
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
		res.responseKnown(status, aw.Header())
		for k := range res.after {
			if gone && res.parts[res.after[k].i].policy.charging() == chargedIfMatched {
				res.after[k].charge = true
			}
		}
		// Caddy's own error, the upstream not reached or not answering (a
		// 502, a 504 of a dial): nothing was generated (charge_failed.go).
		// A client gone first keeps the rule of a cut stream, and so does a
		// timeout waiting for the answer: the upstream may be generating.
		failed, aw.status = !gone && !succeeded(status) && (status != http.StatusGatewayTimeout || unreached(err)), status
		if res.fieldsSent {
			res.writeFields(aw.Header(), rs, true) // Caddy writes the error's response with them
		}
	}
	if aw.body != nil {
		aw.body.Finish()
	}
	gone := ctx.Err() != nil
	var charged []int // indexes in res.after
	for k := range res.after {
		a := &res.after[k]
		p, rq := res.parts[a.i].policy, res.parts[a.i].rq
		delta := int64(0)
		var w llm.Weights // a body's usage is weighed (priced) with
		if p.Settle != nil {
			w = p.Settle.w
		}
		switch {
		case p.charging() == chargedIfMatched:
			if a.charge {
				p.spend("", rq.cost) // money.go
				continue             // the reservation is the charge
			}
			delta = -rq.cost // a response that does not match owes nothing
		default:
			switch p.Settle.From {
			case settleTrailer:
				v := aw.Header().Get(http.TrailerPrefix + p.Settle.Field)
				if v == "" {
					v = aw.Header().Get(p.Settle.Field)
				}
				a.usage, a.settled = p.unit.usage(v, p.after.maxUsage)
			case settleOpenAI, settleAnthropic:
				if p.unit == unitUSD { // priced as the model served (money.go)
					var priced bool
					if w, a.model, priced = p.settlePrice(aw.body.Model(), rs.body); !priced {
						break // nothing to price it with: the reservation stands
					}
				}
				if u, ok := aw.body.Usage(p.Settle.provider(), w); ok {
					a.usage, a.settled = min(u, p.after.maxUsage), true
				}
			}
			switch {
			case a.settled:
				delta = a.usage - rq.cost
				rq.remember(a.usage) // learned_usage.go
			case failed:
				// An error without usage: providers bill none (charge_failed.go).
				delta, rq.learns = -rq.cost, false // nothing learned, nor forgotten
				aw.failedLog(p)
			default:
				// No usage: the charge is what the response delivered implies,
				// never less than the reservation.
				a.lost = aw.lostReason(p, gone)
				delta = max(0, min(aw.estimate(p, w, rs), p.after.maxUsage)-rq.cost)
			}
			p.spend(a.model, rq.cost+delta)
			if delta == 0 && rq.record == 0 {
				continue
			}
		}
		rq.op, rq.delta, rq.cost, rq.wait = opAdjust, delta, 0, 0
		if delta < 0 {
			// Only the tokens still due go back (bucket.go, givenBack): a
			// long response's refund must not forgive what the bucket has
			// refilled since.
			rq.due = res.d.verdicts[a.i].due
		}
		reqs = append(reqs, rq)
		charged = append(charged, k)
	}
	if len(reqs) > 0 {
		// The charge is owed even if the client went away. The
		// placeholders, which access logs read after the response, and the
		// trailer say what it leaves, as this decision's state predicts.
		for j, k := range charged {
			pt := &res.parts[res.after[k].i]
			pt.v.remaining, pt.v.untilFits = pt.decidedLimit().adjusted(pt.v, reqs[j].delta)
			policies = append(policies, pt.policy)
		}
		res.setPlaceholders(rs, rs.retryAfter)
	}
	for k := range res.after {
		if a := &res.after[k]; a.lost >= 0 {
			aw.chargeLost(res.parts[a.i].policy, a.lost)
		}
	}
	if aw.trailers {
		// The declared RateLimit trailer: the state once settled.
		res.writeFields(aw.Header(), rs, false)
	}
	return reqs, policies
}

// Why a charge after the response was not made as measured: the label
// `reason` of caddy_rate_limit_charges_lost_total.
const (
	lostNoUsage          = iota // the response reported no usage
	lostUnreadable              // the body could not be read (its coding, corrupt data, a window too large)
	lostClientGone              // the client went away before the usage came
	lostStoreUnreachable        // the store did not take the charge
	numLostReasons
)

var lostReasonNames = [numLostReasons]string{"no_usage", "unreadable", "client_gone", "store_unreachable"}

// lostReason is why a settle found no usage.
func (w *afterResponse) lostReason(p *Policy, gone bool) int {
	switch {
	case p.Settle.fromBody() && w.body.Unreadable() != nil:
		return lostUnreadable
	case gone:
		return lostClientGone
	}
	return lostNoUsage
}

// estimate is what a response without usage is charged at least (see
// cutEstimate). Only body settles estimate, and only a body that could be
// read (one that could not keeps its reservation); 0 for the others.
func (w *afterResponse) estimate(p *Policy, weights llm.Weights, rs *requestState) int64 {
	if w.body == nil || !p.Settle.fromBody() || w.body.Unreadable() != nil {
		return 0
	}
	return w.body.CutEstimate(p.Settle.provider(), weights, rs.body)
}

// lostLogInterval is how often, at most, a policy logs the settles it lost
// for one reason.
const lostLogInterval = time.Minute

// lostLog limits the log lines of one policy's lost settles of one reason.
type lostLog struct {
	last  atomic.Int64 // when the last line was written, in Unix ns
	count atomic.Int64 // lost since
}

// due counts one lost settle and reports whether a line is due, with the
// count since the last one.
func (l *lostLog) due(now time.Time) (int64, bool) {
	l.count.Add(1)
	last := l.last.Load()
	if now.UnixNano()-last < int64(lostLogInterval) || !l.last.CompareAndSwap(last, now.UnixNano()) {
		return 0, false
	}
	return l.count.Swap(0), true
}

// chargeLost counts a charge not made as measured, and logs the ones an
// operator can fix (a body that cannot be read, an upstream that reports
// no usage) at most once per lostLogInterval per policy and reason.
func (w *afterResponse) chargeLost(p *Policy, reason int) {
	p.after.lost[reason].Inc()
	if (reason != lostUnreadable && reason != lostNoUsage) || p.charging() != chargedBySettle {
		return
	}
	n, due := p.after.logs[reason].due(time.Now())
	if !due {
		return
	}
	fields := []zap.Field{zap.String("policy", p.Name), zap.String("settle", p.Settle.describe()), zap.Int("status", w.status),
		zap.Int64("responses_since_last_line", n), zap.Duration("one_line_per", lostLogInterval)}
	if reason == lostUnreadable {
		w.logger.Warn("settle: the response body could not be read for its usage: the reservation stands", append(fields,
			zap.String("content_encoding", w.body.Coding()), zap.NamedError("why", w.body.Unreadable()))...)
		return
	}
	hint := "the upstream answered " + strconv.Itoa(w.status) + " with no usage: charged the estimate of what was delivered, at least the reservation"
	if p.Settle.From == settleHeader || p.Settle.From == settleTrailer {
		hint = "the upstream answered " + strconv.Itoa(w.status) + " with no usage: the reservation stands"
	}
	switch p.Settle.From {
	case settleOpenAI:
		hint += `; OpenAI streams report usage only when the request sets "stream_options": {"include_usage": true}`
		if p.Settle.IncludeUsage {
			hint += ", which include_usage asked for: this upstream ignores it, or the request's path does not end in /chat/completions"
		} else {
			hint += ", which settle openai include_usage asks for the client"
		}
	case settleHeader, settleTrailer:
		hint += "; the response had no " + p.Settle.Field + " holding a non-negative integer"
	}
	w.logger.Warn("settle: "+hint, fields...)
}

// predicted is what a charged-after policy's bucket holds once this
// response's own charge is made, as far as it is known when the headers
// are written: its whole tokens, and the µs until the next (0 when full).
func (res *admission) predicted(i int) (remaining, untilNext int64) {
	pt := &res.parts[i]
	v := pt.v
	for _, a := range res.after {
		if a.i != i {
			continue
		}
		p, rq := pt.policy, pt.rq
		switch {
		case p.charging() == chargedIfMatched && !a.charge:
			return pt.decidedLimit().adjusted(v, -rq.cost)
		case p.charging() == chargedBySettle && a.settled:
			return pt.decidedLimit().adjusted(v, a.usage-rq.cost)
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

// shape is what of a settle makes its policy's budget, which two
// definitions of one name must agree on: a token policy's settle counts
// what its format and weights say; a money policy's counts dollars,
// whatever the format (one budget may settle OpenAI's responses on one
// route and Anthropic's on another).
func (s *Settle) shape() string {
	if s.unit == unitUSD {
		return "settled in dollars"
	}
	return s.describe()
}

// describe is the Caddyfile form of a settle, for messages.
func (s *Settle) describe() string {
	d := "settle " + s.From
	if s.Field != "" {
		d += " " + s.Field
	}
	if sw := s.Weights; sw != nil && sw.Input != nil && sw.Output != nil {
		d += fmt.Sprintf(" weights input %v output %v", *sw.Input, *sw.Output)
		if sw.CacheWrite != nil {
			d += fmt.Sprintf(" cache_write %v", *sw.CacheWrite)
		}
		if sw.CacheRead != nil {
			d += fmt.Sprintf(" cache_read %v", *sw.CacheRead)
		}
	}
	return d
}
