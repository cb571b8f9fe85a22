package ratelimit

import (
	"net/http"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// requestOutcome holds one request's placeholders, formatted only when a
// later handler or log reads them.
type requestOutcome struct {
	decision   outcome
	policy     string
	remaining  int64 // -1: not decided
	retryAfter int64
}

// outcomeVar is where a request keeps its requestOutcome, so that a second
// rate_limit on the same request updates the same placeholders.
const outcomeVar = "\x00rate_limit"

// outcomeOf returns the request's requestOutcome, registering its
// placeholders the first time.
func outcomeOf(r *http.Request, repl *caddy.Replacer) *requestOutcome {
	if o, ok := caddyhttp.GetVar(r.Context(), outcomeVar).(*requestOutcome); ok {
		return o
	}
	o := &requestOutcome{remaining: -1}
	caddyhttp.SetVar(r.Context(), outcomeVar, o)
	repl.Map(o.placeholder)
	return o
}

func (o *requestOutcome) placeholder(key string) (any, bool) {
	switch key {
	case "http.rate_limit.decision":
		return outcomeNames[o.decision], true
	case "http.rate_limit.policy":
		return o.policy, true
	case "http.rate_limit.remaining":
		if o.remaining < 0 {
			return "", true
		}
		return strconv.FormatInt(o.remaining, 10), true
	case "http.rate_limit.retry_after":
		return strconv.FormatInt(o.retryAfter, 10), true
	}
	return nil, false
}
