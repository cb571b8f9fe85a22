package ratelimit

import (
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestResolveMatchesReplaceAll: looking a sole placeholder up directly gives
// what Caddy's replacer gives for the template.
func TestResolveMatchesReplaceAll(t *testing.T) {
	repl := caddy.NewReplacer()
	repl.Set("user.id", "alice")
	repl.Set("user.cost", 7)
	repl.Set("user.empty", "")
	repl.Set("user.nil", nil)
	for _, tmpl := range []string{
		"{user.id}", "{user.cost}", "{user.empty}", "{user.nil}", "{unknown.thing}", "{}", "{", "}",
		"global", "", "{user.id}{user.cost}", "x{user.id}", "{user.id}x", "{user.{id}", `{user.id\}`, `\{user.id}`,
		"{{user.id}}", "{user.id", "user.id}",
	} {
		if got, want := resolve(repl, tmpl, soleVariable(tmpl)), repl.ReplaceAll(tmpl, ""); got != want {
			t.Errorf("template %q: resolved %q, ReplaceAll %q", tmpl, got, want)
		}
	}
}
