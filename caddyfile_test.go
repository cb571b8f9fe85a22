package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"

	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// respond, basic_auth, forward_auth...

// go test -run TestCaddyfileAdapt -update rewrites the JSON half of every
// JSON fixture with what the adapter produces now. Review the diff by eye
// before keeping it: the fixtures are the expected output, not a recording.
var updateFixtures = flag.Bool("update", false, "rewrite the expected JSON of testdata/caddyfile_adapt/*.caddyfiletest")

const fixtureSeparator = "----------"

// TestCaddyfileAdapt runs the fixtures of testdata/caddyfile_adapt in
// Caddy's caddyfile_adapt style: a Caddyfile, a line of ----------, then
// either the exact pretty JSON that `caddy adapt` gives, or (for a mistake)
// a substring of the error it reports. Every JSON result is then loaded the
// way Caddy loads a config (strict decoding, provisioning), to show that the
// JSON form is valid and equivalent.
func TestCaddyfileAdapt(t *testing.T) {
	files, err := filepath.Glob(filepath.Join("testdata", "caddyfile_adapt", "*.caddyfiletest"))
	if err != nil {
		t.Fatal(err)
	}
	if len(files) == 0 {
		t.Fatal("no fixtures in testdata/caddyfile_adapt")
	}
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			data, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			text := strings.ReplaceAll(string(data), "\r\n", "\n")
			before, after, ok := strings.Cut(text, "\n"+fixtureSeparator+"\n")
			if !ok {
				t.Fatalf("%s: no line of %s between the Caddyfile and the expected result", file, fixtureSeparator)
			}
			caddyfileText := strings.TrimSpace(before) + "\n"
			expected := strings.TrimSpace(after)

			adapter := caddyconfig.GetAdapter("caddyfile")
			if adapter == nil {
				t.Fatal("no caddyfile adapter")
			}
			ours := collectCaddyfileWarnings(t)
			adapted, warnings, adaptErr := adapter.Adapt([]byte(caddyfileText), nil)

			if !strings.HasPrefix(expected, "{") {
				// An error fixture.
				if expected == "" {
					t.Fatalf("%s: empty expected error", file)
				}
				if adaptErr == nil {
					t.Fatalf("%s: expected an error containing\n\t%s\nbut the Caddyfile adapted without error", file, expected)
				}
				if !strings.Contains(adaptErr.Error(), expected) {
					t.Fatalf("%s: expected an error containing\n\t%s\nbut got\n\t%s", file, expected, adaptErr)
				}
				return
			}

			if adaptErr != nil {
				t.Fatalf("%s: adapting: %v", file, adaptErr)
			}
			// Fixtures built from mholt/caddy-ratelimit's README keep its
			// examples as written: they may warn that the input is not
			// `caddy fmt` formatted (its README aligns values), and that
			// subdirectives of that module are ignored. No other fixture
			// may warn.
			mholt := strings.HasPrefix(filepath.Base(file), "mholt_")
			for _, w := range warnings {
				if mholt && strings.Contains(w.Message, "Caddyfile input is not formatted") {
					continue
				}
				t.Errorf("%s: warning: %s:%d: %s: %s", file, w.File, w.Line, w.Directive, w.Message)
			}
			for _, w := range *ours {
				if mholt {
					t.Logf("%s: expected warning: %s", file, w)
				} else {
					t.Errorf("%s: warning: %s", file, w)
				}
			}
			var pretty bytes.Buffer
			if err := json.Indent(&pretty, adapted, "", "\t"); err != nil {
				t.Fatalf("%s: indenting the adapted JSON: %v", file, err)
			}
			got := pretty.String()

			if got != expected {
				if *updateFixtures {
					out := strings.TrimRight(before, " \t\n") + "\n" + fixtureSeparator + "\n" + got + "\n"
					if err := os.WriteFile(file, []byte(out), 0o644); err != nil {
						t.Fatal(err)
					}
					t.Logf("%s: rewrote the expected JSON; review it before keeping it", file)
				} else {
					t.Errorf("%s: the adapted JSON differs from the fixture (- fixture, + adapted):\n%s", file, lineDiff(expected, got))
				}
			}

			checkAdaptedConfig(t, file, adapted)
		})
	}
}

// collectCaddyfileWarnings collects, until the test ends, the warnings the
// parser logs at adapt time (about ignored mholt/caddy-ratelimit
// subdirectives), as "<file>:<line>: <message>".
func collectCaddyfileWarnings(t *testing.T) *[]string {
	t.Helper()
	var got []string
	old := warnCaddyfile
	warnCaddyfile = func(file string, line int, msg string) {
		got = append(got, fmt.Sprintf("%s:%d: %s", file, line, msg))
	}
	t.Cleanup(func() { warnCaddyfile = old })
	return &got
}

