package ratelimit

import (
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestMholtSyntaxWarnings: mholt/caddy-ratelimit's subdirectives that have
// no use here adapt, each with one warning at its line that says why it is
// not needed; `distributed` without a redis block says that the limits are
// then per instance.
func TestMholtSyntaxWarnings(t *testing.T) {
	const zone = "\tzone z {\n\t\tkey {remote_host}\n\t\tevents 2\n\t\twindow 5s\n\t}\n"
	for _, tc := range []struct {
		name string
		body string   // the rate_limit block's body; the subdirective is on its line 2 (Caddyfile line 6)
		want []string // substrings of the one warning
	}{
		{"distributed alone", "\tdistributed\n" + zone,
			[]string{"distributed", "mholt/caddy-ratelimit", "per instance", "redis { address"}},
		{"distributed with intervals", "\tdistributed {\n\t\tread_interval 5s\n\t\twrite_interval 5s\n\t\tpurge_age 1m\n\t}\n" + zone,
			[]string{"distributed", "per instance"}},
		{"distributed with a redis block", "\tdistributed\n" + zone + "\tredis {\n\t\taddress 127.0.0.1:6379\n\t}\n",
			[]string{"distributed", "not needed", "the redis block shares every bucket", "exact and atomic"}},
		{"storage", "\tstorage file_system {\n\t\troot /tmp/x\n\t}\n" + zone,
			[]string{"storage", "not needed", "Redis"}},
		{"storage on one line", "\tstorage file_system /tmp/x\n" + zone,
			[]string{"storage", "not needed"}},
		{"sweep_interval", "\tsweep_interval 1m\n" + zone,
			[]string{"sweep_interval", "not needed", "expire"}},
		{"log_key", "\tlog_key\n" + zone,
			[]string{"log_key", "never logged", "{http.rate_limit.policy}"}},
		{"disable_metrics", "\tdisable_metrics\n" + zone,
			[]string{"disable_metrics", "ignored", "never by key", "/metrics"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := collectCaddyfileWarnings(t)
			// The order option keeps the zone's warning about the directive
			// order (TestMholtOrderWarning) out of these.
			input := "{\n\torder rate_limit before basic_auth\n}\n:8080 {\nrate_limit {\n" + tc.body + "}\nrespond ok\n}\n"
			_, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil)
			if err != nil {
				t.Fatalf("adapting:\n%s\n%v", input, err)
			}
			for _, w := range warnings {
				if !strings.Contains(w.Message, "not formatted") {
					t.Errorf("adapter warning: %+v", w)
				}
			}
			if len(*got) != 1 {
				t.Fatalf("want one warning, got %q", *got)
			}
			w := (*got)[0]
			if !strings.HasPrefix(w, "Caddyfile:6: rate_limit: ") {
				t.Errorf("warning %q does not name Caddyfile:6 and the directive", w)
			}
			for _, s := range tc.want {
				if !strings.Contains(w, s) {
					t.Errorf("warning %q does not say %q", w, s)
				}
			}
		})
	}
}

// TestMholtZones: `zone <name> { key, events N, window W }` is the policy
// `rate N/W burst N`; a zone without a key is one bucket for the zone; a
// zone and a policy cannot share a name; a zone takes one match block.
func TestMholtZones(t *testing.T) {
	adapt := func(body string) (*Handler, error) {
		h := new(Handler)
		_ = collectCaddyfileWarnings(t)
		d := caddyfile.NewTestDispenser("rate_limit {\n" + body + "}\n")
		return h, h.UnmarshalCaddyfile(d)
	}

	h, err := adapt("zone a {\n\tevents 3\n\twindow 1m30s\n}\nzone b {\n\tkey {http.request.header.X-Api-Key}\n\twindow 1s\n\tevents 10\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(h.Policies) != 2 {
		t.Fatalf("%d policies", len(h.Policies))
	}
	a, b := h.Policies[0], h.Policies[1]
	if a.Name != "a" || a.Key != "static" || a.Rate != "3/1m30s" || a.Burst != 3 || a.limit.burst != 3 || a.limit.interval != 30_000_000 {
		t.Errorf("zone a: %+v", a)
	}
	if b.Name != "b" || b.Key != "{http.request.header.X-Api-Key}" || b.Rate != "10/1s" || b.Burst != 10 {
		t.Errorf("zone b: %+v", b)
	}

	for _, tc := range []struct{ body, want string }{
		{"zone a {\n\tevents 3\n\twindow 1m\n}\npolicy a {\n\tkey x\n\trate 1/1s\n}\n", `policy "a": defined twice`},
		{"policy a {\n\tkey x\n\trate 1/1s\n}\nzone a {\n\tevents 3\n\twindow 1m\n}\n", `zone "a": a zone or policy of that name is defined already`},
		{"zone a {\n\tmatch {\n\t\tmethod GET\n\t}\n\tmatch {\n\t\tmethod POST\n\t}\n\tevents 3\n\twindow 1m\n}\n", `zone "a": match: defined twice`},
		{"zone a {\n\tevents 3\n\tevents 4\n\twindow 1m\n}\n", `zone "a": events: defined twice`},
		{"zone a {\n\tevents 3\n\twindow -1m\n}\n", `zone "a": window: "-1m" is not a positive duration`},
		{"zone a {\n\tevents 2000000\n\twindow 1s\n}\n", "at most one token per microsecond"},
		{"zone {\n\tevents 3\n\twindow 1m\n}\n", "zone: a name is required"},
		{"zone a {\n\tevents 3\n\twindow 1m\n}\nlog_key now\n", "log_key: takes no value"},
		{"zone a {\n\tevents 3\n\twindow 1m\n}\nsweep_interval\n", "sweep_interval: a value is required"},
		{"zone a {\n\tevents 3\n\twindow 1m\n}\nstorage\n", "storage: a storage module is required"},
		{"distributed\n", "at least one policy is required"},
	} {
		if _, err := adapt(tc.body); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got error %v, want one containing %q", tc.body, err, tc.want)
		}
	}
}

