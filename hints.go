package ratelimit

import (
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/suggest"
)

// Errors that say what to do with a subdirective the parser does not take
// where it is: one that belongs to another block says which, a misspelt one
// gets the nearest name ("burts: did you mean burst?").

// The subdirectives of each block, as its parser's switch takes them
// (TestSubdirectiveLists holds them to caddyfile.go).
var (
	handlerSubdirectives = []string{"redis", "key_secret", "on_error", "jitter", "headers", "shadow", "instances",
		"ipv6_prefix", "ipv4_prefix", "policy", "require_redis", "error_format", "prices", "zone", "distributed", "storage", "sweep_interval", "log_key", "disable_metrics"}
	redisSubdirectives  = []string{"address", "cluster", "sentinel", "username", "password", "db", "tls", "timeout", "pool_size", "key_prefix"}
	policySubdirectives = []string{"match", "key", "rate", "burst", "concurrent", "lease", "cost", "on_error", "shadow", "wait",
		"charge_if", "settle", "ipv6_prefix", "ipv4_prefix", "quota", "timezone", "durable", "plan", "shed", "priority", "error_format", "hot_keys", "unit"}
)

// The blocks, as unknownSubdirective names them.
const (
	blockOfHandler = iota
	blockOfRedis
	blockOfPolicy
)

// unknownSubdirective is the error for sub, which the block it is in (at
// d, with the section's prefix) does not take.
func unknownSubdirective(d *caddyfile.Dispenser, s *section, block int, sub string) error {
	prefix := ""
	if s != nil {
		prefix = s.prefix
	}
	return d.Errf("%sunrecognized subdirective %q: %s", prefix, sub, subdirectiveHint(block, sub))
}

// subdirectiveHint says where sub belongs, or what it may be a slip for.
func subdirectiveHint(block int, sub string) string {
	own := [...][]string{handlerSubdirectives, redisSubdirectives, policySubdirectives}[block]
	switch {
	case block == blockOfPolicy && (sub == "events" || sub == "window"):
		return sub + " is mholt/caddy-ratelimit's, in a zone: a policy's limit is rate <events>/<window>, as rate 100/1m (docs/migrating.md)"
	case block != blockOfPolicy && slices.Contains(policySubdirectives, sub):
		return fmt.Sprintf("%s is a policy's: it belongs inside a policy block, policy <name> { %s ... }, itself inside rate_limit { }", sub, sub)
	case block != blockOfRedis && slices.Contains(redisSubdirectives, sub):
		return fmt.Sprintf("%s is a Redis setting: it belongs inside the redis block, rate_limit { redis { %s ... } }", sub, sub)
	case block != blockOfHandler && slices.Contains(handlerSubdirectives, sub):
		return fmt.Sprintf("%s is the handler's, for all its policies: it belongs directly inside rate_limit { }, outside the %s block", sub, [...]string{"", "redis", "policy"}[block])
	}
	if near := suggest.Nearest(sub, own); near != "" {
		return "did you mean " + near + "?"
	}
	// A slip for a subdirective of another block.
	for b, names := range [...][]string{handlerSubdirectives, redisSubdirectives, policySubdirectives} {
		if b == block {
			continue
		}
		if near := suggest.Nearest(sub, names); near != "" {
			return fmt.Sprintf("did you mean %s? (%s)", near, subdirectiveHint(block, near))
		}
	}
	return "expected one of " + strings.Join(own, ", ")
}

// durationUnits are the words people write for a rate's duration, and
// the duration each means.
var durationUnits = map[string]string{
	"ms": "ms", "msec": "ms", "millisecond": "ms", "milliseconds": "ms",
	"s": "s", "sec": "s", "secs": "s", "second": "s", "seconds": "s",
	"m": "m", "min": "m", "mins": "m", "minute": "m", "minutes": "m",
	"h": "h", "hr": "h", "hrs": "h", "hour": "h", "hours": "h",
	"d": "d", "day": "d", "days": "d",
}

