package ratelimit

import (
	"container/heap"
	"context"
	"crypto/tls"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
)

// Replay: Caddy's access logs run through a config's policies on a
// virtual clock, with an in-process store of its own (nothing is sent
// anywhere). Each logged request reaches the rate_limit handlers its
// routes lead it to (route_tree.go), at the time it began (the line's ts
// less its duration), and is decided by the module's own code: the
// handler's matching, keys, plans and costs (match), the store's decision
// (admitOn), and after the response, at the time it ended, its charges
// (charge_if, settle on a logged header) and the release of its slots.
// What the log cannot tell (a body's usage, a handler-set placeholder) is
// named, not guessed (replay_sources.go).

// replayWindow is how far, in the log's time, a request may begin before
// one logged ahead of it: Caddy writes a line when the response ends, so a
// long request is logged after shorter ones that began later. Entries are
// decided in the order they began within this window; replayPending
// bounds the entries held for it.
const (
	replayWindow  = 30 * time.Second
	replayPending = 1 << 15
)

// maxDeniedKeys bounds the keys a policy's replay counts denials of, and
// maxSeenKeys the keys it counts as distinct: memory is bounded by the
// keys, never by the lines.
const (
	maxDeniedKeys = 1 << 18
	maxSeenKeys   = 1 << 18
)

// maxEnds bounds the work held for requests' ends (the requests in
// flight at once in the log, of policies with slots or charges after the
// response): beyond it, the earliest is done at once, early (EarlyEnds).
const maxEnds = 1 << 20

// replayer replays entries through the handlers of one config.
type replayer struct {
	tree     *routeTree
	store    *memoryStore
	now      int64 // the virtual clock, µs
	showKeys bool

	policies map[string]*policyReplay
	order    []*policyReplay

	pending arrivals // entries waiting for their turn, by start
	ends    endQueue // work due when a request ends

	report replayReport
	last   int64 // the latest start decided
}

// fields are the log_append fields the policies read: placeholders set
// while a request runs, which a log may carry under their own names.
func (rp *replayer) fields() []string {
	var out []string
	for _, pr := range rp.order {
		for _, f := range pr.needs.fields {
			if !slices.Contains(out, f) {
				out = append(out, f)
			}
		}
	}
	return out
}

// replayReport is what a replay found.
type replayReport struct {
	Log accesslog.Stats `json:"log"`
	// From and To are the first request's start and the last one's end;
	// Requests the entries replayed, Reached those that reached a
	// rate_limit handler.
	From     time.Time `json:"from"`
	To       time.Time `json:"to"`
	Requests int64     `json:"requests"`
	Reached  int64     `json:"reached"`
	// Late: requests decided after one that began later than they did (a
	// request logged more than the window after it began, or beyond the
	// entries held), decided at their own start all the same.
	Late int64 `json:"late,omitempty"`
	// MatchErrors: requests a matcher failed on (counted, not decided).
	MatchErrors int64 `json:"match_errors,omitempty"`
	// EarlyEnds: requests whose end was done before its time, more than
	// maxEnds being in flight at once in the log.
	EarlyEnds int64           `json:"early_ends,omitempty"`
	Policies  []*policyReplay `json:"policies"`
	Elapsed   float64         `json:"elapsed_seconds"`
	// LinesPerMinute is how fast the log was read and replayed.
	LinesPerMinute float64 `json:"lines_per_minute"`
}