// checkAdaptedConfig loads adapted JSON as Caddy does: strict decoding of
// the whole config and of each rate_limit handler, and provisioning. It
// does not start listeners; Redis clients connect lazily, so the addresses
// in fixtures need not be reachable.
func checkAdaptedConfig(t *testing.T, file string, adapted []byte) {
	t.Helper()

	cfg := new(caddy.Config)
	if err := caddy.StrictUnmarshalJSON(adapted, cfg); err != nil {
		t.Fatalf("%s: decoding the adapted config: %v", file, err)
	}
	if err := caddy.Validate(cfg); err != nil {
		t.Fatalf("%s: caddy.Validate of the adapted config: %v", file, err)
	}

	handlers, err := findHandlers(adapted) // check.go
	if err != nil {
		t.Fatal(err)
	}
	if len(handlers) == 0 {
		t.Fatalf("%s: no rate_limit handler in the adapted JSON", file)
	}
	for i, found := range handlers {
		// Round trip: decoding the handler's JSON and encoding it again
		// gives the same JSON, so no field is unknown or lost.
		in := found.raw
		var raw map[string]any
		if err := json.Unmarshal(in, &raw); err != nil {
			t.Fatal(err)
		}
		h := new(Handler)
		if err := caddy.StrictUnmarshalJSON(in, h); err != nil {
			t.Fatalf("%s: rate_limit handler %d: decoding: %v", file, i, err)
		}
		out, err := json.Marshal(h)
		if err != nil {
			t.Fatal(err)
		}
		var back any
		if err := json.Unmarshal(out, &back); err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(map[string]any(raw), back) {
			t.Errorf("%s: rate_limit handler %d does not survive a JSON round trip:\n in: %s\nout: %s", file, i, in, out)
		}

		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := h.Provision(ctx); err != nil {
			cancel()
			t.Fatalf("%s: rate_limit handler %d: provisioning: %v", file, i, err)
		}
		if len(h.Policies) == 0 || h.store == nil {
			t.Errorf("%s: rate_limit handler %d: provisioned without policies or store", file, i)
		}
		for _, p := range h.Policies {
			if p.Shed != nil {
				checkShedProvisioned(t, fmt.Sprintf("%s: rate_limit handler %d", file, i), p)
				continue
			}
			for _, q := range append([]*Policy{p}, slices.Collect(maps.Values(p.plans))...) {
				ok := q.quota != nil || q.limit.interval >= 1 && (q.rate.n >= 1 || p.Concurrent > 0) // a quota has N, no rate
				if !ok || q.limit.burst < 1 || q.costs.max < 1 || !validOnError(q.onError) {
					t.Errorf("%s: rate_limit handler %d: policy %q (plan %q) provisioned with bad numbers: %+v", file, i, q.Name, q.planName, q.limit)
				}
			}
		}
		if err := h.Cleanup(); err != nil {
			t.Errorf("%s: rate_limit handler %d: cleanup: %v", file, i, err)
		}
		cancel()
	}
}

// lineDiff is a small line diff (longest common subsequence) that shows the
// changed lines with two lines of context.
func lineDiff(a, b string) string {
	x, y := strings.Split(a, "\n"), strings.Split(b, "\n")
	n, m := len(x), len(y)
	lcs := make([][]int, n+1)
	for i := range lcs {
		lcs[i] = make([]int, m+1)
	}
	for i := n - 1; i >= 0; i-- {
		for j := m - 1; j >= 0; j-- {
			if x[i] == y[j] {
				lcs[i][j] = lcs[i+1][j+1] + 1
			} else {
				lcs[i][j] = max(lcs[i+1][j], lcs[i][j+1])
			}
		}
	}
	type line struct {
		op   byte
		text string
	}
	var lines []line
	i, j := 0, 0
	for i < n || j < m {
		switch {
		case i < n && j < m && x[i] == y[j]:
			lines = append(lines, line{' ', x[i]})
			i++
			j++
		case i < n && (j == m || lcs[i+1][j] >= lcs[i][j+1]):
			lines = append(lines, line{'-', x[i]})
			i++
		default:
			lines = append(lines, line{'+', y[j]})
			j++
		}
	}
	const context = 2
	var sb strings.Builder
	lastShown := -1
	for k, l := range lines {
		show := false
		for c := max(0, k-context); c <= min(len(lines)-1, k+context); c++ {
			if lines[c].op != ' ' {
				show = true
				break
			}
		}
		if !show {
			continue
		}
		if lastShown >= 0 && k > lastShown+1 {
			sb.WriteString("  ...\n")
		}
		fmt.Fprintf(&sb, "%c %s\n", l.op, l.text)
		lastShown = k
	}
	return sb.String()
}

// mark ends the Caddyfile line an error must point at. Where a mistake
// involves a block (a missing address, a cross-field check), several lines
// may be marked: any of them is right.
const mark = "# <-"

// base is a valid policy for the cases about something else.
const base = "policy ok {\n\tkey {client_ip}\n\trate 10/1s\n}\n"

// redisBlock wraps a redis subdirective in a valid redis block.
func redisBlock(line string) string {
	return "redis {\n\taddress 127.0.0.1:6379\n\t" + line + "\n}\n" + base
}

// inPolicy puts a subdirective line into a valid policy.
func inPolicy(line string) string {
	return "policy api {\n\tkey {client_ip}\n\trate 10/1s\n\t" + line + "\n}\n"
}

// inQuota puts a subdirective line into a valid quota policy (of 5 a day).
func inQuota(line string) string {
	return "policy q {\n\tkey {client_ip}\n\tquota 5/day\n\t" + line + "\n}\n"
}

// redisQuota is inQuota with a redis block, which durable needs.
func redisQuota(line string) string {
	return "redis {\n\taddress 127.0.0.1:6379\n}\n" + inQuota(line)
}

// planBlock is a plan block with the plan lines given.
func planBlock(lines string) string {
	return "plan {http.request.header.X-Plan} {\n\t\t" + lines + "\n\t}"
}

