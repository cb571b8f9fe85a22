package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
)

// The admin API's overrides, beside its other routes:
//
//	POST   /rate_limit/override  {"policy": "<name>", "identity": "<id>", "rate": "5000/1m", "burst": 500,
//	                              "for": "72h", "note": "contract 123"}       (or "concurrent": 10, or "quota": "5000000/month")
//	DELETE /rate_limit/override  {"policy": "<name>", "identity": "<id>"}
//	GET    /rate_limit/overrides?policy=<name>
//
// (The identity goes in bodies, not in URLs, which Caddy's admin API logs.)
//
// An override replaces the limit of one identity's bucket (its plan's, or
// its policy's), on every instance at once, until deleted or, with `for`,
// until it expires by itself; the bucket keeps its state, as across a plan
// change. The identity is hashed as the handler hashes it: the store and
// the logs hold only the hash. Every set and delete is logged at INFO with
// the policy and the hash. A request that is not right (an unknown policy,
// a limit of the wrong kind or out of range, a duration out of range, a
// note too long) gets 400 and changes nothing.

// overrideRequest is what POST /rate_limit/override asks.
type overrideRequest struct {
	Policy     string `json:"policy"`
	Identity   string `json:"identity"`
	Rate       string `json:"rate,omitempty"`
	Burst      int64  `json:"burst,omitempty"`
	Concurrent int64  `json:"concurrent,omitempty"`
	// Quota is a quota policy's N: "N", or "N/<unit>" with the policy's
	// unit (the period and timezone stay the policy's).
	Quota string `json:"quota,omitempty"`
	// For is how long the override lasts, a duration such as 72h or 7d;
	// empty: until deleted.
	For  string `json:"for,omitempty"`
	Note string `json:"note,omitempty"`
}

// overrideAnswer is what a set or a delete answers.
type overrideAnswer struct {
	Policy   string         `json:"policy"`
	Identity string         `json:"identity"`
	Key      string         `json:"key"`
	Store    string         `json:"store"`
	Override *overrideEntry `json:"override,omitempty"`
	// Deleted: a delete found an override in force.
	Deleted *bool `json:"deleted,omitempty"`
	// Announced: every instance was told at once (otherwise within
	// overridesEvery).
	Announced bool `json:"announced"`
}

// overridesAnswer is what the list answers.
type overridesAnswer struct {
	Policy    string          `json:"policy"`
	Store     string          `json:"store"`
	Overrides []overrideEntry `json:"overrides"`
}

func (a adminAPI) serveOverride(w http.ResponseWriter, r *http.Request, action string) error {
	var answer any
	var err error
	switch {
	case action == "overrides" && r.Method == http.MethodGet:
		answer, err = a.listOverrides(r)
	case action == "override" && r.Method == http.MethodPost:
		answer, err = a.setOverride(r)
	case action == "override" && r.Method == http.MethodDelete:
		answer, err = a.deleteOverride(r)
	case action == "overrides":
		return apiError(http.StatusMethodNotAllowed, "overrides takes GET")
	default:
		return apiError(http.StatusMethodNotAllowed, "override takes POST (set) or DELETE")
	}
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}

// overridePolicy finds the policy an override call names, and the storage
// key of its identity.
func overridePolicy(policy, identity string) (definition, string, overrideStore, error) {
	if policy == "" {
		return definition{}, "", nil, apiError(http.StatusBadRequest, "policy: required")
	}
	def, ok := budgets.find(policy)
	if !ok {
		return definition{}, "", nil, apiError(http.StatusBadRequest, "policy %q: no such policy in the loaded config", policy)
	}
	p, h := def.policy, def.handler
	if p.kind == kindShed {
		return definition{}, "", nil, apiError(http.StatusBadRequest, "policy %q sheds load: its capacity is the service's, not an identity's, and has no overrides", policy)
	}
	store := overridesIn(h.store)
	if store == nil {
		return definition{}, "", nil, apiError(http.StatusBadRequest, "policy %q: its store keeps no overrides", policy)
	}
	key := p.fixedKey
	if key == "" {
		if identity == "" {
			return definition{}, "", nil, apiError(http.StatusBadRequest, "identity: required: the value policy %q keys on (%s)", p.Name, p.Key)
		}
		key = p.storageKey(h.hasher, p.identityOf(identity))
	}
	return def, key, store, nil
}

// readOverrideRequest reads an override call's JSON body; a field it does
// not know is a mistake, not something to ignore.
func readOverrideRequest(r *http.Request, shape string) (overrideRequest, error) {
	var req overrideRequest
	body, err := io.ReadAll(io.LimitReader(r.Body, 1<<16))
	if err != nil {
		return req, apiError(http.StatusBadRequest, "reading the request: %v", err)
	}
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, apiError(http.StatusBadRequest, "the body is not %s: %v", shape, err)
	}
	return req, nil
}

