package ratelimit

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// A dry run: "what would happen to this request, now, and why?"
//
//	POST /rate_limit/dry_run {"method": "POST", "url": "https://api.example.com/v1/chat",
//	                          "headers": {"X-Api-Key": ["ak_1"]}, "body": "...", "client_ip": "203.0.113.7"}
//
// The request so described goes through the running config as a real one
// would, as far as its rate_limit handlers: the routes it reaches
// (route_tree.go), the policies that match it, each one's key (its hash),
// plan, override and cost, found by the handler's own code (match). Each
// bucket is then read from the live store without changing it
// (store_peek.go), and the answer says what each policy would decide now:
// allowed (or held for its turn, with `wait`) or denied, what would remain,
// and the true wait. Nothing is charged, no slot or lease taken, nothing
// learned, no hot-key block taken or spent, no metric counted. When the
// store cannot be read the answer says so, and what each policy's
// on_error would do; it never answers "allowed" for a store it could not
// read. It goes through Caddy's admin API, with its origin checks, as
// every route of /rate_limit/ does.

// dryRunRequest describes the request to try.
type dryRunRequest struct {
	Method  string              `json:"method"`
	URL     string              `json:"url"`
	Headers map[string][]string `json:"headers,omitempty"`
	// Body (text) or BodyBase64, for policies that read it (cost openai).
	Body       string `json:"body,omitempty"`
	BodyBase64 string `json:"body_base64,omitempty"`
	// ClientIP is the client's address, for keys on it ({client_ip}).
	ClientIP string `json:"client_ip,omitempty"`
	// ShowKeys: the answer names each policy's identity (an API key, for
	// a policy keyed on the credential), not only its keyed hash, as top's
	// show_keys does: an answer is copied around (caddy rate-limit try
	// --show-keys).
	ShowKeys bool `json:"show_keys,omitempty"`
}

// dryRunAnswer is what the request would get now.
type dryRunAnswer struct {
	Request  string `json:"request"`
	ClientIP string `json:"client_ip,omitempty"`
	// Outcome: admitted, delayed (held for a `wait` turn, then admitted),
	// denied, unknown (a store could not be read: IfUnreadable says what
	// would happen), or none (no policy matched).
	Outcome string `json:"outcome"`
	// Status is what the client would get from the limiter: 429, 503, or
	// 0 (passed on).
	Status   int      `json:"status"`
	DeniedBy []string `json:"denied_by,omitempty"`
	// IfUnreadable: with a store that could not be read, what the
	// policies' on_error would make of the request.
	IfUnreadable string          `json:"if_unreadable,omitempty"`
	Handlers     []dryRunHandler `json:"handlers"`
	Notes        []string        `json:"notes,omitempty"`
}

// dryRunHandler is one rate_limit handler the request reaches.
type dryRunHandler struct {
	Store      string         `json:"store"`
	ReadAt     *time.Time     `json:"read_at,omitempty"`
	Unreadable string         `json:"could_not_read,omitempty"`
	Policies   []dryRunPolicy `json:"policies"`
	NotMatched []string       `json:"not_matched,omitempty"`
}

// dryRunPolicy is what one policy would decide.
type dryRunPolicy struct {
	Policy   string         `json:"policy"`
	Kind     string         `json:"kind"`
	Limit    string         `json:"limit"`
	Plan     string         `json:"plan,omitempty"`
	Override *overrideEntry `json:"override,omitempty"`
	// Identity is the value the policy keys on, with show_keys only.
	Identity string `json:"identity,omitempty"`
	// Key is the bucket's storage key, whose keyed hash names the
	// identity without revealing it; Fingerprint its start, as top shows.
	Key         string `json:"key"`
	Fingerprint string `json:"fingerprint"`
	Cost        int64  `json:"cost"`
	Shadow      bool   `json:"shadow,omitempty"`
	// Decision: allowed, delayed, denied, or "could not read".
	Decision string `json:"decision"`
	// Remaining: what the bucket would hold after the request (slots free,
	// a quota's units left); RetryAfter, for a denial, the true wait in
	// seconds (the Retry-After sent is at least this, spread by jitter;
	// none when the cost can never fit); Delay, for `wait`, how long the
	// request would be held.
	Remaining  *int64   `json:"remaining,omitempty"`
	RetryAfter *float64 `json:"retry_after_seconds,omitempty"`
	NeverFits  bool     `json:"never_fits,omitempty"`
	Delay      *float64 `json:"delay_seconds,omitempty"`
	Learned    int64    `json:"learned,omitempty"`
	// BlocksHere: the key is hot on the instance answering, which decides
	// its requests from blocks of tokens taken ahead (not in Redis).
	BlocksHere *blocksHere `json:"blocks_here,omitempty"`
	// OnError: with the store unreadable, what this policy would do.
	OnError string `json:"on_error,omitempty"`
}