// policyReplay is one policy's replay.
type policyReplay struct {
	Policy string `json:"policy"`
	Kind   string `json:"kind"`
	Limit  string `json:"limit"`
	Shadow bool   `json:"shadow,omitempty"`
	// Matched: requests the policy matched; WouldDeny those it would have
	// denied (Share of Matched), the first at FirstDenial; Delayed those
	// `wait` would have held; NotCharged those it admitted while another
	// policy denied the request (all or nothing: not charged).
	Matched     int64      `json:"matched"`
	WouldDeny   int64      `json:"would_deny"`
	Share       float64    `json:"share"`
	FirstDenial *time.Time `json:"first_denial,omitempty"`
	Delayed     int64      `json:"delayed,omitempty"`
	NotCharged  int64      `json:"not_charged,omitempty"`
	// Keys: the distinct keys it matched (at least, when KeysAtLeast).
	Keys        int64 `json:"keys"`
	KeysAtLeast bool  `json:"keys_at_least,omitempty"`
	// TopDenied: the keys it denied most, as the keyed hashes it stores
	// (the identities too with --show-keys).
	TopDenied []deniedKey `json:"top_denied"`
	// PeakInFlight: a concurrency policy's most requests of one key in
	// flight at once in the log (from the lines' durations), and that key.
	PeakInFlight    *int64 `json:"peak_in_flight,omitempty"`
	PeakInFlightKey string `json:"peak_in_flight_key,omitempty"`
	// Sources are what the policy reads from the log that the log did not
	// have (redacted, missing); NotReplayed what cannot be replayed from a
	// log at all (replay_sources.go).
	Sources     []sourceNote `json:"sources,omitempty"`
	NotReplayed []string     `json:"not_replayed,omitempty"`

	denied     map[string]*deniedKey
	deniedMore int64 // denials of keys beyond maxDeniedKeys
	seen       map[bucketID]struct{}
	ids        bucketIDs
	inFlight   map[string]int64
	peak       int64
	needs      logNeeds
}

// deniedKey is one key's denials.
type deniedKey struct {
	Key      string `json:"key"`
	Identity string `json:"identity,omitempty"`
	Denials  int64  `json:"denials"`
}

// newReplayer makes a replayer of the handlers in tree, on a store of its
// own.
func newReplayer(tree *routeTree, showKeys bool) *replayer {
	rp := &replayer{tree: tree, showKeys: showKeys, policies: map[string]*policyReplay{}}
	rp.store = newMemoryStore(func() int64 { return rp.now })
	for _, h := range tree.handlers() {
		h.store = rp.store
		h.logger = zap.NewNop() // what a replay finds is in its report
		_ = h.provisionPlans()  // the overrides filter of its own store: none
		for _, p := range h.Policies {
			if rp.policies[p.Name] != nil {
				continue
			}
			pr := &policyReplay{Policy: p.Name, Kind: p.kindName(), Limit: p.limitText(), Shadow: p.shadow,
				denied: map[string]*deniedKey{}, seen: map[bucketID]struct{}{}, ids: newBucketIDs(), TopDenied: []deniedKey{}}
			pr.needs, pr.NotReplayed = p.logNeeds() // replay_sources.go
			if p.kind.slots() {
				pr.inFlight = map[string]int64{}
			}
			rp.policies[p.Name] = pr
			rp.order = append(rp.order, pr)
		}
	}
	return rp
}

// limitText is the policy's limit, as the Caddyfile writes it.
func (p *Policy) limitText() string {
	switch p.kind {
	case kindConcurrent:
		return fmt.Sprintf("concurrent %d", p.Concurrent)
	case kindQuota:
		return "quota " + p.Quota
	case kindShed:
		return p.shedShape()
	}
	s := "rate " + p.Rate
	if p.limit.burst != p.rate.n {
		s += fmt.Sprintf(" burst %d", p.limit.burst)
	}
	return s
}

// add takes an entry of the log, in the order the log has them; it is
// decided once no entry still to come can have begun before it (within
// replayWindow).
func (rp *replayer) add(e *accesslog.Entry) {
	rp.report.Requests++
	if rp.report.Requests == 1 || e.Start < rp.report.From.UnixMicro() {
		rp.report.From = time.UnixMicro(e.Start).UTC()
	}
	if e.End > rp.report.To.UnixMicro() {
		rp.report.To = time.UnixMicro(e.End).UTC()
	}
	heap.Push(&rp.pending, *e)
	due := e.End - int64(replayWindow/time.Microsecond)
	for len(rp.pending) > 0 && (rp.pending[0].Start <= due || len(rp.pending) > replayPending) {
		next := heap.Pop(&rp.pending).(accesslog.Entry)
		rp.decide(&next)
	}
}

