package integration_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// docsBlock is the first fenced block of language lang (```lang) in the
// doc file (a path from this package's directory) whose text contains
// every one of contains.
func docsBlock(t *testing.T, file, lang string, contains ...string) string {
	t.Helper()
	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	block := regexp.MustCompile("(?ms)^```" + regexp.QuoteMeta(lang) + "\n(.*?)^```")
next:
	for _, m := range block.FindAllStringSubmatch(string(raw), -1) {
		for _, c := range contains {
			if !strings.Contains(m[1], c) {
				continue next
			}
		}
		return m[1]
	}
	t.Fatalf("%s: no ```%s block containing %q", file, lang, contains)
	return ""
}

// caddyAdapt runs `caddy adapt` (the built binary) on a Caddyfile's text,
// as a user would, and returns the JSON config, failing the test on an
// error or a warning.
func caddyAdapt(t *testing.T, caddyfileText string) map[string]any {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "Caddyfile")
	if err := os.WriteFile(path, []byte(caddyfileText), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(caddyBin, "adapt", "--config", path)
	cmd.Env = append(os.Environ(), "HOME="+dir, "XDG_DATA_HOME="+dir, "XDG_CONFIG_HOME="+dir)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("caddy adapt: %v\n%s\n%s", err, stderr.String(), caddyfileText)
	}
	if strings.Contains(stderr.String(), `"level":"warn"`) {
		t.Fatalf("caddy adapt warns:\n%s\n%s", stderr.String(), caddyfileText)
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatalf("caddy adapt: not JSON: %v\n%s", err, out)
	}
	return cfg
}

// servers is a JSON config's HTTP servers.
func servers(t *testing.T, cfg map[string]any) map[string]any {
	t.Helper()
	apps, _ := cfg["apps"].(map[string]any)
	http, _ := apps["http"].(map[string]any)
	srvs, _ := http["servers"].(map[string]any)
	if len(srvs) == 0 {
		t.Fatalf("no HTTP servers in %v", cfg)
	}
	return srvs
}

// TestReadmeStrictProxyRecipe runs the README's load-balancer recipe as a
// user would (caddy adapt, then caddy run), the test acting as the balancer
// (its address trusted beside the recipe's 10.0.0.0/8), which appends the
// client's address to X-Forwarded-For as balancers do. A client that
// writes its own X-Forwarded-For, a new address and a new API key on every
// request, stays in its one per_ip bucket: admitted its burst and the
// refill, then denied; another client has a bucket of its own. Without
// trusted_proxies_strict (the control) the same client picks a fresh bucket
// each time and every request passes: the test can tell the two apart.
func TestReadmeStrictProxyRecipe(t *testing.T) {
	recipe := docsBlock(t, "../README.md", "caddyfile", "trusted_proxies_strict", "{client_ip}")
	upstream := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))
	t.Cleanup(upstream.Close)

	run := func(t *testing.T, caddyfileText string) (admitted, sent int, remaining []int, other int) {
		cfg := caddyAdapt(t, caddyfileText)
		port, adminPort := testredis.FreePort(t), testredis.FreePort(t)
		cfg["admin"] = map[string]any{"listen": "127.0.0.1:" + strconv.Itoa(adminPort)}
		for _, s := range servers(t, cfg) {
			srv := s.(map[string]any)
			srv["listen"] = []string{"127.0.0.1:" + strconv.Itoa(port)}
			srv["automatic_https"] = map[string]any{"disable": true}
			tp := srv["trusted_proxies"].(map[string]any)
			tp["ranges"] = append(tp["ranges"].([]any), "127.0.0.1/32") // the test is the balancer
		}
		raw, _ := json.Marshal(cfg)
		raw = []byte(strings.ReplaceAll(string(raw), `"dial":"localhost:9000"`, `"dial":"`+strings.TrimPrefix(upstream.URL, "http://")+`"`))
		path := filepath.Join(t.TempDir(), "caddy.json")
		if err := os.WriteFile(path, raw, 0o600); err != nil {
			t.Fatal(err)
		}
		in := testcaddy.StartFile(t, caddyBin, path, "", port, adminPort, nil)
		client := newClient()
		get := func(key, xff string) (int, http.Header) {
			req, _ := http.NewRequest("GET", in.URL+"/", nil)
			req.Host = "api.example.com"
			req.Header.Set("X-Api-Key", key)
			req.Header.Set("X-Forwarded-For", xff)
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			return resp.StatusCode, resp.Header
		}
		for i := range 100 {
			// The client wrote "198.51.100.<i>"; the balancer appended the
			// address it saw, 203.0.113.7.
			code, h := get("key-"+strconv.Itoa(i), "198.51.100."+strconv.Itoa(i)+", 203.0.113.7")
			sent++
			if code == 200 {
				admitted++
			}
			for _, f := range parseFields(t, h, "RateLimit") {
				if f.name == "per_ip" {
					remaining = append(remaining, int(f.params["r"]))
				}
			}
		}
		other, _ = get("key-other", "203.0.113.8")
		return admitted, sent, remaining, other
	}

	start := time.Now()
	admitted, sent, remaining, other := run(t, recipe)
	elapsed := time.Since(start).Seconds()
	// per_ip: burst 60, 300/1m (5 a second) after it.
	if most := 60 + int(5*elapsed) + 1; admitted < 60 || admitted > most || admitted == sent {
		t.Errorf("strict: the spoofing client got %d of %d admitted, want its burst of 60 and the refill (at most %d in %.1fs)", admitted, sent, most, elapsed)
	}
	for i := 1; i < len(remaining) && i < 60; i++ {
		if remaining[i] >= remaining[i-1] {
			t.Errorf("strict: per_ip's r went %v: not one bucket counting down", remaining[:60])
			break
		}
	}
	if other != 200 {
		t.Errorf("strict: another client (203.0.113.8) got %d, want its own bucket", other)
	}
	t.Logf("strict (the README's recipe): %d of %d admitted in %.1fs; another client: %d", admitted, sent, elapsed, other)

	loose := strings.Replace(recipe, "\t\ttrusted_proxies_strict\n", "", 1)
	if loose == recipe {
		t.Fatal("the recipe has no trusted_proxies_strict line to take out for the control")
	}
	admitted, sent, _, _ = run(t, loose)
	if admitted != sent {
		t.Errorf("without trusted_proxies_strict (the control): %d of %d admitted; the leftmost address, the client's own, should pick a fresh bucket each time", admitted, sent)
	}
	t.Logf("without trusted_proxies_strict: %d of %d admitted", admitted, sent)
}

