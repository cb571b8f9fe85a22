package ratelimit

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/breaker"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/topk"
	"go.uber.org/zap"
)

// announcer is a store that a fleet of instances shares: an operator's
// change to a bucket (a reset, a grant, an override set or deleted) is
// announced to every instance, which forgets what it remembered of the
// bucket. Implemented by redisStore (announce.go, override_redis.go), and
// trivially by memoryStore: in process, the change is this instance's own.
type announcer interface {
	// announce tells every instance the bucket under key changed, and
	// returns once the announcement went round (or after a second).
	announce(ctx context.Context, prefix, key string) error
	// announceOverride tells every instance the override of the bucket
	// under key changed, and waits for each to confirm it (a second at
	// most: errUnconfirmed).
	announceOverride(ctx context.Context, prefix, key string) error
}

var (
	_ announcer = (*redisStore)(nil)
	_ announcer = (*memoryStore)(nil)
)

// blockKeeper is a store that may decide a busy key's requests from blocks
// of its tokens taken ahead (hot keys, hotkeys_store.go): inspect shows
// what this instance has taken of a bucket and not spent. Implemented by
// redisStore, and trivially by memoryStore: in process, every decision is
// local already.
type blockKeeper interface {
	// blocksOf is the blocks this instance holds of the bucket under key,
	// and their unspent tokens.
	blocksOf(key string) (blocks int, tokens int64)
}

var (
	_ blockKeeper = (*redisStore)(nil)
	_ blockKeeper = (*memoryStore)(nil)
)

// formatStore is a store whose buckets outlive a release: a fleet writes
// them in the storage format its marker says, so that a mixed fleet reads
// them both ways (format.go, upgrade.go). Implemented by redisStore. Its
// storage format sets the fleet's marker of the buckets under a prefix,
// tells every instance and writes in what the markers now say at once
// (setFormat), and says the marker and the format this instance writes
// (formatOf).
type formatStore interface {
	storage() *storageFormat
}

var _ formatStore = (*redisStore)(nil)

func init() {
	caddy.RegisterModule(adminAPI{})
}

// adminAPI gives Caddy's admin API the operator's handles on buckets,
// under /rate_limit/: inspect, reset and grant a bucket, and list the
// identities a policy denied most. A policy is addressed by its name (one
// name is one budget) and a bucket by the raw identity its key resolves
// to, which is hashed exactly as the handler hashes it: nothing raw is
// stored or logged, and this API's answers are the one place an identity
// is shown. Inspect, reset and grant run through the policy's store, its
// script and Redis clock, as decisions do; reset and grant reach every
// instance at once (see redisStore.announce).
//
//	POST /rate_limit/inspect {"policy": "<name>", "identity": "<id>"}
//	POST /rate_limit/reset   {"policy": "<name>", "identity": "<id>"}
//	POST /rate_limit/grant   {"policy": "<name>", "identity": "<id>", "tokens": <n>}
//	GET  /rate_limit/top?policy=<name>&n=<n>[&show_keys=true]
//	GET  /rate_limit/format
//	POST /rate_limit/format  {"format": "v1" | "v2"}
//	GET  /rate_limit/fleet
//
// and the overrides of admin_override.go and admin_apply.go, and the dry
// run of dryrun.go. Inspect, reset and grant take an optional plan, to read
// the bucket under that plan's limit rather than the policy's own. An
// identity goes in a request body, never in a URL:
// Caddy's admin API logs every request's URL at INFO (GET inspect without
// an identity, for a fixed key or the empty key's bucket, still reads its
// query). Top shows each identity's keyed fingerprint, and the raw
// identity only when asked (show_keys).
type adminAPI struct{}

// CaddyModule returns the Caddy module information.
func (adminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "admin.api.rate_limit",
		New: func() caddy.Module { return new(adminAPI) },
	}
}

