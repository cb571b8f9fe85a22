// Package limitsfile reads a limits file: the overrides of many identities
// of many policies, in one declarative file (YAML, or JSON, which is YAML
// too), that `caddy rate-limit apply` makes the fleet hold. Each entry is
// read on its own: a wrong one is reported with its line, and the others
// are still read.
//
//	source: billing                 # names the overrides this file owns
//	overrides:
//	  - policy: per_tenant
//	    identity: acme              # the raw value the policy keys on
//	    rate: 5000/1m               # or concurrent: 10, or quota: 5000000/month
//	    burst: 500
//	    expires: 2026-01-01T00:00:00Z   # or a date; none: until removed from the file
//	    note: contract 123
package limitsfile

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"go.yaml.in/yaml/v3"
)

// Entry is one override of the file, as written.
type Entry struct {
	Line       int    `json:"line"`
	Policy     string `json:"policy"`
	Identity   string `json:"identity"`
	Rate       string `json:"rate,omitempty"`
	Burst      int64  `json:"burst,omitempty"`
	Concurrent int64  `json:"concurrent,omitempty"`
	Quota      string `json:"quota,omitempty"`
	// Expires is when the override expires, Unix ms (0: never).
	Expires int64  `json:"expires_ms,omitempty"`
	Note    string `json:"note,omitempty"`
}

// LineError is an entry that could not be read.
type LineError struct {
	Line int    `json:"line"`
	Msg  string `json:"error"`
}

func (e LineError) Error() string { return fmt.Sprintf("line %d: %s", e.Line, e.Msg) }

// File is a limits file as read: its source tag, the entries that could be
// read and the errors of those that could not.
type File struct {
	Source  string
	Entries []Entry
	Errors  []LineError
}

// MaxInteger is the largest number an entry may hold: what a Caddy config
// and the store hold exactly (2^53).
const MaxInteger = 1 << 53

// maxEntries bounds a file's overrides.
const maxEntries = 1_000_000

// Source tags: letters, digits and `_.-:/@`, at most 64.
func validSource(s string) bool {
	if s == "" || len(s) > 64 {
		return false
	}
	for _, c := range s {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.ContainsRune("_.-:/@", c)) {
			return false
		}
	}
	return true
}

// ValidSource reports whether s may tag a file's overrides.
func ValidSource(s string) bool { return validSource(s) }

// Parse reads a limits file. An error is returned only for a file that is
// not one at all (not YAML or JSON, no overrides list, a bad source); a
// wrong entry is in File.Errors, with its line.
func Parse(data []byte) (*File, error) {
	var doc yaml.Node
	if err := yaml.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("not YAML or JSON: %v", err)
	}
	if len(doc.Content) == 0 {
		return nil, errors.New("empty: expected source: <tag> and overrides: [...]")
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("line %d: expected a mapping with source and overrides", root.Line)
	}
	f := &File{}
	var list *yaml.Node
	seen := map[string]int{}
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		if prev, dup := seen[k.Value]; dup {
			return nil, fmt.Errorf("line %d: %s given twice (first on line %d)", k.Line, k.Value, prev)
		}
		seen[k.Value] = k.Line
		switch k.Value {
		case "source":
			if v.Kind != yaml.ScalarNode || !validSource(v.Value) {
				return nil, fmt.Errorf("line %d: source: %q: 1 to 64 letters, digits, _ . - : / @", v.Line, v.Value)
			}
			f.Source = v.Value
		case "overrides":
			if v.Kind != yaml.SequenceNode && !(v.Kind == yaml.ScalarNode && v.Tag == "!!null") {
				return nil, fmt.Errorf("line %d: overrides: expected a list", v.Line)
			}
			list = v
		default:
			return nil, fmt.Errorf("line %d: unknown %q: a limits file has source and overrides", k.Line, k.Value)
		}
	}
	if list == nil {
		return nil, errors.New("no overrides: expected overrides: [...] (an empty list removes every override the source owns)")
	}
	if len(list.Content) > maxEntries {
		return nil, fmt.Errorf("%d overrides: at most %d a file", len(list.Content), maxEntries)
	}
	for _, n := range list.Content {
		e, err := entry(n)
		if err != nil {
			f.Errors = append(f.Errors, LineError{Line: n.Line, Msg: err.Error()})
			continue
		}
		f.Entries = append(f.Entries, e)
	}
	return f, nil
}

