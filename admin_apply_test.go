package ratelimit

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/limitsfile"
)

// applyFile posts a limits file's entries to the admin API in process.
func applyFile(t *testing.T, source string, dryRun bool, entries []limitsfile.Entry) applyAnswer {
	t.Helper()
	raw, _ := json.Marshal(applyRequest{Source: source, DryRun: dryRun, Overrides: entries})
	status, body := adminDo(t, "POST", "/rate_limit/apply", string(raw))
	if status != 200 {
		t.Fatalf("apply: %d %s", status, body)
	}
	var a applyAnswer
	if err := json.Unmarshal([]byte(body), &a); err != nil {
		t.Fatal(err)
	}
	return a
}

// TestApplyLimitsFile, in process: a file's overrides are added, a second
// apply changes nothing, a changed file changes and removes only what its
// source owns (a hand-made override stays), wrong lines are refused with
// their line while the rest applies, a dry run changes nothing, and the
// buckets keep their state through it all.
func TestApplyLimitsFile(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "apply_rate", Key: "{http.request.header.X-User}", Rate: "2/1h"},
		{Name: "apply_slots", Key: "{http.request.header.X-User}", Concurrent: 2},
	}}, nil)
	get := func(user string) exchange { return serve([]*Handler{h}, nil, "X-User", user) }
	// acme uses its 2 tokens: denied until an override raises its limit.
	get("acme")
	get("acme")
	if x := get("acme"); x.status != 429 {
		t.Fatalf("3rd of 2: %d", x.status)
	}
	// A hand-made override, which no file may remove.
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"apply_rate","identity":"hand","rate":"7/1h"}`); status != 200 {
		t.Fatal(status, body)
	}
	expires := time.Now().Add(48 * time.Hour).Truncate(time.Second).UnixMilli()
	file := []limitsfile.Entry{
		{Line: 3, Policy: "apply_rate", Identity: "acme", Rate: "5/1h", Note: "contract 1"},
		{Line: 4, Policy: "apply_rate", Identity: "globex", Rate: "100/1h", Burst: 10, Expires: expires},
		{Line: 5, Policy: "apply_slots", Identity: "acme", Concurrent: 9},
	}

	dry := applyFile(t, "billing", true, file)
	if len(dry.Added) != 3 || len(dry.Errors) != 0 || !dry.DryRun {
		t.Fatalf("dry run: %+v", dry)
	}
	// The diff names identities by their keyed fingerprints (a diff is
	// kept: a nightly job's output), the identities only with show_keys.
	for _, c := range dry.Added {
		if c.Identity != "" || c.Fingerprint != fingerprintOf(c.Key) || len(c.Fingerprint) != fingerprintLen {
			t.Fatalf("dry run's diff: %+v", c)
		}
	}
	var out strings.Builder
	printApply(&out, "limits.yaml", dry, len(file))
	if strings.Contains(out.String(), "acme") || strings.Contains(out.String(), "globex") || !strings.Contains(out.String(), "+ apply_rate "+dry.Added[0].Fingerprint+": ") {
		t.Fatalf("the diff printed:\n%s", out.String())
	}
	raw, _ := json.Marshal(applyRequest{Source: "billing", DryRun: true, Overrides: file, ShowKeys: true})
	if _, body := adminDo(t, "POST", "/rate_limit/apply", string(raw)); !strings.Contains(body, `"identity":"globex"`) {
		t.Fatalf("show_keys: %s", body)
	}
	if x := get("acme"); x.status != 429 {
		t.Fatalf("after a dry run: %d, want still denied", x.status)
	}

	a := applyFile(t, "billing", false, file)
	if len(a.Added) != 3 || len(a.Changed)+len(a.Removed)+a.Unchanged+len(a.Errors) != 0 {
		t.Fatalf("first apply: %+v", a)
	}
	// acme's bucket kept its state: it owed 2 of 2, now owes 2 of 5.
	if x := get("acme"); x.status != 200 || fields(t, x.header, "RateLimit")["apply_rate"]["r"] != 2 {
		t.Fatalf("after the apply: %d %v", x.status, x.header)
	}
	again := applyFile(t, "billing", false, file)
	if len(again.Added)+len(again.Changed)+len(again.Removed)+len(again.Errors) != 0 || again.Unchanged != 3 {
		t.Fatalf("second apply of the same file: %+v", again)
	}

	// The file changes: globex gone, acme's limit changed, hand's override
	// taken over, three wrong lines.
	file2 := []limitsfile.Entry{
		{Line: 3, Policy: "apply_rate", Identity: "acme", Rate: "6/1h", Note: "contract 1"},
		{Line: 5, Policy: "apply_slots", Identity: "acme", Concurrent: 9},
		{Line: 6, Policy: "apply_rat", Identity: "x", Rate: "1/1s"},
		{Line: 7, Policy: "apply_slots", Identity: "y", Rate: "1/1s"},
		{Line: 8, Policy: "apply_rate", Identity: "z", Rate: "1/1s", Expires: time.Now().Add(-time.Hour).UnixMilli()},
	}
	b := applyFile(t, "billing", false, file2)
	if len(b.Changed) != 1 || b.Changed[0].Line != 3 || b.Changed[0].Was.Rate != "5/1h" || len(b.Removed) != 1 || b.Removed[0].Was.Rate != "100/1h" || b.Unchanged != 1 {
		t.Fatalf("changed file: %+v", b)
	}
	wantErrs := map[int]string{6: `"apply_rat": no such policy in the loaded config (did you mean apply_rate?)`, 7: "is a concurrency limit", 8: "expires:"}
	if len(b.Errors) != 3 {
		t.Fatalf("errors %+v", b.Errors)
	}
	for _, e := range b.Errors {
		if !strings.Contains(e.Msg, wantErrs[e.Line]) {
			t.Errorf("line %d: %q, want %q", e.Line, e.Msg, wantErrs[e.Line])
		}
	}
	list := func(policy string) map[string]overrideEntry {
		status, body := adminDo(t, "GET", "/rate_limit/overrides?policy="+policy, "")
		var la overridesAnswer
		if err := json.Unmarshal([]byte(body), &la); status != 200 || err != nil {
			t.Fatalf("overrides: %d %s", status, body)
		}
		m := map[string]overrideEntry{}
		for _, e := range la.Overrides {
			m[e.Hash] = e
		}
		return m
	}
	hashOfID := func(id string) string { return hashOf(h.Policies[0].storageKey(h.hasher, id)) }
	held := list("apply_rate")
	if len(held) != 2 || held[hashOfID("hand")].Source != "" || held[hashOfID("acme")].Rate != "6/1h" || held[hashOfID("acme")].Source != "billing" {
		t.Fatalf("overrides held: %+v", held)
	}

	// An identity named twice is refused on both lines, and keeps what it
	// had; another source removes nothing of billing's.
	b2 := applyFile(t, "billing", false, append(file2[:2:2],
		limitsfile.Entry{Line: 9, Policy: "apply_rate", Identity: "dup", Rate: "1/1s"},
		limitsfile.Entry{Line: 10, Policy: "apply_rate", Identity: "dup", Rate: "2/1s"}))
	if len(b2.Errors) != 2 || len(b2.Added) != 0 || b2.Unchanged != 2 {
		t.Fatalf("named twice: %+v", b2)
	}
	for _, e := range b2.Errors {
		if strings.Contains(e.Msg, "dup") { // a line error is printed, and kept with the job's output
			t.Errorf("line %d names the identity: %s", e.Line, e.Msg)
		}
	}
	other := applyFile(t, "crm", false, []limitsfile.Entry{})
	if len(other.Removed) != 0 {
		t.Fatalf("another source removed %+v", other.Removed)
	}
	// An empty file of the source removes what it owns, and only that.
	gone := applyFile(t, "billing", false, []limitsfile.Entry{})
	if len(gone.Removed) != 2 {
		t.Fatalf("empty file: %+v", gone)
	}
	if held := list("apply_rate"); len(held) != 1 || held[hashOfID("hand")].Rate != "7/1h" {
		t.Fatalf("after the empty file: %+v", held)
	}
}

// TestApplyIdentitiesAsTheHandlerKeysThem: two identities the handler
// keys as one (IPv6 addresses of one /64) are one identity named twice:
// both lines are refused; a policy with a fixed key has one override,
// whatever identity a line gives.
func TestApplyIdentitiesAsTheHandlerKeysThem(t *testing.T) {
	testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "apply_ip", Key: "{client_ip}", Rate: "10/1m"},
		{Name: "apply_global", Key: "global", Rate: "10/1m"},
	}}, nil)
	a := applyFile(t, "net", false, []limitsfile.Entry{
		{Line: 1, Policy: "apply_ip", Identity: "2001:db8:1:2::1", Rate: "20/1m"},
		{Line: 2, Policy: "apply_ip", Identity: "2001:db8:1:2::99", Rate: "30/1m"},
		{Line: 3, Policy: "apply_ip", Identity: "192.0.2.1", Rate: "40/1m"},
		{Line: 4, Policy: "apply_global", Identity: "a", Rate: "50/1m"},
		{Line: 5, Policy: "apply_global", Identity: "b", Rate: "60/1m"},
	})
	if len(a.Added) != 1 || a.Added[0].Line != 3 || len(a.Errors) != 4 {
		t.Fatalf("%+v", a)
	}
	for _, e := range a.Errors {
		if !strings.Contains(e.Msg, "named") {
			t.Errorf("line %d: %s", e.Line, e.Msg)
		}
	}
}