// finish decides what is pending and does the work due at the requests'
// ends.
func (rp *replayer) finish() {
	for len(rp.pending) > 0 {
		next := heap.Pop(&rp.pending).(accesslog.Entry)
		rp.decide(&next)
	}
	rp.runEnds(1<<63 - 1)
	for _, pr := range rp.order {
		pr.summarize(rp.report.Requests)
	}
	rp.report.Policies = rp.order
}

// decide runs one request through the handlers it reaches, at its start.
func (rp *replayer) decide(e *accesslog.Entry) {
	rp.runEnds(e.Start)
	if e.Start < rp.last {
		rp.report.Late++
	}
	rp.last = max(rp.last, e.Start)
	r, repl := replayRequest(e)
	hs, err := rp.tree.reach(r)
	if err != nil {
		rp.report.MatchErrors++
		return
	}
	if len(hs) == 0 {
		return
	}
	rp.report.Reached++
	rs := requestStateOf(r, repl)
	rs.dryRun = true // counts nothing
	end := endWork{at: e.End}
	for _, h := range hs {
		res := admissions.Get().(*admission)
		if err := h.match(r, repl, rs, res); err != nil {
			rp.report.MatchErrors++
			res.recycle()
			return
		}
		if len(res.parts) == 0 {
			res.recycle()
			continue
		}
		rp.now = e.Start
		d, err := h.admitOn(r.Context(), rp.store, res)
		if err != nil { // the in-process store always decides
			res.recycle()
			return
		}
		rp.record(e, res, d, &end)
		if !d.admitted {
			res.recycle()
			break // answered 429: no handler after this one runs
		}
		end.reqs = append(end.reqs, afterResponseOf(h, r, rs, res, e)...)
		res.recycle()
	}
	if len(end.reqs) > 0 || len(end.inFlight) > 0 {
		heap.Push(&rp.ends, end)
		if len(rp.ends) > maxEnds {
			rp.report.EarlyEnds++
			rp.runEnds(rp.ends[0].at)
		}
	}
}

// admitOn is the handler's decision of the admission res on the store s:
// the one decision the request path makes (reserve), the turns of `wait`
// included, without holding anything (a virtual clock holds nobody).
func (h *Handler) admitOn(ctx context.Context, s store, res *admission) (decision, error) {
	for i := range res.parts {
		if p := res.parts[i].policy; p.kind != kindConcurrent && p.Wait != 0 && !p.shadow {
			res.parts[i].rq.wait = p.held.wait
		}
	}
	reqs := res.requests()
	d, err := s.decide(ctx, reqs)
	if err != nil {
		return d, err
	}
	res.decided(s, d, allParts(len(res.parts)), reqs)
	return d, nil
}

// afterResponseOf is the work an admitted request leaves for the end of
// its response, as the handler makes it (charge.go) from the logged status
// and headers: charges and settles, then the release of its slots.
func afterResponseOf(h *Handler, r *http.Request, rs *requestState, res *admission, e *accesslog.Entry) []bucketRequest {
	var out []bucketRequest
	hdr := http.Header(e.RespHeader)
	if hdr == nil {
		hdr = http.Header{}
	}
	if aw := h.watchResponse(&loggedResponse{hdr: hdr}, r, rs, res); aw != nil && len(res.after) > 0 {
		aw.wroteHeader, aw.status = true, e.Status
		res.responseKnown(e.Status, hdr)
		reqs, _ := aw.charges(nil)
		out = append(out, reqs...)
	}
	for _, pt := range res.decidedParts() {
		if rq := pt.rq; rq.op == opAcquire && pt.v.allowed {
			rq.op = opRelease
			out = append(out, rq)
		}
	}
	return out
}

// loggedResponse is the response a log line tells of: its headers; what
// is written to it goes nowhere.
type loggedResponse struct{ hdr http.Header }