// entry reads one override.
func entry(n *yaml.Node) (Entry, error) {
	e := Entry{Line: n.Line}
	if n.Kind != yaml.MappingNode {
		return e, errors.New("expected an override: {policy: ..., identity: ..., rate: ... | concurrent: ... | quota: ...}")
	}
	seen := map[string]bool{}
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if seen[k.Value] {
			return e, fmt.Errorf("%s given twice", k.Value)
		}
		seen[k.Value] = true
		if v.Kind != yaml.ScalarNode {
			return e, fmt.Errorf("%s: expected a value, not a list or a mapping", k.Value)
		}
		var err error
		switch k.Value {
		case "policy":
			e.Policy = v.Value
		case "identity":
			e.Identity = v.Value
		case "rate":
			e.Rate = v.Value
		case "quota":
			e.Quota = v.Value
		case "note":
			e.Note = v.Value
		case "burst":
			e.Burst, err = positive(k.Value, v)
		case "concurrent":
			e.Concurrent, err = positive(k.Value, v)
		case "expires":
			e.Expires, err = expires(v)
		case "for":
			err = errors.New("for: a file is applied again and again, and each time for would push the expiry back: give expires: <date>, e.g. expires: 2026-01-01T00:00:00Z")
		default:
			err = fmt.Errorf("unknown %q: an override has policy, identity, rate, burst, concurrent, quota, expires and note", k.Value)
		}
		if err != nil {
			return e, err
		}
	}
	switch {
	case e.Policy == "":
		return e, errors.New("policy: required")
	case e.Rate == "" && e.Concurrent == 0 && e.Quota == "":
		return e, errors.New("a limit is required: rate <N>/<duration> [burst <n>], concurrent <n> or quota <N>")
	}
	return e, nil
}

// positive reads a positive integer below MaxInteger.
func positive(name string, v *yaml.Node) (int64, error) {
	s := strings.TrimSpace(v.Value)
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		if f, ferr := strconv.ParseFloat(s, 64); ferr == nil && !math.IsInf(f, 0) && f == math.Trunc(f) && f > 0 {
			return 0, fmt.Errorf("%s: %s is more than %d", name, s, int64(MaxInteger))
		}
		return 0, fmt.Errorf("%s: %q is not a positive integer", name, v.Value)
	}
	if n < 1 || n > MaxInteger {
		return 0, fmt.Errorf("%s: %d must be from 1 to %d", name, n, int64(MaxInteger))
	}
	return n, nil
}

// expires reads an RFC 3339 time or a date (midnight UTC).
func expires(v *yaml.Node) (int64, error) {
	s := strings.TrimSpace(v.Value)
	for _, layout := range []string{time.RFC3339Nano, "2006-01-02T15:04:05", "2006-01-02"} {
		if t, err := time.Parse(layout, s); err == nil {
			if t.Year() < 2000 || t.Year() > 9999 {
				return 0, fmt.Errorf("expires: %s is out of range", s)
			}
			return t.UnixMilli(), nil
		}
	}
	return 0, fmt.Errorf("expires: %q is not a time such as 2026-01-01T00:00:00Z or a date such as 2026-01-01", v.Value)
}

// Marshal writes entries as a limits file in YAML, one entry a line: the
// inverse of Parse, for files written by programs and tests.
func Marshal(source string, entries []Entry) []byte {
	var b bytes.Buffer
	b.WriteString("source: " + strconv.Quote(source) + "\noverrides:\n")
	for _, e := range entries {
		b.WriteString("  - {policy: " + strconv.Quote(e.Policy) + ", identity: " + strconv.Quote(e.Identity))
		if e.Rate != "" {
			b.WriteString(", rate: " + strconv.Quote(e.Rate))
		}
		if e.Burst != 0 {
			b.WriteString(", burst: " + strconv.FormatInt(e.Burst, 10))
		}
		if e.Concurrent != 0 {
			b.WriteString(", concurrent: " + strconv.FormatInt(e.Concurrent, 10))
		}
		if e.Quota != "" {
			b.WriteString(", quota: " + strconv.Quote(e.Quota))
		}
		if e.Expires != 0 {
			b.WriteString(", expires: " + time.UnixMilli(e.Expires).UTC().Format(time.RFC3339Nano))
		}
		if e.Note != "" {
			b.WriteString(", note: " + strconv.Quote(e.Note))
		}
		b.WriteString("}\n")
	}
	return b.Bytes()
}
