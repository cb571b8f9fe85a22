package ratelimit

import (
	"net/http"
	"net/textproto"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/clientaddr"
)

// template is a key or cost template, resolved per request as
// repl.ReplaceAll(text, "") would, but faster in the common cases: a
// template that is one placeholder is looked up without scanning it, and
// one request header ({http.request.header.X-Api-Key}, the Caddyfile's
// {header.X-Api-Key}), the bearer token ({http.rate_limit.bearer}) or the
// credential ({http.rate_limit.credential}) is
// read from the request directly. A client address
// in it ({client_ip}, {remote_host}, {http.request.remote}) is masked to
// the policy's prefix lengths (see clientaddr.Mask): alone, or among other parts
// (`{client_ip}-{http.request.uri.path}`), whose text is split at
// provision into literals and placeholders so that only the address parts
// are masked.
type template struct {
	text     string
	variable string          // the placeholder's name when text is exactly one
	header   string          // the canonical field name when that is a request header
	bearer   bool            // the placeholder is {http.rate_limit.bearer}
	cred     bool            // the placeholder is {http.rate_limit.credential}
	addr     clientaddr.Kind // whether variable is a client address
	// parts is the text split into literals and placeholders, when it
	// combines a client address with anything else.
	parts []templatePart
}

// templatePart is a literal or, when variable is set, a placeholder.
type templatePart struct {
	literal  string
	variable string
	addr     clientaddr.Kind
}

func newTemplate(text string) template {
	t := template{text: text, variable: soleVariable(text)}
	t.bearer, t.cred = t.variable == bearerPlaceholder, t.variable == credentialPlaceholder
	if t.variable != "" {
		t.variable, t.addr = clientaddr.Placeholder(t.variable)
		if field, ok := strings.CutPrefix(t.variable, reqHeaderPlaceholder); ok {
			t.header = textproto.CanonicalMIMEHeaderKey(field)
		}
		return t
	}
	if parts, ok := parseTemplate(text); ok {
		for _, p := range parts {
			if p.addr != clientaddr.None {
				t.parts = parts
				break
			}
		}
	}
	return t
}

// constant reports whether the template resolves to its own text: no
// placeholder, no escape.
func (t template) constant() bool { return !strings.ContainsAny(t.text, "{}\\") }

// usesAddr reports whether the template holds a client address.
func (t template) usesAddr() bool { return t.addr != clientaddr.None || t.parts != nil }

// reqHeaderPlaceholder prefixes Caddy's request header placeholders.
const reqHeaderPlaceholder = "http.request.header."

// resolve is the template's value for the request, its client addresses
// masked by m.
func (t template) resolve(r *http.Request, repl *caddy.Replacer, m clientaddr.Mask) string {
	switch {
	case t.bearer:
		return bearerToken(r.Header["Authorization"])
	case t.cred:
		return credential(r.Header)
	case t.header != "":
		// What Caddy's placeholder gives: the field's values joined by commas.
		vals := r.Header[t.header]
		if len(vals) == 1 {
			return vals[0]
		}
		return strings.Join(vals, ",")
	case t.variable != "":
		v, _ := repl.GetString(t.variable) // unknown: empty, as ReplaceAll
		if t.addr != clientaddr.None {
			v = m.Masked(v, t.addr)
		}
		return v
	case t.parts != nil:
		return resolveParts(t.parts, repl, m)
	default:
		return repl.ReplaceAll(t.text, "")
	}
}

func resolveParts(parts []templatePart, repl *caddy.Replacer, m clientaddr.Mask) string {
	var buf [128]byte
	b := buf[:0]
	for _, p := range parts {
		if p.variable == "" {
			b = append(b, p.literal...)
			continue
		}
		v, _ := repl.GetString(p.variable) // unknown: empty, as ReplaceAll
		if p.addr != clientaddr.None {
			b, _ = m.AppendMasked(b, v, p.addr)
		} else {
			b = append(b, v...)
		}
	}
	return string(b)
}

