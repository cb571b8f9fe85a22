package ratelimit

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/json"
	"math"
	"math/big"
	"net/http/httptest"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dunglas/httpsfv"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

// Hostile input, by fuzzing: what an operator writes (Caddyfile, rates,
// costs) and what a client sends (identities, cost values) never panics,
// and whatever is accepted keeps the invariants the rest of the code relies
// on. `go test` runs the seed corpus in testdata/fuzz/<FuzzName>/ as
// regular tests; `go test -run '^$' -fuzz '^FuzzX$' -fuzztime 60s .`
// searches for more.

// FuzzCaddyfile feeds arbitrary text as the body of a `rate_limit { ... }`
// block. The parser must never panic, and what it accepts must be a config
// that loads: the parser promises it checked every number, so each policy
// settles, the handler survives a JSON round trip and provisions (which is
// what `caddy run` does with the adapted JSON).
func FuzzCaddyfile(f *testing.F) {
	f.Add("policy api {\n\tkey {http.request.header.X-Api-Key}\n\trate 100/1m\n}")
	f.Fuzz(func(t *testing.T, body string) {
		if len(body) > 4096 {
			return
		}
		input := "rate_limit {\n" + body + "\n}\n"
		// NewTestDispenser calls log.Fatalf on text the lexer rejects, and
		// first substitutes {$ENV} variables (which could turn valid text
		// into invalid): rule both out before handing it the text.
		if strings.Contains(input, "{$") {
			return
		}
		if _, err := caddyfile.Tokenize([]byte(input), "Testfile"); err != nil {
			return
		}
		h := new(Handler)
		if err := h.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input)); err != nil {
			return
		}
		if len(h.Policies) == 0 {
			t.Fatalf("accepted without a policy:\n%s", input)
		}
		for _, p := range h.Policies {
			if err := p.check(); err != nil {
				t.Fatalf("accepted, but policy %q does not check: %v\n%s", p.Name, err, input)
			}
			checkLimit(t, "policy "+p.Name, p.limit, maxBucketSpan)
			if p.costs.max < 1 {
				t.Fatalf("policy %q: max cost %d", p.Name, p.costs.max)
			}
			// The local failure mode divides the budget between instances:
			// its in-process bucket (int64 arithmetic, no Lua) must not
			// overflow either.
			checkLimit(t, "local fallback of policy "+p.Name+" with instances "+strconv.Itoa(h.Instances), h.localRequest(bucketRequest{limit: p.limit, op: opTake, cost: 1}).limit, 1<<62)
		}
		raw, err := json.Marshal(h)
		if err != nil {
			t.Fatalf("accepted, but does not marshal to JSON: %v\n%s", err, input)
		}

		// The JSON, loaded as Caddy loads it: the admin API keeps the config
		// as JSON values (numbers are doubles), and decodes the modules
		// from those.
		var asValues any
		if err := json.Unmarshal(raw, &asValues); err != nil {
			t.Fatal(err)
		}
		if raw, err = json.Marshal(asValues); err != nil {
			t.Fatal(err)
		}
		loaded := new(Handler)
		if err := caddy.StrictUnmarshalJSON(raw, loaded); err != nil {
			t.Fatalf("the adapted JSON does not decode: %v\n%s\n%s", err, input, raw)
		}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		defer cancel()
		if err := loaded.Provision(ctx); err != nil {
			// Caddy's matchers check some of their arguments (a regexp, a
			// CEL expression) only when loaded, for every directive alike;
			// a CA file is read where Caddy runs, not where it adapts.
			if strings.Contains(err.Error(), "match:") || strings.Contains(err.Error(), "tls: ca:") {
				return
			}
			t.Fatalf("the Caddyfile adapts but its JSON does not load: %v\n%s\n%s", err, input, raw)
		}
		if err := loaded.Cleanup(); err != nil {
			t.Fatal(err)
		}
	})
}

