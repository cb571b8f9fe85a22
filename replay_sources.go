package ratelimit

import (
	"fmt"
	"net/http"
	"net/textproto"
	"slices"
	"strings"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

// What a policy reads that a replay takes from the access log, and what
// the log lacks. A key read from a header the log redacts (Caddy writes
// Authorization and Cookie as REDACTED unless told to log credentials) or
// does not have makes every such request one key: the replay says so,
// with what that means and what to log instead, rather than report the
// denials of one bucket shared by everyone as if they were the config's.
// What a log cannot tell at all (the usage in a response body, a
// placeholder a handler sets) is named, never guessed.

// logNeeds is what a policy's key (and plan) read from a request, and
// what its settle reads from the response.
type logNeeds struct {
	groups  []headerGroup // request headers, each placeholder's
	userID  bool          // {http.auth.user.id}: the log's user_id
	absent  []string      // placeholders the log has no field for
	fields  []string      // of those, log_append fields the log may carry
	resp    string        // settle header <field>: the response header
	missing map[string]int64
	// counts, per source (a header group's name, "user_id", a field, the
	// response header)
	redacted map[string]int64
}

// headerGroup is the request headers one placeholder reads: one header,
// or the several a credential may be sent in.
type headerGroup struct {
	name    string // what the notes call it
	headers []string
}

// sourceNote is a source a policy read that the log did not have.
type sourceNote struct {
	Source   string  `json:"source"`
	Redacted int64   `json:"redacted,omitempty"`
	Missing  int64   `json:"missing,omitempty"`
	Share    float64 `json:"share"`
	Meaning  string  `json:"meaning"`
	Fix      string  `json:"fix,omitempty"`
}

// logNeeds finds what the policy reads from the log, and what it reads
// that no log holds.
func (p *Policy) logNeeds() (n logNeeds, notReplayed []string) {
	n.missing, n.redacted = map[string]int64{}, map[string]int64{}
	for _, text := range []string{p.Key, planFrom(p)} {
		for _, name := range placeholdersOf(text) {
			n.add(name)
		}
	}
	if p.Settle != nil {
		switch p.Settle.From {
		case settleHeader:
			n.resp = textproto.CanonicalMIMEHeaderKey(p.Settle.Field)
		case settleTrailer:
			notReplayed = append(notReplayed, "settle trailer "+p.Settle.Field+": trailers are not in the access log; each request keeps its reservation (cost)")
		default:
			notReplayed = append(notReplayed, p.Settle.describe()+": the usage is in the response body, which the access log does not have; each request keeps its reservation (cost), never settled")
		}
	}
	if p.costs.fromBody {
		notReplayed = append(notReplayed, "cost "+string(p.Cost)+": the request body is not in the access log; every request reserves max_cost")
	}
	for _, name := range placeholdersOf(string(p.Cost)) {
		if _, ok := logHas(name); !ok {
			notReplayed = append(notReplayed, "cost {"+name+"}: not in the access log; every request is charged max_cost")
		}
	}
	if p.kind == kindShed && p.Shed.Latency != 0 {
		notReplayed = append(notReplayed, "shed latency: the upstream's latency under other load is not in the log; its adaptive limit is not replayed")
	}
	if p.kind == kindConcurrent && p.Wait != 0 {
		notReplayed = append(notReplayed, "wait: a request that would wait for a free slot is counted as denied")
	}
	return n, notReplayed
}

func planFrom(p *Policy) string {
	if p.Plan == nil {
		return ""
	}
	return p.Plan.From
}

// placeholdersOf lists the placeholders of a template.
func placeholdersOf(text string) []string {
	parts, ok := parseTemplate(text)
	if !ok {
		return nil
	}
	var out []string
	for _, part := range parts {
		if part.variable != "" {
			out = append(out, part.variable)
		}
	}
	return out
}

// logHas says whether a log line holds a placeholder's value: the request
// headers it reads (none for what the line has otherwise).
func logHas(name string) (headers []string, ok bool) {
	if _, kind := clientaddr.Placeholder(name); kind != clientaddr.None {
		return nil, true
	}
	switch {
	case name == bearerPlaceholder:
		return []string{"Authorization"}, true
	case name == credentialPlaceholder:
		return append([]string{"Authorization"}, credentialHeaders[:]...), true
	case strings.HasPrefix(name, reqHeaderPlaceholder):
		return []string{textproto.CanonicalMIMEHeaderKey(strings.TrimPrefix(name, reqHeaderPlaceholder))}, true
	case strings.HasPrefix(name, "http.request.cookie."):
		return []string{"Cookie"}, true
	case name == "http.request.body" || strings.HasPrefix(name, "http.request.body."):
		return nil, false
	case strings.HasPrefix(name, "http.request.") || strings.HasPrefix(name, "http.regexp.") ||
		strings.HasPrefix(name, "http.matchers.") || strings.HasPrefix(name, "env.") ||
		strings.HasPrefix(name, "system.") || strings.HasPrefix(name, "time."):
		return nil, true
	case name == "http.auth.user.id":
		return nil, true
	}
	return nil, false
}

func (n *logNeeds) add(name string) {
	headers, ok := logHas(name)
	switch {
	case !ok:
		if !slices.Contains(n.absent, name) {
			n.absent = append(n.absent, name)
			n.fields = append(n.fields, name)
		}
	case name == "http.auth.user.id":
		n.userID = true
	case len(headers) > 0:
		g := headerGroup{name: "request header " + strings.Join(headers, ", ")}
		if name == credentialPlaceholder {
			g.name = "the credential (" + strings.Join(headers, ", ") + ")"
		}
		g.headers = headers
		if !slices.ContainsFunc(n.groups, func(x headerGroup) bool { return x.name == g.name }) {
			n.groups = append(n.groups, g)
		}
	}
}

// check counts what e lacks of what the policy reads.
func (n *logNeeds) check(e *accesslog.Entry) {
	for _, g := range n.groups {
		present, redacted := 0, 0
		for _, h := range g.headers {
			vs := e.Header[h]
			if len(vs) == 0 {
				continue
			}
			present++
			if allRedacted(vs) {
				redacted++
			}
		}
		switch {
		case present == 0:
			n.missing[g.name]++
		case redacted == present:
			n.redacted[g.name]++
		}
	}
	if n.userID && e.UserID == "" {
		n.missing["user_id"]++
	}
	for _, f := range n.fields {
		if _, ok := e.Fields[f]; !ok {
			n.missing["{"+f+"}"]++
		}
	}
	if n.resp != "" && len(e.RespHeader[n.resp]) == 0 {
		n.missing["response header "+n.resp]++
	}
}

func allRedacted(vs []string) bool {
	for _, v := range vs {
		if v != accesslog.Redacted {
			return false
		}
	}
	return true
}

// summarize is the notes of what the log lacked, of matched requests.
func (n *logNeeds) summarize(notes []sourceNote, matched, keys int64) []sourceNote {
	if matched == 0 {
		return notes
	}
	share := func(c int64) float64 { return float64(c) / float64(matched) }
	oneKey := "replayed, they are one key: a single bucket shared by all of them"
	if keys == 1 {
		oneKey = "replayed, every request is one key: a single bucket for everyone, whose denials are not the config's"
	}
	for _, g := range n.groups {
		if c := n.redacted[g.name]; c > 0 {
			fix := "log it hashed, which keeps clients apart without writing their credentials: " +
				"log { format filter { request>headers>" + g.headers[0] + " hash } } (a hashed bearer token is read as the token); " +
				"or key the policy on something the log has"
			notes = append(notes, sourceNote{Source: g.name, Redacted: c, Share: share(c),
				Meaning: fmt.Sprintf("the log shows it as REDACTED on %s of the requests the policy matched: %s", percent(share(c)), oneKey), Fix: fix})
		}
		if c := n.missing[g.name]; c > 0 {
			notes = append(notes, sourceNote{Source: g.name, Missing: c, Share: share(c),
				Meaning: fmt.Sprintf("the log has no value for it on %s of the requests the policy matched: replayed, they share the bucket of the empty key, as the handler would put requests that truly lack it", percent(share(c))),
				Fix:     "if those requests had it, the log dropped it: check the log's filters (a delete filter on request>headers>" + g.headers[0] + ")"})
		}
	}
	if c := n.missing["user_id"]; c > 0 {
		notes = append(notes, sourceNote{Source: "{http.auth.user.id} (the log's user_id)", Missing: c, Share: share(c),
			Meaning: fmt.Sprintf("empty on %s of the requests the policy matched: %s", percent(share(c)), oneKey),
			Fix:     "user_id is logged when an authentication handler (basic_auth, forward_auth with copy_headers) runs before the log is written"})
	}
	for _, f := range n.fields {
		if c := n.missing["{"+f+"}"]; c > 0 {
			notes = append(notes, sourceNote{Source: "{" + f + "}", Missing: c, Share: share(c),
				Meaning: fmt.Sprintf("a value set while the request runs, not in the access log (%s of the requests the policy matched): %s", percent(share(c)), oneKey),
				Fix:     "log it under its own name, which the replay reads: log_append " + f + " {" + f + "}"})
		}
	}
	if n.resp != "" {
		if c := n.missing["response header "+n.resp]; c > 0 {
			notes = append(notes, sourceNote{Source: "response header " + n.resp, Missing: c, Share: share(c),
				Meaning: fmt.Sprintf("not in the log for %s of the requests the policy matched: those keep their reservation (cost), never settled", percent(share(c))),
				Fix:     "check that the log keeps response headers (no delete filter on resp_headers>" + n.resp + ")"})
		}
	}
	return notes
}

func percent(f float64) string {
	switch {
	case f >= 0.9995:
		return "100%"
	case f >= 0.1:
		return fmt.Sprintf("%.0f%%", f*100)
	case f >= 0.001:
		return fmt.Sprintf("%.1f%%", f*100)
	}
	return fmt.Sprintf("%.2g%%", f*100)
}

// hashedCredentials makes an Authorization header that Caddy's log filter
// `hash` wrote (the first 4 bytes of its SHA-256, 8 hex digits) a bearer
// token, so that {http.rate_limit.bearer} and {http.rate_limit.credential}
// key on it: one key per credential, as in the handler.
func hashedCredentials(h http.Header) {
	vs := h["Authorization"]
	if len(vs) == 1 && isHashed(vs[0]) {
		h["Authorization"] = []string{"Bearer " + vs[0]}
	}
}

func isHashed(v string) bool {
	if len(v) != 8 {
		return false
	}
	for i := 0; i < len(v); i++ {
		if !(v[i] >= '0' && v[i] <= '9' || v[i] >= 'a' && v[i] <= 'f') {
			return false
		}
	}
	return true
}