// Routes returns the routes under /rate_limit/.
func (a adminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{{Pattern: "/rate_limit/", Handler: caddy.AdminHandlerFunc(a.serve)}}
}

// adminRequest is what an admin call asks, from the query or a JSON body.
type adminRequest struct {
	Policy   string `json:"policy"`
	Identity string `json:"identity"`
	Tokens   int64  `json:"tokens"`
	// Amount is what a grant gives back in the policy's unit, as a person
	// writes it: dollars (1.50) for a money policy (admin_money.go).
	Amount string `json:"amount,omitempty"`
	N      int    `json:"n"`
	Plan   string `json:"plan,omitempty"`
	// EmptyKey names the bucket of the requests whose key resolved empty
	// (Identity then empty): they all share it.
	EmptyKey bool `json:"empty_key,omitempty"`
	// ShowKeys: top shows the raw identities, not only their keyed
	// fingerprints (caddy rate-limit top --show-keys).
	ShowKeys bool `json:"show_keys,omitempty"`
}

// bucketState is a bucket as inspect, reset and grant answer it.
type bucketState struct {
	Policy   string `json:"policy"`
	Kind     string `json:"kind"`
	Rate     string `json:"rate"`
	Burst    int64  `json:"burst"`
	Identity string `json:"identity"`
	// Key is the bucket's storage key: a hash, which logs and access logs
	// ({http.rate_limit.key}) show instead of the identity.
	Key   string `json:"key"`
	Store string `json:"store"`
	// Currency: USD for a money policy, whose amounts (burst, tokens,
	// quota, used, granted, learned) are then micro-dollars.
	Currency string `json:"currency,omitempty"`
	// Tokens in the bucket now (negative: owed); NextToken and Full are
	// seconds until one more token and until the bucket is full.
	Tokens    int64   `json:"tokens"`
	NextToken float64 `json:"next_token_seconds"`
	Full      float64 `json:"full_seconds"`
	// Granted is what grant gave back (at most what makes the bucket full:
	// 0 for a full one).
	Granted *int64 `json:"granted,omitempty"`
	// Learned, for a settle policy: the most the key's recent settles used
	// beyond their reservations; a request reserves its own cost plus a
	// high percentile of what requests of its size used beyond theirs (at
	// most the burst); 0 when none did. A reset forgets it.
	Learned *int64 `json:"learned,omitempty"`
	// A concurrent policy's slots, and those held now (Tokens: those free);
	// after a reset, the running requests' (kept), and Dropped, the stale
	// leases of holders that vanished.
	Slots   int64  `json:"slots,omitempty"`
	InUse   *int64 `json:"in_use,omitempty"`
	Dropped *int64 `json:"dropped,omitempty"`
	// Announced: every instance was told of the reset or grant at once
	// (otherwise within a second).
	Announced *bool `json:"announced,omitempty"`
	// A quota's N and calendar unit, the units used in the current period
	// (Tokens: those left), and the period's start and end, in UTC and in
	// the policy's zone.
	Quota  int64                `json:"quota,omitempty"`
	Unit   string               `json:"unit,omitempty"`
	Used   *int64               `json:"used,omitempty"`
	Period *calendar.PeriodText `json:"period,omitempty"`
	// Plan is the plan the bucket was read under ("default": the policy's
	// own limit), for a policy with plans; Override the operator's override
	// of the identity's limit, when one is in force: Rate, Burst and Slots
	// are then the override's.
	Plan     string         `json:"plan,omitempty"`
	Override *overrideEntry `json:"override,omitempty"`
	// Held: blocks of the bucket's tokens the instance answering holds, the
	// key being hot there (see docs/hot-keys.md): taken from the bucket
	// (Tokens counts them out), not spent yet.
	BlocksHere *blocksHere `json:"blocks_here,omitempty"`
	// A shed policy's adaptive limit on this instance (shed { latency }),
	// and the requests in flight under it.
	ShedLimit    *int64 `json:"shed_limit,omitempty"`
	ShedInFlight *int64 `json:"shed_in_flight,omitempty"`
}

