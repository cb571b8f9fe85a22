package ratelimit

import (
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
)

// requestState is what the rate_limit handlers a request passes through
// know of it: its placeholders, formatted only when a later handler or an
// access log reads them, and, for a second handler nested in the first,
// the policies decided already and the RateLimit fields sent so far.
type requestState struct {
	decided    bool    // a rate_limit handler decided the request
	outcome    outcome // {http.rate_limit.decision}: the placeholder keeps its name
	policy     string
	key        string // that policy's storage key: a hash, never the identity
	remaining  int64  // -1: not decided
	retryAfter int64

	// policies names the policies decided for this request (by an earlier
	// handler, for a later one): a policy is one budget, charged once per
	// request.
	policies  []string // the policies decided (see wasDecided)
	policyBuf [4]string
	// The members of RateLimit-Policy and RateLimit set by earlier
	// handlers, which later ones add to.
	policyField, limitField string
	// fieldValues holds the values of the first RateLimit-Policy and
	// RateLimit fields set (fieldsSet), in place of an allocation.
	fieldValues [2]string
	fieldsSet   bool

	// header is the request's, for {http.rate_limit.bearer} and
	// {http.rate_limit.credential}.
	header http.Header
	// body is what the request body asks for (`cost openai`), read once.
	body     llm.Request
	bodyRead bool
	// dryRun: the request is a dry run's (dryrun.go) or a replay's, which
	// counts nothing.
	dryRun bool
	// prices are the prices of the handler that read the body, for
	// {http.rate_limit.model}; usageAsk is what asking a stream for its
	// usage did to the body (money.go), once tried.
	prices        *price.Table
	usageAsk      *llm.UsageAsk
	usageAskTried bool
}

// bodyWhole reports whether the request body read is the whole body.
func (rs *requestState) bodyWhole() bool { return rs.bodyRead && !rs.body.Truncated() }

// stateVar is where a request keeps its requestState.
const stateVar = "\x00rate_limit"

// requestStateOf returns the request's requestState, registering its
// placeholders the first time.
func requestStateOf(r *http.Request, repl *caddy.Replacer) *requestState {
	if rs, ok := caddyhttp.GetVar(r.Context(), stateVar).(*requestState); ok {
		return rs
	}
	rs := &requestState{remaining: -1, header: r.Header}
	rs.policies = rs.policyBuf[:0]
	caddyhttp.SetVar(r.Context(), stateVar, rs)
	repl.Map(rs.placeholder)
	return rs
}

// wasDecided reports whether an earlier handler decided the policy.
func (rs *requestState) wasDecided(name string) bool { return slices.Contains(rs.policies, name) }

// placeholder resolves the handler's placeholders:
//
// Placeholder | Value
// ------------|------
// `{http.rate_limit.decision}` | allowed, delayed, denied, shadow_denied, fail_open, fail_closed, local_allowed, local_denied or shed
// `{http.rate_limit.policy}` | the denying policy, or the one with the fewest tokens left
// `{http.rate_limit.key}` | that policy's storage key (a hash, never the identity), to tie a hot Redis key to requests
// `{http.rate_limit.remaining}` | that policy's whole tokens left (empty when nothing was decided)
// `{http.rate_limit.retry_after}` | the Retry-After sent, in seconds (0 when none)
// `{http.rate_limit.bearer}` | the token of an `Authorization: Bearer` request header, to key on: the scheme in any case, spaces around the token removed; empty without one
// `{http.rate_limit.credential}` | the request's credential, to key on: the token of `Authorization: Bearer`, or `x-api-key`, `api-key` or `x-goog-api-key` (spaces around it removed); empty without one, or with two different ones
// `{http.rate_limit.model}` | the model an LLM request's JSON body names, to key on (read when a policy's key uses it or a policy reads the body): with prices, the listed name it is priced as (a dated snapshot is its family's), empty for one with no price; without, as the body names it
func (rs *requestState) placeholder(key string) (any, bool) {
	switch key {
	case bearerPlaceholder:
		return bearerToken(rs.header["Authorization"]), true
	case credentialPlaceholder:
		return credential(rs.header), true
	case "http.rate_limit.decision":
		if !rs.decided { // no policy matched
			return "", true
		}
		return outcomeNames[rs.outcome], true
	case "http.rate_limit.policy":
		return rs.policy, true
	case "http.rate_limit.key":
		return rs.key, true
	case "http.rate_limit.remaining":
		if rs.remaining < 0 {
			return "", true
		}
		return strconv.FormatInt(rs.remaining, 10), true
	case "http.rate_limit.retry_after":
		return strconv.FormatInt(rs.retryAfter, 10), true
	case modelPlaceholder:
		return rs.model(), true
	}
	return nil, false
}

// bearerPlaceholder is the placeholder of the request's bearer token.
const bearerPlaceholder = "http.rate_limit.bearer"

// bearerToken is the credential of an Authorization field's first value
// with the Bearer scheme (RFC 6750): the scheme matched whatever its case,
// the whitespace around the token dropped, so that a client cannot get a
// new bucket by writing its one credential differently. Empty for any
// other scheme, or none.
func bearerToken(values []string) string {
	if len(values) == 0 {
		return ""
	}
	v := strings.TrimLeft(values[0], " \t")
	const scheme = "bearer"
	if len(v) <= len(scheme) || !strings.EqualFold(v[:len(scheme)], scheme) || v[len(scheme)] != ' ' && v[len(scheme)] != '\t' {
		return ""
	}
	return strings.Trim(v[len(scheme):], " \t")
}
