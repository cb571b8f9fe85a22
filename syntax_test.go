package ratelimit

import (
	"context"
	"encoding/json"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestReadmeSyntax pins the README's Caddyfile syntax block (the first
// ```caddyfile block after the heading "## Caddyfile syntax") to what the
// parser in caddyfile.go accepts, and each name to a row of the README's
// directive tables, so that the documentation cannot drift from the code.
// What the parser accepts is read from caddyfile.go itself: the string
// constants of the case clauses of the switch statements on the
// subdirective in (*Handler).UnmarshalCaddyfile,
// (*RedisConfig).unmarshalCaddyfile (the tls options are those of its
// switch on opt) and unmarshalPolicy.
// mholt/caddy-ratelimit's subdirectives, accepted for its Caddyfiles, are
// documented in docs/migrating.md instead.
func TestReadmeSyntax(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(raw)
	block, err := syntaxBlock(readme)
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
				t.Errorf("%s: the parser accepts %q, which the README's syntax block does not list", b, name)
			}
		}
		for _, name := range doc {
			if !slices.Contains(code, name) {
				t.Errorf("%s: the README's syntax block lists %q, which the parser does not accept", b, name)
			}
		}
		for _, name := range doc {
			if !tableRow(readme, name) {
				t.Errorf("%s: %q has no row in the README's directive tables (a row starting with \"| `%s\")", b, name, name)
			}
		}
		t.Logf("%s: %s", b, strings.Join(doc, ", "))
	}
}

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
// "## Caddyfile syntax".
func syntaxBlock(readme string) (string, error) {
	_, after, ok := strings.Cut(readme, "\n## Caddyfile syntax\n")
	if !ok {
		return "", errorString("README.md has no heading \"## Caddyfile syntax\"")
	}
	_, after, ok = strings.Cut(after, "```caddyfile\n")
	if !ok {
		return "", errorString("README.md has no ```caddyfile block after \"## Caddyfile syntax\"")
	}
	block, _, ok := strings.Cut(after, "\n```")
	if !ok {
		return "", errorString("README.md: the syntax block does not end")
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

// tableRow reports whether the README has a table row for the subdirective
// name: a line starting with "| `name", the name followed by a space or
// the closing backtick.
func tableRow(readme, name string) bool {
	re := regexp.MustCompile("(?m)^\\| `" + regexp.QuoteMeta(name) + "[ `]")
	return re.MatchString(readme)
}

// TestReadmeJSON: the README's first config is the same in its Caddyfile
// and its JSON (the first ```caddyfile and ```json blocks after "## A first
// config"): the Caddyfile adapts to exactly that JSON, which Caddy
// validates. Every other JSON block of the README that is a rate_limit
// handler provisions.
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

	handlers := 0
	for _, m := range regexp.MustCompile("(?s)```json\n(.*?)\n```").FindAllStringSubmatch(string(raw), -1) {
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
		t.Error("the README's JSON section has no rate_limit handler block")
	}
}
