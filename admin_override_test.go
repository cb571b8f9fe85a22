package ratelimit

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestServeHTTPOverride, in process (no redis block): an override set
// through the admin API applies to the identity's next request, its bucket
// kept; inspect and the list show it; bad input changes nothing; `for`
// expires by itself; delete brings the policy's limit back.
func TestServeHTTPOverride(t *testing.T) {
	fake := time.Now()
	processOverrides.mu.Lock()
	processOverrides.now = func() time.Time { return fake }
	processOverrides.mu.Unlock()
	defer func() {
		processOverrides.mu.Lock()
		processOverrides.now = time.Now
		processOverrides.mu.Unlock()
	}()
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "ovr_unit", Key: "{http.request.header.X-User}", Rate: "5/1h"}}}, nil)
	get := func() exchange { return serve([]*Handler{h}, nil, "X-User", "acme") }
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["ovr_unit"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["ovr_unit"]["r"] }
	for range 5 {
		get()
	}
	if x := get(); x.status != 429 {
		t.Fatalf("6th of 5: %d", x.status)
	}
	if h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatal("the policy's overrides flag is on before any override")
	}

	list := func() []overrideEntry {
		t.Helper()
		status, body := adminDo(t, "GET", "/rate_limit/overrides?policy=ovr_unit", "")
		var a overridesAnswer
		if err := json.Unmarshal([]byte(body), &a); status != 200 || err != nil {
			t.Fatalf("overrides: %d %s", status, body)
		}
		return a.Overrides
	}
	// Bad input: 400, and nothing changes.
	for _, tc := range []struct{ body, says string }{
		{`{"policy":"nope","identity":"acme","rate":"100/1h"}`, `policy "nope": no such policy`},
		{`{"identity":"acme","rate":"100/1h"}`, "policy: required"},
		{`{"policy":"ovr_unit","rate":"100/1h"}`, "identity: required"},
		{`{"policy":"ovr_unit","identity":"acme"}`, "a limit is required"},
		{`{"policy":"ovr_unit","identity":"acme","concurrent":5}`, "is a rate limit: its overrides take rate"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"0/1h"}`, "rate: \"0/1h\": N must be a positive integer"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","burst":-1}`, "burst: -1"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"1/1s","burst":9007199254740991}`, "take too long to refill"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"soon"}`, "for: "},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"500ms"}`, "for: 500ms must be from 1s"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","for":"400d"}`, "for: 9600h0m0s must be from 1s to 8784h0m0s"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","note":"` + strings.Repeat("n", 201) + `"}`, "note: 201 bytes, at most 200"},
		{`{"policy":"ovr_unit","identity":"acme","rate":"100/1h","note":"line\nbreak"}`, "note: one line"},
		{`{"policy":"ovr_unit","identity":"acme","limit":"rate 100/1h"}`, `unknown field "limit"`},
		{`not json`, "the body is not"},
	} {
		if status, body := adminDo(t, "POST", "/rate_limit/override", tc.body); status != 400 || !strings.Contains(body, tc.says) {
			t.Errorf("POST %s: %d %q, want 400 saying %q", tc.body, status, body, tc.says)
		}
	}
	if n := len(list()); n != 0 || h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatalf("after refused overrides: %d listed, flag %v", n, h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")))
	}
	if x := get(); x.status != 429 {
		t.Fatalf("after refused overrides: %d, want still denied", x.status)
	}

	// An override: the bucket's 5 owed tokens are kept (5 of 20), and the
	// field shows the override's limit per the policy's window.
	status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme","rate":"100/1h","burst":20,"note":"contract 1"}`)
	if status != 200 {
		t.Fatalf("setting an override: %d %s", status, body)
	}
	if x := get(); x.status != 200 || q(x) != 100 || r(x) != 14 || fields(t, x.header, "RateLimit-Policy")["ovr_unit"]["burst"] != 20 {
		t.Fatalf("under the override: %d q=%d r=%d, RateLimit-Policy %s; want 200 q=100 r=14, its burst 20 (the limit in force)", x.status, q(x), r(x), x.header.Get("RateLimit-Policy"))
	}
	if x := serve([]*Handler{h}, nil, "X-User", "bob"); q(x) != 5 {
		t.Fatalf("another identity: q=%d, want the policy's 5", q(x))
	}
	if l := list(); len(l) != 1 || l[0].Note != "contract 1" || l[0].describe() != "rate 100/1h burst 20" || l[0].Key != h.Policies[0].storageKey(h.hasher, "acme") {
		t.Fatalf("list: %+v", l)
	}
	status, body = adminDo(t, "POST", "/rate_limit/inspect", `{"policy":"ovr_unit","identity":"acme"}`)
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); status != 200 || err != nil || st.Override == nil || st.Burst != 20 || st.Rate != "100/1h" || st.Tokens != 14 {
		t.Fatalf("inspect: %d %s", status, body)
	}

	// Delete: the policy's limit again, the 6 override tokens owed capped
	// at its 5: denied.
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme"}`); status != 200 {
		t.Fatalf("delete: %d %s", status, body)
	}
	if x := get(); x.status != 429 || q(x) != 5 {
		t.Fatalf("after the delete: %d q=%d, want 429 q=5", x.status, q(x))
	}
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme"}`); status != 404 || !strings.Contains(body, "no override in force") {
		t.Fatalf("deleting again: %d %s, want 404", status, body)
	}

	// for 2s: in force until then, gone after, by itself.
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"ovr_unit","identity":"acme","rate":"1000/1h","for":"2s"}`); status != 200 {
		t.Fatalf("setting an override for 2s: %d %s", status, body)
	}
	fake = fake.Add(1999 * time.Millisecond)
	if x := get(); x.status != 200 || q(x) != 1000 {
		t.Fatalf("1.999 s into an override for 2s: %d q=%d", x.status, q(x))
	}
	fake = fake.Add(time.Millisecond)
	if x := get(); q(x) != 5 || len(list()) != 0 || h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")) {
		t.Fatalf("2 s into an override for 2s: q=%d, %d listed, flag %v; want it gone", q(x), len(list()), h.Policies[0].overrides.may(h.Policies[0].storageKey(h.hasher, "acme")))
	}
}

// TestServeHTTPQuotaOverride, in process (no redis block): an override of
// a quota policy set through the admin API applies to the identity's next
// request, its count kept: raised, it admits at once what the new N leaves;
// lowered below the units used, it denies at once; inspect and the list
// show it; a limit of the wrong kind is 400 and changes nothing; delete
// brings the policy's N back.
func TestServeHTTPQuotaOverride(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "qovr_unit", Key: "{http.request.header.X-User}", Quota: "5/year", Timezone: "Europe/Berlin"},
		{Name: "qovr_rate", Key: "{http.request.header.X-User}", Rate: "1000/1s"},
	}}, nil)
	acme := "acme-" + time.Now().Format("150405.000000") // the store is the process's
	get := func(user string) exchange { return serve([]*Handler{h}, nil, "X-User", user) }
	q := func(x exchange) int64 { return fields(t, x.header, "RateLimit-Policy")["qovr_unit"]["q"] }
	r := func(x exchange) int64 { return fields(t, x.header, "RateLimit")["qovr_unit"]["r"] }
	for range 5 {
		get(acme)
	}
	if x := get(acme); x.status != 429 {
		t.Fatalf("6th of 5: %d", x.status)
	}
	for _, tc := range []struct{ body, says string }{
		{`{"policy":"qovr_unit","identity":"` + acme + `","rate":"100/1h"}`, `policy qovr_unit is a quota (5/year): its overrides take quota <N>, not rate`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","concurrent":5}`, `is a quota (5/year): its overrides take quota <N>`},
		{`{"policy":"qovr_unit","identity":"` + acme + `"}`, "a limit is required: quota <N>, e.g. quota 50/year"},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"50/month"}`, `quota: "50/month": the period is the policy's (quota 5/year, timezone Europe/Berlin)`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"0"}`, `quota: "0": N must be an integer from 1`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"lots"}`, `quota: "lots": N must be an integer`},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":"9007199254740992"}`, "an override's N is below 9007199254740992"},
		{`{"policy":"qovr_unit","identity":"` + acme + `","quota":50}`, "the body is not"},
		{`{"policy":"qovr_rate","identity":"` + acme + `","quota":"50"}`, "policy qovr_rate is a rate limit: its overrides take rate <N>/<duration> [burst <n>], not quota"},
	} {
		if status, body := adminDo(t, "POST", "/rate_limit/override", tc.body); status != 400 || !strings.Contains(body, tc.says) {
			t.Errorf("POST %s: %d %q, want 400 saying %q", tc.body, status, body, tc.says)
		}
	}
	if x := get(acme); x.status != 429 || q(x) != 5 {
		t.Fatalf("after refused overrides: %d q=%d, want still 429 q=5", x.status, q(x))
	}

	set := func(body string) {
		t.Helper()
		if status, answer := adminDo(t, "POST", "/rate_limit/override", body); status != 200 {
			t.Fatalf("POST %s: %d %s", body, status, answer)
		}
	}
	// Raised to 8: the 5 used count: 3 more, then denied.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"8/year","note":"contract 7"}`)
	if x := get(acme); x.status != 200 || q(x) != 8 || r(x) != 2 {
		t.Fatalf("under quota 8: %d q=%d r=%d, want 200 q=8 r=2", x.status, q(x), r(x))
	}
	if x := get("bob-" + acme); q(x) != 5 {
		t.Fatalf("another identity: q=%d, want the policy's 5", q(x))
	}
	status, body := adminDo(t, "POST", "/rate_limit/inspect", `{"policy":"qovr_unit","identity":"`+acme+`"}`)
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); status != 200 || err != nil || st.Override == nil || st.Override.describe() != "quota 8/year" ||
		st.Quota != 8 || st.Used == nil || *st.Used != 6 || st.Tokens != 2 {
		t.Fatalf("inspect: %d %s", status, body)
	}
	var out bytes.Buffer
	if err := printAnswer(&out, "inspect", []byte(body)); err != nil || !strings.Contains(out.String(), "used      6 of 8; 2 left") || !strings.Contains(out.String(), `override  quota 8/year, until deleted, note "contract 7"`) {
		t.Fatalf("caddy rate-limit inspect prints (%v):\n%s", err, out.String())
	}
	status, body = adminDo(t, "GET", "/rate_limit/overrides?policy=qovr_unit", "")
	var list overridesAnswer
	if err := json.Unmarshal([]byte(body), &list); status != 200 || err != nil || len(list.Overrides) != 1 || list.Overrides[0].describe() != "quota 8/year" || list.Overrides[0].Note != "contract 7" {
		t.Fatalf("overrides: %d %s", status, body)
	}
	// Lowered to 3, below the 6 used: denied at once, nothing left.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"3"}`)
	if x := get(acme); x.status != 429 || q(x) != 3 || r(x) != 0 {
		t.Fatalf("under quota 3 with 6 used: %d q=%d r=%d, want 429 q=3 r=0", x.status, q(x), r(x))
	}
	// Raised again: the count was never reset.
	set(`{"policy":"qovr_unit","identity":"` + acme + `","quota":"7"}`)
	if x := get(acme); x.status != 200 || r(x) != 0 {
		t.Fatalf("under quota 7 with 6 used: %d r=%d, want 200 r=0", x.status, r(x))
	}
	if status, body := adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"qovr_unit","identity":"`+acme+`"}`); status != 200 {
		t.Fatalf("delete: %d %s", status, body)
	}
	if x := get(acme); x.status != 429 || q(x) != 5 {
		t.Fatalf("after the delete: %d q=%d, want 429 q=5", x.status, q(x))
	}
}
