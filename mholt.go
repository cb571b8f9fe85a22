package ratelimit

import (
	"fmt"
	"strconv"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

// unmarshalZone reads mholt/caddy-ratelimit's zone as a policy of the same
// name: `events N window W` is `rate N/W burst N` (a full bucket admits N
// at once, as an empty sliding window does, then N per W), a zone without
// a key is one bucket for everyone, as there, and `ipv4_prefix` and
// `ipv6_prefix` are the policy's (0, there the whole address, is the
// whole address: 32 or 128).
func unmarshalZone(d *caddyfile.Dispenser) (*Policy, error) {
	p := new(Policy)
	s, err := newNamedSection(d, "zone", &p.Name)
	if err != nil {
		return nil, err
	}
	var events int64
	var window string
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := s.once(d); err != nil {
			return nil, err
		}
		switch sub := d.Val(); sub {
		case "match":
			if err := s.matchArg(d, p); err != nil {
				return nil, err
			}
		case "key":
			if err := s.oneArg(d, &p.Key); err != nil {
				return nil, err
			}
		case "events":
			if err := s.positiveArg(d, &events); err != nil {
				return nil, err
			}
		case "window":
			if err := s.oneArg(d, &window); err != nil {
				return nil, err
			}
			if dur, err := caddy.ParseDuration(window); err != nil || dur <= 0 {
				return nil, s.errf(d, "window: %q is not a positive duration", window)
			}
		case "ipv6_prefix":
			if err := s.prefixArg(d, &p.IPv6Prefix, 128, true); err != nil {
				return nil, err
			}
		case "ipv4_prefix":
			if err := s.prefixArg(d, &p.IPv4Prefix, 32, true); err != nil {
				return nil, err
			}
		default:
			return nil, s.errf(d, "unrecognized subdirective %q (a zone takes match, key, events, window, ipv4_prefix and ipv6_prefix)", sub)
		}
	}
	if events == 0 || window == "" {
		return nil, s.at.Errf("%sevents and window are both required", s.prefix)
	}
	if p.Key == "" {
		p.Key = "static" // one bucket for the whole zone
	}
	p.Rate = strconv.FormatInt(events, 10) + "/" + window
	p.Burst = float64(events)
	if err := p.check(); err != nil {
		// The rate and burst come from events and window.
		s.seen["rate"], s.seen["burst"] = s.seen["events"], s.seen["events"]
		return nil, s.fail(fmt.Errorf("events %d window %s: %w", events, window, err))
	}
	s.warnUnusedPrefix(p)
	return p, nil
}

// ignoredSubdirective is one of mholt/caddy-ratelimit's subdirectives that
// have no use here, and where it was.
type ignoredSubdirective struct {
	name string
	file string
	line int
}

// skipMholtSubdirective consumes `distributed [{...}]`, `storage
// <module...> [{...}]`, `sweep_interval <duration>`, `log_key` or
// `disable_metrics`, checking
// what mholt/caddy-ratelimit checked, so that a typo still fails.
func skipMholtSubdirective(d *caddyfile.Dispenser) (ignoredSubdirective, error) {
	ig := ignoredSubdirective{name: d.Val(), file: d.File(), line: d.Line()}
	switch ig.name {
	case "distributed":
		if d.NextArg() {
			return ig, d.Errf("distributed: unexpected argument %q", d.Val())
		}
		for nesting := d.Nesting(); d.NextBlock(nesting); {
			switch sub := d.Val(); sub {
			case "read_interval", "write_interval", "purge_age":
				var s string
				if err := newSection(d, "distributed: ").oneArg(d, &s); err != nil {
					return ig, err
				}
				if _, err := caddy.ParseDuration(s); err != nil {
					return ig, d.Errf("distributed: %s: %q is not a duration", sub, s)
				}
			default:
				return ig, d.Errf("distributed: unrecognized subdirective %q", sub)
			}
		}
	case "storage":
		if !d.NextArg() {
			return ig, d.Err("storage: a storage module is required, as in storage <module> ...")
		}
		d.RemainingArgs()
		for nesting := d.Nesting(); d.NextBlock(nesting); {
		}
	case "sweep_interval":
		var s string
		if err := newSection(d, "").oneArg(d, &s); err != nil {
			return ig, err
		}
		if dur, err := caddy.ParseDuration(s); err != nil || dur <= 0 {
			return ig, d.Errf("sweep_interval: %q is not a positive duration", s)
		}
	case "log_key", "disable_metrics":
		if err := newSection(d, "").noArg(d); err != nil {
			return ig, err
		}
	}
	return ig, nil
}

// why says why the subdirective is not needed.
func (ig ignoredSubdirective) why(haveRedis bool) string {
	const from = " (a mholt/caddy-ratelimit subdirective)"
	switch ig.name {
	case "distributed":
		if haveRedis {
			return "rate_limit: distributed" + from + " is not needed and is ignored: the redis block shares every bucket " +
				"between instances, each decision exact and atomic in Redis, instead of approximate state synced through Caddy storage"
		}
		return "rate_limit: distributed" + from + " is ignored: limits are shared through Redis, not Caddy storage. " +
			"Without a redis { address <host:port> } block these limits are per instance: N instances allow N times the rate"
	case "storage":
		return "rate_limit: storage" + from + " is not needed and is ignored: shared state lives in Redis (the redis block), not in a Caddy storage module"
	case "sweep_interval":
		return "rate_limit: sweep_interval" + from + " is not needed and is ignored: Redis keys expire by themselves when their " +
			"bucket is full again, and the in-process store sweeps full buckets as it grows"
	case "disable_metrics":
		return "rate_limit: disable_metrics" + from + " is ignored: this module's metrics are labelled by policy, outcome and error kind, " +
			"never by key, so they stay a few series per policy (mholt's had a series per key). They are in Caddy's metrics registry " +
			"(the admin API's /metrics), with Caddy's own"
	default: // log_key
		return "rate_limit: log_key" + from + " is ignored: raw keys are never logged or stored, only keyed hashes. " +
			"Denials are logged at DEBUG with the policy; log_append rate_limit_policy {http.rate_limit.policy} adds it to access logs"
	}
}

// sourceLine is a line of a Caddyfile.
type sourceLine struct {
	file string
	line int
}

// warnCaddyfile reports, at adapt time, a subdirective that is accepted
// but ignored, or does not do what its author may expect. A handler
// directive cannot add to the adapter's warnings (httpcaddyfile.Helper
// keeps that list unexported), so the warning is
// logged as `caddy adapt` and `caddy run` log the adapter's own: at WARN,
// under the adapter's name, with the file and line (as Caddy's own
// deprecated directives do). Tests replace it to collect the warnings.
var warnCaddyfile = func(file string, line int, msg string) {
	caddy.Log().Named("caddyfile").Warn(msg, zap.String("file", file), zap.Int("line", line))
}
