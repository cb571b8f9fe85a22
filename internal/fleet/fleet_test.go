package fleet

import (
	"encoding/json"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestSecretFingerprint(t *testing.T) {
	a, b := SecretFingerprint("change-me"), SecretFingerprint("change-me2")
	for _, tc := range []struct {
		name string
		got  string
		want func(string) bool
	}{
		{"no secret", SecretFingerprint(""), func(s string) bool { return s == NoSecret }},
		{"same secret, same fingerprint", SecretFingerprint("change-me"), func(s string) bool { return s == a }},
		{"another secret, another fingerprint", b, func(s string) bool { return s != a }},
		{"8 characters of base64url", a, func(s string) bool { return len(s) == 8 && !strings.ContainsAny(s, "+/=") }},
		{"not the secret", SecretFingerprint("abcdefgh"), func(s string) bool { return s != "abcdefgh" }},
	} {
		if !tc.want(tc.got) {
			t.Errorf("%s: got %q", tc.name, tc.got)
		}
	}
}

func TestBound(t *testing.T) {
	long := strings.Repeat("é", 200) // 400 bytes
	for _, tc := range []struct {
		name string
		in   string
		same bool
	}{
		{"short", "{client_ip}", true},
		{"at the bound", strings.Repeat("a", maxPart), true},
		{"long", long, false},
	} {
		got := Bound(tc.in)
		if (got == tc.in) != tc.same || len(got) > maxPart || !utf8.ValidString(got) {
			t.Errorf("%s: Bound gave %q (%d bytes)", tc.name, got, len(got))
		}
	}
	if Bound(long+"a") == Bound(long+"b") {
		t.Error("two long strings differing past the cut are bounded alike")
	}
}

func TestEncode(t *testing.T) {
	r := Record{ID: "a", Version: "v0.4.0", Format: "v1", Policies: []Policy{
		{Name: "b", Prefix: "rl:", Limit: "rate 1/1s", Key: "k", Secret: "s"},
		{Name: "a", Prefix: "rl:", Limit: "rate 1/1s", Key: "k", Secret: "s"},
	}}
	raw, d1 := Encode(r)
	back, err := Decode(raw)
	if err != nil || back.Policies[0].Name != "a" || back.Truncated {
		t.Fatalf("decoded %+v, %v: want the policies sorted, not truncated", back, err)
	}
	r.Policies[0], r.Policies[1] = r.Policies[1], r.Policies[0]
	if _, d2 := Encode(r); d2 != d1 {
		t.Errorf("the same policies in another order: digest %s, then %s", d1, d2)
	}
	r.Policies[0].Secret = "t"
	if _, d3 := Encode(r); d3 == d1 {
		t.Error("another secret fingerprint, same digest")
	}

	big := Record{ID: "a"}
	for i := range 2000 {
		big.Policies = append(big.Policies, Policy{Name: fmt.Sprintf("p%04d", i), Prefix: "rl:", Limit: strings.Repeat("x", 40), Key: "{client_ip}", Secret: "s"})
	}
	raw, _ = Encode(big)
	back, err = Decode(raw)
	if err != nil || len(raw) > MaxRecordBytes || !back.Truncated || len(back.Policies) < 100 {
		t.Errorf("2000 policies: %d bytes, %d policies kept, truncated %v, %v", len(raw), len(back.Policies), back.Truncated, err)
	}
}

func pol(name, prefix, limit, key, secret string) Policy {
	return Policy{Name: name, Prefix: prefix, Limit: limit, Key: key, Secret: secret}
}

func TestAgainst(t *testing.T) {
	api := pol("api", "rl:", "rate 100/1m", "{client_ip}", "S1")
	login := pol("login", "rl:", "rate 5/1m", "{client_ip}", "S1")
	self := Record{ID: "self", Policies: []Policy{api, login}}
	with := func(id string, db int, ps ...Policy) Record { return Record{ID: id, DB: db, Policies: ps} }
	change := func(p Policy, f func(*Policy)) Policy { f(&p); return p }

	for _, tc := range []struct {
		name   string
		others []Record
		want   map[string][]string // policy -> differs
	}{
		{"alone", nil, nil},
		{"self only", []Record{self}, nil},
		{"the same config", []Record{with("b", 0, api, login)}, nil},
		{"another key_secret", []Record{with("b", 0, change(api, func(p *Policy) { p.Secret = "S2" }), change(login, func(p *Policy) { p.Secret = "S2" }))},
			map[string][]string{"api": {PartSecret}, "login": {PartSecret}}},
		{"another limit", []Record{with("b", 0, change(api, func(p *Policy) { p.Limit = "rate 200/1m" }), login)},
			map[string][]string{"api": {PartLimit}}},
		{"another key", []Record{with("b", 0, change(api, func(p *Policy) { p.Key = "{http.auth.user.id}" }))},
			map[string][]string{"api": {PartKey}}},
		{"two instances, two ways", []Record{
			with("b", 0, change(api, func(p *Policy) { p.Secret = "S2" })),
			with("c", 0, change(api, func(p *Policy) { p.Limit = "rate 1/1s" })),
		}, map[string][]string{"api": {PartLimit, PartSecret}}},
		{"another key_prefix: another fleet", []Record{with("b", 0, change(api, func(p *Policy) { p.Prefix = "x:"; p.Secret = "S2" }))}, nil},
		{"another database: another fleet", []Record{with("b", 1, change(api, func(p *Policy) { p.Secret = "S2" }))}, nil},
		{"a policy self does not have", []Record{with("b", 0, pol("other", "rl:", "rate 1/1s", "k", "S9"), pol("other", "rl:", "rate 2/1s", "k", "S9"))}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := map[string][]string{}
			for _, s := range Against(self, tc.others) {
				got[s.Policy] = s.Differs
				if !slices.Contains(s.Variants[0].Instances, "self") {
					t.Errorf("%s: self's variant is not first: %+v", s.Policy, s.Variants)
				}
			}
			if len(got) == 0 {
				got = nil
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("disagreements %v, want %v", got, tc.want)
			}
		})
	}
}

