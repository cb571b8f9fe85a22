package ratelimit

import (
	"strings"
	"testing"
)

// TestParseOverrideArgsQuota: the command line's quota limit.
func TestParseOverrideArgsQuota(t *testing.T) {
	req, del, err := parseOverrideArgs(strings.Fields("quota 5000000/month for 30d note contract 123"))
	if err != nil || del || req.Quota != "5000000/month" || req.For != "30d" || req.Note != "contract 123" || req.Rate != "" {
		t.Fatalf("quota 5000000/month for 30d note ...: %+v %v %v", req, del, err)
	}
	if _, _, err := parseOverrideArgs([]string{"quota"}); err == nil || !strings.Contains(err.Error(), "quota: a value is required") {
		t.Fatalf("quota without a value: %v", err)
	}
	if e := (overrideEntry{Kind: "quota", Quota: "5000/month"}); e.describe() != "quota 5000/month" {
		t.Fatalf("describe: %q", e.describe())
	}
}
