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
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	_ "github.com/caddyserver/caddy/v2/modules/standard" // respond, basic_auth, forward_auth...
)

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

// TestJSONConfigErrors checks that a JSON config mistake fails provisioning
// (what `caddy validate` and a config load run) with an error that names
// the policy, when there is one, and the field.
func TestJSONConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler string   // the handler's JSON, without "handler"
		want    []string // substrings of the error
	}{
		{
			name:    "max_cost above the burst",
			handler: `{"policies":[{"name":"llm","key":"{http.rate_limit.credential}","rate":"500/1m","cost":"openai","max_cost":8000,"settle":{"from":"openai"}}]}`,
			want:    []string{`policy "llm"`, "cost: max 8000 is more than the burst 500"},
		},
		{
			name:    "error_format unknown",
			handler: `{"error_format":"gemini","policies":[{"name":"api","key":"{client_ip}","rate":"1/1s"}]}`,
			want:    []string{`error_format: "gemini"`},
		},
		{
			name:    "settle debt negative",
			handler: `{"policies":[{"name":"api","key":"k","rate":"1/1s","settle":{"from":"openai","debt":-1}}]}`,
			want:    []string{`policy "api"`, "settle: debt -1"},
		},
		{
			name:    "cache_write for openai",
			handler: `{"policies":[{"name":"api","key":"k","rate":"1/1s","settle":{"from":"openai","weights":{"input":1,"output":1,"cache_write":1}}}]}`,
			want:    []string{`policy "api"`, "cache_write is for anthropic"},
		},
		{
			name:    "rate zero",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"0/1s"}]}`,
			want:    []string{`policy "api"`, `rate: "0/1s"`, "positive integer"},
		},
		{
			name:    "rate negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"-5/1m"}]}`,
			want:    []string{`policy "api"`, `rate: "-5/1m"`},
		},
		{
			name:    "rate fractional",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"1.5/1s"}]}`,
			want:    []string{`policy "api"`, `rate: "1.5/1s"`},
		},
		{
			name:    "rate without slash",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100"}]}`,
			want:    []string{`policy "api"`, `rate: "100" is not N/duration`},
		},
		{
			name:    "rate bad duration",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/1fortnight"}]}`,
			want:    []string{`policy "api"`, `rate: "100/1fortnight": bad duration`},
		},
		{
			name:    "hot_keys not a rate",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/1s","hot_keys":"often"}]}`,
			want:    []string{`policy "api"`, `hot_keys: "often" is not N/duration`, "or off"},
		},
		{
			name:    "hot_keys on a concurrency limit",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","concurrent":3,"hot_keys":"off"}]}`,
			want:    []string{`policy "api"`, "hot_keys: a concurrent policy has no tokens to take ahead"},
		},
		{
			name:    "rate missing",
			handler: `{"policies":[{"name":"api","key":"{client_ip}"}]}`,
			want:    []string{`policy "api"`, "rate:"},
		},
		{
			name:    "burst negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","burst":-1}]}`,
			want:    []string{`policy "api"`, "burst: -1"},
		},
		{
			name:    "max_cost negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","cost":"{http.request.header.X-Cost}","max_cost":-1}]}`,
			want:    []string{`policy "api"`, "max_cost: -1"},
		},
		{
			name:    "cost zero",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","cost":"0"}]}`,
			want:    []string{`policy "api"`, `cost: "0"`},
		},
		{
			name:    "duplicate policy names",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"},{"name":"api","key":"global","rate":"100/1s"}]}`,
			want:    []string{`policy "api"`, "defined twice"},
		},
		{
			name:    "ipv6_prefix above 128",
			handler: `{"ipv6_prefix":129,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"ipv6_prefix: 129 must be from 1 to 128"},
		},
		{
			name:    "ipv4_prefix negative",
			handler: `{"ipv4_prefix":-8,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"ipv4_prefix: -8 must be from 1 to 32"},
		},
		{
			name:    "policy ipv4_prefix above 32",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","ipv4_prefix":33}]}`,
			want:    []string{`policy "api"`, "ipv4_prefix: 33 must be from 1 to 32"},
		},
		{
			name:    "concurrent policy ipv6_prefix above 128",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","concurrent":3,"ipv6_prefix":200}]}`,
			want:    []string{`policy "api"`, "ipv6_prefix: 200 must be from 1 to 128"},
		},
		{
			name:    "bad on_error",
			handler: `{"on_error":"fail_maybe","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`on_error: "fail_maybe"`},
		},
		{
			name:    "bad policy on_error",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","on_error":"retry"}]}`,
			want:    []string{`policy "api"`, `on_error: "retry"`},
		},
		{
			name:    "bad headers",
			handler: `{"headers":"ietf","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`headers: "ietf"`},
		},
		{
			name:    "negative jitter",
			handler: `{"jitter":-1,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"jitter: -1"},
		},
		{
			name:    "jitter too large",
			handler: `{"jitter":20,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"jitter: 20"},
		},
		{
			name:    "missing key",
			handler: `{"policies":[{"name":"api","rate":"10/1s"}]}`,
			want:    []string{`policy "api"`, "key: required"},
		},
		{
			name:    "policy name with a space",
			handler: `{"policies":[{"name":"per user","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`policy "per user"`, `name "per user"`},
		},
		{
			name:    "policy without a name",
			handler: `{"policies":[{"key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`policy ""`, `name ""`},
		},
		{
			name:    "no policy",
			handler: `{"key_secret":"s"}`,
			want:    []string{"at least one policy is required"},
		},
		{
			name:    "redis without addresses",
			handler: `{"redis":{"password":"x"},"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"redis: address: at least one host:port is required"},
		},
		{
			name:    "redis cluster and sentinel",
			handler: `{"redis":{"addresses":["10.0.0.1:6379"],"cluster":true,"sentinel":"mymaster"},"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"redis: cluster and sentinel exclude each other"},
		},
		{
			name:    "unknown policy field",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","brust":5}]}`,
			want:    []string{`unknown field "brust"`},
		},
		{
			name:    "bad matcher",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","match":{"no_such_matcher":{}}}]}`,
			want:    []string{`policy "api"`, "match:", "no_such_matcher"},
		},
		{
			name:    "quota of an unknown period",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/fortnight"}]}`,
			want:    []string{`policy "monthly"`, "quota:", "minute, hour, day, week, month or year"},
		},
		{
			name:    "quota above 2^53",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"9007199254740993/month"}]}`,
			want:    []string{`policy "monthly"`, "quota:", "from 1 to 9007199254740992"},
		},
		{
			name:    "quota and rate",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","rate":"10/1s"}]}`,
			want:    []string{`policy "monthly"`, "rate:", "a rate or a quota"},
		},
		{
			name:    "quota and concurrent",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","concurrent":3}]}`,
			want:    []string{`policy "monthly"`, "concurrent:", "a quota or concurrent"},
		},
		{
			name:    "unknown time zone",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","timezone":"Mars/Olympus"}]}`,
			want:    []string{`policy "monthly"`, "timezone:", `"Mars/Olympus"`, "IANA"},
		},
		{
			name:    "durable replicas 0",
			handler: `{"redis":{"addresses":["127.0.0.1:6379"]},"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":0}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "replicas <n> (at least 1) or aof"},
		},
		{
			name:    "durable replicas negative",
			handler: `{"redis":{"addresses":["127.0.0.1:6379"]},"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":-1}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "from 1 to 1000"},
		},
		{
			name:    "rate in words",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/minute"}]}`,
			want:    []string{`policy "api"`, `rate: "100/minute"`, "did you mean 100/1m?"},
		},
		{
			name:    "key_secret from an unset variable",
			handler: `{"key_secret":"{env.RATE_LIMIT_TEST_UNSET_SECRET}","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"key_secret:", "environment variable RATE_LIMIT_TEST_UNSET_SECRET is not set", "export RATE_LIMIT_TEST_UNSET_SECRET="},
		},
		{
			name:    "durable without redis",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":1}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "needs a redis block"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			check := func(how string, err error) {
				t.Helper()
				if err == nil {
					t.Fatalf("%s: %s succeeded; want an error containing %q", tc.handler, how, tc.want)
				}
				t.Logf("%s: %v", how, err)
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %s error\n\t%v\ndoes not contain %q", tc.handler, how, err, w)
					}
				}
			}

			// The handler alone, provisioned as Caddy provisions a module.
			var err error
			h := new(Handler)
			if err = caddy.StrictUnmarshalJSON([]byte(tc.handler), h); err == nil {
				ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
				err = h.Provision(ctx)
				if err == nil {
					_ = h.Cleanup()
				}
				cancel()
			}
			check("provisioning", err)

			// The same handler in a whole config, as `caddy validate` loads it.
			withName := `{"handler":"rate_limit",` + strings.TrimPrefix(tc.handler, "{")
			config := `{"apps":{"http":{"servers":{"srv0":{"listen":[":8080"],"routes":[{"handle":[` + withName + `]}]}}}}}`
			cfg := new(caddy.Config)
			if err := caddy.StrictUnmarshalJSON([]byte(config), cfg); err != nil {
				t.Fatal(err)
			}
			check("caddy.Validate", caddy.Validate(cfg))
		})
	}
}