// checkLimit holds a bucket's shape to what bucket.go assumes: at least one
// token, a positive interval, and burst·interval within bound (maxBucketSpan
// for Redis, whose Lua numbers are doubles; less than 2^63 for int64).
func checkLimit(t *testing.T, what string, l limit, bound int64) {
	t.Helper()
	span := new(big.Int).Mul(big.NewInt(l.interval), big.NewInt(l.burst))
	if l.interval < 1 || l.burst < 1 || span.Cmp(big.NewInt(bound)) > 0 {
		t.Fatalf("%s: unsound bucket: interval %dµs, burst %d (span %s µs, at most %d allowed)", what, l.interval, l.burst, span, bound)
	}
}

// FuzzParseRate: parseRate never panics, and a rate it accepts has at least
// one event, a positive period and at most one token per microsecond.
func FuzzParseRate(f *testing.F) {
	f.Add("100/1m")
	f.Fuzz(func(t *testing.T, s string) {
		events, period, err := parseRate(s)
		if err != nil {
			if events != 0 || period != 0 {
				t.Fatalf("%q: error %v with values %d, %v", s, err, events, period)
			}
			return
		}
		if events < 1 || period <= 0 || period/time.Duration(events) < time.Microsecond {
			t.Fatalf("%q accepted as %d per %v", s, events, period)
		}
		// The canonical form reads back the same.
		canon := strconv.FormatInt(events, 10) + "/" + period.String()
		if e2, p2, err := parseRate(canon); err != nil || e2 != events || p2 != period {
			t.Fatalf("%q read as %d per %v, but %q reads as %d per %v (%v)", s, events, period, canon, e2, p2, err)
		}
	})
}

// FuzzParseCost: a fixed cost is a positive integer; anything with a
// placeholder is resolved per request. The resolved cost of a request is
// always in [1, max]: the value itself when it is a positive integer up to
// max, max for anything else.
func FuzzParseCost(f *testing.F) {
	f.Add("1", "5", int64(10))
	f.Fuzz(func(t *testing.T, spec, resolved string, maxCost int64) {
		cost, fixed, err := unitTokens.parseCost(spec)
		switch {
		case err != nil:
			if !fixed {
				t.Fatalf("%q: a placeholder cost failed: %v", spec, err)
			}
		case fixed:
			if cost < 1 {
				t.Fatalf("%q accepted as a fixed cost of %d", spec, cost)
			}
			if strings.Contains(spec, "{") {
				t.Fatalf("%q has a placeholder but was taken as fixed", spec)
			}
		default:
			if !strings.Contains(spec, "{") {
				t.Fatalf("%q taken as a placeholder", spec)
			}
		}

		// A request's cost from a placeholder: what a client sends.
		if maxCost < 1 || maxCost > maxJSONInteger {
			maxCost = 1 + (maxCost & math.MaxInt32)
		}
		p := &Policy{Name: "tokens", Key: "global", Rate: "10/1s", Cost: "{fuzz.cost}", MaxCost: float64(maxCost), Burst: float64(maxCost)} // max above the burst is refused
		if err := p.check(); err != nil {
			t.Fatal(err)
		}
		repl := caddy.NewReplacer()
		repl.Set("fuzz.cost", resolved)
		got := p.cost(httptest.NewRequest("GET", "/", nil), repl)
		want := maxCost
		if v, err := strconv.ParseInt(resolved, 10, 64); err == nil && v >= 1 && v <= maxCost {
			want = v
		}
		if got != want || got < 1 || got > maxCost {
			t.Fatalf("cost %q with max %d charged %d, want %d", resolved, maxCost, got, want)
		}
	})
}

