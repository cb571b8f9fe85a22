package ratelimit

import (
	"context"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
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
// runs, is Caddyfile.example with its buckets in Redis: the same policies,
// and the Redis address, password and secret read at load ({env.X}).
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
		found := rateLimitHandlers(t, out)
		if len(found) != 1 {
			t.Fatalf("%s: %d rate_limit handlers, want 1", file, len(found))
		}
		handler := found[0]
		p, _ := json.Marshal(handler["policies"])
		return string(p), handler
	}
	example, _ := policies("Caddyfile.example")
	fleet, h := policies("Caddyfile.fleet")
	if example != fleet {
		t.Errorf("Caddyfile.fleet's policies differ from Caddyfile.example's:\n%s\n%s", fleet, example)
	}
	// What a reload must keep is read by Caddy from its environment at load
	// ({env.X}), not by whoever adapts the file ({$X}).
	redis, _ := h["redis"].(map[string]any)
	if addrs, _ := json.Marshal(redis["addresses"]); string(addrs) != `["{env.REDIS_ADDRESS}"]` || redis["password"] != "{env.REDIS_PASSWORD}" || h["key_secret"] != "{env.RATE_LIMIT_SECRET}" {
		t.Errorf("Caddyfile.fleet: want a redis block with address {env.REDIS_ADDRESS} and password {env.REDIS_PASSWORD}, and key_secret {env.RATE_LIMIT_SECRET}, got %v", h)
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

// TestReferenceSyntax pins the syntax block of docs/reference.md (the
// first ```caddyfile block after the heading "## Caddyfile syntax") to what
// the parser in caddyfile.go accepts, and each name to a row of its
// directive tables, so that the documentation cannot drift from the code.
// What the parser accepts is read from caddyfile.go itself: the string
// constants of the case clauses of the switch statements on the
// subdirective in (*Handler).UnmarshalCaddyfile,
// (*RedisConfig).unmarshalCaddyfile (the tls options are those of its
// switch on opt) and unmarshalPolicy.
// mholt/caddy-ratelimit's subdirectives, accepted for its Caddyfiles, are
// documented in docs/migrating.md instead.
func TestReferenceSyntax(t *testing.T) {
	raw, err := os.ReadFile(referenceFile)
	if err != nil {
		t.Fatal(err)
	}
	reference := string(raw)
	block, err := syntaxBlock(reference)
	if err != nil {
		t.Fatal(err)
	}
	documented := syntaxNames(block)
	accepted, err := parserNames("caddyfile.go")
	if err != nil {
		t.Fatal(err)
	}

	migrating, err := os.ReadFile("docs/migrating.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range mholtSubdirectives {
		if !slices.Contains(accepted[blockHandler], name) {
			t.Errorf("%s: listed as a mholt/caddy-ratelimit subdirective, but (*Handler).UnmarshalCaddyfile does not accept it: update mholtSubdirectives", name)
		}
		if !strings.Contains(string(migrating), "`"+name) {
			t.Errorf("%s: a mholt/caddy-ratelimit subdirective the parser accepts, not documented in docs/migrating.md", name)
		}
	}
	accepted[blockHandler] = slices.DeleteFunc(accepted[blockHandler], func(s string) bool {
		return slices.Contains(mholtSubdirectives, s)
	})

	for _, b := range []string{blockHandler, blockRedis, blockTLS, blockPolicy} {
		doc, code := documented[b], accepted[b]
		if len(code) == 0 {
			t.Errorf("%s: found no case strings in caddyfile.go: has the parser moved?", b)
		}
		for _, name := range code {
			if !slices.Contains(doc, name) {
				t.Errorf("%s: the parser accepts %q, which the syntax block of %s does not list", b, name, referenceFile)
			}
		}
		for _, name := range doc {
			if !slices.Contains(code, name) {
				t.Errorf("%s: the syntax block of %s lists %q, which the parser does not accept", b, referenceFile, name)
			}
		}
		for _, name := range doc {
			if !tableRow(reference, name) {
				t.Errorf("%s: %q has no row in the directive tables of %s (a row starting with \"| `%s\")", b, name, referenceFile, name)
			}
		}
		t.Logf("%s: %s", b, strings.Join(doc, ", "))
	}
}

// referenceFile holds the syntax, its tables, the JSON and the metrics.
const referenceFile = "docs/reference.md"

// The blocks whose subdirectives are compared.
const (
	blockHandler = "rate_limit"
	blockRedis   = "redis"
	blockTLS     = "redis tls options"
	blockPolicy  = "policy"
)

// mholtSubdirectives are mholt/caddy-ratelimit's, which the parser accepts
// so that its Caddyfiles adapt, and docs/migrating.md documents.
var mholtSubdirectives = []string{"zone", "distributed", "storage", "sweep_interval", "log_key", "disable_metrics"}

// syntaxBlock returns the first ```caddyfile block after the heading
// "## Caddyfile syntax" of the reference.
func syntaxBlock(reference string) (string, error) {
	_, after, ok := strings.Cut(reference, "\n## Caddyfile syntax\n")
	if !ok {
		return "", errorString(referenceFile + " has no heading \"## Caddyfile syntax\"")
	}
	_, after, ok = strings.Cut(after, "```caddyfile\n")
	if !ok {
		return "", errorString(referenceFile + " has no ```caddyfile block after \"## Caddyfile syntax\"")
	}
	block, _, ok := strings.Cut(after, "\n```")
	if !ok {
		return "", errorString(referenceFile + ": the syntax block does not end")
	}
	return block, nil
}

type errorString string

func (e errorString) Error() string { return string(e) }

// syntaxNames collects the subdirectives of each block of the syntax: the
// first word of each line in rate_limit { }, redis { } and policy <name> { }
// (not in match { }, whose lines are request matchers), and the options of
// tls, the first word of each of its [...] groups.
func syntaxNames(block string) map[string][]string {
	names := map[string][]string{}
	add := func(b, name string) {
		if !slices.Contains(names[b], name) {
			names[b] = append(names[b], name)
		}
	}
	stack := []string{""} // the blocks the line is in; "" outside rate_limit
	for _, line := range strings.Split(block, "\n") {
		fields := strings.Fields(line)
		for i, f := range fields {
			if strings.HasPrefix(f, "#") {
				fields = fields[:i]
				break
			}
		}
		if len(fields) == 0 {
			continue
		}
		in, name := stack[len(stack)-1], fields[0]
		if name != "}" {
			switch in {
			case blockHandler, blockPolicy:
				add(in, name)
			case blockRedis:
				add(in, name)
				if name == "tls" {
					for _, f := range fields[1:] {
						if opt, ok := strings.CutPrefix(f, "["); ok {
							add(blockTLS, strings.TrimSuffix(opt, "]"))
						}
					}
				}
			}
		}
		// Only a token that is a brace opens or closes a block, as in a
		// Caddyfile: {placeholder} does not.
		for _, f := range fields {
			switch f {
			case "{":
				switch {
				case in == "" && name == "rate_limit":
					stack = append(stack, blockHandler)
				case in == blockHandler && (name == "redis" || name == "policy"):
					stack = append(stack, name)
				default:
					stack = append(stack, "other")
				}
			case "}":
				if len(stack) > 1 {
					stack = stack[:len(stack)-1]
				}
			}
		}
	}
	return names
}

// parserNames reads, from the Go source of the Caddyfile parser, the
// subdirectives each function accepts: the string constants of the case
// clauses of its switch statements on the subdirective's name (sub), and
// of the redis block's switch on the tls option (opt).
func parserNames(file string) (map[string][]string, error) {
	f, err := parser.ParseFile(token.NewFileSet(), file, nil, 0)
	if err != nil {
		return nil, err
	}
	names := map[string][]string{}
	found := map[string]bool{}
	for _, decl := range f.Decls {
		fn, ok := decl.(*ast.FuncDecl)
		if !ok || fn.Body == nil {
			continue
		}
		var b string
		switch recv, name := receiverType(fn), fn.Name.Name; {
		case recv == "Handler" && name == "UnmarshalCaddyfile":
			b = blockHandler
		case recv == "RedisConfig" && name == "unmarshalCaddyfile":
			b = blockRedis
		case recv == "" && name == "unmarshalPolicy":
			b = blockPolicy
		default:
			continue
		}
		found[b] = true
		ast.Inspect(fn.Body, func(n ast.Node) bool {
			sw, ok := n.(*ast.SwitchStmt)
			if !ok {
				return true
			}
			// The switches on the subdirective's name (sub), and in the redis
			// block the one on the tls option (opt); not others a parser may
			// have on a subdirective's values.
			tag, _ := sw.Tag.(*ast.Ident)
			var into string
			switch {
			case tag == nil:
				return true
			case tag.Name == "sub":
				into = b
			case tag.Name == "opt" && b == blockRedis:
				into = blockTLS
			default:
				return true
			}
			for _, stmt := range sw.Body.List {
				for _, e := range stmt.(*ast.CaseClause).List {
					lit, ok := e.(*ast.BasicLit)
					if !ok || lit.Kind != token.STRING {
						continue
					}
					s, err := strconv.Unquote(lit.Value)
					if err == nil && !slices.Contains(names[into], s) {
						names[into] = append(names[into], s)
					}
				}
			}
			return true
		})
	}
	for _, b := range []string{blockHandler, blockRedis, blockPolicy} {
		if !found[b] {
			return nil, errorString(file + ": the parser function of the " + b + " block is not there: has it been renamed?")
		}
	}
	return names, nil
}

// receiverType is the name of fn's receiver type, "" for a function.
func receiverType(fn *ast.FuncDecl) string {
	if fn.Recv == nil || len(fn.Recv.List) == 0 {
		return ""
	}
	typ := fn.Recv.List[0].Type
	if star, ok := typ.(*ast.StarExpr); ok {
		typ = star.X
	}
	if id, ok := typ.(*ast.Ident); ok {
		return id.Name
	}
	return ""
}

// tableRow reports whether the reference has a table row for the
// subdirective name: a line starting with "| `name", the name followed by a
// space or the closing backtick.
func tableRow(reference, name string) bool {
	re := regexp.MustCompile("(?m)^\\| `" + regexp.QuoteMeta(name) + "[ `]")
	return re.MatchString(reference)
}

// TestReadmeJSON: the README's first config is the same in its Caddyfile
// and its JSON (the first ```caddyfile and ```json blocks after "## A first
// config"): the Caddyfile adapts to exactly that JSON, which Caddy
// validates. Every JSON block of the README and the reference that is a
// rate_limit handler provisions.
func TestReadmeJSON(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	_, first, ok := strings.Cut(string(raw), "\n## A first config\n")
	if !ok {
		t.Fatal(`README.md has no heading "## A first config"`)
	}
	block := func(text, lang string) string {
		_, after, ok := strings.Cut(text, "```"+lang+"\n")
		if !ok {
			t.Fatalf("README.md: no ```%s block after \"## A first config\"", lang)
		}
		b, _, _ := strings.Cut(after, "\n```")
		return b
	}
	caddyfileText, jsonText := block(first, "caddyfile")+"\n", block(first, "json")
	adapted, warnings, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
	if err != nil || len(warnings) > 0 {
		t.Fatalf("the README's first Caddyfile: %v %v", err, warnings)
	}
	var got, want any
	if err := json.Unmarshal(adapted, &got); err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal([]byte(jsonText), &want); err != nil {
		t.Fatalf("the README's first JSON is not JSON: %v", err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("the README's first Caddyfile adapts to\n%s\nnot to its JSON", adapted)
	}
	t.Setenv("RATE_LIMIT_SECRET", "readme-test-secret")
	cfg := new(caddy.Config)
	if err := caddy.StrictUnmarshalJSON([]byte(jsonText), cfg); err != nil {
		t.Fatal(err)
	}
	if err := caddy.Validate(cfg); err != nil {
		t.Errorf("the README's first JSON: %v", err)
	}

	reference, err := os.ReadFile(referenceFile)
	if err != nil {
		t.Fatal(err)
	}
	handlers := 0
	for _, m := range regexp.MustCompile("(?s)```json\n(.*?)\n```").FindAllStringSubmatch(string(raw)+"\n"+string(reference), -1) {
		var v map[string]any
		if err := json.Unmarshal([]byte(m[1]), &v); err != nil {
			t.Errorf("a README JSON block is not JSON: %v\n%s", err, m[1])
			continue
		}
		if v["handler"] != "rate_limit" {
			continue
		}
		handlers++
		delete(v, "handler") // the module's name, not one of its fields
		fields, _ := json.Marshal(v)
		h := new(Handler)
		if err := caddy.StrictUnmarshalJSON(fields, h); err != nil {
			t.Errorf("a README rate_limit handler: %v\n%s", err, m[1])
			continue
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		if err := h.Provision(ctx); err != nil {
			t.Errorf("a README rate_limit handler does not provision: %v\n%s", err, m[1])
		} else {
			_ = h.Cleanup()
		}
		cancel()
	}
	if handlers == 0 {
		t.Errorf("neither the README nor %s has a rate_limit handler block", referenceFile)
	}
}

// The alerting rules operators load (docs/operators-guide.md, Alerts), and
// their promtool tests.
const (
	alertRulesFile = "docs/prometheus/rate-limit-alerts.yml"
	alertTestsFile = "docs/prometheus/rate-limit-alerts.test.yml"
)

// TestAlertRules checks the rules file with promtool and runs its unit
// tests (`promtool test rules`): each alert fires for what it is about,
// with its labels and annotations, and not for what it is not. Every
// alert of the file has a test in which it fires. promtool comes with
// Debian's prometheus package, which `make test` installs when missing.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (run `make test`, which installs Debian's prometheus package, or apt-get install prometheus): %v", err)
	}
	dir, rules := filepath.Dir(alertRulesFile), filepath.Base(alertRulesFile)
	for _, args := range [][]string{{"check", "rules", rules}, {"test", "rules", filepath.Base(alertTestsFile)}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("promtool %v: %v\n%s", args, err, out)
		}
		t.Logf("promtool %v:\n%s", args, out)
	}

	raw, err := os.ReadFile(alertRulesFile)
	if err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile(alertTestsFile)
	if err != nil {
		t.Fatal(err)
	}
	alerts := regexp.MustCompile(`(?m)^\s*- alert: (\w+)$`).FindAllStringSubmatch(string(raw), -1)
	if len(alerts) < 7 {
		t.Fatalf("%d alerts in %s, it has more", len(alerts), alertRulesFile)
	}
	for _, a := range alerts {
		fires := regexp.MustCompile(`alertname: ` + a[1] + `\n\s+exp_alerts:\n\s+- exp_labels:`)
		if !fires.Match(tests) {
			t.Errorf("%s: no test in %s in which it fires", a[1], alertTestsFile)
		}
	}
}