// inZone puts a subdirective line into a valid mholt-style zone.
func inZone(line string) string {
	return "zone z {\n\tevents 10\n\twindow 1s\n\t" + line + "\n}\n"
}

// TestCaddyfileErrors feeds every subdirective of the handler, of its redis
// block, of a policy and of mholt/caddy-ratelimit's syntax that the parser
// accepts (zone, distributed, storage, sweep_interval, log_key,
// disable_metrics) a malformed
// value (missing, extra, of the wrong
// type or out of range) through the real Caddyfile adapter, and requires an
// error that names the subdirective and the line of the mistake, in
// Caddy's own format ("..., at Caddyfile:<line>").
func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct {
		sub  string // what the error must name
		name string
		body string // the rate_limit block's body; the wrong line ends in mark
	}{
		// The handler's subdirectives.
		{"redis", "extra argument", "redis 127.0.0.1:6379 { " + mark + "\n\taddress 127.0.0.1:6379\n}\n" + base},
		{"redis", "no address", "redis { " + mark + "\n\tdb 1\n}\n" + base},
		{"redis", "no block", "redis " + mark + "\n" + base},
		{"redis", "twice", "redis {\n\taddress a:1\n}\nredis { " + mark + "\n\taddress b:1\n}\n" + base},
		{"key_secret", "missing value", "key_secret " + mark + "\n" + base},
		{"key_secret", "extra value", "key_secret a b " + mark + "\n" + base},
		{"key_secret", "empty", "key_secret \"\" " + mark + "\n" + base},
		{"on_error", "missing value", "on_error " + mark + "\n" + base},
		{"on_error", "extra value", "on_error fail_open fail_closed " + mark + "\n" + base},
		{"on_error", "wrong value", "on_error retry " + mark + "\n" + base},
		{"jitter", "missing value", "jitter " + mark + "\n" + base},
		{"jitter", "extra value", "jitter 20% 30% " + mark + "\n" + base},
		{"jitter", "not a number", "jitter lots " + mark + "\n" + base},
		{"jitter", "negative", "jitter -5% " + mark + "\n" + base},
		{"jitter", "bare number above 1", "jitter 20 " + mark + "\n" + base},
		{"jitter", "above 1000%", "jitter 2000% " + mark + "\n" + base},
		{"jitter", "NaN", "jitter NaN% " + mark + "\n" + base},
		{"jitter", "infinite", "jitter Inf% " + mark + "\n" + base},
		{"headers", "missing value", "headers " + mark + "\n" + base},
		{"headers", "extra value", "headers draft off " + mark + "\n" + base},
		{"headers", "wrong value", "headers ietf " + mark + "\n" + base},
		{"error_format", "missing value", "error_format " + mark + "\n" + base},
		{"error_format", "wrong value", "error_format gemini " + mark + "\n" + base},
		{"error_format", "in a policy, wrong value", inPolicy("error_format json " + mark)},
		{"shadow", "extra value", "shadow yes " + mark + "\n" + base},
		{"instances", "missing value", "instances " + mark + "\n" + base},
		{"instances", "extra value", "instances 2 3 " + mark + "\n" + base},
		{"instances", "not a number", "instances two " + mark + "\n" + base},
		{"instances", "zero", "instances 0 " + mark + "\n" + base},
		{"instances", "fractional", "instances 1.5 " + mark + "\n" + base},
		// 10^10 instances overflowed the local fallback's interval (int64
		// µs), and the in-process bucket then admitted every request.
		{"instances", "overflowing the local bucket", "on_error local\ninstances 10000000000 " + mark + "\n" + base},
		{"ipv6_prefix", "missing value", "ipv6_prefix " + mark + "\n" + base},
		{"ipv6_prefix", "extra value", "ipv6_prefix 64 48 " + mark + "\n" + base},
		{"ipv6_prefix", "zero", "ipv6_prefix 0 " + mark + "\n" + base},
		{"ipv6_prefix", "above 128", "ipv6_prefix 129 " + mark + "\n" + base},
		{"ipv6_prefix", "negative", "ipv6_prefix -64 " + mark + "\n" + base},
		{"ipv6_prefix", "not a number", "ipv6_prefix /64 " + mark + "\n" + base},
		{"ipv6_prefix", "fractional", "ipv6_prefix 56.5 " + mark + "\n" + base},
		{"ipv6_prefix", "twice", "ipv6_prefix 64\nipv6_prefix 48 " + mark + "\n" + base},
		{"ipv4_prefix", "missing value", "ipv4_prefix " + mark + "\n" + base},
		{"ipv4_prefix", "zero", "ipv4_prefix 0 " + mark + "\n" + base},
		{"ipv4_prefix", "above 32", "ipv4_prefix 33 " + mark + "\n" + base},
		{"ipv4_prefix", "not a number", "ipv4_prefix 255.255.255.0 " + mark + "\n" + base},
		{"policy", "no name", "policy { " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"policy", "extra argument", "policy a b { " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"policy", "bad name", "policy \"per user\" { " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"policy", "name too long", "policy " + strings.Repeat("p", 65) + " { " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"policy", "no block", "policy a " + mark + "\n"},
		{"policy", "twice", base + "policy ok { " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"policy", "none at all", "key_secret s\n"}, // the rate_limit line is marked by the test
		{"bogus", "unknown subdirective", "bogus 1 " + mark + "\n" + base},

		// mholt/caddy-ratelimit's subdirectives, accepted for migration.
		{"zone", "no name", "zone { " + mark + "\n\tevents 1\n\twindow 1s\n}\n"},
		{"zone", "extra argument", "zone a b { " + mark + "\n\tevents 1\n\twindow 1s\n}\n"},
		{"zone", "bad name", "zone \"a b\" { " + mark + "\n\tevents 1\n\twindow 1s\n}\n"},
		{"zone", "no events", "zone z { " + mark + "\n\twindow 1s\n}\n"},
		{"zone", "no window", "zone z { " + mark + "\n\tevents 1\n}\n"},
		{"zone", "same name as a policy", base + "zone ok { " + mark + "\n\tevents 1\n\twindow 1s\n}\n"},
		{"events", "missing value", inZone("events " + mark)},
		{"events", "extra value", inZone("events 1 2 " + mark)},
		{"events", "zero", inZone("events 0 " + mark)},
		{"events", "not a number", inZone("events many " + mark)},
		{"events", "twice", inZone("events 5 " + mark)},
		{"events", "faster than one per microsecond", "zone z { " + mark + "\n\tevents 1000001 " + mark + "\n\twindow 1s " + mark + "\n}\n"},
		{"window", "missing value", inZone("window " + mark)},
		{"window", "extra value", inZone("window 1s 2s " + mark)},
		{"window", "not a duration", inZone("window daily " + mark)},
		{"window", "zero", inZone("window 0s " + mark)},
		{"window", "twice", inZone("window 1m " + mark)},
		{"key", "zone: missing value", inZone("key " + mark)},
		{"key", "zone: extra value", inZone("key a b " + mark)},
		{"key", "zone: twice", inZone("key a\n\tkey b " + mark)},
		{"match", "zone: twice", inZone("match path /a\n\tmatch path /b " + mark)},
		{"match", "zone: unknown matcher", inZone("match no_such_matcher foo " + mark)},
		{"rate", "zone: unknown subdirective", inZone("rate 1/1s " + mark)},
		{"distributed", "extra argument", "distributed yes " + mark + "\n" + base},
		{"read_interval", "missing value", "distributed {\n\tread_interval " + mark + "\n}\n" + base},
		{"read_interval", "not a duration", "distributed {\n\tread_interval often " + mark + "\n}\n" + base},
		{"write_interval", "extra value", "distributed {\n\twrite_interval 1s 2s " + mark + "\n}\n" + base},
		{"purge_age", "not a duration", "distributed {\n\tpurge_age old " + mark + "\n}\n" + base},
		{"sync_interval", "distributed: unknown subdirective", "distributed {\n\tsync_interval 1s " + mark + "\n}\n" + base},
		{"storage", "missing module", "storage " + mark + "\n" + base},
		{"sweep_interval", "missing value", "sweep_interval " + mark + "\n" + base},
		{"sweep_interval", "extra value", "sweep_interval 1m 2m " + mark + "\n" + base},
		{"sweep_interval", "not a duration", "sweep_interval often " + mark + "\n" + base},
		{"sweep_interval", "zero", "sweep_interval 0s " + mark + "\n" + base},
		{"log_key", "extra value", "log_key yes " + mark + "\n" + base},
		{"disable_metrics", "extra value", "disable_metrics yes " + mark + "\n" + base},
		{"ipv6_prefix", "zone: above 128", inZone("ipv6_prefix 129 " + mark)},
		{"ipv6_prefix", "zone: not a number", inZone("ipv6_prefix all " + mark)},
		{"ipv6_prefix", "zone: twice", inZone("ipv6_prefix 64\n\tipv6_prefix 56 " + mark)},
		{"ipv4_prefix", "zone: above 32", inZone("ipv4_prefix 33 " + mark)},
		{"ipv4_prefix", "zone: missing value", inZone("ipv4_prefix " + mark)},

		// The redis block's subdirectives.
		{"address", "missing value", "redis {\n\taddress " + mark + "\n}\n" + base},
		{"cluster", "extra value", redisBlock("cluster yes " + mark)},
		{"sentinel", "missing value", redisBlock("sentinel " + mark)},
		{"sentinel", "extra value", redisBlock("sentinel a b " + mark)},
		{"sentinel", "with cluster", "redis { " + mark + "\n\taddress a:1\n\tcluster\n\tsentinel m " + mark + "\n}\n" + base},
		{"username", "missing value", redisBlock("username " + mark)},
		{"username", "extra value", redisBlock("username a b " + mark)},
		{"password", "missing value", redisBlock("password " + mark)},
		{"password", "extra value", redisBlock("password a b " + mark)},
		{"db", "missing value", redisBlock("db " + mark)},
		{"db", "extra value", redisBlock("db 1 2 " + mark)},
		{"db", "not a number", redisBlock("db one " + mark)},
		{"db", "negative", redisBlock("db -1 " + mark)},
		{"db", "fractional", redisBlock("db 1.5 " + mark)},
		{"tls", "unknown option", redisBlock("tls verify_nothing " + mark)},
		{"ca", "tls: missing value", redisBlock("tls ca " + mark)},
		{"server_name", "tls: missing value", redisBlock("tls insecure_skip_verify server_name " + mark)},
		{"timeout", "missing value", redisBlock("timeout " + mark)},
		{"timeout", "extra value", redisBlock("timeout 1s 2s " + mark)},
		{"timeout", "not a duration", redisBlock("timeout soon " + mark)},
		{"timeout", "zero", redisBlock("timeout 0 " + mark)},
		{"timeout", "negative", redisBlock("timeout -1s " + mark)},
		{"pool_size", "missing value", redisBlock("pool_size " + mark)},
		{"pool_size", "extra value", redisBlock("pool_size 1 2 " + mark)},
		{"pool_size", "not a number", redisBlock("pool_size many " + mark)},
		{"pool_size", "zero", redisBlock("pool_size 0 " + mark)},
		// go-redis allocates for the whole pool when the client is made:
		// 10^8 exhausted memory (fatal error: runtime: out of memory) when
		// Caddy loaded the config, or reloaded into it.
		{"pool_size", "too large to allocate", redisBlock("pool_size 100000000 " + mark)},
		{"key_prefix", "missing value", redisBlock("key_prefix " + mark)},
		{"key_prefix", "extra value", redisBlock("key_prefix a b " + mark)},
		{"nodes", "unknown subdirective", redisBlock("nodes a:1 " + mark)},

		// A policy's subdirectives.
		{"match", "unknown matcher", "policy api {\n\tmatch { " + mark + "\n\t\tno_such_matcher foo " + mark + "\n\t} " + mark + "\n\tkey k\n\trate 1/1s\n}\n"},
		{"match", "inline unknown matcher", inPolicy("match no_such_matcher foo " + mark)},
		{"match", "twice", inPolicy("match path /a\n\tmatch path /b " + mark)},
		{"key", "missing value", inPolicy("key " + mark)},
		{"key", "extra value", inPolicy("key a b " + mark)},
		{"key", "absent", "policy api { " + mark + "\n\trate 1/1s\n}\n"},
		{"rate", "missing value", inPolicy("rate " + mark)},
		{"rate", "extra value", inPolicy("rate 1/1s 2/1s " + mark)},
		{"rate", "no slash", inPolicy("rate 100 " + mark)},
		{"rate", "zero", inPolicy("rate 0/1s " + mark)},
		{"rate", "negative", inPolicy("rate -1/1s " + mark)},
		{"rate", "fractional", inPolicy("rate 1.5/1s " + mark)},
		{"rate", "hex", inPolicy("rate 0x10/1s " + mark)},
		{"rate", "overflowing", inPolicy("rate 99999999999999999999/1s " + mark)},
		{"rate", "bad duration", inPolicy("rate 1/1fortnight " + mark)},
		{"rate", "zero duration", inPolicy("rate 1/0s " + mark)},
		{"rate", "negative duration", inPolicy("rate 1/-1s " + mark)},
		{"rate", "above one per microsecond", inPolicy("rate 1000001/1s " + mark)},
		{"rate", "absent", "policy api { " + mark + "\n\tkey k\n}\n"},
		{"burst", "missing value", inPolicy("burst " + mark)},
		{"burst", "extra value", inPolicy("burst 1 2 " + mark)},
		{"burst", "zero", inPolicy("burst 0 " + mark)},
		{"burst", "negative", inPolicy("burst -1 " + mark)},
		{"burst", "fractional", inPolicy("burst 1.5 " + mark)},
		{"burst", "not a number", inPolicy("burst lots " + mark)},
		{"burst", "overflowing", inPolicy("burst 99999999999999999999 " + mark)},
		// Too large for the rate: a check of two fields, at the policy's
		// line or the burst's.
		{"burst", "too slow to refill", "policy api { " + mark + "\n\tkey k\n\trate 1/1s\n\tburst 9223372036854775807 " + mark + "\n}\n"},
		{"cost", "missing value", inPolicy("cost " + mark)},
		{"cost", "extra value", inPolicy("cost 1 2 " + mark)},
		{"cost", "zero", inPolicy("cost 0 " + mark)},
		{"cost", "negative", inPolicy("cost -1 " + mark)},
		{"cost", "fractional", inPolicy("cost 1.5 " + mark)},
		{"cost", "hex", inPolicy("cost 0x2 " + mark)},
		{"cost", "not a number", inPolicy("cost lots " + mark)},
		{"cost", "max without value", inPolicy("cost {http.request.header.X-Cost} max " + mark)},
		{"cost", "max not a number", inPolicy("cost {http.request.header.X-Cost} max lots " + mark)},
		{"cost", "max zero", inPolicy("cost {http.request.header.X-Cost} max 0 " + mark)},
		{"cost", "unbounded neither max nor refuse", inPolicy("cost openai max 10 unbounded sometimes " + mark)},
		{"cost", "unbounded without openai", inPolicy("cost 1 unbounded refuse " + mark)},
		{"cost", "unknown option", inPolicy("cost openai maximum 10 " + mark)},
		{"cost", "max above the burst", "policy llm {\n\tkey {http.rate_limit.credential}\n\trate 500/1m\n\tburst 500\n\tcost openai max 8000 " + mark + "\n\tsettle openai\n}\n"},
		{"cost", "max above a quota", inQuota("cost {http.request.header.X-Cost} max 6 " + mark)},
		{"cost", "min instead of max", inPolicy("cost 1 min 2 " + mark)},
		{"cost", "above burst", "policy api { " + mark + "\n\tkey k\n\trate 10/1s\n\tcost 11 " + mark + "\n}\n"},
		{"cost", "openai, max zero", inPolicy("cost openai max 0 " + mark)},
		{"cost", "openai, max not a number", inPolicy("cost openai max lots " + mark)},
		{"settle", "missing value", inPolicy("settle " + mark)},
		{"settle", "unknown source", inPolicy("settle gemini " + mark)},
		{"settle", "header without its field", inPolicy("settle header " + mark)},
		{"settle", "anthropic with a field", inPolicy("settle anthropic X-Usage-Tokens " + mark)},
		{"settle", "max without value", inPolicy("settle openai max " + mark)},
		{"settle", "max zero", inPolicy("settle openai max 0 " + mark)},
		{"settle", "max twice", inPolicy("settle openai max 5 max 6 " + mark)},
		{"settle", "an unknown option", inPolicy("settle openai min 5 " + mark)},
		{"settle", "weights without output", inPolicy("settle openai weights input 1 " + mark)},
		{"settle", "weights without values", inPolicy("settle anthropic weights " + mark)},
		{"settle", "weights: input twice", inPolicy("settle openai weights input 1 input 2 output 3 " + mark)},
		{"settle", "weights twice", inPolicy("settle openai weights input 1 output 1 weights input 1 output 1 " + mark)},
		{"settle", "weights not a number", inPolicy("settle openai weights input lots output 4 " + mark)},
		{"settle", "weights negative", inPolicy("settle openai weights input -1 output 4 " + mark)},
		{"settle", "weights above 1000", inPolicy("settle openai weights input 1 output 1001 " + mark)},
		{"settle", "weights NaN", inPolicy("settle openai weights input NaN output 1 " + mark)},
		{"settle", "weights with 7 decimals", inPolicy("settle openai weights input 0.0000001 output 1 " + mark)},
		{"settle", "weights both zero", inPolicy("settle anthropic weights input 0 output 0 " + mark)},
		{"settle", "weights on a header", inPolicy("settle header X-Usage-Tokens weights input 1 output 4 " + mark)},
		{"settle", "weights on a trailer", inPolicy("settle trailer X-Usage-Tokens weights input 1 output 4 " + mark)},
		{"settle", "cache_write on openai", inPolicy("settle openai weights input 1 output 4 cache_write 1 " + mark)},
		{"settle", "cache_read negative", inPolicy("settle anthropic weights input 1 output 4 cache_read -1 " + mark)},
		{"settle", "cache_read without input and output", inPolicy("settle anthropic weights cache_read 1 " + mark)},
		{"settle", "debt without value", inPolicy("settle openai debt " + mark)},
		{"settle", "debt zero", inPolicy("settle openai debt 0 " + mark)},
		{"settle", "debt twice", inPolicy("settle openai debt 5 debt 6 " + mark)},
		{"settle", "debt too long to pay back", inPolicy("settle openai debt 9007199254740992 " + mark)},
		{"settle", "with charge_if", inPolicy("charge_if status 401\n\tsettle openai " + mark)},
		{"on_error", "policy: missing value", inPolicy("on_error " + mark)},
		{"on_error", "policy: extra value", inPolicy("on_error local local " + mark)},
		{"on_error", "policy: wrong value", inPolicy("on_error ignore " + mark)},
		{"shadow", "policy: extra value", inPolicy("shadow on " + mark)},
		{"wait", "missing value", inPolicy("wait " + mark)},
		{"wait", "extra value", inPolicy("wait 1s 10 20 " + mark)},
		{"wait", "not a duration", inPolicy("wait soon " + mark)},
		{"wait", "zero", inPolicy("wait 0s " + mark)},
		{"wait", "negative", inPolicy("wait -1s " + mark)},
		{"wait", "max_held not a number", inPolicy("wait 1s many " + mark)},
		{"wait", "max_held zero", inPolicy("wait 1s 0 " + mark)},
		// One value out of range: the error should point at its line, not
		// only at the policy's.
		{"wait", "longer than a day", inPolicy("wait 25h " + mark)},
		{"hot_keys", "missing value", inPolicy("hot_keys " + mark)},
		{"hot_keys", "extra value", inPolicy("hot_keys 100/1s off " + mark)},
		{"hot_keys", "not a rate", inPolicy("hot_keys fast " + mark)},
		{"hot_keys", "zero", inPolicy("hot_keys 0/1s " + mark)},
		{"hot_keys", "fractional", inPolicy("hot_keys 1.5/1s " + mark)},
		{"hot_keys", "twice", inPolicy("hot_keys off\n\thot_keys off " + mark)},
		{"hot_keys", "on a quota", inQuota("hot_keys 100/1s " + mark)},
		{"hot_keys", "on a settle policy", "policy s {\n\tkey {client_ip}\n\trate 100/1s\n\tsettle header X-Used\n\thot_keys 100/1s " + mark + "\n}\n"},
		{"hot_keys", "on a charge_if policy", "policy s {\n\tkey {client_ip}\n\trate 100/1s\n\tcharge_if status 401\n\thot_keys 100/1s " + mark + "\n}\n"},
		{"hot_keys", "on a concurrency limit", "policy c {\n\tkey {client_ip}\n\tconcurrent 3\n\thot_keys off " + mark + "\n}\n"},
		{"ipv6_prefix", "policy: missing value", inPolicy("ipv6_prefix " + mark)},
		{"ipv6_prefix", "policy: zero", inPolicy("ipv6_prefix 0 " + mark)},
		{"ipv6_prefix", "policy: above 128", inPolicy("ipv6_prefix 129 " + mark)},
		{"ipv6_prefix", "policy: not a number", inPolicy("ipv6_prefix sixty-four " + mark)},
		{"ipv6_prefix", "policy: twice", inPolicy("ipv6_prefix 64\n\tipv6_prefix 48 " + mark)},
		{"ipv4_prefix", "policy: zero", inPolicy("ipv4_prefix 0 " + mark)},
		{"ipv4_prefix", "policy: above 32", inPolicy("ipv4_prefix 33 " + mark)},
		{"ipv4_prefix", "policy: not a number", inPolicy("ipv4_prefix /24 " + mark)},
		{"brust", "unknown subdirective", inPolicy("brust 5 " + mark)},

		// A quota policy's.
		{"quota", "missing value", "policy q {\n\tkey {client_ip}\n\tquota " + mark + "\n}\n"},
		{"quota", "extra value", "policy q {\n\tkey {client_ip}\n\tquota 5/day 6/day " + mark + "\n}\n"},
		{"quota", "unknown period", "policy q {\n\tkey {client_ip}\n\tquota 5/fortnight " + mark + "\n}\n"},
		{"quota", "a duration for a period", "policy q {\n\tkey {client_ip}\n\tquota 5/24h " + mark + "\n}\n"},
		{"quota", "no period", "policy q {\n\tkey {client_ip}\n\tquota 5 " + mark + "\n}\n"},
		{"quota", "zero", "policy q {\n\tkey {client_ip}\n\tquota 0/day " + mark + "\n}\n"},
		{"quota", "negative", "policy q {\n\tkey {client_ip}\n\tquota -5/day " + mark + "\n}\n"},
		{"quota", "fractional", "policy q {\n\tkey {client_ip}\n\tquota 1.5/day " + mark + "\n}\n"},
		{"quota", "above 2^53", "policy q {\n\tkey {client_ip}\n\tquota 9007199254740993/month " + mark + "\n}\n"},
		{"quota", "twice", inQuota("quota 6/day " + mark)},
		{"rate", "quota and rate", inQuota("rate 10/1s " + mark)},
		{"concurrent", "quota and concurrent", inQuota("concurrent 3 " + mark)},
		{"burst", "quota and burst", inQuota("burst 5 " + mark)},
		{"wait", "quota and wait", inQuota("wait 1s " + mark)},
		{"cost", "above the quota", inQuota("cost 6 " + mark)},
		{"timezone", "missing value", inQuota("timezone " + mark)},
		{"timezone", "extra value", inQuota("timezone UTC Europe/Berlin " + mark)},
		{"timezone", "unknown zone", inQuota("timezone America/New_Yrok " + mark)},
		{"timezone", "the machine's", inQuota("timezone Local " + mark)},
		{"timezone", "without a quota", inPolicy("timezone UTC " + mark)},
		{"durable", "no option", redisQuota("durable " + mark)},
		{"durable", "unknown option", redisQuota("durable fsync " + mark)},
		{"durable", "replicas zero", redisQuota("durable replicas 0 " + mark)},
		{"durable", "replicas not a number", redisQuota("durable replicas one " + mark)},
		{"durable", "replicas without a number", redisQuota("durable replicas " + mark)},
		{"durable", "replicas above 1000", redisQuota("durable replicas 1001 " + mark)},
		{"durable", "twice", redisQuota("durable aof\n\tdurable replicas 1 " + mark)},
		{"durable", "without a redis block", inQuota("durable replicas 1 " + mark)},
		{"durable", "on a rate policy", "redis {\n\taddress 127.0.0.1:6379\n}\n" + inPolicy("durable replicas 1 "+mark)},
		// A policy's plans: each mistake at its plan's line.
		{"plan", "no placeholder", inPolicy("plan { " + mark + "\n\t\tpro rate 1/1s\n\t}")},
		{"plan", "two placeholders", inPolicy("plan {a} {b} { " + mark + "\n\t\tpro rate 1/1s\n\t}")},
		{"plan", "not a placeholder", inPolicy("plan gold { " + mark + "\n\t\tpro rate 1/1s\n\t}")},
		{"plan", "no plans", inPolicy("plan {http.request.header.X-Plan} { " + mark + "\n\t}")},
		{"plan", "no block", inPolicy("plan {http.request.header.X-Plan} " + mark)},
		{"plan", "twice", inPolicy("plan {a} {\n\t\tpro rate 1/1s\n\t}\n\tplan {b} { " + mark + "\n\t\tpro rate 1/1s\n\t}")},
		{"plan", "duplicate plan names", inPolicy(planBlock("pro rate 20/1s\n\t\tpro rate 30/1s " + mark))},
		{"plan", "plan line with no limit", inPolicy(planBlock("pro " + mark))},
		{"plan", "bad plan name", inPolicy(planBlock("\"pro plan\" rate 20/1s " + mark))},
		{"plan", "plan named default", inPolicy(planBlock("default rate 20/1s " + mark))},
		{"plan", "concurrent in a rate policy", inPolicy(planBlock("pro concurrent 5 " + mark))},
		{"plan", "rate in a concurrent policy", "policy api {\n\tkey k\n\tconcurrent 2\n\t" + planBlock("pro rate 20/1s "+mark) + "\n}\n"},
		{"plan", "rate zero", inPolicy(planBlock("pro rate 0/1s " + mark))},
		{"plan", "rate without value", inPolicy(planBlock("pro rate " + mark))},
		{"plan", "rate bad duration", inPolicy(planBlock("pro rate 5/1fortnight " + mark))},
		{"plan", "burst zero", inPolicy(planBlock("pro burst 0 " + mark))},
		{"plan", "burst not a number", inPolicy(planBlock("pro burst lots " + mark))},
		{"plan", "burst too slow to refill", inPolicy(planBlock("pro rate 1/1s burst 9223372036854775807 " + mark))},
		{"plan", "cost without max", inPolicy(planBlock("pro cost 5 " + mark))},
		{"plan", "cost max zero", inPolicy(planBlock("pro cost max 0 " + mark))},
		{"plan", "fixed cost above the plan's burst", "policy api {\n\tkey k\n\trate 10/1s\n\tcost 5\n\t" + planBlock("pro burst 4 "+mark) + "\n}\n"},
		{"plan", "unknown word", inPolicy(planBlock("pro speed 5 " + mark))},
		{"plan", "word twice", inPolicy(planBlock("pro burst 5 burst 6 " + mark))},
		{"plan", "a block under a plan", inPolicy(planBlock("pro rate 4/1s { " + mark + "\n\t\t\trate 5/1s\n\t\t}"))},
		// A quota policy's plans: quota <N>, nothing of another kind.
		{"plan", "rate in a quota policy", inQuota(planBlock("pro rate 20/1s " + mark))},
		{"plan", "burst in a quota policy", inQuota(planBlock("pro burst 20 " + mark))},
		{"plan", "concurrent in a quota policy", inQuota(planBlock("pro concurrent 5 " + mark))},
		{"plan", "quota in a rate policy", inPolicy(planBlock("pro quota 5000 " + mark))},
		{"plan", "quota in a concurrent policy", "policy api {\n\tkey k\n\tconcurrent 2\n\t" + planBlock("pro quota 5000 "+mark) + "\n}\n"},
		{"quota", "plan quota zero", inQuota(planBlock("pro quota 0 " + mark))},
		{"quota", "plan quota negative", inQuota(planBlock("pro quota -5 " + mark))},
		{"quota", "plan quota above 2^53", inQuota(planBlock("pro quota 9007199254740993 " + mark))},
		{"quota", "plan quota not a number", inQuota(planBlock("pro quota lots " + mark))},
		{"quota", "plan quota of another unit", inQuota(planBlock("pro quota 50/month " + mark))},
		{"quota", "plan quota of an unknown unit", inQuota(planBlock("pro quota 50/fortnight " + mark))},
		{"quota", "plan quota without value", inQuota(planBlock("pro quota " + mark))},
		{"cost", "plan quota below the fixed cost", "policy q {\n\tkey k\n\tquota 10/day\n\tcost 5\n\t" + planBlock("pro quota 4 "+mark) + "\n}\n"},
	} {
		t.Run(tc.sub+"/"+tc.name, func(t *testing.T) {
			caddyfileText, lines := siteWith(tc.body)
			if len(lines) == 0 {
				t.Fatalf("no line marked %q in\n%s", mark, caddyfileText)
			}
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
			if err == nil {
				t.Fatalf("adapted without error:\n%s", caddyfileText)
			}
			msg := err.Error()
			// As a word: every error starts "parsing caddyfile tokens for
			// 'rate_limit'", which holds "rate" but does not name it.
			if !regexp.MustCompile(`(^|[^A-Za-z_])` + regexp.QuoteMeta(tc.sub) + `([^A-Za-z_]|$)`).MatchString(msg) {
				t.Errorf("the error does not name %q: %v", tc.sub, err)
			}
			m := atLine.FindAllStringSubmatch(msg, -1)
			if len(m) == 0 {
				t.Fatalf("the error has no Caddyfile:<line>: %v\n%s", err, caddyfileText)
			}
			got, _ := strconv.Atoi(m[len(m)-1][1])
			if !lines[got] {
				t.Errorf("the error points at line %d, want %s: %v\n%s", got, lineList(lines), err, numbered(caddyfileText))
			}
		})
	}
}

