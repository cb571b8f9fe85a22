package ratelimit

import (
	"context"
	"net/http/httptest"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

// TestBearerKey: {http.rate_limit.bearer} keys on the credential alone:
// "Bearer x", "bearer x" and "Bearer   x " share one bucket, "Bearer y"
// has its own, and anything else (no credential, another scheme) shares
// the empty key's.
func TestBearerKey(t *testing.T) {
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{{Name: "per_key", Key: "{http.rate_limit.bearer}", Rate: "3/1h"}}}, newMemoryStore((&clock{t: 1000 * sec}).now))
	for i, auth := range []string{"Bearer x", "bearer x", "BEARER   x ", "Bearer\tx"} {
		x := serve([]*Handler{h}, nil, "Authorization", auth)
		if want := int64(2 - i); i < 3 && (x.status != 200 || fields(t, x.header, "RateLimit")["per_key"]["r"] != want) || i == 3 && x.status != 429 {
			t.Fatalf("%q: %d %q, want the one bucket of x", auth, x.status, x.header.Get("RateLimit"))
		}
	}
	if x := serve([]*Handler{h}, nil, "Authorization", "Bearer y"); x.status != 200 || fields(t, x.header, "RateLimit")["per_key"]["r"] != 2 {
		t.Fatalf("Bearer y: %d %q, want a bucket of its own", x.status, x.header.Get("RateLimit"))
	}
	// No bearer credential: the empty key's one bucket, used up by the
	// fourth request.
	for i, auth := range []string{"", "Basic eDp5", "Bearerx", "Bearer "} {
		x := serve([]*Handler{h}, nil, "Authorization", auth)
		if i < 3 && (x.status != 200 || fields(t, x.header, "RateLimit")["per_key"]["r"] != int64(2-i)) || i == 3 && x.status != 429 {
			t.Fatalf("%q: %d %q, want the empty key's bucket", auth, x.status, x.header.Get("RateLimit"))
		}
	}
	for in, want := range map[string]string{"Bearer abc": "abc", "bearer abc": "abc", "  Bearer   abc  ": "abc", "Bearer a b": "a b", "Basic abc": "", "Bearer": "", "Bearerabc": "", "Token abc": ""} {
		if got := bearerToken([]string{in}); got != want {
			t.Errorf("bearerToken(%q) = %q, want %q", in, got, want)
		}
	}
	// The template's fast path gives what the placeholder gives.
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("Authorization", "bearer  tok")
	repl := caddy.NewReplacer()
	ctx := context.WithValue(r.Context(), caddyhttp.VarsCtxKey, map[string]any{})
	r = r.WithContext(ctx)
	requestStateOf(r, repl)
	tm := newTemplate("{http.rate_limit.bearer}")
	if got, want := tm.resolve(r, repl, clientaddr.Mask{}), repl.ReplaceAll("{http.rate_limit.bearer}", ""); !tm.bearer || got != "tok" || want != "tok" {
		t.Errorf("resolved %q (fast path %v), the replacer %q", got, tm.bearer, want)
	}
	if got := newTemplate("{http.rate_limit.bearer}:x").resolve(r, repl, clientaddr.Mask{}); got != "tok:x" {
		t.Errorf("in a longer template: %q", got)
	}
}
