package limitsfile

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// YAML and JSON read the same; each wrong entry is an error with its line,
// and the entries around it are read.
func TestParse(t *testing.T) {
	yamlFile := `source: billing
overrides:
  - policy: per_tenant
    identity: acme
    rate: 5000/1m
    burst: 500
    expires: 2026-01-01T00:00:00Z
    note: contract 123
  - {policy: exports, identity: 007, concurrent: 10}
  - {policy: per_tenant, identity: big, rate: 1/1s, burst: 99999999999999999999}
  - {policy: per_tenant, identity: frac, rate: 1/1s, burst: 1.5}
  - {policy: per_tenant, identity: neg, concurrent: -2}
  - {policy: per_tenant, identity: x, rate: 1/1s, for: 72h}
  - {policy: per_tenant, identity: y, rate: 1/1s, colour: blue}
  - {identity: nopolicy, rate: 1/1s}
  - {policy: per_tenant, identity: nolimit}
  - just a string
  - {policy: monthly, identity: acme, quota: 5000000/month, expires: 2026-02-01}
  - {policy: per_tenant, identity: twice, rate: 1/1s, rate: 2/1s}
`
	f, err := Parse([]byte(yamlFile))
	if err != nil {
		t.Fatal(err)
	}
	if f.Source != "billing" {
		t.Errorf("source %q", f.Source)
	}
	want := []Entry{
		{Line: 3, Policy: "per_tenant", Identity: "acme", Rate: "5000/1m", Burst: 500, Expires: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC).UnixMilli(), Note: "contract 123"},
		{Line: 9, Policy: "exports", Identity: "007", Concurrent: 10},
		{Line: 18, Policy: "monthly", Identity: "acme", Quota: "5000000/month", Expires: time.Date(2026, 2, 1, 0, 0, 0, 0, time.UTC).UnixMilli()},
	}
	if fmt.Sprint(f.Entries) != fmt.Sprint(want) {
		t.Errorf("entries\n%v\nwant\n%v", f.Entries, want)
	}
	wantErrs := map[int]string{
		10: "more than 9007199254740992", 11: "not a positive integer", 12: "must be from 1", 13: "give expires",
		14: `unknown "colour"`, 15: "policy: required", 16: "a limit is required", 17: "expected an override", 19: "rate given twice",
	}
	if len(f.Errors) != len(wantErrs) {
		t.Errorf("errors %v", f.Errors)
	}
	for _, e := range f.Errors {
		if w, ok := wantErrs[e.Line]; !ok || !strings.Contains(e.Msg, w) {
			t.Errorf("line %d: %q, want %q", e.Line, e.Msg, w)
		}
	}

	jsonFile := `{"source": "billing",
 "overrides": [
  {"policy": "per_tenant", "identity": "acme", "rate": "5000/1m", "burst": 500, "expires": "2026-01-01T00:00:00Z", "note": "contract 123"},
  {"policy": "exports", "identity": "007", "concurrent": 10},
  {"policy": "per_tenant", "identity": "caf\u00e9 \"q\"", "rate": "1/1s"}
 ]}`
	g, err := Parse([]byte(jsonFile))
	if err != nil {
		t.Fatal(err)
	}
	if len(g.Errors) != 0 || len(g.Entries) != 3 || g.Entries[0].Line != 3 || g.Entries[1].Line != 4 || g.Entries[2].Identity != `café "q"` {
		t.Errorf("JSON: %+v", g)
	}
	if g.Entries[0].Burst != 500 || g.Entries[0].Expires != want[0].Expires {
		t.Errorf("JSON entry %+v", g.Entries[0])
	}
}

// What is not a limits file at all is one error, naming what is wrong.
func TestParseRefused(t *testing.T) {
	for file, msg := range map[string]string{
		"":                                    "empty",
		"[1, 2]":                              "expected a mapping",
		"source: x\n":                         "no overrides",
		"source: 'a b'\noverrides: []":        "source",
		"source: x\noverrides: {a: 1}":        "expected a list",
		"source: x\nsource: y\noverrides: []": "given twice",
		"sauce: x\noverrides: []":             "unknown",
		"source: x\noverrides: [\n":           "not YAML",
		"\x00\x01":                            "not YAML",
	} {
		if _, err := Parse([]byte(file)); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%q: %v, want %q", file, err, msg)
		}
	}
	f, err := Parse([]byte("overrides: []"))
	if err != nil || f.Source != "" || len(f.Entries) != 0 {
		t.Errorf("empty list: %+v %v", f, err)
	}
}

// Marshal writes what Parse reads back.
func TestMarshalRoundTrip(t *testing.T) {
	in := []Entry{
		{Policy: "p", Identity: "a: b # c", Rate: "10/1m", Burst: 3, Expires: time.Date(2027, 5, 6, 7, 8, 9, 0, time.UTC).UnixMilli(), Note: "x \"y\""},
		{Policy: "q", Identity: "123", Concurrent: 4},
		{Policy: "r", Identity: "", Quota: "100"},
	}
	f, err := Parse(Marshal("src", in))
	if err != nil || len(f.Errors) != 0 {
		t.Fatal(err, f.Errors)
	}
	for i := range in {
		in[i].Line = i + 3
	}
	if fmt.Sprint(f.Entries) != fmt.Sprint(in) {
		t.Errorf("%v\nwant\n%v", f.Entries, in)
	}
}

// FuzzParse: no file crashes the parser; every entry read has a policy, a
// limit and numbers in range.
func FuzzParse(f *testing.F) {
	f.Add([]byte("source: x\noverrides:\n  - {policy: p, identity: a, rate: 1/1s, burst: 3}\n"))
	f.Add([]byte(`{"source":"x","overrides":[{"policy":"p","identity":"a","concurrent":2,"expires":"2027-01-01"}]}`))
	f.Add([]byte("overrides: [{policy: p, quota: 5, note: \"n\"}, 3, [1]]"))
	f.Fuzz(func(t *testing.T, data []byte) {
		file, err := Parse(data)
		if err != nil {
			return
		}
		for _, e := range file.Entries {
			if e.Policy == "" || e.Rate == "" && e.Concurrent == 0 && e.Quota == "" || e.Burst < 0 || e.Burst > MaxInteger || e.Concurrent < 0 || e.Concurrent > MaxInteger {
				t.Fatalf("entry %+v", e)
			}
		}
	})
}
