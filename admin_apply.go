package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/limitsfile"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/suggest"
	"go.uber.org/zap"
)

// A limits file applied (`caddy rate-limit apply`, internal/limitsfile):
//
//	POST /rate_limit/apply {"source": "billing", "dry_run": false,
//	                        "overrides": [{"line": 3, "policy": ..., "identity": ..., "rate": ..., "burst": ...,
//	                                       "concurrent": ..., "quota": ..., "expires_ms": ..., "note": ...}]}
//
// makes the overrides the store holds what the file says, as a diff: an
// override of the file that is not in force is added; one in force that
// differs (limit, expiry, note, or set by hand or by another source) is
// changed; one the source set before that the file no longer names is
// removed. Overrides set by hand (`caddy rate-limit override`) or by
// another source are never removed: each override's index entry carries
// the source that set it. An entry that is wrong (an unknown policy, a
// limit of the wrong kind or out of range, an expiry in the past, an
// identity named twice) is refused with its line, and the identity's
// override is left as it is; the others are applied. Applying the same
// file again changes nothing. Overrides never touch buckets: each keeps
// its state, as across a plan change. Identities are hashed as the handler
// hashes them, before anything is stored.

// applyRequest is what POST /rate_limit/apply asks.
type applyRequest struct {
	Source    string             `json:"source"`
	DryRun    bool               `json:"dry_run,omitempty"`
	Overrides []limitsfile.Entry `json:"overrides"`
	// ShowKeys: the diff names each identity, not only its keyed
	// fingerprint, as top's show_keys does: a diff is copied around (the
	// output of a nightly job) and its identities may be API keys.
	ShowKeys bool `json:"show_keys,omitempty"`
}

// applyAnswer is the diff, as made (or, for a dry run, as it would be).
type applyAnswer struct {
	Source    string                 `json:"source"`
	DryRun    bool                   `json:"dry_run"`
	Stores    []string               `json:"stores"`
	Added     []applyChange          `json:"added"`
	Changed   []applyChange          `json:"changed"`
	Removed   []applyChange          `json:"removed"`
	Unchanged int                    `json:"unchanged"`
	Errors    []limitsfile.LineError `json:"errors"`
	// Announced: every instance was told of each change at once
	// (otherwise each sees it within overridesEvery).
	Announced bool `json:"announced"`
}

// applyChange is one override added, changed or removed: the file's line
// (none for a removal), the policy, the identity as the file names it
// (none for a removal: the store holds only its hash), its key, and the
// override as it is after the change and, for a change or a removal, as it
// was.
type applyChange struct {
	Line   int    `json:"line,omitempty"`
	Policy string `json:"policy"`
	// Identity, with show_keys only.
	Identity    string         `json:"identity,omitempty"`
	Key         string         `json:"key"`
	Fingerprint string         `json:"fingerprint"`
	Override    *overrideEntry `json:"override,omitempty"`
	Was         *overrideEntry `json:"was,omitempty"`
}

// maxApplyBody bounds a limits file sent to the admin API: a million
// overrides of some 120 bytes.
const maxApplyBody = 128 << 20

// overrideApplier is a store that writes many overrides at once, each
// expiring at a time given (a limits file's), rather than one by one.
// Implemented by redisStore and the in-process store.
type overrideApplier interface {
	// applyOverrides writes sets (each entry's Expires is when, Unix ms;
	// 0: never) and deletes the overrides of the buckets under deletes.
	applyOverrides(ctx context.Context, sets []overrideWrite, deletes []string) error
}

// Who answers it: the override stores of both stores (override_batch.go).
var (
	_ overrideApplier = (*overrideFlags)(nil)
	_ overrideApplier = (*overrideTable)(nil)
)

// overrideWrite is one override a limits file sets.
type overrideWrite struct {
	key   string
	o     override
	entry overrideEntry
}

// applyTarget is one policy's overrides in one store, the unit of the diff.
type applyTarget struct {
	prefix  string // <key_prefix><policy>:
	policy  *Policy
	handler *Handler
	store   overrideStore
	held    map[string]overrideEntry // by hash, in force now
	sets    []overrideWrite
	dels    []string
}

func (a adminAPI) apply(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return apiError(http.StatusMethodNotAllowed, "apply takes POST")
	}
	body, err := io.ReadAll(io.LimitReader(r.Body, maxApplyBody+1))
	if err != nil {
		return apiError(http.StatusBadRequest, "reading the request: %v", err)
	}
	if len(body) > maxApplyBody {
		return apiError(http.StatusRequestEntityTooLarge, "the limits file is more than %d MiB: split it by source", maxApplyBody>>20)
	}
	var req applyRequest
	if err := json.Unmarshal(body, &req); err != nil {
		return apiError(http.StatusBadRequest, `the body is not {"source": ..., "overrides": [...]}: %v`, err)
	}
	if !limitsfile.ValidSource(req.Source) {
		return apiError(http.StatusBadRequest, "source: %q: 1 to 64 letters, digits, _ . - : / @ naming the overrides this file owns", req.Source)
	}
	answer, err := applyOverrides(r.Context(), req)
	if err != nil {
		return err
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(answer)
}