// TestMholtOrderWarning: a zone (mholt/caddy-ratelimit's syntax) in a
// Caddyfile that leaves rate_limit at this module's place in the directive
// order, after basic_auth where mholt's runs before it, gets one warning at
// the zone's line that says how to keep mholt's order; a Caddyfile that
// orders rate_limit itself, or uses only this module's syntax, gets none.
func TestMholtOrderWarning(t *testing.T) {
	const zone = "rate_limit {\n\tzone z {\n\t\tkey {remote_host}\n\t\tevents 2\n\t\twindow 5s\n\t}\n}\n"
	const policy = "rate_limit {\n\tpolicy p {\n\t\tkey {remote_host}\n\t\trate 2/5s\n\t}\n}\n"
	for _, tc := range []struct {
		name, global, site string
		warn               bool
	}{
		{"zone, no order", "", zone, true},
		{"zone, order of another directive", "order header first\n", zone, true},
		{"zone, before basic_auth", "order rate_limit before basic_auth\n", zone, false},
		{"zone, before basicauth (the old name, as mholt's old README)", "order rate_limit before basicauth\n", zone, false},
		{"zone, after basic_auth", "order rate_limit after basic_auth\n", zone, false},
		{"zone, first", "order rate_limit first\n", zone, false},
		{"zone in a route, no order", "", "route {\n" + zone + "respond ok\n}\n", true},
		{"policy, no order", "", policy, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			input := ":8080 {\n" + tc.site + "respond ok\n}\n"
			if tc.global != "" {
				input = "{\n" + tc.global + "}\n" + input
			}
			got := collectCaddyfileWarnings(t)
			if _, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(input), nil); err != nil {
				t.Fatalf("adapting:\n%s\n%v", input, err)
			}
			var order []string
			for _, w := range *got {
				if strings.Contains(w, "basic_auth") {
					order = append(order, w)
				}
			}
			if !tc.warn {
				if len(order) != 0 {
					t.Fatalf("want no warning about the order, got %q", order)
				}
				return
			}
			if len(order) != 1 {
				t.Fatalf("want one warning about the order, got %q", *got)
			}
			zoneLine := strings.Count(input[:strings.Index(input, "zone z")], "\n") + 1
			for _, s := range []string{"Caddyfile:" + strconv.Itoa(zoneLine) + ": rate_limit: ", "mholt/caddy-ratelimit", "before basic_auth",
				"order rate_limit before basic_auth", "route { }", "in the order written", "docs/migrating.md"} {
				if !strings.Contains(order[0], s) {
					t.Errorf("warning %q does not say %q", order[0], s)
				}
			}
		})
	}
}

// TestMholtZonePrefixes: a zone's ipv4_prefix and ipv6_prefix are the
// policy's, mholt's 0 (no grouping) the whole address; out of range or not
// a number fails at the line; a prefix on a key without a client address
// warns that it does nothing.
func TestMholtZonePrefixes(t *testing.T) {
	adapt := func(body string) (*Handler, []string, error) {
		got := collectCaddyfileWarnings(t)
		h := new(Handler)
		err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser("rate_limit {\n" + body + "}\n"))
		return h, *got, err
	}
	h, warnings, err := adapt("zone a {\n\tkey {remote_host}\n\tevents 3\n\twindow 1m\n\tipv6_prefix 48\n\tipv4_prefix 24\n}\n" +
		"zone b {\n\tkey {remote_host}\n\tevents 3\n\twindow 1m\n\tipv6_prefix 0\n\tipv4_prefix 0\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Errorf("warnings: %q", warnings)
	}
	if a, b := h.Policies[0], h.Policies[1]; a.IPv6Prefix != 48 || a.IPv4Prefix != 24 || b.IPv6Prefix != 128 || b.IPv4Prefix != 32 {
		t.Errorf("zone a: /%d /%d, want /48 /24; zone b: /%d /%d, want /128 /32", a.IPv6Prefix, a.IPv4Prefix, b.IPv6Prefix, b.IPv4Prefix)
	}
	for _, tc := range []struct{ line, want string }{
		{"ipv6_prefix 129", `zone "z": ipv6_prefix: "129" must be an integer from 0 to 128`},
		{"ipv4_prefix 33", `zone "z": ipv4_prefix: "33" must be an integer from 0 to 32`},
		{"ipv6_prefix -1", `ipv6_prefix: "-1" must be`},
		{"ipv6_prefix sixty-four", `ipv6_prefix: "sixty-four" must be`},
		{"ipv6_prefix", "ipv6_prefix: a value is required"},
		{"ipv6_prefix 64 64", "ipv6_prefix: one value expected"},
	} {
		_, _, err := adapt("zone z {\n\tkey {remote_host}\n\tevents 3\n\twindow 1m\n\t" + tc.line + "\n}\n")
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "Testfile:6") {
			t.Errorf("%q: got error %v, want one containing %q at Testfile:6", tc.line, err, tc.want)
		}
	}
	_, warnings, err = adapt("zone z {\n\tkey {http.request.header.X-Real-IP}\n\tevents 3\n\twindow 1m\n\tipv6_prefix 64\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 1 || !strings.HasPrefix(warnings[0], "Testfile:6: rate_limit: zone \"z\": ipv6_prefix applies to a client address") ||
		!strings.Contains(warnings[0], "trusted_proxies") {
		t.Errorf("a prefix on a header key: warnings %q", warnings)
	}
}
