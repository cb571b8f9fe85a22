package ratelimit

import (
	"testing"
	"time"
)

func TestDecodeOverride(t *testing.T) {
	for _, tc := range []struct {
		v    string
		want override
		ok   bool
	}{
		{"o1 r 12000 500", override{overrideRate, 12000, 500}, true},
		{"o1 c 0 10", override{overrideSlots, 0, 10}, true},
		{"o1 r 1 2251799813685248", override{overrideRate, 1, 1 << 51}, true}, // burst × interval at maxBucketSpan
		{"o1 r 2 2251799813685248", override{}, false},                        // beyond it
		{"o1 r 0 5", override{}, false},
		{"o1 r 5 0", override{}, false},
		{"o1 c 0 0", override{}, false},
		{"o1 r 12000", override{}, false},
		{"o1 r 12000 500 7", override{}, false},
		{"o1 r -1 5", override{}, false},
		{"o1 r +1 5", override{}, false},
		{"o1 r 12345678901234567 5", override{}, false}, // 17 digits: beyond what Lua holds exactly
		{"o1 c 12345678901234567 5", override{}, false},
		{"o1 q 0 5000", override{overrideQuota, 0, 5000}, true},
		{"o1 q 1 5", override{overrideQuota, 1, 5}, true}, // the interval is not read, as for slots
		{"o1 q 0 0", override{}, false},
		{"o1 q 0 9007199254740993", override{}, false}, // beyond 2^53
		{"o2 r 1 5", override{}, false},
		{"1700000000000000:1000", override{}, false}, // a bucket
		{"", override{}, false},
	} {
		got, ok := decodeOverride(tc.v)
		if ok != tc.ok || ok && got != tc.want {
			t.Errorf("decodeOverride(%q) = %+v, %v; want %+v, %v", tc.v, got, ok, tc.want, tc.ok)
		}
		if ok && got.encode() != tc.v {
			t.Errorf("%+v encodes as %q, want %q", got, got.encode(), tc.v)
		}
	}
}

func TestOverrideLimitFor(t *testing.T) {
	sent := limit{interval: 600_000, burst: 100, slack: 5_000_000} // 100/1m, wait 5s
	slots := limit{interval: 30_000_000, burst: 3}                 // 3 slots, lease 30s
	rate := override{kind: overrideRate, interval: 12_000, burst: 500}
	for _, tc := range []struct {
		name         string
		o            override
		sent         limit
		slots        bool
		waitUS, debt int64
		want         limit
	}{
		{"rate, wait", rate, sent, false, 5_000_000, 0, limit{12_000, 500, 5_000_000}},
		{"rate, settle max 800", rate, sent, false, 0, 800, limit{12_000, 500, 800 * 12_000}},
		{"rate, settle twice the burst", rate, sent, false, 1_000, -2, limit{12_000, 500, 1_000 + 1000*12_000}},
		{"rate on slots: ignored", rate, slots, true, 0, 0, slots},
		{"slots", override{kind: overrideSlots, burst: 10}, slots, true, 0, 0, limit{30_000_000, 10, 0}},
		{"slots on a rate bucket: ignored", override{kind: overrideSlots, burst: 10}, sent, false, 0, 0, sent},
		{"debt beyond the span: capped", override{kind: overrideRate, interval: 1 << 20, burst: 1 << 30}, sent, false, 0, -2, limit{1 << 20, 1 << 30, 1<<51 - 1<<50}},
		{"wait beyond the span: capped", override{kind: overrideRate, interval: 1 << 20, burst: 1 << 31}, sent, false, 1 << 40, 0, limit{1 << 20, 1 << 31, 0}},
	} {
		if got := tc.o.limitFor(tc.sent, tc.slots, tc.waitUS, tc.debt); got != tc.want {
			t.Errorf("%s: %+v, want %+v", tc.name, got, tc.want)
		}
	}
}

// TestServeHTTPQuotaOverrideSettle: a quota's override applies to what a
// settle charges after the response, and to what the fields and the
// placeholders predict of it: reserved 5 of an override's 100, settled at
// 2, 98 left (the policy's own N is 10).
func TestServeHTTPQuotaOverrideSettle(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "qovr_settle", Key: "{http.request.header.X-User}", Quota: "10/year", Cost: "5", Settle: &Settle{From: settleHeader, Field: "X-Used"}},
	}}, nil)
	dana := "dana-" + time.Now().Format("150405.000000")
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"qovr_settle","identity":"`+dana+`","quota":"100"}`); status != 200 {
		t.Fatalf("setting the override: %d %s", status, body)
	}
	defer adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"qovr_settle","identity":"`+dana+`"}`)
	x := serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Used", "2"), "X-User", dana)
	pol, lim := fields(t, x.header, "RateLimit-Policy")["qovr_settle"], fields(t, x.header, "RateLimit")["qovr_settle"]
	if x.status != 200 || pol["q"] != 100 || lim["r"] != 98 || x.vars["remaining"] != "98" {
		t.Fatalf("settled at 2 under quota 100: %d q=%d r=%d remaining %q, want 200 q=100 r=98 remaining 98", x.status, pol["q"], lim["r"], x.vars["remaining"])
	}
	if x := serve([]*Handler{h}, nil, "X-User", dana); fields(t, x.header, "RateLimit")["qovr_settle"]["r"] != 93 {
		t.Fatalf("the next reservation: %v, want r=93 (98 - 5: the settle was made under the override)", fields(t, x.header, "RateLimit")["qovr_settle"])
	}
}
