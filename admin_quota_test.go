package ratelimit

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

// TestAdminQuota: inspect, grant and reset through the admin API, on the
// in-process store: used, quota, the period in UTC and the zone; a grant
// gives units back (never below 0 used); a reset zeroes the period.
func TestAdminQuota(t *testing.T) {
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: "admin-quota-test", Key: "{http.request.header.X-User}", Quota: "10/month", Timezone: "Europe/Berlin"},
	}}, nil)
	carol := "carol-" + strconv.FormatInt(time.Now().UnixNano(), 10) // the store is the process's
	for range 4 {
		serve([]*Handler{h}, nil, "X-User", carol)
	}
	call := func(method, path, body string) bucketState {
		t.Helper()
		r := httptest.NewRequest(method, path, strings.NewReader(body))
		w := httptest.NewRecorder()
		if err := (adminAPI{}).serve(w, r); err != nil {
			t.Fatalf("%s %s: %v", method, path, err)
		}
		var st bucketState
		if err := json.Unmarshal(w.Body.Bytes(), &st); err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		action := strings.TrimPrefix(strings.SplitN(path, "?", 2)[0], "/rate_limit/")
		if err := printAnswer(&out, action, w.Body.Bytes()); err != nil {
			t.Fatal(err)
		}
		t.Logf("caddy rate-limit %s:\n%s", action, out.String())
		return st
	}
	st := call("POST", "/rate_limit/inspect", `{"policy":"admin-quota-test","identity":"`+carol+`"}`)
	now := time.Now().In(calendartest.Zone(t, "Europe/Berlin"))
	start := time.Date(now.Year(), now.Month(), 1, 0, 0, 0, 0, now.Location())
	if st.Used == nil || *st.Used != 4 || st.Quota != 10 || st.Tokens != 6 || st.Unit != "month" || st.Kind != "quota" || st.Period == nil ||
		st.Period.StartZone != start.Format(time.RFC3339) || st.Period.Start != start.UTC().Format(time.RFC3339) ||
		st.Period.EndZone != start.AddDate(0, 1, 0).Format(time.RFC3339) || st.Period.Zone != "Europe/Berlin" {
		t.Fatalf("inspect: %+v %+v", st, st.Period)
	}
	if st := call("POST", "/rate_limit/grant", `{"policy":"admin-quota-test","identity":"`+carol+`","tokens":3}`); *st.Used != 1 || *st.Granted != 3 {
		t.Fatalf("grant 3: %+v", st)
	}
	if st := call("POST", "/rate_limit/grant", `{"policy":"admin-quota-test","identity":"`+carol+`","tokens":5}`); *st.Used != 0 || *st.Granted != 1 {
		t.Fatalf("grant 5 of 1 used: %+v, want 1 granted, 0 used", st)
	}
	serve([]*Handler{h}, nil, "X-User", carol)
	if st := call("POST", "/rate_limit/reset", `{"policy":"admin-quota-test","identity":"`+carol+`"}`); *st.Used != 0 || st.Tokens != 10 {
		t.Fatalf("reset: %+v", st)
	}
	x := serve([]*Handler{h}, nil, "X-User", carol)
	if lim := fields(t, x.header, "RateLimit")["admin-quota-test"]; lim["r"] != 9 {
		t.Fatalf("after the reset: %v", lim)
	}
}