// FuzzStorageKey: any identity, any bytes, becomes <prefix><policy>:{<22
// base64url>}: fixed length, none of the identity in it, distinct identities in
// distinct keys, and a different key_secret makes a different key.
func FuzzStorageKey(f *testing.F) {
	f.Add([]byte("alice"), []byte("bob"), "")
	p := &Policy{Name: "per_user", Key: "{http.request.header.X-User}", Rate: "10/1s"}
	h := &Handler{Policies: []*Policy{p}}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := h.Provision(ctx); err != nil {
		f.Fatal(err)
	}
	const prefix = "rl:per_user:"
	shape := regexp.MustCompile(`^` + regexp.QuoteMeta(prefix) + `\{[A-Za-z0-9_-]{22}\}$`)
	hexLike := regexp.MustCompile(`^[A-Za-z0-9_-]*$`)
	f.Fuzz(func(t *testing.T, id1, id2 []byte, secret string) {
		kh := newKeyHasher(secret)
		k1, k2 := p.storageKey(kh, string(id1)), p.storageKey(kh, string(id2))
		for _, k := range []string{k1, k2} {
			if !shape.MatchString(k) || len(k) != len(prefix)+24 {
				t.Fatalf("key %q for %q is not %s{<22 base64url>}", k, id1, prefix)
			}
		}
		if len(id1) >= 8 && !hexLike.Match(id1) && !strings.Contains(prefix+"{}", string(id1)) && strings.Contains(k1, string(id1)) {
			t.Fatalf("key %q contains the identity %q", k1, id1)
		}
		if (string(id1) == string(id2)) != (k1 == k2) {
			t.Fatalf("identities %q and %q: keys %q and %q", id1, id2, k1, k2)
		}
		if again := p.storageKey(newKeyHasher(secret), string(id1)); again != k1 {
			t.Fatalf("key of %q not stable: %q then %q", id1, k1, again)
		}
		// Without a secret the hash is plain SHA-256, as documented; with
		// one, it is not.
		sum := sha256.Sum256(id1)
		plain := prefix + "{" + base64.RawURLEncoding.EncodeToString(sum[:16]) + "}"
		if (secret == "") != (k1 == plain) {
			t.Fatalf("secret %q: key %q, plain SHA-256 key %q", secret, k1, plain)
		}
		if secret != "" {
			mac := hmac.New(sha256.New, []byte(secret))
			mac.Write(id1)
			if want := prefix + "{" + base64.RawURLEncoding.EncodeToString(mac.Sum(nil)[:16]) + "}"; k1 != want {
				t.Fatalf("secret %q: key %q, HMAC-SHA-256 key %q", secret, k1, want)
			}
		}
	})
}

// FuzzRateLimitFields: the RateLimit-Policy and RateLimit members of any
// valid policy name, rate and burst, for any tokens left and wait the
// bucket can produce, joined as lists, parse as RFC 9651 lists of sf-String
// items (the name) with integer parameters of the right values.
func FuzzRateLimitFields(f *testing.F) {
	f.Add("per_user", "100/1m", int64(0), int64(3), int64(4_500_000))
	f.Fuzz(func(t *testing.T, name, rate string, burst, remaining, wait int64) {
		name = validName(name)
		if name == "" {
			return
		}
		p := &Policy{Name: name, Key: "k", Rate: rate, Burst: float64(burst)}
		if err := p.check(); err != nil {
			return // a config the parser rejects
		}
		// What a bucket of this policy can report: 0..burst tokens left
		// (burst may exceed the sf-Integer range), a wait of -1 (never) or
		// 0..tau µs (at most 2^51, about 71 years).
		remaining = clamp(remaining, 0, p.limit.burst)
		if wait != neverFits {
			wait = clamp(wait, 0, min(p.limit.tau(), 1e15))
		}
		q, w := fieldQuota(p.rate.n, p.rate.per)
		if q < 1 || w < 1 || q > sfIntegerMax || w > sfIntegerMax {
			t.Fatalf("rate %q: RateLimit-Policy q=%d w=%d; both must be positive sf-Integers", rate, q, w)
		}
		const other = "other.policy-2"
		pol := string(policyMember(nil, name, q, w, unitTokens)) + ", " + string(policyMember(nil, other, 1, 1, unitTokens))
		lim := string(limitMember(nil, name, remaining, wait)) + ", " + string(limitMember(nil, other, 0, neverFits))

		checkMembers(t, "RateLimit-Policy", pol, name, map[string]int64{"q": q, "w": w})
		// Beyond the sf-Integer range, r is lowered to its largest value
		// (the draft allows a server to state less than it has).
		want := map[string]int64{"r": min(remaining, sfIntegerMax)}
		if wait != neverFits {
			want["t"] = (wait + 999_999) / 1_000_000
		}
		checkMembers(t, "RateLimit", lim, name, want)
	})
}