func (w *loggedResponse) Header() http.Header         { return w.hdr }
func (w *loggedResponse) Write(b []byte) (int, error) { return len(b), nil }
func (w *loggedResponse) WriteHeader(int)             {}

// record counts a decision of the policies of res.
func (rp *replayer) record(e *accesslog.Entry, res *admission, d decision, end *endWork) {
	for _, pt := range res.decidedParts() {
		pr := rp.policies[pt.policy.Name]
		if pr == nil {
			continue
		}
		v, key := pt.v, pt.rq.key
		pr.Matched++
		pr.needs.check(e) // replay_sources.go
		if len(pr.seen) < maxSeenKeys {
			pr.seen[pr.ids.of(key)] = struct{}{}
		} else if _, ok := pr.seen[pr.ids.of(key)]; !ok {
			pr.KeysAtLeast = true
		}
		switch {
		case !v.allowed:
			pr.WouldDeny++
			if pr.FirstDenial == nil {
				t := time.UnixMicro(e.Start).UTC()
				pr.FirstDenial = &t
			}
			dk := pr.denied[key]
			if dk == nil {
				if len(pr.denied) >= maxDeniedKeys {
					pr.deniedMore++
					break
				}
				dk = &deniedKey{Key: key}
				if rp.showKeys {
					dk.Identity = pt.identity
				}
				pr.denied[key] = dk
			}
			dk.Denials++
		case !d.admitted:
			pr.NotCharged++
		case v.delay > 0:
			pr.Delayed++
		}
		if pr.inFlight != nil {
			n := pr.inFlight[key] + 1
			pr.inFlight[key] = n
			if n > pr.peak {
				pr.peak, pr.PeakInFlightKey = n, key
			}
			end.inFlight = append(end.inFlight, inFlightRef{pr, key})
		}
	}
}

// summarize fills in the policy's report.
func (pr *policyReplay) summarize(requests int64) {
	if pr.Matched > 0 {
		pr.Share = float64(pr.WouldDeny) / float64(pr.Matched)
	}
	pr.Keys = int64(len(pr.seen))
	for _, dk := range pr.denied {
		pr.TopDenied = append(pr.TopDenied, *dk)
	}
	slices.SortFunc(pr.TopDenied, func(a, b deniedKey) int {
		if a.Denials != b.Denials {
			return int(b.Denials - a.Denials)
		}
		return strings.Compare(a.Key, b.Key)
	})
	if len(pr.TopDenied) > 10 {
		pr.TopDenied = pr.TopDenied[:10]
	}
	if pr.inFlight != nil {
		peak := pr.peak
		pr.PeakInFlight = &peak
	}
	pr.Sources = pr.needs.summarize(pr.Sources, pr.Matched, pr.Keys)
}

// runEnds does the work due at requests' ends until the time upTo.
func (rp *replayer) runEnds(upTo int64) {
	for len(rp.ends) > 0 && rp.ends[0].at <= upTo {
		w := heap.Pop(&rp.ends).(endWork)
		if len(w.reqs) > 0 {
			rp.now = w.at
			_, _ = rp.store.decide(context.Background(), w.reqs)
		}
		for _, f := range w.inFlight {
			if n := f.pr.inFlight[f.key] - 1; n > 0 {
				f.pr.inFlight[f.key] = n
			} else {
				delete(f.pr.inFlight, f.key)
			}
		}
	}
}