const maxDryRunBody = 8 << 20

func (a adminAPI) dryRun(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return apiError(http.StatusMethodNotAllowed, "dry_run takes POST")
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxDryRunBody))
	if err != nil {
		return apiError(http.StatusBadRequest, "reading the request: %v", err)
	}
	var req dryRunRequest
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return apiError(http.StatusBadRequest, `the body is not {"method": ..., "url": ..., "headers": {...}, "body": ..., "client_ip": ...}: %v`, err)
	}
	answer, err := dryRun(r.Context(), req)
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}

// tryRequest is the request req describes, prepared as Caddy's server
// prepares one.
func tryRequest(ctx context.Context, req dryRunRequest) (*http.Request, *caddy.Replacer, error) {
	method := strings.ToUpper(req.Method)
	if method == "" {
		method = http.MethodGet
	}
	u, err := url.Parse(req.URL)
	if err != nil || u.Path == "" && u.Host == "" {
		// Not quoted: Caddy's admin API logs an error's message, and a URL
		// may carry a credential in its query.
		return nil, nil, apiError(http.StatusBadRequest, "url: not a URL such as https://api.example.com/v1/items")
	}
	if u.Path == "" {
		u.Path = "/"
	}
	var body []byte
	switch {
	case req.Body != "" && req.BodyBase64 != "":
		return nil, nil, apiError(http.StatusBadRequest, "body and body_base64 exclude each other")
	case req.BodyBase64 != "":
		if body, err = base64.StdEncoding.DecodeString(req.BodyBase64); err != nil {
			return nil, nil, apiError(http.StatusBadRequest, "body_base64: %v", err)
		}
	default:
		body = []byte(req.Body)
	}
	var remote string
	if req.ClientIP != "" {
		ip := net.ParseIP(strings.Trim(req.ClientIP, "[]"))
		if ip == nil {
			return nil, nil, apiError(http.StatusBadRequest, "client_ip: not an IP address such as 203.0.113.7") // not quoted: logged
		}
		remote = net.JoinHostPort(ip.String(), "0")
	}
	header := http.Header{}
	for name, vs := range req.Headers {
		for _, v := range vs {
			header.Add(name, v)
		}
	}
	host := u.Host
	if h := header.Get("Host"); h != "" {
		host = h
		header.Del("Host")
	}
	r := &http.Request{Method: method, URL: u, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1, Header: header, Host: host,
		RemoteAddr: remote, RequestURI: u.RequestURI(), Body: io.NopCloser(bytes.NewReader(body)), ContentLength: int64(len(body))}
	if u.Scheme == "https" {
		r.TLS = &tlsState
	}
	repl := caddy.NewReplacer()
	r = caddyhttp.PrepareRequest(r.WithContext(ctx), repl, nil, nil)
	if req.ClientIP != "" {
		caddyhttp.SetVar(r.Context(), caddyhttp.ClientIPVarKey, strings.Trim(req.ClientIP, "[]"))
	}
	return r, repl, nil
}

