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

// logNeeds is what a policy's key and plan read from a request, and what
// its settle reads from the response, and how often the log lacked it.
type logNeeds struct {
	sources     []logSource
	fields      []string // placeholders read from log_append fields of their names
	resp        string   // settle header <field>: the response header
	respMissing int64
}

// logSource is one placeholder of a policy's key or plan, as the log holds
// it: request headers, the log's user_id, or a field of its name.
type logSource struct {
	use      string   // "key" or "plan"
	name     string   // what the notes call it
	headers  []string // the request headers it reads (a credential: several)
	userID   bool     // {http.auth.user.id}: the log's user_id
	field    string   // a placeholder no log holds but under its own name
	redacted int64
	missing  int64
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
	for _, name := range placeholdersOf(p.Key) {
		n.add("key", name)
	}
	for _, name := range placeholdersOf(planFrom(p)) {
		n.add("plan", name)
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

func (n *logNeeds) add(use, name string) {
	headers, ok := logHas(name)
	src := logSource{use: use}
	switch {
	case !ok:
		src.name, src.field = "{"+name+"}", name
		if !slices.Contains(n.fields, name) {
			n.fields = append(n.fields, name)
		}
	case name == "http.auth.user.id":
		src.name, src.userID = "{http.auth.user.id} (the log's user_id)", true
	case len(headers) > 0:
		src.name, src.headers = "request header "+strings.Join(headers, ", "), headers
		if name == credentialPlaceholder {
			src.name = "the credential (" + strings.Join(headers, ", ") + ")"
		}
	default:
		return // in every line
	}
	if !slices.ContainsFunc(n.sources, func(x logSource) bool { return x.use == use && x.name == src.name }) {
		n.sources = append(n.sources, src)
	}
}

// check counts what e lacks of what the policy reads.
func (n *logNeeds) check(e *accesslog.Entry) {
	for i := range n.sources {
		src := &n.sources[i]
		switch {
		case src.userID:
			if e.UserID == "" {
				src.missing++
			}
		case src.field != "":
			if _, ok := e.Fields[src.field]; !ok {
				src.missing++
			}
		default:
			present, redacted := 0, 0
			for _, h := range src.headers {
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
				src.missing++
			case redacted == present:
				src.redacted++
			}
		}
	}
	if n.resp != "" && len(e.RespHeader[n.resp]) == 0 {
		n.respMissing++
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
	for _, src := range n.sources {
		what := "its " + src.use + " reads " + src.name
		same := oneKey
		if src.use == "plan" {
			same = "replayed under the policy's own limit (the default plan)"
		}
		if c := src.redacted; c > 0 {
			notes = append(notes, sourceNote{Source: what, Redacted: c, Share: share(c),
				Meaning: fmt.Sprintf("the log shows it as REDACTED on %s of the requests the policy matched: %s", percent(share(c)), same),
				Fix: "log it hashed, which keeps clients apart without writing their credentials: " +
					"log { format filter { request>headers>" + src.headers[0] + " hash } } (a hashed bearer token is read as the token); " +
					"or key the policy on something the log has"})
		}
		c := src.missing
		if c == 0 {
			continue
		}
		note := sourceNote{Source: what, Missing: c, Share: share(c)}
		switch {
		case src.userID:
			note.Meaning = fmt.Sprintf("empty on %s of the requests the policy matched: %s", percent(share(c)), same)
			note.Fix = "user_id is logged when an authentication handler (basic_auth, forward_auth with copy_headers) runs before the log is written"
		case src.field != "":
			note.Meaning = fmt.Sprintf("a value set while the request runs, not in the access log (%s of the requests the policy matched): %s", percent(share(c)), same)
			note.Fix = "log it under its own name, which the replay reads: log_append " + src.field + " {" + src.field + "}"
		case src.use == "plan":
			note.Meaning = fmt.Sprintf("the log has no value for it on %s of the requests the policy matched: %s", percent(share(c)), same)
			note.Fix = "if those requests had it, the log dropped it: check the log's filters (a delete filter on request>headers>" + src.headers[0] + ")"
		default:
			note.Meaning = fmt.Sprintf("the log has no value for it on %s of the requests the policy matched: replayed, they share the bucket of the empty key, as the handler would put requests that truly lack it", percent(share(c)))
			note.Fix = "if those requests had it, the log dropped it: check the log's filters (a delete filter on request>headers>" + src.headers[0] + ")"
		}
		notes = append(notes, note)
	}
	if n.resp != "" && n.respMissing > 0 {
		c := n.respMissing
		notes = append(notes, sourceNote{Source: "its settle reads response header " + n.resp, Missing: c, Share: share(c),
			Meaning: fmt.Sprintf("not in the log for %s of the requests the policy matched: those keep their reservation (cost), never settled", percent(share(c))),
			Fix:     "check that the log keeps response headers (no delete filter on resp_headers>" + n.resp + ")"})
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