// replayRequest is the request a log entry tells of, prepared as Caddy's
// server prepares one: its client address the logged client_ip, and
// {http.auth.user.id} the logged user_id.
func replayRequest(e *accesslog.Entry) (*http.Request, *caddy.Replacer) {
	u, err := url.ParseRequestURI(e.URI)
	if err != nil {
		u = &url.URL{Path: "/"}
	}
	u.Host = e.Host
	header := http.Header(e.Header)
	if header == nil {
		header = http.Header{}
	}
	hashedCredentials(header) // replay_sources.go
	port := e.RemotePort
	if port == "" {
		port = "0"
	}
	r := &http.Request{Method: e.Method, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: header,
		Host: e.Host, RemoteAddr: net.JoinHostPort(e.RemoteIP, port), RequestURI: e.URI, Body: http.NoBody}
	if major, minor, ok := http.ParseHTTPVersion(e.Proto); ok {
		r.Proto, r.ProtoMajor, r.ProtoMinor = e.Proto, major, minor
	}
	if e.TLS {
		u.Scheme = "https"
		r.TLS = &tls.ConnectionState{HandshakeComplete: true, ServerName: e.Host}
	}
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r.WithContext(context.Background()), repl, nil, nil)
	if e.ClientIP != "" {
		caddyhttp.SetVar(r.Context(), caddyhttp.ClientIPVarKey, e.ClientIP)
	}
	if e.UserID != "" {
		repl.Set("http.auth.user.id", e.UserID)
	}
	for name, v := range e.Fields { // log_append <placeholder> {<placeholder>}
		repl.Set(name, v)
	}
	return r, repl
}

// arrivals are the entries waiting to be decided, earliest start first.
type arrivals []accesslog.Entry

func (a arrivals) Len() int           { return len(a) }
func (a arrivals) Less(i, j int) bool { return a[i].Start < a[j].Start }
func (a arrivals) Swap(i, j int)      { a[i], a[j] = a[j], a[i] }
func (a *arrivals) Push(x any)        { *a = append(*a, x.(accesslog.Entry)) }
func (a *arrivals) Pop() any {
	old := *a
	e := old[len(old)-1]
	*a = old[:len(old)-1]
	return e
}

// endWork is what is due when a request ends: its charges and releases,
// and the policies it was in flight under.
type endWork struct {
	at       int64
	reqs     []bucketRequest
	inFlight []inFlightRef
}

type inFlightRef struct {
	pr  *policyReplay
	key string
}

type endQueue []endWork

func (q endQueue) Len() int           { return len(q) }
func (q endQueue) Less(i, j int) bool { return q[i].at < q[j].at }
func (q endQueue) Swap(i, j int)      { q[i], q[j] = q[j], q[i] }
func (q *endQueue) Push(x any)        { *q = append(*q, x.(endWork)) }
func (q *endQueue) Pop() any {
	old := *q
	w := old[len(old)-1]
	*q = old[:len(old)-1]
	return w
}

// replayConfig makes the route tree of a JSON config for a replay: each
// rate_limit handler provisioned in ctx without its redis block (a replay
// decides in a store of its own), so nothing is sent anywhere.
func replayConfig(ctx caddy.Context, raw []byte) (*routeTree, error) {
	var hs []*Handler
	tree, err := configRoutes(ctx, raw, func(path string, hraw json.RawMessage) (*Handler, error) {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(hraw, &m); err != nil {
			return nil, fmt.Errorf("%s: %v", path, err)
		}
		delete(m, "handler")
		delete(m, "redis")
		delete(m, "require_redis")
		b, _ := json.Marshal(m)
		h := new(Handler)
		if err := caddy.StrictUnmarshalJSON(b, h); err != nil {
			return nil, fmt.Errorf("%s: %v", path, err)
		}
		for _, p := range h.Policies {
			if p != nil {
				p.Durable = nil // needs Redis; changes no decision
			}
		}
		if h.KeySecret != "" && caddy.NewReplacer().ReplaceAll(h.KeySecret, "") == "" {
			return nil, fmt.Errorf("%s: key_secret %q resolves to nothing here: give the replay the secret your instances have, "+
				"in the environment variable it names, so that the keys it shows are the hashes they store", path, h.KeySecret)
		}
		if err := h.Provision(ctx); err != nil {
			return nil, fmt.Errorf("%s: %v", path, err)
		}
		hs = append(hs, h)
		return h, nil
	})
	if err != nil {
		for _, h := range hs {
			_ = h.Cleanup()
		}
		return nil, err
	}
	return tree, nil
}