// calendarUnits are the duration-like words that are a quota's calendar
// periods rather than a duration.
var calendarUnits = map[string]string{"week": "week", "weeks": "week", "month": "month", "months": "month", "year": "year", "years": "year"}

// rateHint says what to write for a rate N/d whose duration d does not
// parse: "100/minute" is 100/1m, "100/month" a quota. "" when it cannot
// tell.
func rateHint(n, d string) string {
	i := 0
	for i < len(d) && (d[i] >= '0' && d[i] <= '9' || d[i] == '.') {
		i++
	}
	count, word := d[:i], strings.ToLower(strings.TrimSpace(d[i:]))
	if count == "" {
		count = "1"
	}
	if unit, ok := durationUnits[word]; ok {
		return fmt.Sprintf("did you mean %s/%s%s? (a duration as 1s, 1m, 1h or 1d)", n, count, unit)
	}
	if period, ok := calendarUnits[word]; ok && count == "1" {
		return fmt.Sprintf("a calendar %s is a quota's period: quota %s/%s counts per calendar %s; a rolling window is a duration, as rate %s/%s",
			period, n, period, period, n, map[string]string{"week": "7d", "month": "30d", "year": "365d"}[period])
	}
	return ""
}

// periodHint says what to write for a quota N/p whose period p is not a
// calendar unit: a duration is a rate's window, a slip gets the nearest.
func periodHint(n, p string) string {
	if period, ok := calendarUnits[strings.ToLower(p)]; ok {
		return fmt.Sprintf("did you mean %s/%s?", n, period)
	}
	if near := suggest.Nearest(p, calendar.UnitNames()); near != "" {
		return fmt.Sprintf("did you mean %s/%s?", n, near)
	}
	if _, ok := durationUnits[strings.ToLower(strings.TrimLeft(p, "0123456789"))]; ok {
		return fmt.Sprintf("a quota counts calendar periods; for a rolling window of %s, use rate %s/%s", p, n, p)
	}
	return ""
}

// envPlaceholder finds the {env.NAME} placeholders of a value.
var envPlaceholder = regexp.MustCompile(`\{env\.([^{}]+)\}`)

// emptySecretError is the error for a key_secret that resolved to nothing:
// it names the environment variables to export.
func emptySecretError(tmpl string) error {
	var names []string
	for _, m := range envPlaceholder.FindAllStringSubmatch(tmpl, -1) {
		if !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	if len(names) == 0 {
		return fmt.Errorf("key_secret: %q resolves to the empty string: give a secret (the same on every instance)", tmpl)
	}
	return fmt.Errorf("key_secret: %q resolves to the empty string: the environment variable %s is not set (or empty) where Caddy runs: "+
		"export it before starting Caddy, the same value on every instance, e.g. export %s=$(openssl rand -hex 32)",
		tmpl, strings.Join(names, " or "), names[0])
}

// emptyEnvError is the load error of a redis field (address, sentinel)
// whose placeholder resolved to nothing: the variable to set, and where (an
// {env.X} is read from the environment of the running Caddy, which caddy
// reload does not change); example is a value to show.
func emptyEnvError(field, tmpl, example string) error {
	var names []string
	for _, m := range envPlaceholder.FindAllStringSubmatch(tmpl, -1) {
		if !slices.Contains(names, m[1]) {
			names = append(names, m[1])
		}
	}
	if len(names) == 0 {
		return fmt.Errorf("redis: %s %q resolves to the empty string", field, tmpl)
	}
	return fmt.Errorf("redis: %s %q resolves to the empty string: the environment variable %s is not set (or empty) where Caddy runs: "+
		"export it before starting Caddy (e.g. export %s=%s); caddy reload does not change it, Caddy reads its own environment",
		field, tmpl, strings.Join(names, " or "), names[0], example)
}
