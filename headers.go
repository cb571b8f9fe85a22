package ratelimit

import (
	"encoding/json"
	"errors"
	"math"
	"math/rand/v2"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// The response side of the contract: the RateLimit-Policy and RateLimit
// fields of draft-ietf-httpapi-ratelimit-headers-11, Retry-After, and the
// RFC 9457 problem bodies of 429 and 503. The draft is still moving: its
// serialisation lives in policyMember and limitMember and nowhere else.

const (
	problemQuotaExceeded   = "https://iana.org/assignments/http-problem-types#quota-exceeded"
	problemReducedCapacity = "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity"
)

// fieldQuota is a policy as the RateLimit-Policy field states it: q units
// per w seconds. w must be a whole, non-zero number of seconds, so a
// sub-second or fractional period becomes the quota of the next whole
// number of seconds, rounded down (10/100ms is q=100;w=1).
func fieldQuota(n int64, per time.Duration) (q, w int64) {
	w = int64(per / time.Second)
	if per%time.Second != 0 {
		w++ // (per + time.Second - 1) could overflow
	}
	q = int64(float64(n) * float64(w) * float64(time.Second) / float64(per))
	return min(q, maxSFInteger), min(w, maxSFInteger)
}

// policyMember is one member of RateLimit-Policy: "name";q=100;w=60, and
// the quota unit of a policy that counts money ("name";q=5000000;w=3600;
// qu="usd-micros").
func policyMember(b []byte, name string, q, w int64, u unit) []byte {
	b = appendSFString(b, name)
	b = append(b, ";q="...)
	b = strconv.AppendInt(b, q, 10)
	b = append(b, ";w="...)
	b = strconv.AppendInt(b, w, 10)
	if qu := u.fieldUnit(); qu != "" {
		b = append(b, ";qu="...)
		b = appendSFString(b, qu)
	}
	return b
}

// slotsMember is the RateLimit-Policy member of a concurrency policy:
// "name";q=3;qu="concurrent-requests": no window.
func slotsMember(b []byte, name string, slots int64) []byte {
	b = appendSFString(b, name)
	b = append(b, ";q="...)
	b = strconv.AppendInt(b, min(slots, maxSFInteger), 10)
	return append(b, `;qu="concurrent-requests"`...)
}

// limitMember is one member of RateLimit: "name";r=0;t=3, where r is the
// whole tokens left and t the seconds (rounded up) until the next token, or
// on a denial until the request would fit; 0 when the bucket is full. A
// request that can never fit (cost above burst) gets no t.
func limitMember(b []byte, name string, remaining, waitUS int64) []byte {
	b = appendSFString(b, name)
	b = append(b, ";r="...)
	// A bucket in debt, or with slots reserved beyond its capacity, has no
	// tokens left to offer: r is never negative.
	b = strconv.AppendInt(b, min(max(remaining, 0), maxSFInteger), 10)
	if waitUS == neverFits {
		return b
	}
	b = append(b, ";t="...)
	return strconv.AppendInt(b, ceilSeconds(waitUS), 10)
}

// maxSFInteger is the largest RFC 9651 sf-Integer (15 digits). Larger
// values are lowered to it, which the draft allows.
const maxSFInteger = 999_999_999_999_999

// appendSFString serialises an RFC 9651 sf-String. Policy names are
// validated to printable ASCII at provisioning; only " and \ need escaping.
func appendSFString(b []byte, s string) []byte {
	b = append(b, '"')
	for i := 0; i < len(s); i++ {
		if s[i] == '"' || s[i] == '\\' {
			b = append(b, '\\')
		}
		b = append(b, s[i])
	}
	return append(b, '"')
}

// ceilSeconds rounds a wait in µs up to whole seconds.
func ceilSeconds(us int64) int64 {
	if us <= 0 {
		return 0
	}
	return (us + 999_999) / 1_000_000
}

// retryAfter is the Retry-After of a denial whose true wait is waitUS:
// whole seconds, at least 1, never below the wait rounded up, and spread
// upward by up to jitter (a fraction) so denied clients do not all return
// in the same second.
func retryAfter(waitUS int64, jitter float64) int64 {
	secs := float64(waitUS) / 1e6
	if jitter > 0 {
		secs *= 1 + jitter*rand.Float64()
	}
	ra := int64(math.Ceil(secs))
	return max(ra, ceilSeconds(waitUS), 1)
}

// maxRetryWait is the longest wait a denial lets a client's SDK sleep
// through: the official OpenAI and Anthropic SDKs retry a 429 (twice by
// default) after the wait retry-after-ms or Retry-After gives, with no cap
// (or 2^31 ms), so a long one leaves the application's call pending that
// long with nothing surfaced. A denial whose Retry-After is longer, every
// quota's denial (its period's end) and a cost that can never fit say
// `x-should-retry: false`, which both SDKs obey before anything else: the
// error reaches the application at once.
const maxRetryWait = 10 // seconds

// setRetryFields sets the fields that tell a client when to come back:
// Retry-After (whole seconds; none for ra 0: a request that can never
// fit), retry-after-ms beside it (the same instant, in milliseconds, which
// the LLM SDKs read first), and `x-should-retry: false` when the client
// should not retry by itself.
func setRetryFields(h http.Header, ra int64, retry bool) {
	if ra > 0 {
		h.Set("Retry-After", strconv.FormatInt(ra, 10))
		h.Set("Retry-After-Ms", strconv.FormatInt(ra*1000, 10))
	}
	if !retry {
		h.Set("X-Should-Retry", "false")
	}
}

type problem struct {
	Type             string   `json:"type"`
	Title            string   `json:"title"`
	Status           int      `json:"status"`
	Detail           string   `json:"detail"`
	ViolatedPolicies []string `json:"violated-policies,omitempty"`
}

// writeProblem writes an RFC 9457 problem response. Rate-limit responses
// are about this client at this moment: never cache them.
func writeProblem(w http.ResponseWriter, p problem) error {
	body, err := json.Marshal(p)
	if err != nil {
		return err
	}
	return writeProblemBody(w, p.Status, body)
}

func writeProblemBody(w http.ResponseWriter, status int, body []byte) error {
	h := w.Header()
	h.Set("Content-Type", "application/problem+json")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}

func quotaExceeded(violated []string) problem {
	noun := "policy"
	if len(violated) > 1 {
		noun = "policies"
	}
	return problem{
		Type:             problemQuotaExceeded,
		Title:            "Quota Exceeded",
		Status:           http.StatusTooManyRequests,
		Detail:           "Rate limit exceeded for " + noun + " " + strings.Join(violated, ", ") + ".",
		ViolatedPolicies: violated,
	}
}

func reducedCapacity() problem {
	return problem{
		Type:   problemReducedCapacity,
		Title:  "Temporary Reduced Capacity",
		Status: http.StatusServiceUnavailable,
		Detail: "The rate limiter is unavailable; try again shortly.",
	}
}

// boundaryRetryAfter is the Retry-After of a request a quota denied, whose
// period ends waitUS from now: whole seconds, never before the boundary,
// spread upward by up to spreadUS (see boundarySpread). A quota comes back
// whole at its boundary rather than at a rate, so there are no turns to
// pace clients to (internal/pace): spreading them from the boundary is what
// keeps them from returning together.
func boundaryRetryAfter(waitUS, spreadUS int64) int64 {
	at := waitUS
	if spreadUS > 0 {
		at += int64(float64(spreadUS) * rand.Float64())
	}
	return max(ceilSeconds(at), ceilSeconds(waitUS), 1)
}

// errRateLimited is the error of a denial handed to a site's handle_errors.
var errRateLimited = errors.New("rate limit exceeded")

// errStoreUnavailable is the error of a fail_closed 503 handed to a site's
// handle_errors.
var errStoreUnavailable = errors.New("rate limiter unavailable")

// handlesErrors reports whether the server has an error route that would
// take this request's error of the given status: a site's handle_errors.
func handlesErrors(r *http.Request, status int) bool {
	srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok || srv == nil || srv.Errors == nil || len(srv.Errors.Routes) == 0 {
		return false
	}
	// Match as Caddy will, with the error's placeholders set.
	er := srv.Errors.WithError(r, caddyhttp.Error(status, errRateLimited))
	for _, route := range srv.Errors.Routes {
		if len(route.MatcherSets) == 0 {
			return true
		}
		if ok, err := route.MatcherSets.AnyMatchWithError(er); ok && err == nil {
			return true
		}
	}
	return false
}

// A quota's fields: its RateLimit-Policy member, and its Retry-After past
// the boundary.

// quotaMember is a cached RateLimit-Policy member, for one quota and period.
type quotaMember struct {
	n      int64
	p      calendar.Period
	member []byte
}

// policyMember is the RateLimit-Policy member of a quota of n units in
// period p: "name";q=n;w=<p's length in seconds>, built once a period.
func (q *quotaSpec) policyMember(n int64, p calendar.Period) []byte {
	if m := q.member.Load(); m != nil && m.p == p && m.n == n {
		return m.member
	}
	m := &quotaMember{n: n, p: p, member: policyMember(nil, q.name, min(n, maxSFInteger), min(p.Seconds(), maxSFInteger), q.counts)}
	q.member.Store(m)
	return m.member
}

// maxBoundarySpread bounds how far past a quota's boundary Retry-After
// sends the clients it denied.
const maxBoundarySpread = time.Hour

// boundarySpread is how far past its boundary a quota spreads the return
// of the clients it denied: jitter of the period's length (a minute's 12 s
// at 20%), at most maxBoundarySpread. Of the period rather than of each
// client's wait: clients denied in the period's last second would
// otherwise all come back in the next one's first.
func boundarySpread(p calendar.Period, jitter float64) int64 {
	return min(int64(float64(p.End-p.Start)*jitter), maxBoundarySpread.Microseconds())
}