// parseTemplate splits text into literals and placeholders exactly as
// Caddy's replacer scans it (caddy.Replacer.ReplaceAll: `\{` and `\}`
// are literal braces, a placeholder ends at its first unescaped `}`, an
// unclosed `{` is literal); ok is false for a text it gives up on (more
// than 100 unclosed braces), which is then resolved by the replacer.
func parseTemplate(text string) (parts []templatePart, ok bool) {
	var lit strings.Builder
	flush := func() {
		if lit.Len() > 0 {
			parts = append(parts, templatePart{literal: lit.String()})
			lit.Reset()
		}
	}
	last, unclosed := 0, 0
scan:
	for i := 0; i < len(text); i++ {
		if i > 0 && text[i-1] == '\\' && (text[i] == '}' || text[i] == '{') {
			lit.WriteString(text[last : i-1])
			last = i
			continue
		}
		if text[i] != '{' {
			continue
		}
		if unclosed > 100 {
			return nil, false
		}
		end := strings.IndexByte(text[i:], '}') + i
		if end < i {
			unclosed++
			continue
		}
		for end > 0 && end < len(text)-1 && text[end-1] == '\\' {
			next := strings.IndexByte(text[end+1:], '}')
			if next < 0 {
				unclosed++
				continue scan
			}
			end += next + 1
		}
		lit.WriteString(text[last:i])
		flush()
		name, kind := clientaddr.Placeholder(text[i+1 : end])
		parts = append(parts, templatePart{variable: name, addr: kind})
		i = end
		last = i + 1
	}
	lit.WriteString(text[last:])
	flush()
	return parts, true
}

// soleVariable is the name of the placeholder that tmpl consists of, or ""
// when tmpl is anything else.
func soleVariable(tmpl string) string {
	if len(tmpl) < 3 || tmpl[0] != '{' || tmpl[len(tmpl)-1] != '}' || strings.ContainsAny(tmpl[1:len(tmpl)-1], "{}\\") {
		return ""
	}
	return tmpl[1 : len(tmpl)-1]
}

// identityOf is the identity an operator names (caddy rate-limit inspect
// per_ip 2001:db8:1:2::9) as the policy's key holds it: its client address
// masked, so that it names the bucket the handler uses for it (here the
// /64's). For a key that combines the address with other parts, raw is
// the whole value as the key puts it together (`2001:db8::9-/login` for
// `{client_ip}-{http.request.uri.path}`); the address in it is masked
// when it can be told apart from the rest. Anything else is kept as it is,
// so a value already masked (2001:db8:1:2::/64) names the same bucket.
func (p *Policy) identityOf(raw string) string {
	t := p.keyTmpl
	switch {
	case t.addr != clientaddr.None:
		return p.addrMask.Masked(raw, t.addr)
	case t.parts != nil:
		if vals, ok := splitParts(t.parts, raw); ok {
			var b []byte
			for i, part := range t.parts {
				switch {
				case part.variable == "":
					b = append(b, part.literal...)
				case part.addr != clientaddr.None:
					b, _ = p.addrMask.AppendMasked(b, vals[i], part.addr)
				default:
					b = append(b, vals[i]...)
				}
			}
			return string(b)
		}
	}
	return raw
}

// Bounds of splitParts's search, whose input an operator sends.
const (
	maxSplitLen   = 4096
	maxSplitSteps = 10_000
)

// splitParts finds the placeholders' values in raw, a value the parts
// resolved to: each placeholder's value ends where the next literal
// begins, and an address placeholder's value is an address. ok is false
// when there is no such split (or it cannot be found within bounds, or two
// placeholders touch, leaving their boundary unknown).
func splitParts(parts []templatePart, raw string) (vals []string, ok bool) {
	if len(raw) > maxSplitLen {
		return nil, false
	}
	vals = make([]string, len(parts))
	steps := 0
	var match func(i int, rest string) bool
	match = func(i int, rest string) bool {
		if steps++; steps > maxSplitSteps {
			return false
		}
		if i == len(parts) {
			return rest == ""
		}
		p := parts[i]
		if p.variable == "" {
			after, ok := strings.CutPrefix(rest, p.literal)
			return ok && match(i+1, after)
		}
		fits := func(v string) bool { return p.addr == clientaddr.None || clientaddr.Valid(v, p.addr) }
		if i+1 == len(parts) {
			vals[i] = rest
			return fits(rest)
		}
		next := parts[i+1].literal
		if next == "" {
			return false
		}
		for off := 0; off <= len(rest); {
			j := strings.Index(rest[off:], next)
			if j < 0 {
				return false
			}
			if v := rest[:off+j]; fits(v) {
				vals[i] = v
				if match(i+1, rest[off+j:]) {
					return true
				}
			}
			off += j + 1
		}
		return false
	}
	return vals, match(0, raw)
}