// dryRun answers what the request req describes would get now.
func dryRun(ctx context.Context, req dryRunRequest) (*dryRunAnswer, error) {
	r, repl, err := tryRequest(ctx, req)
	if err != nil {
		return nil, err
	}
	ans := &dryRunAnswer{Request: r.Method + " " + req.URL, ClientIP: req.ClientIP, Outcome: "none", Handlers: []dryRunHandler{}}
	var hs []*Handler
	if tree := liveRoutes(); tree != nil {
		if hs, err = tree.reach(r); err != nil {
			return nil, apiError(http.StatusBadRequest, "matching the request: %v", err)
		}
	} else {
		hs = budgets.handlers()
	}
	if len(hs) == 0 {
		ans.Notes = append(ans.Notes, "no rate_limit handler of the running config is on this request's route")
		return ans, nil
	}
	rs := requestStateOf(r, repl)
	rs.dryRun = true
	failOpen := true // while every unreadable policy would admit
	for _, h := range hs {
		res := admissions.Get().(*admission)
		hd, denied, unreadable, err := dryRunHandlerOf(ctx, h, r, repl, rs, res)
		res.recycle()
		if err != nil {
			return nil, err
		}
		if hd == nil {
			continue
		}
		if !req.ShowKeys {
			for i := range hd.Policies {
				hd.Policies[i].Identity = ""
			}
		}
		ans.Handlers = append(ans.Handlers, *hd)
		switch {
		case unreadable != "":
			ans.Outcome = "unknown"
			if unreadable != "admitted" {
				failOpen = false
				ans.IfUnreadable = unreadable
			}
		case len(denied) > 0:
			ans.DeniedBy = denied
			if ans.Outcome != "unknown" {
				ans.Outcome, ans.Status = "denied", http.StatusTooManyRequests
			}
		case ans.Outcome == "none":
			ans.Outcome = "admitted"
			for _, p := range hd.Policies {
				if p.Decision == "delayed" {
					ans.Outcome = "delayed"
				}
			}
		}
		if len(denied) > 0 || ans.Outcome == "unknown" && !failOpen {
			break // the request would be answered here
		}
	}
	if ans.Outcome == "unknown" && ans.IfUnreadable == "" {
		ans.IfUnreadable = "admitted: every policy it could not read fails open (on_error fail_open), uncounted"
	}
	if ans.Outcome == "unknown" {
		ans.Status = 0
		if strings.HasPrefix(ans.IfUnreadable, "503") {
			ans.Status = http.StatusServiceUnavailable
		}
	}
	if req.ClientIP == "" {
		for _, hd := range ans.Handlers {
			for _, p := range hd.Policies {
				if def, ok := budgets.find(p.Policy); ok && def.policy.keyTmpl.usesAddr() {
					ans.Notes = append(ans.Notes, "policy "+p.Policy+" keys on the client's address, and none was given (client_ip, --client-ip): the empty key's bucket was read")
				}
			}
		}
	}
	return ans, nil
}

