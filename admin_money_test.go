package ratelimit

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"
)

// TestAdminMoney: inspect, grant and top of a money policy speak dollars:
// the admin API in micro-dollars with the currency named, the CLI in
// dollars; a grant takes dollars.
func TestAdminMoney(t *testing.T) {
	p := &Policy{Name: "money_admin", Key: "{http.rate_limit.bearer}", Unit: "usd", Rate: "5/24h", Cost: "openai", MaxCost: 1, Settle: &Settle{From: settleOpenAI}}
	q := &Policy{Name: "money_admin_q", Key: "{http.rate_limit.bearer}", Unit: "usd", Quota: "0.002/month", Cost: "openai", MaxCost: 0.001}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Prices: moneyPrices(""), Policies: []*Policy{p, q}}, nil)
	const req = `{"model":"gpt-4.1","messages":[{"role":"user","content":"Say hi"}],"max_tokens":100}`
	up := answering([]byte(`{"model":"gpt-4.1","usage":{"prompt_tokens":1000,"completion_tokens":500}}`), "Content-Type", "application/json")
	for range 3 { // 810 µ$ reserved each (the quota's $0.002 admits 2)
		serveLLM(t, h, req, up, "Authorization", "Bearer acme")
	}
	status, body := adminDo(t, "POST", "/rate_limit/inspect", `{"policy":"money_admin","identity":"acme"}`)
	var st bucketState
	if err := json.Unmarshal([]byte(body), &st); err != nil || status != 200 || st.Currency != "USD" || st.Burst != 5_000_000 || st.Tokens != 5_000_000-2*6000 {
		t.Fatalf("inspect: %d %s", status, body)
	}
	var out bytes.Buffer
	if err := printAnswer(&out, "inspect", []byte(body)); err != nil || !strings.Contains(out.String(), "$4.988 of $5.00; next micro-dollar in") || !strings.Contains(out.String(), "burst $5.00") {
		t.Errorf("inspect printed:\n%s", out.String())
	}
	status, body = adminDo(t, "POST", "/rate_limit/grant", `{"policy":"money_admin","identity":"acme","amount":"0.0015"}`)
	if err := json.Unmarshal([]byte(body), &st); err != nil || status != 200 || *st.Granted != 1500 || st.Tokens != 5_000_000-2*6000+1500 {
		t.Fatalf("grant $0.0015: %d %s", status, body)
	}
	out.Reset()
	if err := printAnswer(&out, "grant", []byte(body)); err != nil || !strings.Contains(out.String(), "granted $0.0015; $4.9895 of $5.00 now") {
		t.Errorf("grant printed: %s", out.String())
	}
	if status, body = adminDo(t, "POST", "/rate_limit/grant", `{"policy":"money_admin","identity":"acme","tokens":5}`); status != 400 || !strings.Contains(body, "give the amount in dollars") {
		t.Errorf("grant of tokens to a money policy: %d %s", status, body)
	}
	if status, body = adminDo(t, "POST", "/rate_limit/grant", `{"policy":"money_admin","identity":"acme","amount":"0.0000001"}`); status != 400 || !strings.Contains(body, "more than 6 decimal places") {
		t.Errorf("grant of a fraction of a micro-dollar: %d %s", status, body)
	}
	// The quota: used and left in dollars; top lists the denied with what
	// they have left.
	status, body = adminDo(t, "POST", "/rate_limit/inspect", `{"policy":"money_admin_q","identity":"acme"}`)
	out.Reset()
	if err := printAnswer(&out, "inspect", []byte(body)); err != nil || !strings.Contains(out.String(), "$0.00162 of $0.002; $0.00038 left") {
		t.Errorf("quota inspect printed: %d %s\n%s", status, body, out.String())
	}
	status, body = adminDo(t, "GET", "/rate_limit/top?policy=money_admin_q", "")
	var top topAnswer
	if err := json.Unmarshal([]byte(body), &top); err != nil || top.Currency != "USD" || len(top.Identities) != 1 || top.Identities[0].Left != "0.00038" || top.Identities[0].Limit != "0.002" {
		t.Fatalf("top: %d %s", status, body)
	}
	out.Reset()
	if err := printAnswer(&out, "top", []byte(body)); err != nil || !strings.Contains(out.String(), "$0.00038 of $0.002") {
		t.Errorf("top printed:\n%s", out.String())
	}
}