func (a adminAPI) serve(w http.ResponseWriter, r *http.Request) error {
	action := strings.TrimPrefix(r.URL.Path, "/rate_limit/")
	if action == "format" {
		return a.format(w, r)
	}
	if action == "fleet" {
		return a.fleet(w, r) // admin_fleet.go
	}
	if action == "override" || action == "overrides" {
		return a.serveOverride(w, r, action)
	}
	if action == "apply" {
		return a.apply(w, r) // admin_apply.go
	}
	if action == "dry_run" {
		return a.dryRun(w, r) // dryrun.go
	}
	method := map[string]string{"inspect": http.MethodPost, "top": http.MethodGet, "reset": http.MethodPost, "grant": http.MethodPost}[action]
	if method == "" {
		return apiError(http.StatusNotFound, "no such rate_limit endpoint %q: use inspect, reset, grant, top, format, fleet, override, overrides, apply or dry_run", action)
	}
	if action == "inspect" && r.Method == http.MethodGet {
		// The query form, for what names no identity (a fixed key, the
		// empty key's bucket); an identity in the URL is refused.
		if r.URL.Query().Has("identity") {
			return apiError(http.StatusBadRequest, "identity: send it in the request body, never in the URL, which Caddy's admin API logs: "+
				`POST /rate_limit/inspect {"policy": "...", "identity": "..."} (caddy rate-limit inspect does); the identity in this URL was logged`)
		}
		method = http.MethodGet
	}
	if r.Method != method {
		return apiError(http.StatusMethodNotAllowed, "%s takes %s", action, method)
	}
	var req adminRequest
	if method == http.MethodPost {
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<20))
		if err != nil {
			return apiError(http.StatusBadRequest, "reading the request: %v", err)
		}
		if err := json.Unmarshal(body, &req); err != nil {
			return apiError(http.StatusBadRequest, "the body is not {\"policy\": ..., \"identity\": ..., \"tokens\": ...}: %v", err)
		}
	} else {
		q := r.URL.Query()
		req.Policy, req.Plan = q.Get("policy"), q.Get("plan")
		req.EmptyKey, _ = strconv.ParseBool(q.Get("empty_key"))
		req.ShowKeys, _ = strconv.ParseBool(q.Get("show_keys"))
		if n := q.Get("n"); n != "" {
			v, err := strconv.Atoi(n)
			if err != nil || v < 1 {
				return apiError(http.StatusBadRequest, "n: %q is not a positive integer", n)
			}
			req.N = v
		}
	}
	if req.Policy == "" {
		return apiError(http.StatusBadRequest, "policy: required")
	}
	def, ok := budgets.find(req.Policy)
	if !ok {
		return apiError(http.StatusNotFound, "policy %q: no such policy in the loaded config", req.Policy)
	}
	var answer any
	var err error
	switch action {
	case "top":
		answer = a.top(r.Context(), def, req)
	case "inspect", "reset", "grant":
		answer, err = a.bucket(r.Context(), action, def, req)
	}
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}

