package ratelimit

import (
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// TestDocsCaddyfilesFormatted: every Caddyfile snippet of README.md and
// docs/ is as `caddy fmt` writes it, so that one copied into a Caddyfile
// does not make Caddy warn "Caddyfile input is not formatted" on every
// start. A snippet indented as part of a list is read without the list's
// indentation; a syntax description (with <placeholders>, its columns
// aligned) is not a Caddyfile.
func TestDocsCaddyfilesFormatted(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append(files, "README.md")
	block := regexp.MustCompile("(?ms)^([ \t]*)```caddyfile\n(.*?)^[ \t]*```")
	syntax := regexp.MustCompile(`<[a-z_]+>`)
	n := 0
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
			if syntax.MatchString(body) {
				continue
			}
			n++
			if got := string(caddyfile.Format([]byte(body))); got != body {
				t.Errorf("%s: a Caddyfile snippet is not as caddy fmt writes it:\n%s\ncaddy fmt:\n%s", f, body, got)
			}
		}
	}
	if n < 10 {
		t.Fatalf("found %d Caddyfile snippets, the docs have more", n)
	}
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