func TestFleets(t *testing.T) {
	api := pol("api", "rl:", "rate 100/1m", "{client_ip}", "S1")
	other := api
	other.Secret = "S2"
	staging := api
	staging.Prefix = "staging:"
	records := []Record{
		{ID: "a", Policies: []Policy{api}},
		{ID: "b", Policies: []Policy{other}},
		{ID: "c", Policies: []Policy{staging}},
		{ID: "d", DB: 1, Policies: []Policy{api}},
		{ID: "e", Policies: []Policy{api, staging}},
	}
	got := Fleets(records)
	type brief struct {
		db        int
		prefix    string
		instances string
		splits    string
	}
	var b []brief
	for _, f := range got {
		var s []string
		for _, sp := range f.Splits {
			var vs []string
			for _, v := range sp.Variants {
				vs = append(vs, v.Secret+"="+strings.Join(v.Instances, "+"))
			}
			s = append(s, sp.Policy+":"+strings.Join(sp.Differs, ",")+":"+strings.Join(vs, " "))
		}
		b = append(b, brief{f.DB, f.Prefix, strings.Join(f.Instances, ","), strings.Join(s, ";")})
	}
	want := []brief{
		{0, "rl:", "a,b,e", "api:key_secret:S1=a+e S2=b"},
		{0, "staging:", "c,e", ""},
		{1, "rl:", "d", ""},
	}
	if !reflect.DeepEqual(b, want) {
		t.Errorf("fleets\n got %v\nwant %v", b, want)
	}
}

// TestDecodeOldPlans: a plan's limit that the release before this one
// wrote as a Go struct's dump is read as this one writes it (as a
// Caddyfile says it), so that a mixed fleet agrees on a policy both
// enforce alike.
func TestDecodeOldPlans(t *testing.T) {
	old := `{"id":"a","policies":[{"name":"per_tenant","key_prefix":"rl:","limit":"kind rate, rate 10/1m, burst 10, plan {http.request.header.X-Plan} { pro {Rate:60/1h Burst:20 MaxCost:0 Concurrent:0 Quota:}; team {Rate: Burst:0 MaxCost:5 Concurrent:0 Quota:}; }","key":"{client_ip}","key_secret":"none"}]}`
	r, err := Decode([]byte(old))
	if err != nil {
		t.Fatal(err)
	}
	want := "kind rate, rate 10/1m, burst 10, plan {http.request.header.X-Plan} { pro rate 60/1h burst 20; team cost max 5; }"
	if got := r.Policies[0].Limit; got != want {
		t.Errorf("read %q, want %q", got, want)
	}
	if got := PlanLimit("", 0, 0, 3, ""); got != "concurrent 3" {
		t.Errorf("PlanLimit: %q", got)
	}
}

// TestRecordBesideV040: a policy whose limit the release before this one
// wrote otherwise (Previous) is stored with that form as "limit", which
// v0.4.0 compares with its own, and the Caddyfile's form beside it, which
// this release reads back.
func TestRecordBesideV040(t *testing.T) {
	const (
		now = "kind rate, rate 10/1m, burst 10, plan {x} { pro rate 60/1h burst 20; }"
		was = "kind rate, rate 10/1m, burst 10, plan {x} { pro {Rate:60/1h Burst:20 MaxCost:0 Concurrent:0 Quota:}; }"
	)
	raw, _ := Encode(Record{ID: "a", Policies: []Policy{{Name: "p", Limit: now, Previous: was}, {Name: "q", Limit: "kind rate, rate 1/1s, burst 1"}}})
	var v040 struct {
		Policies []map[string]string `json:"policies"`
	}
	if err := json.Unmarshal(raw, &v040); err != nil {
		t.Fatal(err)
	}
	if p := v040.Policies[0]; p["limit"] != was || p["caddyfile_limit"] != now {
		t.Errorf("stored %q", raw)
	}
	if _, ok := v040.Policies[1]["caddyfile_limit"]; ok {
		t.Errorf("a limit both releases write alike is stored twice: %q", raw)
	}
	r, err := Decode(raw)
	if err != nil || r.Policies[0].Limit != now || r.Policies[0].Previous != "" || r.Policies[1].Limit != "kind rate, rate 1/1s, burst 1" {
		t.Errorf("read back %+v, %v", r.Policies, err)
	}
}
