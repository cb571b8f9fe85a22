package price

import (
	"strings"
	"testing"
)

func TestParseUSD(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		err  string
	}{
		{"5", 5_000_000, ""},
		{"1.50", 1_500_000, ""},
		{"0.000001", 1, ""},
		{"2.5", 2_500_000, ""},
		{".5", 500_000, ""},
		{"5.", 5_000_000, ""},
		{"0", 0, ""},
		{"1e-6", 1, ""},
		{"2.5E2", 250_000_000, ""},
		{"9007199254.740992", 1 << 53, ""},
		{"9007199254.740993", 0, "more than $"},
		{"0.0000001", 0, "more than 6 decimal places"},
		{"1.0000000", 1_000_000, ""}, // trailing zeros are exact
		{"-1", 0, "negative"},
		{"-0", 0, ""},
		{"", 0, "not an amount"},
		{".", 0, "not an amount"},
		{"1,5", 0, "not an amount"},
		{"$5", 0, "not an amount"},
		{"+5", 0, "not an amount"},
		{"1e", 0, "not an amount"},
		{"1e999", 0, "not an amount"},
		{"NaN", 0, "not an amount"},
		{"Inf", 0, "not an amount"},
		{"0x10", 0, "not an amount"},
		{"99999999999999999999999", 0, "more than $"},
	} {
		got, err := ParseUSD(tc.in)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("ParseUSD(%q): %v", tc.in, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("ParseUSD(%q) = %d, %v; want an error saying %q", tc.in, got, err, tc.err)
		case tc.err == "" && got != tc.want:
			t.Errorf("ParseUSD(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
}

func TestFormatUSD(t *testing.T) {
	for _, tc := range []struct {
		in   int64
		want string
	}{
		{1_500_000, "1.50"}, {5_000_000, "5.00"}, {1_234_567, "1.234567"}, {100, "0.0001"}, {0, "0.00"},
		{1, "0.000001"}, {-2_500_000, "-2.50"}, {1 << 53, "9007199254.740992"},
	} {
		if got := FormatUSD(tc.in); got != tc.want {
			t.Errorf("FormatUSD(%d) = %q, want %q", tc.in, got, tc.want)
		}
		if tc.in >= 0 {
			back, err := ParseUSD(FormatUSD(tc.in))
			if err != nil || back != tc.in {
				t.Errorf("ParseUSD(FormatUSD(%d)) = %d, %v", tc.in, back, err)
			}
		}
	}
}

func TestParsePerMillion(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want int64
		err  string
	}{
		{"2.50", 2_500_000, ""},
		{"0.075", 75_000, ""},
		{"0.000001", 1, ""},
		{"0", 0, ""},
		{"1000000", MaxPrice, ""},
		{"1000000.000001", 0, "more than 1000000 per million"},
		{"0.0000001", 0, "more than 6 decimal places"},
		{"-3", 0, "negative"},
		{"three", 0, "not a price"},
	} {
		got, err := ParsePerMillion(tc.in)
		switch {
		case tc.err == "" && err != nil:
			t.Errorf("ParsePerMillion(%q): %v", tc.in, err)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("ParsePerMillion(%q) = %d, %v; want an error saying %q", tc.in, got, err, tc.err)
		case tc.err == "" && got != tc.want:
			t.Errorf("ParsePerMillion(%q) = %d, want %d", tc.in, got, tc.want)
		}
	}
	if got := FormatPerMillion(2_500_000); got != "2.5" {
		t.Errorf("FormatPerMillion(2500000) = %q", got)
	}
	if got := FormatPerMillion(3_000_000); got != "3" {
		t.Errorf("FormatPerMillion(3000000) = %q", got)
	}
}
