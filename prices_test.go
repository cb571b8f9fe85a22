package ratelimit

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// provisionJSON provisions a handler from its JSON, as Caddy does, and
// loads it in a whole config, as `caddy validate` does: both errors.
func provisionJSON(t *testing.T, handler string) (provisioned, validated error) {
	t.Helper()
	h := new(Handler)
	if provisioned = caddy.StrictUnmarshalJSON([]byte(handler), h); provisioned == nil {
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if provisioned = h.Provision(ctx); provisioned == nil {
			_ = h.Cleanup()
		}
		cancel()
	}
	withName := `{"handler":"rate_limit",` + strings.TrimPrefix(handler, "{")
	config := `{"apps":{"http":{"servers":{"srv0":{"listen":[":8080"],"routes":[{"handle":[` + withName + `]}]}}}}}`
	cfg := new(caddy.Config)
	if err := caddy.StrictUnmarshalJSON([]byte(config), cfg); err != nil {
		t.Fatal(err)
	}
	return provisioned, caddy.Validate(cfg)
}

// TestPricesFileErrors: a price list that cannot be used fails the load,
// naming the file and the entry (or line).
func TestPricesFileErrors(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct{ name, list, want string }{
		{"negative", `{"gpt-4.1": {"input_cost_per_token": -2e-06, "output_cost_per_token": 8e-06}}`, `entry "gpt-4.1": input_cost_per_token -2e-06 is negative`},
		{"missing", `{"gpt-4.1": {"input_cost_per_token": 2e-06}}`, `entry "gpt-4.1": output_cost_per_token is missing`},
		{"twice", `{"gpt-4.1": {"input_cost_per_token": 2e-06, "output_cost_per_token": 8e-06},
 "gpt-4.1": {"input_cost_per_token": 1e-06, "output_cost_per_token": 8e-06}}`, `entry "gpt-4.1": listed twice`},
		{"not JSON", "{\n\"gpt-4.1\": {\"input_cost_per_token\": 2e-06,,}}", "line 2: not JSON"},
		{"not a number", `{"gpt-4.1": {"input_cost_per_token": "two", "output_cost_per_token": 8e-06}}`, `entry "gpt-4.1": input_cost_per_token two is not a number`},
	} {
		file := filepath.Join(dir, tc.name+".json")
		if err := os.WriteFile(file, []byte(tc.list), 0o600); err != nil {
			t.Fatal(err)
		}
		handler := `{"prices":{"file":"` + file + `"},"policies":[{"name":"team","key":"k","unit":"usd","rate":"3/1h","cost":"openai","max_cost":1}]}`
		p, v := provisionJSON(t, handler)
		for how, err := range map[string]error{"provisioning": p, "caddy validate": v} {
			if err == nil || !strings.Contains(err.Error(), `prices: file "`+file+`": `+tc.want) {
				t.Errorf("%s, %s: %v; want it to name the file and say %q", tc.name, how, err, tc.want)
			}
		}
	}
	p, _ := provisionJSON(t, `{"prices":{"file":"`+filepath.Join(dir, "none.json")+`"},"policies":[{"name":"team","key":"k","rate":"3/1h"}]}`)
	if p == nil || !strings.Contains(p.Error(), "none.json") {
		t.Errorf("a missing file: %v", p)
	}
}

