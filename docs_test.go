package ratelimit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/prometheus/client_golang/prometheus"
)

// docsSnippet is a Caddyfile snippet of README.md or docs/: not a syntax
// description (with <placeholders>, its columns aligned), and read without
// the indentation of a list it is part of.
type docsSnippet struct{ file, body string }

func docsCaddyfiles(t *testing.T) []docsSnippet {
	t.Helper()
	files, _ := filepath.Glob("docs/*.md")
	files = append(files, "README.md")
	block := regexp.MustCompile("(?ms)^([ \t]*)```caddyfile\n(.*?)^[ \t]*```")
	syntax := regexp.MustCompile(`<[a-z_]+>`)
	var out []docsSnippet
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range block.FindAllStringSubmatch(string(raw), -1) {
			indent, body := m[1], m[2]
			if indent != "" {
				var lines []string
				for _, l := range strings.SplitAfter(body, "\n") {
					lines = append(lines, strings.TrimPrefix(l, indent))
				}
				body = strings.Join(lines, "")
			}
			if !syntax.MatchString(body) {
				out = append(out, docsSnippet{f, body})
			}
		}
	}
	if len(out) < 10 {
		t.Fatalf("found %d Caddyfile snippets, the docs have more", len(out))
	}
	return out
}

// TestDocsCaddyfilesFormatted: every Caddyfile snippet of README.md and
// docs/ is as `caddy fmt` writes it, so that one copied into a Caddyfile
// does not make Caddy warn "Caddyfile input is not formatted" on every
// start.
func TestDocsCaddyfilesFormatted(t *testing.T) {
	for _, sn := range docsCaddyfiles(t) {
		if got := string(caddyfile.Format([]byte(sn.body))); got != sn.body {
			t.Errorf("%s: a Caddyfile snippet is not as caddy fmt writes it:\n%s\ncaddy fmt:\n%s", sn.file, sn.body, got)
		}
	}
}

// TestDocsCaddyfilesAdapt: every Caddyfile snippet of README.md and docs/
// adapts without an error or a warning, as `caddy adapt` would take it
// copied into a Caddyfile; a snippet that is a policy block alone is
// adapted inside a site's rate_limit. One that leaves parts out ("...")
// is not a whole config.
func TestDocsCaddyfilesAdapt(t *testing.T) {
	n := 0
	for _, sn := range docsCaddyfiles(t) {
		body := sn.body
		if strings.Contains(body, "...") || strings.Contains(body, "…") {
			continue
		}
		if strings.HasPrefix(body, "policy ") {
			var sb strings.Builder
			sb.WriteString(":8080 {\n\trate_limit {\n")
			for _, l := range strings.SplitAfter(body, "\n") {
				if l != "" {
					sb.WriteString("\t\t" + l)
				}
			}
			sb.WriteString("\t}\n}\n")
			body = string(caddyfile.Format([]byte(sb.String())))
		}
		n++
		_, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(body), nil)
		if err != nil || len(warnings) > 0 {
			t.Errorf("%s: a Caddyfile snippet does not adapt: %v %v\n%s", sn.file, err, warnings, body)
		}
	}
	t.Logf("%d snippets adapted", n)
}

// TestOperatorControlsListsEverySubcommand: every subcommand of `caddy
// rate-limit` is in docs/operator-controls.md's list at its top, as
// `caddy rate-limit <name>`.
func TestOperatorControlsListsEverySubcommand(t *testing.T) {
	raw, err := os.ReadFile("docs/operator-controls.md")
	if err != nil {
		t.Fatal(err)
	}
	// The first code block: the list of commands.
	_, list, _ := strings.Cut(string(raw), "\n```\n")
	list, _, _ = strings.Cut(list, "\n```\n")
	subs := rateLimitCobra(t).Commands()
	if len(subs) < 7 {
		t.Fatalf("found %d subcommands of caddy rate-limit, there are more", len(subs))
	}
	for _, sub := range subs {
		if !regexp.MustCompile(`(?m)^caddy rate-limit ` + regexp.QuoteMeta(sub.Name()) + `\b`).MatchString(list) {
			t.Errorf("caddy rate-limit %s is not in the list of commands at the top of docs/operator-controls.md", sub.Name())
		}
	}
}