// TestLLMExamplePaths: the LLM gateway of docs/after-admission.md, adapted
// as written, limits every request under its provider's prefix however the
// path is spelled (a trailing slash, `;a=b`, a suffix, the case, doubled
// slashes, dot segments, percent-encoding), counts GETs as requests and
// POSTs as tokens too, leaves count_tokens out of the token budget only;
// and the rest of the site answers 404 rather than reach the provider.
func TestLLMExamplePaths(t *testing.T) {
	example := llmGatewayExample(t)
	t.Setenv("RATE_LIMIT_SECRET", "test")
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(example), nil)
	if err != nil {
		t.Fatalf("the docs' example does not adapt: %v", err)
	}
	// Each site's rate_limit handler, in process (its redis block dropped).
	var handlers []*Handler
	for _, x := range rateLimitHandlers(t, adapted) {
		delete(x, "redis")
		b, _ := json.Marshal(x)
		h := new(Handler)
		if err := json.Unmarshal(b, h); err != nil {
			t.Fatal(err)
		}
		handlers = append(handlers, h)
	}
	if len(handlers) != 2 || !strings.Contains(string(adapted), `"status_code":404`) {
		t.Fatalf("%d rate_limit handlers in the example, a 404 for the rest: %v", len(handlers), strings.Contains(string(adapted), `"status_code":404`))
	}
	for _, h := range handlers {
		testHandler(t, h, newMemoryStore((&clock{t: 1000 * sec}).now))
	}
	openai, anthropic := handlers[0], handlers[1]
	if strings.HasPrefix(anthropic.Policies[0].Name, "openai") { // the sites in JSON's order
		openai, anthropic = anthropic, openai
	}
	decided := func(h *Handler, method, target string) []string {
		r := httptest.NewRequest(method, "http://gw"+target, strings.NewReader(`{"model":"m","max_tokens":10,"messages":[]}`))
		r.Header.Set("Authorization", "Bearer sk-paths")
		x := serveOn([]*Handler{h}, nil, upstreamAnswering(200), r)
		var names []string
		for name := range fields(t, x.header, "RateLimit") {
			names = append(names, name)
		}
		slices.Sort(names)
		return names
	}
	both := []string{"openai_requests", "openai_tokens"}
	for _, target := range []string{"/v1/chat/completions", "/v1/chat/completions/", "/v1/chat/completions;a=b", "/v1/chat/completions.json",
		"/V1/chat/completions", "//v1/chat/completions", "/v1//chat/completions", "/./v1/chat/completions", "/x/../v1/chat/completions",
		"/v1%2Fchat/completions", "/%761/chat/completions", "/v1/responses", "/v1/embeddings"} {
		if got := decided(openai, "POST", target); !slices.Equal(got, both) {
			t.Errorf("POST %s: decided by %v, want %v", target, got, both)
		}
	}
	if got := decided(openai, "GET", "/v1/models"); !slices.Equal(got, []string{"openai_requests"}) {
		t.Errorf("GET /v1/models: decided by %v, want the requests' policy alone", got)
	}
	for _, target := range []string{"/v1", "/v2/chat/completions", "/openai/v1/chat/completions"} {
		if got := decided(openai, "POST", target); len(got) != 0 {
			t.Errorf("POST %s: decided by %v, want none (the site answers 404)", target, got)
		}
	}
	if got := decided(anthropic, "POST", "/v1/messages/count_tokens"); !slices.Equal(got, []string{"anthropic_requests"}) {
		t.Errorf("POST /v1/messages/count_tokens: decided by %v, want the requests' policy alone", got)
	}
	for _, target := range []string{"/v1/messages", "/v1/messages/", "/v1/messages/count_tokens/", "/V1/Messages/count_tokens;x"} {
		if got := decided(anthropic, "POST", target); !slices.Equal(got, []string{"anthropic_requests", "anthropic_tokens"}) {
			t.Errorf("POST %s: decided by %v, want both", target, got)
		}
	}
}

