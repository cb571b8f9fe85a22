package ratelimit

import (
	"encoding/json"
	"strings"
	"testing"
)

// TestAdminInspectPlan: inspect reads a bucket under the plan asked for,
// and refuses one the policy does not have.
func TestAdminInspectPlan(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{tenantPolicy("plans_inspect")}}, nil)
	for range 2 {
		serve([]*Handler{h}, nil, "X-Tenant", "acme", "X-Plan", "pro")
	}
	for _, tc := range []struct {
		plan          string
		status        int
		planLabel     string
		burst, tokens int64
		says          string
	}{
		{"", 200, "default", 6, 4, ""},
		{"pro", 200, "pro", 20, 18, ""},
		{"default", 200, "default", 6, 4, ""},
		{"gold", 400, "", 0, 0, `plan "gold": policy "plans_inspect" has no such plan`},
	} {
		status, body := adminDo(t, "POST", "/rate_limit/inspect", `{"policy":"plans_inspect","identity":"acme","plan":"`+tc.plan+`"}`)
		var st bucketState
		_ = json.Unmarshal([]byte(body), &st)
		if status != tc.status || status == 200 && (st.Plan != tc.planLabel || st.Burst != tc.burst || st.Tokens != tc.tokens) || !strings.Contains(body, tc.says) {
			t.Errorf("inspect plan %q: %d %s; want %d plan %q burst %d tokens %d %q", tc.plan, status, body, tc.status, tc.planLabel, tc.burst, tc.tokens, tc.says)
		}
	}
}