// TestPricesJSONErrors: the JSON config's mistakes of prices and money
// policies, each naming what is wrong.
func TestPricesJSONErrors(t *testing.T) {
	for _, tc := range []struct{ handler, want string }{
		{`{"prices":{"models":[{"model":"a","input":2,"output":8},{"model":"a","input":1,"output":1}]},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, "prices: a: listed twice"},
		{`{"prices":{"models":[{"model":"a","input":-2,"output":8}]},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, `prices: a: input: "-2" is negative`},
		{`{"prices":{"models":[{"model":"a","input":2}]},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, "prices: a: output: a price is required"},
		{`{"prices":{"models":[{"model":"a","input":"2.0000001","output":8}]},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, "more than 6 decimal places"},
		{`{"prices":{"models":[{"model":"a","input":2,"output":8}],"unknown":"b"},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, "prices: unknown b: that model has no price"},
		{`{"prices":{},"policies":[{"name":"p","key":"k","rate":"1/1s"}]}`, "prices: a model's price"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","quota":"500/month","cost":"openai"}]}`, `policy "p": unit usd prices LLM requests (cost openai) with the handler's prices`},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"3/1h","cost":"0.01","settle":{"from":"openai"}}]}`, "(settle openai) with the handler's prices"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"3/1h","burst":1.0000001,"cost":"0.01"}]}`, `burst: "1.0000001" has more than 6 decimal places`},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"3/1h","burst":-1,"cost":"0.01"}]}`, "burst: -1 must be more than 0 dollars"},
		{`{"policies":[{"name":"p","key":"k","rate":"3/1h","burst":2.5}]}`, "burst: 2.5 must be a whole number of tokens"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"0.0000001/1h","cost":"0.01"}]}`, "more than 6 decimal places"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"2/1s","cost":"0.01"}]}`, "more than a dollar a second"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"7/1h","cost":"0.01"}]}`, "nearest exact amounts for this duration are $6.25 and $7.03125"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"3/1h","cost":"0"}]}`, "must be more than 0 dollars"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","rate":"3/1h","cost":"3.000001"}]}`, "cost: $3.000001 is more than max $3.00 or burst $3.00"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","quota":"5/month","cost":"0.01","max_cost":6}]}`, "cost: max 6.00 is more than the quota 5.00"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","quota":"9007199255/month","cost":"0.01"}]}`, "is more than $9007199254.740992"},
		{`{"policies":[{"name":"p","key":"k","unit":"usd","concurrent":3}]}`, "unit: usd is for rate and quota policies"},
		{`{"policies":[{"name":"p","key":"k","rate":"3/1h","settle":{"from":"anthropic","include_usage":true}}]}`, "settle: include_usage is for openai"},
	} {
		p, v := provisionJSON(t, tc.handler)
		for how, err := range map[string]error{"provisioning": p, "caddy validate": v} {
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("%s\n%s: %v\nwant %q", tc.handler, how, err, tc.want)
			}
		}
	}
}

// TestMoneyLimits: a money policy's amounts are micro-dollars, exactly,
// and its bucket is a token bucket of micro-dollars.
func TestMoneyLimits(t *testing.T) {
	for _, tc := range []struct {
		p                         Policy
		interval, burst, max, fix int64
	}{
		// $3 an hour: 1,200 µs a micro-dollar, a burst of $3.
		{Policy{Rate: "3/1h", Cost: "0.01"}, 1200, 3_000_000, 3_000_000, 10_000},
		{Policy{Rate: "1.5/1h", Burst: 1.5, Cost: "0.000001", MaxCost: 0.25}, 2400, 1_500_000, 250_000, 1},
		{Policy{Rate: "5/1d", Burst: 0.5, Cost: "0.5"}, 17_280, 500_000, 500_000, 500_000},
		{Policy{Rate: "1/1s", Cost: "1"}, 1, 1_000_000, 1_000_000, 1_000_000}, // the fastest
		{Policy{Rate: "0.000001/1h", Cost: "0.000001"}, 3_600_000_000, 1, 1, 1},
	} {
		p := tc.p
		p.Name, p.Key, p.Unit = "money", "k", "usd"
		if err := p.check(); err != nil {
			t.Fatalf("%+v: %v", tc.p, err)
		}
		if p.limit.interval != tc.interval || p.limit.burst != tc.burst || p.costs.max != tc.max || p.costs.fixed != tc.fix {
			t.Errorf("%+v: interval %d, burst %d, max %d, cost %d; want %d, %d, %d, %d", tc.p, p.limit.interval, p.limit.burst, p.costs.max, p.costs.fixed, tc.interval, tc.burst, tc.max, tc.fix)
		}
		// Exact: the rate refills its N in its duration, to the microsecond.
		if p.rate.n*p.limit.interval != p.rate.per.Microseconds() {
			t.Errorf("%+v: %d µ$ × %d µs ≠ %s", tc.p, p.rate.n, p.limit.interval, p.rate.per)
		}
		if p.limit.tau()+p.limit.slack >= maxBucketSpan {
			t.Errorf("%+v: beyond 2^51 µs", tc.p)
		}
	}
	q := Policy{Name: "monthly", Key: "k", Unit: "usd", Quota: "500/month", Cost: "openai", MaxCost: 2.5, Settle: &Settle{From: settleOpenAI, Debt: 20}}
	if err := q.check(); err != nil {
		t.Fatal(err)
	}
	if q.limit.burst != 500_000_000 || q.costs.max != 2_500_000 || q.after.debt != 20_000_000 || !q.costs.fromBody {
		t.Errorf("quota 500/month: %d µ$, max %d, debt %d", q.limit.burst, q.costs.max, q.after.debt)
	}
	// A plan of a money policy is in dollars too.
	pl := Policy{Name: "teams", Key: "k", Unit: "usd", Quota: "500/month", Cost: "0.01",
		Plan: &Plan{From: "{x}", Plans: map[string]*PlanLimit{"big": {Quota: "2000.50", MaxCost: 10}}}}
	if err := pl.check(); err != nil {
		t.Fatal(err)
	}
	big, err := pl.planPolicy("big", pl.Plan.Plans["big"])
	if err != nil || big.limit.burst != 2_000_500_000 || big.costs.max != 10_000_000 {
		t.Fatalf("plan big: %v, %d µ$, max %d", err, big.limit.burst, big.costs.max)
	}
}

// TestMoneyBudgetAcrossFormats: one money budget may settle OpenAI's
// responses on one route and Anthropic's on another (its dollars are
// dollars whatever the format); a token budget may not (its tokens are
// counted as its format and weights say).
func TestMoneyBudgetAcrossFormats(t *testing.T) {
	handler := func(unit, from string) string {
		p := `{"name":"team","key":"{http.request.header.X-Team}","rate":"3/1h","cost":"openai","max_cost":1,"settle":{"from":"` + from + `"}` + unit + `}`
		return `{"handler":"rate_limit","prices":{"models":[{"model":"m","input":1,"output":1}]},"policies":[` + p + `]}`
	}
	config := func(a, b string) string {
		route := func(path, h string) string { return `{"match":[{"path":["` + path + `"]}],"handle":[` + h + `]}` }
		return `{"apps":{"http":{"servers":{"srv0":{"listen":[":8080"],"routes":[` + route("/v1/chat/*", a) + `,` + route("/v1/messages", b) + `]}}}}}`
	}
	for _, tc := range []struct {
		unit string
		ok   bool
	}{{`,"unit":"usd"`, true}, {"", false}} {
		cfg := new(caddy.Config)
		if err := caddy.StrictUnmarshalJSON([]byte(config(handler(tc.unit, "openai"), handler(tc.unit, "anthropic"))), cfg); err != nil {
			t.Fatal(err)
		}
		err := caddy.Validate(cfg)
		if (err == nil) != tc.ok || err != nil && !strings.Contains(err.Error(), "defined differently") {
			t.Errorf("unit %q, settled openai on one route and anthropic on the other: %v", tc.unit, err)
		}
	}
}