func (adminAPI) setOverride(r *http.Request) (*overrideAnswer, error) {
	req, err := readOverrideRequest(r, `{"policy": ..., "identity": ..., "rate": ..., "burst": ..., "concurrent": ..., "quota": ..., "for": ..., "note": ...}`)
	if err != nil {
		return nil, err
	}
	def, key, store, err := overridePolicy(req.Policy, req.Identity)
	if err != nil {
		return nil, err
	}
	p, h := def.policy, def.handler
	o, entry, err := p.checkOverride(req)
	if err != nil {
		return nil, apiError(http.StatusBadRequest, "%v", err)
	}
	d, err := parseOverrideFor(req.For)
	if err != nil {
		return nil, apiError(http.StatusBadRequest, "%v", err)
	}
	if err := checkNote(req.Note); err != nil {
		return nil, apiError(http.StatusBadRequest, "%v", err)
	}
	entry.Note = req.Note
	if entry, err = store.setOverride(r.Context(), key, o, entry, d); err != nil {
		return nil, storeAPIError(err)
	}
	entry.Hash, entry.Key = hashOf(key), key
	announced := announceOverride(r.Context(), h, key)
	fields := []zap.Field{zap.String("policy", p.Name), zap.String("key", key), zap.String("limit", entry.describe())}
	if entry.Expires > 0 {
		fields = append(fields, zap.Time("expires", time.UnixMilli(entry.Expires).UTC()))
	}
	h.logger.Info("rate limit override set", fields...)
	return &overrideAnswer{Policy: p.Name, Identity: req.Identity, Key: key, Store: h.storeName(), Override: &entry, Announced: announced}, nil
}

func (adminAPI) deleteOverride(r *http.Request) (*overrideAnswer, error) {
	req, err := readOverrideRequest(r, `{"policy": ..., "identity": ...}`)
	if err != nil {
		return nil, err
	}
	if req.Rate != "" || req.Burst != 0 || req.Concurrent != 0 || req.Quota != "" || req.For != "" || req.Note != "" {
		return nil, apiError(http.StatusBadRequest, "a delete takes the policy and the identity only")
	}
	def, key, store, err := overridePolicy(req.Policy, req.Identity)
	if err != nil {
		return nil, err
	}
	p, h := def.policy, def.handler
	deleted, err := store.deleteOverride(r.Context(), key)
	if err != nil {
		return nil, storeAPIError(err)
	}
	if !deleted {
		// Not the identity: Caddy's admin API logs the errors it returns.
		return nil, apiError(http.StatusNotFound, "policy %q, key %s: no override in force for this identity", p.Name, key)
	}
	announced := announceOverride(r.Context(), h, key)
	h.logger.Info("rate limit override deleted", zap.String("policy", p.Name), zap.String("key", key))
	return &overrideAnswer{Policy: p.Name, Identity: req.Identity, Key: key, Store: h.storeName(), Deleted: &deleted, Announced: announced}, nil
}

func (adminAPI) listOverrides(r *http.Request) (*overridesAnswer, error) {
	name := r.URL.Query().Get("policy")
	def, _, store, err := overridePolicy(name, "-")
	if err != nil {
		return nil, err
	}
	entries, err := store.overridesOf(r.Context(), def.policy.keyPrefix)
	if err != nil {
		return nil, storeAPIError(err)
	}
	if entries == nil {
		entries = []overrideEntry{}
	}
	return &overridesAnswer{Policy: def.policy.Name, Store: def.handler.storeName(), Overrides: entries}, nil
}

// announceOverride tells every instance an override of the bucket under
// key was set or deleted: each reads the bucket's override from its next
// request, forgets what it remembered of the bucket, and confirms it.
func announceOverride(ctx context.Context, h *Handler, key string) bool {
	a, ok := h.store.(announcer)
	if !ok {
		return true
	}
	if err := a.announceOverride(ctx, h.keyPrefix, key); err != nil {
		h.logger.Warn("announcing a rate-limit override", zap.String("key", key), zap.Error(err))
		return false
	}
	return true
}