// applyOverrides makes the diff of req against the overrides in force and,
// unless it is a dry run, applies it.
func applyOverrides(ctx context.Context, req applyRequest) (*applyAnswer, error) {
	ans := &applyAnswer{Source: req.Source, DryRun: req.DryRun, Added: []applyChange{}, Changed: []applyChange{},
		Removed: []applyChange{}, Errors: []limitsfile.LineError{}, Announced: true}
	// Every policy that keeps overrides, each store and prefix once: the
	// file's own, and those whose overrides of this source it may remove.
	targets := map[string]*applyTarget{}
	var order []string
	for _, h := range budgets.handlers() {
		store := overridesIn(h.store)
		if store == nil {
			continue
		}
		for _, p := range h.Policies {
			id := h.storeName() + " " + p.keyPrefix
			if p.kind == kindShed || targets[id] != nil {
				continue
			}
			targets[id] = &applyTarget{prefix: p.keyPrefix, policy: p, handler: h, store: store}
			order = append(order, id)
		}
	}
	slices.Sort(order)
	if len(order) == 0 {
		return nil, apiError(http.StatusNotFound, "the loaded config has no policy that keeps overrides")
	}
	for _, id := range order {
		t := targets[id]
		entries, err := t.store.overridesOf(ctx, t.prefix)
		if err != nil {
			return nil, storeAPIError(err)
		}
		t.held = make(map[string]overrideEntry, len(entries))
		for _, e := range entries {
			t.held[e.Hash] = e
		}
		if !slices.Contains(ans.Stores, t.handler.storeName()) {
			ans.Stores = append(ans.Stores, t.handler.storeName())
		}
	}

	// The file's entries, each checked as the admin API checks one
	// override; an identity named twice is refused on both lines.
	now := time.Now()
	type wanted struct {
		line     int
		identity string
		t        *applyTarget
		w        overrideWrite
	}
	byKey := map[string]*wanted{}
	var keys []string
	named := map[string]bool{} // keys the file names, right or wrong: never removed
	refused := map[string]bool{}
	for _, e := range req.Overrides {
		def, key, _, err := overridePolicy(e.Policy, e.Identity)
		if key != "" {
			named[key] = true
		}
		if err != nil {
			ans.Errors = append(ans.Errors, limitsfile.LineError{Line: e.Line, Msg: applyErrorText(err, e.Policy)})
			continue
		}
		t := targets[def.handler.storeName()+" "+def.policy.keyPrefix]
		if t == nil {
			ans.Errors = append(ans.Errors, limitsfile.LineError{Line: e.Line, Msg: fmt.Sprintf("policy %q: its store keeps no overrides", e.Policy)})
			continue
		}
		o, entry, err := def.policy.checkOverride(overrideRequest{Rate: e.Rate, Burst: e.Burst, Concurrent: e.Concurrent, Quota: e.Quota})
		if err == nil {
			err = checkNote(e.Note)
		}
		if err == nil && e.Expires != 0 {
			err = checkExpiry(e.Expires, now)
		}
		if err == nil {
			if first := byKey[key]; first != nil || refused[key] {
				if first != nil {
					ans.Errors = append(ans.Errors, limitsfile.LineError{Line: first.line, Msg: fmt.Sprintf("policy %s: its identity is named again on line %d: which one is meant? Neither is applied", e.Policy, e.Line)})
					delete(byKey, key)
				}
				refused[key] = true
				err = fmt.Errorf("policy %s: its identity is named on an earlier line too: neither is applied", e.Policy)
			}
		}
		if err != nil {
			ans.Errors = append(ans.Errors, limitsfile.LineError{Line: e.Line, Msg: err.Error()})
			continue
		}
		entry.Note, entry.Expires, entry.Source = e.Note, e.Expires, req.Source
		byKey[key] = &wanted{line: e.Line, identity: e.Identity, t: t, w: overrideWrite{key: key, o: o, entry: entry}}
		keys = append(keys, key)
	}

	// The diff.
	for _, key := range keys {
		wt := byKey[key]
		if wt == nil {
			continue // refused: named twice
		}
		t, hash := wt.t, hashOf(key)
		ch := applyChange{Line: wt.line, Policy: t.policy.Name, Key: key, Fingerprint: fingerprintOf(key)}
		if req.ShowKeys {
			ch.Identity = wt.identity
		}
		after := wt.w.entry
		after.Hash, after.Key = hash, key
		ch.Override = &after
		if held, ok := t.held[hash]; ok {
			if sameOverride(t.policy, held, wt.w) {
				ans.Unchanged++
				continue
			}
			was := held
			ch.Was = &was
			ans.Changed = append(ans.Changed, ch)
		} else {
			ans.Added = append(ans.Added, ch)
		}
		t.sets = append(t.sets, wt.w)
	}
	for _, id := range order {
		t := targets[id]
		var gone []overrideEntry
		for hash, held := range t.held {
			key := t.prefix + "{" + hash + "}"
			if held.Source == req.Source && byKey[key] == nil && !named[key] {
				gone = append(gone, held)
			}
		}
		slices.SortFunc(gone, func(a, b overrideEntry) int { return strings.Compare(a.Hash, b.Hash) })
		for _, held := range gone {
			was := held
			ans.Removed = append(ans.Removed, applyChange{Policy: t.policy.Name, Key: held.Key, Fingerprint: fingerprintOf(held.Key), Was: &was})
			t.dels = append(t.dels, held.Key)
		}
	}
	slices.SortFunc(ans.Errors, func(a, b limitsfile.LineError) int { return a.Line - b.Line })
	if req.DryRun {
		return ans, nil
	}

	// Applied, store by store; then every instance is told.
	for _, id := range order {
		t := targets[id]
		if len(t.sets) == 0 && len(t.dels) == 0 {
			continue
		}
		oa, ok := t.store.(overrideApplier)
		if !ok {
			return nil, apiError(http.StatusNotImplemented, "policy %s: its store cannot apply a limits file", t.policy.Name)
		}
		if err := oa.applyOverrides(ctx, t.sets, t.dels); err != nil {
			return nil, storeAPIError(fmt.Errorf("policy %s: %w (run apply again: what was applied is kept, the rest is applied then)", t.policy.Name, err))
		}
		changed := make([]string, 0, len(t.sets)+len(t.dels))
		for _, s := range t.sets {
			changed = append(changed, s.key)
		}
		changed = append(changed, t.dels...)
		if !announceOverrides(ctx, t.handler, changed) {
			ans.Announced = false
		}
		t.handler.logger.Info("rate limit overrides applied", zap.String("policy", t.policy.Name), zap.String("source", req.Source),
			zap.Int("set", len(t.sets)), zap.Int("removed", len(t.dels)))
		if ce := t.handler.logger.Check(zap.DebugLevel, "rate limit overrides applied: keys"); ce != nil {
			ce.Write(zap.String("policy", t.policy.Name), zap.Strings("keys", changed))
		}
	}
	return ans, nil
}