var atLine = regexp.MustCompile(`at Caddyfile:(\d+)\b`)

// siteWith puts a rate_limit block with body into a site, and returns the
// Caddyfile with the numbers of its marked lines (the rate_limit line when
// the body marks none).
func siteWith(body string) (string, map[int]bool) {
	var sb strings.Builder
	sb.WriteString(":8080 {\n\trate_limit {\n")
	for _, l := range strings.Split(strings.TrimRight(body, "\n"), "\n") {
		sb.WriteString("\t\t" + l + "\n")
	}
	sb.WriteString("\t}\n\trespond \"ok\"\n}\n")
	text := sb.String()
	lines := map[int]bool{}
	for i, l := range strings.Split(text, "\n") {
		if strings.HasSuffix(strings.TrimSpace(l), mark) {
			lines[i+1] = true
		}
	}
	if !strings.Contains(body, mark) {
		lines[2] = true
	}
	return text, lines
}

func lineList(lines map[int]bool) string {
	var s []string
	for l := range lines {
		s = append(s, strconv.Itoa(l))
	}
	return "line " + strings.Join(s, " or ")
}

func numbered(text string) string {
	var sb strings.Builder
	for i, l := range strings.Split(strings.TrimRight(text, "\n"), "\n") {
		sb.WriteString(strconv.Itoa(i+1) + "\t" + l + "\n")
	}
	return sb.String()
}