// TestFleetCaddyfileIsTheExample: Caddyfile.fleet, which `make fleet`
// runs, is Caddyfile.example with its buckets in Redis: the same policies.
func TestFleetCaddyfileIsTheExample(t *testing.T) {
	policies := func(file string) (string, map[string]any) {
		t.Helper()
		raw, err := os.ReadFile(file)
		if err != nil {
			t.Fatal(err)
		}
		out, _, err := caddyconfig.GetAdapter("caddyfile").Adapt(raw, map[string]any{"filename": file})
		if err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		var handler map[string]any
		var find func(v any)
		find = func(v any) {
			switch x := v.(type) {
			case map[string]any:
				if x["handler"] == "rate_limit" {
					handler = x
					return
				}
				for _, e := range x {
					find(e)
				}
			case []any:
				for _, e := range x {
					find(e)
				}
			}
		}
		var cfg any
		if err := json.Unmarshal(out, &cfg); err != nil {
			t.Fatal(err)
		}
		find(cfg)
		if handler == nil {
			t.Fatalf("%s: no rate_limit handler", file)
		}
		p, _ := json.Marshal(handler["policies"])
		return string(p), handler
	}
	example, _ := policies("Caddyfile.example")
	fleet, h := policies("Caddyfile.fleet")
	if example != fleet {
		t.Errorf("Caddyfile.fleet's policies differ from Caddyfile.example's:\n%s\n%s", fleet, example)
	}
	if h["redis"] == nil || h["key_secret"] != "{env.RATE_LIMIT_SECRET}" {
		t.Errorf("Caddyfile.fleet: want a redis block and key_secret {env.RATE_LIMIT_SECRET}, got %v", h)
	}
}

// TestDocsMetricSamples: every line of /metrics output shown in the docs
// (`caddy_rate_limit_<name>{labels} value`) names a metric the module
// exports, with exactly its labels, so that a sample cannot show labels
// the real output does not have (or miss some it has).
func TestDocsMetricSamples(t *testing.T) {
	collectors := []prometheus.Collector{decisionsTotal, chargesLost, inFlight, leasesExpired, releaseRetries, waiting,
		storeDuration, storeErrors, circuitOpen, buckets, quotaUsed, slots, shedLimitGauge}
	labels := map[string]string{} // metric name: its label names, sorted, comma-separated
	descs := make(chan *prometheus.Desc, 64)
	for _, c := range collectors {
		c.Describe(descs)
	}
	close(descs)
	descRE := regexp.MustCompile(`fqName: "(\w+)".*variableLabels: \{([^}]*)\}`)
	for d := range descs {
		m := descRE.FindStringSubmatch(d.String())
		if m == nil {
			t.Fatalf("cannot read %s", d)
		}
		names := strings.Split(m[2], ",")
		slices.Sort(names)
		labels[m[1]] = strings.Join(names, ",")
	}
	files, _ := filepath.Glob("docs/*.md")
	sample := regexp.MustCompile(`(?m)^\s*(caddy_rate_limit_\w+)\{([^}]*)\} [0-9.e+-]+$`)
	n := 0
	for _, f := range append(files, "README.md") {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range sample.FindAllStringSubmatch(string(raw), -1) {
			n++
			name := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(m[1], "_bucket"), "_count"), "_sum")
			want, ok := labels[name]
			if !ok {
				t.Errorf("%s: %s is not a metric the module exports", f, m[1])
				continue
			}
			var got []string
			for _, kv := range strings.Split(m[2], ",") {
				k, _, _ := strings.Cut(kv, "=")
				if k != "le" {
					got = append(got, k)
				}
			}
			slices.Sort(got)
			if strings.Join(got, ",") != want {
				t.Errorf("%s: %s{%s}: the module's %s has the labels %s", f, m[1], m[2], name, want)
			}
		}
	}
	if n == 0 {
		t.Fatal("found no /metrics samples in the docs")
	}
}