// applyErrorText is the message of an admin API error, for a line.
func applyErrorText(err error, policy string) string {
	msg := err.Error()
	if strings.Contains(msg, "no such policy") {
		var names []string
		for _, p := range budgets.policies() {
			names = append(names, p.Name)
		}
		if near := suggest.Nearest(policy, names); near != "" {
			msg += " (did you mean " + near + "?)"
		}
	}
	return msg
}

// checkExpiry checks a limits file's expiry, Unix ms, as `for` is checked.
func checkExpiry(ms int64, now time.Time) error {
	at := time.UnixMilli(ms)
	switch d := at.Sub(now); {
	case d < minOverrideFor:
		return fmt.Errorf("expires: %s is past (or within a second): remove the entry, or give a later time", at.UTC().Format(time.RFC3339))
	case d > maxOverrideFor:
		return fmt.Errorf("expires: %s is more than 366 days away", at.UTC().Format(time.RFC3339))
	}
	return nil
}

// sameOverride reports whether the override in force, held, is the one the
// file wants: the same limit (as the policy reads both), expiry, note and
// source.
func sameOverride(p *Policy, held overrideEntry, want overrideWrite) bool {
	if held.Expires != want.entry.Expires || held.Note != want.entry.Note || held.Source != want.entry.Source {
		return false
	}
	o, _, err := p.checkOverride(overrideRequest{Rate: held.Rate, Burst: held.Burst, Concurrent: held.Concurrent, Quota: held.Quota})
	return err == nil && o == want.o
}

// announceOverrides tells every instance the overrides of the buckets
// under keys changed, as announceOverride does for one.
func announceOverrides(ctx context.Context, h *Handler, keys []string) bool {
	a, ok := h.store.(batchAnnouncer)
	if !ok {
		for _, key := range keys {
			pacing.Forget(key)
		}
		return true
	}
	if err := a.announceOverrides(ctx, h.keyPrefix, keys); err != nil {
		h.logger.Warn("announcing rate-limit overrides", zap.Int("keys", len(keys)), zap.Error(err))
		return false
	}
	return true
}

// batchAnnouncer is an announcer that announces many overrides at once.
// Implemented by redisStore.
type batchAnnouncer interface {
	announceOverrides(ctx context.Context, prefix string, keys []string) error
}

var _ batchAnnouncer = (*redisStore)(nil) // override_batch.go