// TestReadmeRecipes: each recipe of the README (a "### " section under
// "## Recipes") has a whole Caddyfile that `caddy adapt`, the built
// binary, takes as written without an error or a warning, and links to
// the guide that explains it.
func TestReadmeRecipes(t *testing.T) {
	raw, err := os.ReadFile("../README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, recipes, ok := strings.Cut(string(raw), "\n## Recipes\n")
	if !ok {
		t.Fatal(`README.md has no "## Recipes"`)
	}
	recipes, _, _ = strings.Cut(recipes, "\n## ")
	sections := strings.Split(recipes, "\n### ")[1:]
	if len(sections) < 8 {
		t.Fatalf("%d recipes in the README, it has more", len(sections))
	}
	block := regexp.MustCompile("(?ms)^```caddyfile\n(.*?)^```")
	link := regexp.MustCompile(`\]\((docs/[\w-]+\.md)(#[\w-]+)?\)`)
	for _, sec := range sections {
		title, _, _ := strings.Cut(sec, "\n")
		t.Run(title, func(t *testing.T) {
			m := block.FindStringSubmatch(sec)
			if m == nil {
				t.Fatal("no Caddyfile")
			}
			cfg := caddyAdapt(t, m[1])
			if len(servers(t, cfg)) == 0 {
				t.Fatal("no site")
			}
			guides := link.FindAllStringSubmatch(sec, -1)
			if len(guides) == 0 {
				t.Fatal("no link to its guide in docs/")
			}
			for _, g := range guides {
				if _, err := os.Stat("../" + g[1]); err != nil {
					t.Errorf("links to %s: %v", g[1], err)
				}
			}
		})
	}
}

// TestDocsCaddyfilesAdaptWithCaddy: every whole Caddyfile of the README and
// docs/ (not a syntax description with <placeholders>, not one that leaves
// parts out with "...") goes through `caddy adapt`, the built binary,
// without an error or a warning: what a user copying it sees, the warnings
// Caddy's own directives log included (the root package's test of the
// same snippets sees only the adapter's). mholt/caddy-ratelimit's zones,
// whose warnings docs/migrating.md shows, are left out.
func TestDocsCaddyfilesAdaptWithCaddy(t *testing.T) {
	files, _ := filepath.Glob("../docs/*.md")
	files = append(files, "../README.md")
	block := regexp.MustCompile("(?ms)^([ \t]*)```caddyfile\n(.*?)^[ \t]*```")
	syntax := regexp.MustCompile(`<[a-z_]+>`)
	n := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for i, m := range block.FindAllStringSubmatch(string(raw), -1) {
			body := m[2]
			if m[1] != "" {
				body = regexp.MustCompile("(?m)^"+regexp.QuoteMeta(m[1])).ReplaceAllString(body, "")
			}
			if syntax.MatchString(body) || strings.Contains(body, "...") || strings.Contains(body, "…") || strings.Contains(body, "\tzone ") {
				continue
			}
			if strings.HasPrefix(body, "policy ") { // a policy block alone, in a site's rate_limit
				body = ":8080 {\n\trate_limit {\n" + regexp.MustCompile("(?m)^(.)").ReplaceAllString(body, "\t\t$1") + "\t}\n}\n"
			}
			t.Run(filepath.Base(f)+"#"+strconv.Itoa(i+1), func(t *testing.T) {
				t.Parallel()
				caddyAdapt(t, body)
			})
			n++
		}
	}
	if n < 30 {
		t.Fatalf("%d whole Caddyfiles in the docs, they have more", n)
	}
	t.Logf("%d Caddyfiles adapted by caddy adapt", n)
}