// TestDocsCommandPaths: every file or directory a command of the README or
// docs/ names by a relative path (a config given to --config, ./cmd/…,
// ./integration_test, Caddyfile.fleet, a .json or .yml file) exists in the
// repository, where the docs run their commands from (the root, or the
// directory a `cd` moved to), unless the same code block creates it. An
// absolute path is the reader's own (/etc/caddy/Caddyfile), a $VARIABLE
// theirs too. Commands are the lines of ```sh blocks and the inline code
// that starts with a command (make, go, caddy, bin/caddy, promtool, cd).
func TestDocsCommandPaths(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append(files, "README.md", "xcaddy.md")
	shBlock := regexp.MustCompile("(?ms)^[ \t]*```sh\n(.*?)^[ \t]*```")
	inline := regexp.MustCompile("`((?:make|go|caddy|bin/caddy|promtool|cd|[A-Z_]+=\\S+ go) [^`]+)`")
	created := regexp.MustCompile(`(?:>|-o|--output)\s+(\S+)`)
	pathLike := regexp.MustCompile(`^(\./\S+|[\w.-]+(/[\w.-]+)*\.(Caddyfile|json|ya?ml|go|md|mjs|svg)|Caddyfile(\.\w+)?|[\w-]+(/[\w.-]+)+)$`)
	checked := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		var commands [][]string // the lines of one block, or one inline command
		for _, m := range shBlock.FindAllStringSubmatch(string(raw), -1) {
			commands = append(commands, strings.Split(m[1], "\n"))
		}
		for _, m := range inline.FindAllStringSubmatch(string(raw), -1) {
			commands = append(commands, []string{m[1]})
		}
		for _, lines := range commands {
			made := map[string]bool{}
			for _, l := range lines {
				for _, c := range created.FindAllStringSubmatch(l, -1) {
					made[c[1]] = true
				}
			}
			for _, line := range lines {
				line, _, _ = strings.Cut(line, " #")
				line = strings.TrimPrefix(strings.TrimSpace(line), "$ ")
				if strings.Contains(line, "<<") || strings.HasPrefix(line, "#") {
					continue
				}
				dir := "."
				for _, part := range regexp.MustCompile(`&&|;|\|`).Split(line, -1) {
					fields := strings.Fields(part)
					if len(fields) == 2 && fields[0] == "cd" {
						dir = filepath.Join(dir, fields[1])
						continue
					}
					for i, tok := range fields {
						tok = strings.Trim(tok, `"'`)
						if i == 0 && !strings.HasPrefix(tok, "./") || strings.ContainsAny(tok, "$<>{}*=:[") || strings.HasPrefix(tok, "/") || strings.HasSuffix(tok, "/...") ||
							!pathLike.MatchString(tok) || made[tok] || i > 0 && (fields[i-1] == "-o" || fields[i-1] == "-D" || fields[i-1] == ">") {
							continue
						}
						if strings.Contains(tok, "/") && !strings.HasPrefix(tok, "./") && !strings.Contains(tok, ".") && i > 0 && fields[i-1] != "--config" {
							continue // a/b without a dot is rarely a path: an API route, a module
						}
						checked++
						if _, err := os.Stat(filepath.Join(dir, tok)); err != nil {
							t.Errorf("%s: `%s` names %s, which does not exist (from %s)", f, strings.TrimSpace(line), tok, dir)
						}
					}
				}
			}
		}
	}
	if checked < 20 {
		t.Fatalf("checked %d paths in the docs' commands, they name more", checked)
	}
	t.Logf("%d paths named in commands exist", checked)
}