// bucket inspects, resets or grants tokens to one bucket.
func (adminAPI) bucket(ctx context.Context, action string, def definition, req adminRequest) (*bucketState, error) {
	p, h := def.policy, def.handler
	p, ok := p.planNamed(req.Plan) // the bucket as that plan reads it
	if !ok {
		return nil, apiError(http.StatusBadRequest, "plan %q: policy %q has no such plan", req.Plan, def.policy.Name)
	}
	def.policy = p
	key := p.fixedKey
	switch {
	case key != "":
	case req.EmptyKey && req.Identity != "":
		return nil, apiError(http.StatusBadRequest, "identity and empty_key exclude each other: empty_key names the bucket of the requests whose key resolved empty")
	case req.EmptyKey:
		key = p.storageKey(h.hasher, "") // as the handler names it
	case req.Identity == "":
		return nil, apiError(http.StatusBadRequest, "identity: required: the value policy %q keys on (%s); for the bucket the requests whose key resolved empty share, empty_key (--empty-key)", p.Name, p.Key)
	default:
		req.Identity = p.identityOf(req.Identity) // a client address names its network's bucket, as in the handler
		key = p.storageKey(h.hasher, req.Identity)
	}
	switch p.kind {
	case kindShed:
		return adminAPI{}.shed(ctx, action, def, req, key)
	case kindConcurrent:
		return adminAPI{}.slots(ctx, action, def, req, key)
	case kindQuota:
		return adminAPI{}.quota(ctx, action, def, req, key)
	}
	// A grant reads the bucket and gives the tokens back in one decision:
	// each of its buckets reads the state from before it, so the first says
	// what the grant found, atomically.
	inspect := bucketRequest{key: key, limit: p.limit, op: opInspect, learns: p.learns()} // shows what its key learned
	p.markOverridable(&inspect, true)                                                     // shows the override in force
	reqs := []bucketRequest{inspect}
	switch action {
	case "reset":
		reqs[0].op = opReset // and forgets what its key learned
	case "grant":
		tokens, err := p.grantAmount(req) // admin_money.go
		if err != nil {
			return nil, err
		}
		grant := inspect
		grant.op, grant.delta, grant.learns = opAdjust, -tokens, false // no settle: nothing to learn
		reqs = append(reqs, grant)
	}
	d, err := h.store.decide(ctx, reqs)
	if err != nil {
		return nil, storeAPIError(err)
	}
	v := d.verdicts[len(reqs)-1]
	st := &bucketState{
		Policy: p.Name, Kind: p.kindName(), Rate: p.Rate, Burst: v.limit.burst, Identity: req.Identity, Key: key, Store: h.storeName(),
		Tokens: v.remaining, NextToken: seconds(v.untilFits), Full: seconds(v.limit.untilFull(v.remaining, v.untilFits)),
		Plan: p.planLabel(), Currency: p.unit.currency(),
	}
	showOverride(ctx, h, key, v, st)
	if bk, ok := h.store.(blockKeeper); ok {
		if blocks, tokens := bk.blocksOf(key); blocks > 0 {
			st.BlocksHere = &blocksHere{Blocks: blocks, Tokens: tokens}
		}
	}
	if inspect.learns && action != "reset" {
		learned := d.verdicts[0].learned
		st.Learned = &learned
	}
	if action == "inspect" {
		return st, nil
	}
	var granted int64
	if action == "grant" {
		granted = v.remaining - d.verdicts[0].remaining
		st.Granted = &granted
	}
	// The change is made; every instance forgets what it remembered of the
	// bucket.
	announced := true
	if a, ok := h.store.(announcer); ok {
		if err := a.announce(ctx, h.keyPrefix, key); err != nil {
			announced = false
			h.logger.Warn("announcing a rate-limit change", zap.String("policy", p.Name), zap.String("key", key), zap.Error(err))
		}
	}
	st.Announced = &announced
	h.logger.Info("rate limit bucket "+action, zap.String("policy", p.Name), zap.String("key", key), zap.Int64("tokens", v.remaining), zap.Int64("granted", granted))
	return st, nil
}

