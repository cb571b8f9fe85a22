package ratelimit

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"
)

// TestDenialRetryFields: every 429 with a Retry-After sends
// retry-after-ms beside it (the same instant); a denial whose Retry-After
// is past maxRetryWait, every quota denial and a cost that can never fit
// send x-should-retry: false, so that an SDK surfaces them at once instead
// of sleeping; a short wait says nothing (the SDK retries, as it should).
func TestDenialRetryFields(t *testing.T) {
	for _, tc := range []struct {
		name  string
		p     *Policy
		first int // requests admitted before the denial
		retry bool
	}{
		{"a 2 s wait", &Policy{Name: "short", Key: "k", Rate: "1/2s"}, 1, true},
		{"a wait of an hour", &Policy{Name: "long", Key: "k", Rate: "1/1h"}, 1, false},
		{"a quota's denial", &Policy{Name: "daily", Key: "k", Quota: "2/day"}, 2, false},
	} {
		h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{tc.p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		var x exchange
		for i := 0; i <= tc.first; i++ {
			x = serve([]*Handler{h}, nil)
		}
		ra, err := strconv.ParseInt(x.header.Get("Retry-After"), 10, 64)
		if x.status != 429 || err != nil || x.header.Get("Retry-After-Ms") != strconv.FormatInt(1000*ra, 10) {
			t.Fatalf("%s: %d, Retry-After %q, retry-after-ms %q", tc.name, x.status, x.header.Get("Retry-After"), x.header.Get("Retry-After-Ms"))
		}
		if got := x.header.Get("X-Should-Retry"); tc.retry && got != "" || !tc.retry && got != "false" {
			t.Errorf("%s (Retry-After %d): x-should-retry %q", tc.name, ra, got)
		}
	}
	// A cost that can never fit: an operator's override of the key's burst
	// below what a request costs.
	h2 := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "never_fits", Key: "{http.request.header.X-Never}", Rate: "100/1s", Cost: "{http.request.header.X-Cost}"}}}, nil)
	if status, body := adminDo(t, "POST", "/rate_limit/override", `{"policy":"never_fits","identity":"k","rate":"100/1s","burst":10}`); status != 200 {
		t.Fatalf("setting an override: %d %s", status, body)
	}
	t.Cleanup(func() { adminDo(t, "DELETE", "/rate_limit/override", `{"policy":"never_fits","identity":"k"}`) })
	x := serve([]*Handler{h2}, nil, "X-Never", "k", "X-Cost", "50")
	if x.status != 429 || x.header.Get("Retry-After") != "" || x.header.Get("Retry-After-Ms") != "" || x.header.Get("X-Should-Retry") != "false" {
		t.Fatalf("a cost that never fits: %d, Retry-After %q, retry-after-ms %q, x-should-retry %q", x.status, x.header.Get("Retry-After"), x.header.Get("Retry-After-Ms"), x.header.Get("X-Should-Retry"))
	}
}

// TestDenialErrorFormat: error_format shapes a 429's body as the
// provider's rate-limit error, which the official SDKs read (OpenAI's
// error.message, type and code; Anthropic's error.type and message), the
// handler's format or a policy's own; the RateLimit fields stay.
func TestDenialErrorFormat(t *testing.T) {
	deny := func(p *Policy, header ...string) exchange {
		t.Helper()
		h := testHandler(t, &Handler{Jitter: jitterOff(), ErrorFormat: errorFormatOpenAI, Policies: []*Policy{p}}, newMemoryStore((&clock{t: 1000 * sec}).now))
		serve([]*Handler{h}, nil, header...)
		x := serve([]*Handler{h}, nil, header...)
		if x.status != 429 || x.header.Get("RateLimit") == "" {
			t.Fatalf("%v: %d, RateLimit %q", header, x.status, x.header.Get("RateLimit"))
		}
		return x
	}
	x := deny(&Policy{Name: "gpt_tokens", Key: "k", Rate: "10/1h", Cost: "{http.request.header.X-Cost}", Settle: &Settle{From: settleOpenAI}}, "X-Cost", "10")
	var oa struct {
		Error struct {
			Message, Type, Code string
			Param               *string
		}
	}
	if err := json.Unmarshal([]byte(x.body), &oa); err != nil || x.header.Get("Content-Type") != "application/json" || oa.Error.Code != "rate_limit_exceeded" ||
		oa.Error.Type != "tokens" || !strings.Contains(oa.Error.Message, "gpt_tokens") || !strings.Contains(oa.Error.Message, "try again in "+x.header.Get("Retry-After")+"s") {
		t.Fatalf("openai: %s %q (%v)", x.header.Get("Content-Type"), x.body, err)
	}
	x = deny(&Policy{Name: "claude_tokens", Key: "k", Rate: "10/1h", ErrorFormat: errorFormatAnthropic, Cost: "10"})
	var an struct {
		Type  string
		Error struct{ Type, Message string }
	}
	if err := json.Unmarshal([]byte(x.body), &an); err != nil || an.Type != "error" || an.Error.Type != "rate_limit_error" || !strings.Contains(an.Error.Message, "claude_tokens") {
		t.Fatalf("anthropic: %q (%v)", x.body, err)
	}
	x = deny(&Policy{Name: "plain", Key: "k", Rate: "1/1h", ErrorFormat: errorFormatProblem})
	if x.header.Get("Content-Type") != "application/problem+json" || !strings.Contains(x.body, "quota-exceeded") {
		t.Fatalf("problem: %s %q", x.header.Get("Content-Type"), x.body)
	}
	if err := checkErrorFormat("gemini"); err == nil || !strings.Contains(err.Error(), "error_format") {
		t.Fatalf("an unknown format: %v", err)
	}
}
