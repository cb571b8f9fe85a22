package ratelimit

import (
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

func TestParseQuota(t *testing.T) {
	for s, want := range map[string]struct {
		n    int64
		unit calendar.Unit
	}{
		"1000000/month":        {1_000_000, calendar.Month},
		"30/minute":            {30, calendar.Minute},
		"1/year":               {1, calendar.Year},
		"9007199254740992/day": {1 << 53, calendar.Day},
	} {
		n, unit, err := parseQuota(s)
		if err != nil || n != want.n || unit != want.unit {
			t.Errorf("parseQuota(%q) = %d, %v, %v", s, n, unit, err)
		}
	}
	for s, msg := range map[string]string{
		"1000000":              "not N/",
		"0/month":              "from 1 to 9007199254740992",
		"-5/day":               "from 1 to",
		"+5/day":               "from 1 to",
		"1.5/day":              "from 1 to",
		"9007199254740993/day": "from 1 to",
		"5/fortnight":          "minute, hour, day, week, month or year",
		"5/1m":                 "minute, hour, day, week, month or year",
		"5/Month":              "minute, hour, day, week, month or year",
		"5/months":             "minute, hour, day, week, month or year",
	} {
		if _, _, err := parseQuota(s); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("parseQuota(%q): error %v, want one saying %q", s, err, msg)
		}
	}
}