// slots inspects or frees a concurrency policy's slots.
func (adminAPI) slots(ctx context.Context, action string, def definition, req adminRequest, key string) (*bucketState, error) {
	p, h := def.policy, def.handler
	rq := bucketRequest{key: key, limit: p.limit, op: opCount, leasesExpired: p.slots.expired}
	if p.kind != kindShed { // a shed policy's capacity is the service's: no override
		p.markOverridable(&rq, true) // shows the override in force
	}
	switch action {
	case "grant":
		return nil, apiError(http.StatusBadRequest, "policy %q is a concurrency limit: it has slots, not tokens, to grant (reset drops its stale leases)", p.Name)
	case "reset":
		// Running requests keep their slots: the limit holds. Stale leases,
		// of holders that vanished, go: those not renewed for most of a
		// lease, when a running request's is renewed every third of it
		// (and may spend another third on its way to Redis).
		rq.op, rq.events, rq.delta = opFree, h.events, p.limit.interval/staleAfter
	}
	d, err := h.store.decide(ctx, []bucketRequest{rq})
	if err != nil {
		return nil, storeAPIError(err)
	}
	v := d.verdicts[0]
	inUse := v.limit.burst - v.remaining // burst: the slots (concurrent, shed { concurrent })
	st := &bucketState{Policy: p.Name, Kind: p.kindName(), Slots: v.limit.burst, Identity: req.Identity, Key: key, Store: h.storeName(),
		Tokens: v.remaining, InUse: &inUse, Plan: p.planLabel()}
	showOverride(ctx, h, key, v, st)
	if action == "reset" {
		dropped := v.expired
		st.Dropped = &dropped
		slotQueues.wake(key)
		h.logger.Info("rate limit slots reset", zap.String("policy", p.Name), zap.String("key", key), zap.Int64("running_kept", inUse), zap.Int64("stale_dropped", dropped))
	}
	return st, nil
}

// staleAfter: a reset drops the leases with less than 1/staleAfter of
// their lease left (not renewed for the rest of it).
const staleAfter = 5

// topAnswer is what top answers.
type topAnswer struct {
	Policy string  `json:"policy"`
	Window float64 `json:"window_seconds"`
	// Currency: USD for a money policy, whose identities say what they
	// have left (admin_money.go).
	Currency   string     `json:"currency,omitempty"`
	Identities []topEntry `json:"identities"`
	// Truncated: the identities are not all those denied in the window
	// (more than n were, or the sketch forgot some).
	Truncated bool `json:"truncated"`
}

func (a adminAPI) top(ctx context.Context, def definition, req adminRequest) topAnswer {
	n := req.N
	if n == 0 {
		n = 10
	}
	ids, truncated := def.policy.top.Top(n)
	out := make([]topEntry, 0, len(ids))
	for _, e := range ids {
		out = append(out, topEntry{Entry: e, Fingerprint: fingerprintOf(e.Key)})
	}
	a.topBudgets(ctx, def, out) // by each raw identity, before they are hidden
	if !req.ShowKeys {
		// The raw identity (an API key, for a policy keyed on the
		// credential) only when asked: a listing is copied around.
		for i := range out {
			out[i].Identity, out[i].Truncated = "", false
		}
	}
	return topAnswer{Policy: def.policy.Name, Window: topk.Window.Seconds(), Currency: def.policy.unit.currency(),
		Identities: out, Truncated: truncated}
}

// topEntry is an identity top lists: its keyed fingerprint, and its raw
// value (Identity) only with show_keys; for a money policy, what its bucket
// has left now and holds when full, in dollars (admin_money.go).
type topEntry struct {
	topk.Entry
	Fingerprint string `json:"fingerprint"`
	Left        string `json:"left,omitempty"`
	Limit       string `json:"limit,omitempty"`
}

// MarshalJSON leaves out an identity not shown.
func (e topEntry) MarshalJSON() ([]byte, error) {
	type shown struct {
		Fingerprint string `json:"fingerprint"`
		Identity    string `json:"identity,omitempty"`
		Key         string `json:"key"`
		Denials     int64  `json:"denials"`
		Error       int64  `json:"error_bound"`
		Truncated   bool   `json:"truncated,omitempty"`
		Left        string `json:"left,omitempty"`
		Limit       string `json:"limit,omitempty"`
	}
	return json.Marshal(shown{e.Fingerprint, e.Identity, e.Key, e.Denials, e.Error, e.Truncated, e.Left, e.Limit})
}

