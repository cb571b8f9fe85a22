package ratelimit

import (
	"fmt"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// The credential a request carries, as the LLM SDKs send it, to key on:
// `{http.rate_limit.credential}`. OpenAI's SDK and Anthropic's current
// TypeScript SDK send `Authorization: Bearer <key>`; Anthropic's other
// clients and curl examples `x-api-key`; Azure OpenAI `api-key`; Google's
// Gemini API `x-goog-api-key`. A policy keyed on one of these headers alone
// sees every client that uses another as the empty key, all in one
// bucket: one tenant's requests deny every other's.

// credentialPlaceholder is the placeholder of the request's credential.
const credentialPlaceholder = "http.rate_limit.credential"

// credentialHeaders are the fields a credential is read from, besides
// Authorization (its Bearer token).
var credentialHeaders = [...]string{"X-Api-Key", "Api-Key", "X-Goog-Api-Key"}

// credential is the request's credential: the token of `Authorization:
// Bearer` (the scheme in any case, the spaces around the token dropped,
// as {http.rate_limit.bearer}), or the value of `x-api-key`, `api-key` or
// `x-goog-api-key` (the spaces around it dropped), whichever the request
// carries. Empty without one, and when the request carries two different
// ones: which of them the upstream takes cannot be known, and keying on
// either would let a client choose a fresh bucket by varying the other.
func credential(h http.Header) string {
	cred := ""
	take := func(v string) bool {
		switch {
		case v == "":
		case cred == "":
			cred = v
		case cred != v:
			return false
		}
		return true
	}
	for _, v := range h["Authorization"] {
		if !take(bearerToken([]string{v})) {
			return ""
		}
	}
	for _, name := range credentialHeaders {
		for _, v := range h[name] {
			if !take(strings.Trim(v, " \t")) {
				return ""
			}
		}
	}
	return cred
}

// One credential a request. A request carrying two different credentials
// (a Bearer token and a different x-api-key, say) is refused with a 400
// before any policy keyed on the credential decides it, and before the
// provider: which of them the provider reads depends on the provider and
// the endpoint (OpenAI reads Authorization, Anthropic x-api-key, Azure
// api-key, and some accept either), so keying on one would let a client
// be charged on a fresh bucket while the provider bills the other, and
// resolving it empty (as before) put it in the bucket every request
// without a credential shares. The official SDKs send one; the same value
// in several fields is one credential.

// twoCredentials is the credential fields of h when it carries two
// different credentials (their names, not their values), else nil.
func twoCredentials(h http.Header) []string {
	var names []string
	first := ""
	differ := false
	note := func(name, v string) {
		if v == "" {
			return
		}
		names = append(names, name)
		switch {
		case first == "":
			first = v
		case v != first:
			differ = true
		}
	}
	for _, v := range h["Authorization"] {
		note("Authorization", bearerToken([]string{v}))
	}
	for _, name := range credentialHeaders {
		for _, v := range h[name] {
			note(name, strings.Trim(v, " \t"))
		}
	}
	if !differ {
		return nil
	}
	return slices.Compact(names)
}

// usesCredential reports whether the template reads the credential.
func (t template) usesCredential() bool {
	return t.cred || strings.Contains(t.text, "{"+credentialPlaceholder+"}")
}

// twoCredentialsRefusal refuses a request carrying two different
// credentials (its header h), for policy p: the fields named, never their
// values.
func twoCredentialsRefusal(p *Policy, h http.Header) *refusal {
	return &refusal{policy: p, code: "two_credentials", title: "Two Credentials",
		detail: "The request carries two different credentials (" + strings.Join(twoCredentials(h), ", ") +
			"): send one. Which of them the provider would read cannot be known, so the request is refused before it."}
}

// A policy warns when at least emptyKeyShare of its requests since it last
// judged (at least emptyKeyJudged of them) resolved its key empty: they all
// share one bucket. At most one line per lostLogInterval.
const (
	emptyKeyShare  = 0.1
	emptyKeyJudged = 20
)

// emptyKeyWatch counts a policy's requests whose key resolved empty, and
// warns when they are a share of its requests.
type emptyKeyWatch struct {
	empty    prometheus.Counter // caddy_rate_limit_empty_keys_total{policy}
	lastLine atomic.Int64       // Unix ns
	requests atomic.Int64       // since the policy last judged
	empties  atomic.Int64       // of them, with an empty key
}

func newEmptyKeyWatch(policy string) *emptyKeyWatch {
	return &emptyKeyWatch{empty: emptyKeys.WithLabelValues(policy)}
}

// note counts a request of policy p whose key resolved to identity, and,
// for one that resolved empty, judges the share of those since it last
// judged: a WARN when it is emptyKeyShare or more.
func (w *emptyKeyWatch) note(p *Policy, identity string, logger *zap.Logger) {
	if w == nil {
		return
	}
	requests := w.requests.Add(1)
	if identity != "" {
		return
	}
	w.empty.Inc()
	empties := w.empties.Add(1)
	if requests < emptyKeyJudged {
		return
	}
	now := time.Now().UnixNano()
	last := w.lastLine.Load()
	if now-last < int64(lostLogInterval) || !w.lastLine.CompareAndSwap(last, now) {
		return
	}
	w.requests.Add(-requests)
	w.empties.Add(-empties)
	if float64(empties) < emptyKeyShare*float64(requests) {
		w.lastLine.CompareAndSwap(now, last) // no line written
		return
	}
	advice := "Key on what identifies every client: {http.rate_limit.credential} reads " +
		"Authorization: Bearer, x-api-key, api-key and x-goog-api-key (the official LLM SDKs send Authorization: Bearer); "
	if p.keyTmpl.usesCredential() {
		// Keyed on the credential already: these requests carry none (two
		// different ones are refused, never keyed empty).
		advice = "The key is the credential: these requests carry none in Authorization: Bearer, x-api-key, api-key or " +
			"x-goog-api-key (a client without one, or a credential elsewhere, e.g. Gemini's ?key= query); require one before rate_limit, or match them apart; "
	}
	logger.Warn("rate_limit: policy "+p.Name+": its key resolved empty for "+share(empties, requests)+" of its requests: they all share one bucket, "+
		"so one client's requests deny every other's. "+advice+
		"caddy rate-limit inspect "+p.Name+" --empty-key shows that bucket, reset --empty-key makes it full",
		zap.String("policy", p.Name), zap.String("key", p.Key), zap.Int64("empty", empties), zap.Int64("requests", requests),
		zap.Duration("one_line_per", lostLogInterval))
}

// share says n of total as a percentage.
func share(n, total int64) string {
	if total <= 0 {
		return "all"
	}
	return fmt.Sprintf("%.0f%%", 100*float64(n)/float64(total))
}

var emptyKeys = prometheus.NewCounterVec(prometheus.CounterOpts{
	Namespace: "caddy", Subsystem: "rate_limit", Name: "empty_keys_total",
	Help: "Requests whose policy key resolved to the empty string: they all share one bucket of the policy (caddy rate-limit inspect <policy> --empty-key).",
}, []string{"policy"})
