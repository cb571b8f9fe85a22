package ratelimit

import (
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
		body string   // the rate_limit block's body; the subdirective is on its line 2 (Caddyfile line 3)
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
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := collectCaddyfileWarnings(t)
			input := ":8080 {\nrate_limit {\n" + tc.body + "}\nrespond ok\n}\n"
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
			if !strings.HasPrefix(w, "Caddyfile:3: rate_limit: ") {
				t.Errorf("warning %q does not name Caddyfile:3 and the directive", w)
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