// dryRunHandlerOf reads what the handler's policies would decide for r.
// denied names the enforced policies that would deny; unreadable, when
// the store could not be read, what on_error would make of the request
// ("admitted" when every policy fails open).
func dryRunHandlerOf(ctx context.Context, h *Handler, r *http.Request, repl *caddy.Replacer, rs *requestState, res *admission) (hd *dryRunHandler, denied []string, unreadable string, err error) {
	if err := h.match(r, repl, rs, res); err != nil {
		return nil, nil, "", apiError(http.StatusBadRequest, "%v", err)
	}
	hd = &dryRunHandler{Store: h.storeName(), Policies: []dryRunPolicy{}}
	for _, p := range h.Policies {
		if !rs.wasDecided(p.Name) {
			hd.NotMatched = append(hd.NotMatched, p.Name)
		}
	}
	if len(res.parts) == 0 && len(res.adaptive) == 0 {
		return nil, nil, "", nil
	}
	reqs := make([]bucketRequest, len(res.parts))
	for i := range res.parts {
		p, rq := res.parts[i].policy, res.parts[i].rq
		if p.kind != kindShed {
			p.markOverridable(&rq, true) // the override in force, whatever this instance knows
		}
		if p.kind != kindConcurrent && p.Wait != 0 && !p.shadow {
			rq.wait = p.held.wait
		}
		reqs[i] = rq
	}
	pk, ok := h.store.(peeker)
	if !ok {
		return nil, nil, "", apiError(http.StatusNotImplemented, "the store of %s cannot be read without deciding", h.storeName())
	}
	var d decision
	var readErr error
	if len(reqs) > 0 {
		d, readErr = pk.peek(ctx, reqs)
	}
	if readErr == nil && len(reqs) > 0 {
		at := time.UnixMicro(d.now).UTC()
		hd.ReadAt = &at
	}
	if readErr != nil {
		hd.Unreadable = readErr.Error()
		unreadable = "admitted"
	}
	var local []bucketRequest
	var localAt []int
	for i := range res.parts {
		p := res.parts[i].policy
		dp := dryRunPolicy{Policy: p.Name, Kind: p.kindName(), Limit: p.limitText(), Plan: p.planLabel(),
			Key: reqs[i].key, Fingerprint: fingerprintOf(reqs[i].key), Cost: reqs[i].cost, Shadow: p.shadow,
			Identity: res.parts[i].identity} // dryRun keeps it with show_keys only
		if readErr != nil {
			dp.Decision = "could not read"
			switch p.onError {
			case failClosed:
				dp.OnError = "on_error fail_closed: 503 for the request"
				if !p.shadow {
					unreadable = "503: policy " + p.Name + " fails closed (on_error fail_closed)"
				}
			case failLocal:
				dp.OnError = "on_error local: decided by this instance's in-process bucket"
				local, localAt = append(local, h.localRequest(reqs[i])), append(localAt, i)
			default:
				dp.OnError = "on_error fail_open: admitted, uncounted"
			}
			hd.Policies = append(hd.Policies, dp)
			continue
		}
		v := d.verdicts[i]
		dp.Decision, dp.Cost, dp.Learned = "allowed", max(v.cost, reqs[i].cost), v.learned

		rem := v.remaining
		dp.Remaining = &rem
		switch {
		case !v.allowed:
			dp.Decision = "denied"
			if v.untilFits == neverFits {
				dp.NeverFits = true
			} else {
				wait := seconds(v.untilFits)
				dp.RetryAfter = &wait
			}
			if !p.shadow {
				denied = append(denied, p.Name)
			}
		case v.delay > 0:
			dp.Decision = "delayed"
			delay := seconds(v.delay)
			dp.Delay = &delay
		}
		if bk, ok := h.store.(blockKeeper); ok {
			if blocks, tokens := bk.blocksOf(reqs[i].key); blocks > 0 {
				dp.BlocksHere = &blocksHere{Blocks: blocks, Tokens: tokens}
			}
		}
		if store := overridesIn(h.store); store != nil && p.kind != kindShed {
			if e, err := store.overrideOf(ctx, reqs[i].key); err == nil && e != nil {
				dp.Override = e
			}
		}
		if v.limit != reqs[i].limit && v.limit != (limit{}) { // decided under an override
			dp.Limit = "override"
			if dp.Override != nil {
				dp.Limit = dp.Override.describe() + " (override)"
			}
		}
		hd.Policies = append(hd.Policies, dp)
	}
	if len(local) > 0 && !strings.HasPrefix(unreadable, "503") {
		ld, _ := localFallback.peek(ctx, local)
		for j, i := range localAt {
			v := ld.verdicts[j]
			verdict := "allowed"
			if !v.allowed {
				verdict = "denied"
				if p := res.parts[i].policy; !p.shadow {
					unreadable = "429: policy " + p.Name + " would deny it from this instance's in-process bucket (on_error local)"
				}
			}
			hd.Policies[i].OnError += fmt.Sprintf(" (1/%d of the budget): %s, %d would remain", max(1, h.Instances), verdict, v.remaining)
		}
	}
	return hd, denied, unreadable, nil
}

// tlsState marks a described https request as one over TLS, for matchers
// of the protocol.
var tlsState = tls.ConnectionState{HandshakeComplete: true}