// fingerprintLen is how much of a key's keyed hash top shows: enough to
// tell identities apart and to find one in {http.rate_limit.key} of an
// access log, and no more than the hash (a keyed hash: without the key
// secret, it says nothing of the identity).
const fingerprintLen = 12

// fingerprintOf is the fingerprint of a storage key: the start of its
// keyed hash (the whole key for a fixed one, which names no identity).
func fingerprintOf(key string) string {
	h := hashOf(key)
	if h == key {
		return key
	}
	return h[:min(len(h), fingerprintLen)]
}

// untilFull is the µs until a bucket that holds remaining tokens, the next
// of which comes in next µs, is full.
func (l limit) untilFull(remaining, next int64) int64 {
	if remaining >= l.burst {
		return 0
	}
	return next + (l.burst-max(remaining, 0)-1)*l.interval
}

func seconds(us int64) float64 {
	return float64(us) / float64(time.Second/time.Microsecond)
}

func apiError(status int, format string, args ...any) error {
	return caddy.APIError{HTTPStatus: status, Err: fmt.Errorf(format, args...)}
}

// storeAPIError is the answer when the store could not act: nothing was
// changed that this instance knows of.
func storeAPIError(err error) error {
	msg := "the rate-limit store could not act (%v); nothing was changed"
	if errors.Is(err, context.DeadlineExceeded) || resultOf(err) == breaker.Failed {
		msg = "the rate-limit store did not answer (%v): the change may not have been made; retry when it answers"
	}
	return apiError(http.StatusServiceUnavailable, msg, err)
}

// Interface guard.
var _ caddy.AdminRouter = (*adminAPI)(nil)

// formatAnswer is what /rate_limit/format answers: for each Redis (and
// key prefix) of the loaded config, the fleet marker and the format this
// instance writes buckets in.
type formatAnswer struct {
	Stores []storeFormat `json:"stores"`
}

type storeFormat struct {
	Store string `json:"store"`
	// Marker is the fleet's marker: "v2" once set, "v1" otherwise.
	Marker string `json:"marker"`
	// Writes is the format this instance writes buckets in.
	Writes string `json:"writes"`
}

// format shows, or sets, the fleet marker of every Redis store of the
// loaded config (see upgrade.go).
func (adminAPI) format(w http.ResponseWriter, r *http.Request) error {
	var set string
	switch r.Method {
	case http.MethodGet:
	case http.MethodPost:
		var req struct {
			Format string `json:"format"`
		}
		body, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
		if err == nil {
			err = json.Unmarshal(body, &req)
		}
		if err != nil || req.Format != markerV1 && req.Format != markerV2 {
			return apiError(http.StatusBadRequest, `the body is not {"format": "v1"} or {"format": "v2"}`)
		}
		set = req.Format
	default:
		return apiError(http.StatusMethodNotAllowed, "format takes GET or POST")
	}
	var answer formatAnswer
	seen := map[string]bool{}
	for _, h := range budgets.handlers() {
		fs, ok := h.store.(formatStore)
		if !ok || seen[h.storeName()] {
			continue
		}
		seen[h.storeName()] = true
		ctx := r.Context()
		if set != "" {
			if err := fs.storage().setFormat(ctx, h.keyPrefix, set); err != nil {
				return storeAPIError(err)
			}
			h.logger.Info("rate limit storage format set", zap.String("store", h.storeName()), zap.String("format", set))
		}
		marker, writes, err := fs.storage().formatOf(ctx, h.keyPrefix)
		if err != nil {
			return storeAPIError(err)
		}
		answer.Stores = append(answer.Stores, storeFormat{Store: h.storeName(), Marker: marker, Writes: writes})
	}
	if len(answer.Stores) == 0 {
		return apiError(http.StatusNotFound, "the loaded config has no rate_limit handler with a redis block")
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}