// sfIntegerMax is the largest RFC 9651 sf-Integer: 15 decimal digits.
const sfIntegerMax = 999_999_999_999_999

// checkMembers parses a field value as a client would and checks its first
// member (the fuzzed policy) and its second (a fixed one).
func checkMembers(t *testing.T, field, value, name string, want map[string]int64) {
	t.Helper()
	list, err := httpsfv.UnmarshalList([]string{value})
	if err != nil {
		t.Fatalf("%s: %s is not a structured-field list: %v", field, value, err)
	}
	if len(list) != 2 {
		t.Fatalf("%s: %s has %d members, want 2", field, value, len(list))
	}
	item, ok := list[0].(httpsfv.Item)
	if !ok {
		t.Fatalf("%s: %s: first member is not an item", field, value)
	}
	if s, ok := item.Value.(string); !ok || s != name {
		t.Fatalf("%s: %s: member value %#v, want the sf-String %q", field, value, item.Value, name)
	}
	names := item.Params.Names()
	if len(names) != len(want) {
		t.Fatalf("%s: %s: parameters %v, want %v", field, value, names, want)
	}
	for k, v := range want {
		got, ok := item.Params.Get(k)
		if n, isInt := got.(int64); !ok || !isInt || n != v {
			t.Fatalf("%s: %s: parameter %s=%#v, want the integer %d", field, value, k, got, v)
		}
	}
	if second, ok := list[1].(httpsfv.Item); !ok || second.Value != "other.policy-2" {
		t.Fatalf("%s: %s: second member %#v", field, value, list[1])
	}
}

// validName keeps the bytes of s that a policy name may hold, at most 64.
func validName(s string) string {
	var b []byte
	for i := 0; i < len(s) && len(b) < 64; i++ {
		if c := s[i]; 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '-' || c == '.' {
			b = append(b, c)
		}
	}
	if !policyName.Match(b) {
		return ""
	}
	return string(b)
}

// clamp folds v into [lo, hi] (hi ≥ lo), keeping values in range as they
// are and spreading the others over the range.
func clamp(v, lo, hi int64) int64 {
	if v >= lo && v <= hi {
		return v
	}
	span := uint64(hi-lo) + 1
	if span == 0 {
		return v
	}
	return lo + int64(uint64(v)%span)
}

// FuzzParseTemplate: the split of any template into literals and
// placeholders resolves as Caddy's replacer resolves the template, and
// masking any value, as a host or host:port, never panics and is stable.
func FuzzParseTemplate(f *testing.F) {
	f.Add("{client_ip}-{http.request.uri.path}", "2001:db8::1")
	f.Add(`a\{b}{user.id\}c}`, "[::ffff:1.2.3.4]:80")
	f.Fuzz(func(t *testing.T, tmpl, value string) {
		if len(tmpl) > 512 {
			return
		}
		r := httptest.NewRequest("GET", "/a", nil)
		repl := caddyhttp.NewTestReplacer(r)
		repl.Set("user.id", value)
		parts, ok := parseTemplate(tmpl)
		if ok {
			var long []templatePart // the parts with no address, which resolve unmasked
			for _, p := range parts {
				if p.addr == clientaddr.None {
					long = append(long, p)
				}
			}
			if len(long) == len(parts) {
				if got, want := resolveParts(parts, repl, clientaddr.Mask{V4: 32, V6: 64}), repl.ReplaceAll(tmpl, ""); got != want {
					t.Fatalf("%q: parts %+v resolve to %q, ReplaceAll to %q", tmpl, parts, got, want)
				}
			}
		}
		m := clientaddr.Mask{V4: 24, V6: 64}
		for _, kind := range []clientaddr.Kind{clientaddr.Host, clientaddr.HostPort} {
			once := m.Masked(value, kind)
			if m.Masked(once, kind) != once {
				t.Fatalf("%q masked to %q, which masks to %q", value, once, m.Masked(once, kind))
			}
		}
	})
}
