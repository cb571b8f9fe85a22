package ratelimit

import (
	"context"
	"testing"
)

// TestDebtKept: a settle's debt is kept beyond twice the burst (the
// release before forgave the rest), up to the policy's debt cap: by
// default what the rate refills in a day, at least twice the burst, or
// `settle ... debt <n>`; a usage beyond burst + debt changes nothing more.
func TestDebtKept(t *testing.T) {
	for _, tc := range []struct {
		name       string
		rate       string
		burst      float64
		settle     Settle
		debt, ucap int64
	}{
		{"default: a day of the rate", "200000/1h", 50000, Settle{From: settleOpenAI}, 4_800_000, 4_850_000},
		{"default: at least twice the burst", "10/1h", 1000, Settle{From: settleHeader, Field: "X-Usage"}, 2000, 3000},
		{"debt set", "200000/1h", 50000, Settle{From: settleOpenAI, Debt: 150000}, 150000, 200000},
		{"max set", "200000/1h", 50000, Settle{From: settleOpenAI, Max: 60000}, 4_800_000, 60000},
	} {
		p := &Policy{Name: "llm", Key: "k", Rate: tc.rate, Burst: tc.burst, Cost: "openai", Settle: &tc.settle}
		if err := p.check(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if p.after.debt != tc.debt || p.after.maxUsage != tc.ucap || p.limit.slack != tc.debt*p.limit.interval || p.debtRule() != tc.debt {
			t.Errorf("%s: debt %d, usage cap %d, slack %d, override rule %d; want debt %d, cap %d", tc.name, p.after.debt, p.after.maxUsage, p.limit.slack, p.debtRule(), tc.debt, tc.ucap)
		}
	}
	// Through the handler: one request reserving 100 of a burst of 50,000
	// uses 3,200,000: the bucket owes 3,150,100, all of it.
	c := &clock{t: 1000 * sec}
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "llm", Key: "{http.request.header.X-Api-Key}", Rate: "200000/1h",
		Burst: 50000, Cost: "{http.request.header.X-Max-Tokens}", Settle: &Settle{From: settleHeader, Field: "X-Usage-Tokens"}}}}, newMemoryStore(c.now))
	x := serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Usage-Tokens", "3200000"), "X-Api-Key", "k", "X-Max-Tokens", "100")
	d, _ := h.store.decide(context.Background(), []bucketRequest{{key: h.Policies[0].storageKey(h.hasher, "k"), limit: h.Policies[0].limit, op: opInspect}})
	if x.status != 200 || d.verdicts[0].remaining != 50000-3200000 {
		t.Fatalf("after a usage of 3,200,000: %d tokens (status %d), want %d (v0.3.0: -100,000)", d.verdicts[0].remaining, x.status, 50000-3200000)
	}
	// An absurd usage (a broken upstream) owes the cap, no more: the key
	// is back within a day and a burst's refill.
	serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Usage-Tokens", "900000000000000"), "X-Api-Key", "k2", "X-Max-Tokens", "1")
	d, _ = h.store.decide(context.Background(), []bucketRequest{{key: h.Policies[0].storageKey(h.hasher, "k2"), limit: h.Policies[0].limit, op: opInspect}})
	if d.verdicts[0].remaining != -4_800_000 {
		t.Fatalf("after an absurd usage: %d tokens, want -4,800,000 (the debt cap)", d.verdicts[0].remaining)
	}
}