// TestDocsLinks: every relative link of the README and docs/ (and
// xcaddy.md) reaches a file of the repository, and its #anchor a heading
// of that file (as GitHub makes anchors of headings).
func TestDocsLinks(t *testing.T) {
	files, _ := filepath.Glob("docs/*.md")
	files = append(files, "README.md", "xcaddy.md")
	link := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	heading := regexp.MustCompile("(?m)^#+ (.+)$")
	fence := regexp.MustCompile("(?ms)^[ \t]*```.*?^[ \t]*```")
	anchors := func(file string) map[string]bool {
		raw, err := os.ReadFile(file)
		if err != nil {
			return nil
		}
		out := map[string]bool{}
		for _, m := range heading.FindAllStringSubmatch(fence.ReplaceAllString(string(raw), ""), -1) {
			a := strings.ToLower(m[1])
			a = regexp.MustCompile("[^a-z0-9 _-]").ReplaceAllString(a, "")
			out[strings.ReplaceAll(a, " ", "-")] = true
		}
		return out
	}
	n := 0
	for _, f := range files {
		raw, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range link.FindAllStringSubmatch(fence.ReplaceAllString(string(raw), ""), -1) {
			target := m[1]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			path, anchor, _ := strings.Cut(target, "#")
			file := f
			if path != "" {
				file = filepath.Join(filepath.Dir(f), path)
				if _, err := os.Stat(file); err != nil {
					t.Errorf("%s: the link %s: %v", f, target, err)
					continue
				}
			}
			n++
			if anchor != "" && !anchors(file)[anchor] {
				t.Errorf("%s: the link %s: %s has no heading whose anchor is #%s", f, target, file, anchor)
			}
		}
	}
	t.Logf("%d links checked", n)
}