// checkOverride checks an override's limit against the policy, as the
// policy's own limit is checked: of its kind, in range, able to admit its
// cost. It returns the override and its entry.
func (p *Policy) checkOverride(req overrideRequest) (override, overrideEntry, error) {
	rate, burst, concurrent := req.Rate, req.Burst, req.Concurrent
	if p.kind == kindQuota {
		switch {
		case rate != "" || burst != 0 || concurrent != 0:
			return override{}, overrideEntry{}, errors.New("policy " + p.Name + " is a quota (" + p.Quota + "): its overrides take quota <N>, not rate, burst or concurrent")
		case req.Quota == "":
			return override{}, overrideEntry{}, errors.New("a limit is required: quota <N>, e.g. quota " + p.quotaWith(min(10*p.limit.burst, maxJSONInteger)))
		}
		n, err := p.quotaOf(req.Quota)
		if err != nil {
			return override{}, overrideEntry{}, err
		}
		if n >= maxJSONInteger { // what the store holds exactly (override.valid)
			return override{}, overrideEntry{}, fmt.Errorf("quota: %d: an override's N is below %d", n, int64(maxJSONInteger))
		}
		q := *p
		q.Plan, q.Quota = nil, p.quotaWith(n)
		if err := q.check(); err != nil { // e.g. a fixed cost above it
			return override{}, overrideEntry{}, err
		}
		return override{kind: overrideQuota, burst: n}, overrideEntry{Kind: "quota", Quota: q.Quota}, nil
	}
	if req.Quota != "" {
		kind := "rate limit: its overrides take rate <N>/<duration> [burst <n>]"
		if p.kind == kindConcurrent {
			kind = "concurrency limit: its overrides take concurrent <n>"
		}
		return override{}, overrideEntry{}, errors.New("policy " + p.Name + " is a " + kind + ", not quota (a quota is a policy of its own)")
	}
	if p.kind == kindConcurrent {
		switch {
		case rate != "" || burst != 0:
			return override{}, overrideEntry{}, errors.New("policy " + p.Name + " is a concurrency limit: its overrides take concurrent <n>, not rate or burst")
		case concurrent == 0:
			return override{}, overrideEntry{}, errors.New("a limit is required: concurrent <n>")
		case concurrent >= maxJSONInteger: // what the store holds exactly (override.valid)
			return override{}, overrideEntry{}, fmt.Errorf("concurrent: %d: an override's slots are below %d", concurrent, int64(maxJSONInteger))
		}
		q := *p
		q.Plan, q.Concurrent = nil, concurrent
		if err := q.check(); err != nil {
			return override{}, overrideEntry{}, err
		}
		return override{kind: overrideSlots, burst: concurrent}, overrideEntry{Kind: "concurrent", Concurrent: concurrent}, nil
	}
	switch {
	case concurrent != 0:
		return override{}, overrideEntry{}, errors.New("policy " + p.Name + " is a rate limit: its overrides take rate <N>/<duration> [burst <n>], not concurrent")
	case rate == "":
		return override{}, overrideEntry{}, errors.New("a limit is required: rate <N>/<duration> [burst <n>]")
	}
	q := *p
	q.Plan, q.Rate, q.Burst = nil, rate, float64(burst)
	if err := q.check(); err != nil {
		return override{}, overrideEntry{}, err
	}
	return override{kind: overrideRate, interval: q.limit.interval, burst: q.limit.burst}, overrideEntry{Kind: "rate", Rate: rate, Burst: q.limit.burst}, nil
}

// parseOverrideFor parses how long an override lasts (0: until deleted).
func parseOverrideFor(s string) (time.Duration, error) {
	if s == "" {
		return 0, nil
	}
	d, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, errors.New("for: " + err.Error())
	}
	if d <= 0 {
		return 0, errors.New("for: " + s + " must be positive: how long the override lasts, from " + minOverrideFor.String() + " to 366 days")
	}
	if d < minOverrideFor || d > maxOverrideFor {
		return 0, errors.New("for: " + d.String() + " must be from " + minOverrideFor.String() + " to " + maxOverrideFor.String() + " (366 days)")
	}
	return d, nil
}

// checkNote checks an override's note: a line of text for people.
func checkNote(note string) error {
	if len(note) > maxNoteLen {
		return errors.New("note: " + strconv.Itoa(len(note)) + " bytes, at most " + strconv.Itoa(maxNoteLen))
	}
	if !utf8.ValidString(note) || strings.IndexFunc(note, func(r rune) bool { return unicode.IsControl(r) }) >= 0 {
		return errors.New("note: one line of UTF-8 text, without control characters")
	}
	return nil
}

// showOverride adds to a bucket's state the override of its identity, if
// one is stored, and the limit it was decided under.
func showOverride(ctx context.Context, h *Handler, key string, v verdict, st *bucketState) {
	store := overridesIn(h.store)
	if store == nil {
		return
	}
	e, err := store.overrideOf(ctx, key)
	if err != nil || e == nil {
		return
	}
	st.Override = e
	if e.Kind == "rate" && v.limit.interval > 0 {
		st.Rate, st.Burst = e.Rate, v.limit.burst
	}
}
