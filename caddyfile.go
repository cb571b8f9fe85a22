package ratelimit

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	httpcaddyfile.RegisterHandlerDirective("rate_limit", parseCaddyfile)
	// After forward_auth (and so basic_auth): {http.auth.user.id} and the
	// headers forward_auth copies are there to key on.
	httpcaddyfile.RegisterDirectiveOrder("rate_limit", httpcaddyfile.After, "forward_auth")
}

func parseCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	rl := new(Handler)
	err := rl.UnmarshalCaddyfile(h.Dispenser)
	return rl, err
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	rate_limit [<matcher>] {
//	    redis {
//	        address    <host:port> [<host:port>...]
//	        cluster
//	        sentinel   <master_name>
//	        username   <user>
//	        password   <password>
//	        db         <n>
//	        tls        [ca <pem_file>] [server_name <name>] [insecure_skip_verify]
//	        timeout    <duration>
//	        pool_size  <n>
//	        key_prefix <prefix>
//	    }
//	    key_secret <secret>
//	    on_error   fail_open|fail_closed|local
//	    jitter     <percent>
//	    headers    draft|off
//	    shadow
//	    instances  <n>
//
//	    policy <name> {
//	        match { <request matchers> }
//	        key      <template>
//	        rate     <N>/<duration>
//	        burst    <n>
//	        cost     <n | {placeholder}> [max <n>]
//	        on_error fail_open|fail_closed|local
//	        shadow
//	        wait     <duration> [<max_held>]
//	    }
//	}
//
// mholt/caddy-ratelimit's syntax is accepted too, so that its Caddyfiles
// adapt unchanged: `zone <name> { match {...} key <k> events <N> window <W> }`
// is `policy <name> { match {...} key <k> rate <N>/<W> burst <N> }` (a zone
// without a key is one bucket for everyone, as there), and its
// `distributed {...}`, `storage <module...>`, `sweep_interval <d>` and
// `log_key` are accepted and ignored with a warning that says why they are
// not needed (its `jitter <fraction>` is ours).
//
// Values are checked here, so that `caddy adapt` reports a mistake with its
// line.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	// The directive's position, for errors found after its block.
	directive := *d
	if d.NextArg() {
		return d.Errf("unexpected argument %q: expected rate_limit [<matcher>] { ... }", d.Val())
	}
	seen := map[string]int{}
	var ignored []ignoredSubdirective // mholt/caddy-ratelimit's, warned about below
	for d.NextBlock(0) {
		switch sub := d.Val(); sub {
		case "redis":
			if h.Redis != nil {
				return d.Errf("redis: defined twice (first at line %d)", seen["redis"])
			}
			seen["redis"] = d.Line()
			h.Redis = new(RedisConfig)
			if err := h.Redis.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "key_secret":
			if err := oneArg(d, &h.KeySecret); err != nil {
				return err
			}
		case "on_error":
			if err := onErrorArg(d, &h.OnError); err != nil {
				return err
			}
		case "jitter":
			var s string
			if err := oneArg(d, &s); err != nil {
				return err
			}
			j, err := parseJitter(s)
			if err != nil {
				return d.Errf("jitter: %v", err)
			}
			h.Jitter = &j
		case "headers":
			if err := oneArg(d, &h.Headers); err != nil {
				return err
			}
			if h.Headers != "draft" && h.Headers != "off" {
				return d.Errf("headers: %q is not draft or off", h.Headers)
			}
		case "shadow":
			if err := noArg(d); err != nil {
				return err
			}
			h.Shadow = true
		case "instances":
			if err := intArg(d, &h.Instances, 1, maxInstances); err != nil {
				return err
			}
		case "policy":
			at := *d // the policy's line
			p, err := unmarshalPolicy(d)
			if err != nil {
				return err
			}
			if line, dup := seen["policy "+p.Name]; dup {
				return at.Errf("policy %q: defined twice (first at line %d)", p.Name, line)
			}
			seen["policy "+p.Name] = at.Line()
			h.Policies = append(h.Policies, p)
		case "zone": // mholt/caddy-ratelimit's policy
			at := *d
			p, err := unmarshalZone(d)
			if err != nil {
				return err
			}
			if line, dup := seen["policy "+p.Name]; dup {
				return at.Errf("zone %q: a zone or policy of that name is defined already (at line %d)", p.Name, line)
			}
			seen["policy "+p.Name] = at.Line()
			h.Policies = append(h.Policies, p)
		case "distributed", "storage", "sweep_interval", "log_key":
			ig, err := skipMholtSubdirective(d)
			if err != nil {
				return err
			}
			ignored = append(ignored, ig)
		default:
			return d.Errf("unrecognized subdirective %q", sub)
		}
	}
	if len(h.Policies) == 0 {
		return directive.Err("at least one policy is required")
	}
	for _, ig := range ignored {
		warnCaddyfile(ig.file, ig.line, ig.why(h.Redis != nil))
	}
	return nil
}

func (c *RedisConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) (err error) {
	block := *d // the redis line, for errors found after its block
	// Errors of the shared helpers name the subdirective; say it is redis's.
	defer func() {
		if err != nil && !strings.HasPrefix(err.Error(), "redis: ") {
			err = fmt.Errorf("redis: %w", err)
		}
	}()
	if d.NextArg() {
		return d.Errf("unexpected argument %q: the addresses go in the block, as address <host:port>...", d.Val())
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch sub := d.Val(); sub {
		case "address":
			addrs := d.RemainingArgs()
			if len(addrs) == 0 {
				return d.Errf("redis: address: at least one host:port is required")
			}
			c.Addresses = append(c.Addresses, addrs...)
		case "cluster":
			if err := noArg(d); err != nil {
				return err
			}
			c.Cluster = true
		case "sentinel":
			if err := oneArg(d, &c.Sentinel); err != nil {
				return err
			}
		case "username":
			if err := oneArg(d, &c.Username); err != nil {
				return err
			}
		case "password":
			if err := oneArg(d, &c.Password); err != nil {
				return err
			}
		case "db":
			if err := intArg(d, &c.DB, 0, maxDB); err != nil {
				return err
			}
		case "tls":
			c.TLS = new(RedisTLS)
			for d.NextArg() {
				switch opt := d.Val(); opt {
				case "insecure_skip_verify":
					c.TLS.InsecureSkipVerify = true
				case "ca", "server_name":
					if !d.NextArg() {
						return d.Errf("redis: tls: %s: a value is required", opt)
					}
					if opt == "ca" {
						c.TLS.CA = d.Val()
					} else {
						c.TLS.ServerName = d.Val()
					}
				default:
					return d.Errf("redis: tls: unknown option %q (insecure_skip_verify, ca <pem_file>, server_name <name>)", opt)
				}
			}
		case "timeout":
			var s string
			if err := oneArg(d, &s); err != nil {
				return err
			}
			dur, err := caddy.ParseDuration(s)
			if err != nil || dur <= 0 {
				return d.Errf("redis: timeout: %q is not a positive duration", s)
			}
			c.Timeout = caddy.Duration(dur)
		case "pool_size":
			if err := intArg(d, &c.PoolSize, 1, maxPoolSize); err != nil {
				return err
			}
		case "key_prefix":
			if err := oneArg(d, &c.KeyPrefix); err != nil {
				return err
			}
		default:
			return d.Errf("redis: unrecognized subdirective %q", sub)
		}
	}
	if len(c.Addresses) == 0 {
		return block.Err("redis: address is required")
	}
	if c.Cluster && c.Sentinel != "" {
		return block.Err("redis: cluster and sentinel exclude each other")
	}
	return nil
}

// namedBlock reads the name of a `policy <name> {` (or `zone`) line into
// name. It returns the line's position, for errors found after the block,
// and fail, which formats an error of one of the block's fields.
func namedBlock(d *caddyfile.Dispenser, kind string, name *string) (at caddyfile.Dispenser, fail func(field, format string, args ...any) error, err error) {
	if !d.NextArg() {
		return at, nil, d.Errf("%s: a name is required, as in %s <name> { ... }", kind, kind)
	}
	*name = d.Val()
	if !policyName.MatchString(*name) {
		return at, nil, d.Errf("%s %q: the name must be 1 to 64 letters, digits, '_', '-' or '.'", kind, *name)
	}
	at = *d
	if d.NextArg() {
		return at, nil, d.Errf("%s %q: unexpected argument %q: expected %s <name> { ... }", kind, *name, d.Val(), kind)
	}
	fail = func(field, format string, args ...any) error {
		return d.Errf("%s %q: %s: %s", kind, *name, field, fmt.Sprintf(format, args...))
	}
	return at, fail, nil
}

// prefixErr names the block in an error that does not yet.
func prefixErr(err *error, kind, name string) {
	prefix := fmt.Sprintf("%s %q: ", kind, name)
	if *err != nil && !strings.HasPrefix((*err).Error(), prefix) {
		*err = fmt.Errorf("%s%w", prefix, *err)
	}
}

func unmarshalPolicy(d *caddyfile.Dispenser) (_ *Policy, err error) {
	p := new(Policy)
	at, fail, err := namedBlock(d, "policy", &p.Name)
	if err != nil {
		return nil, err
	}
	// Errors of the shared helpers name the subdirective; add the policy.
	defer prefixErr(&err, "policy", p.Name)
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch sub := d.Val(); sub {
		case "match":
			if p.MatchRaw != nil {
				return nil, fail("match", "defined twice")
			}
			set, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
			if err != nil { // it has the line already
				return nil, fmt.Errorf("policy %q: match: %w", p.Name, err)
			}
			p.MatchRaw = set
		case "key":
			if err := oneArg(d, &p.Key); err != nil {
				return nil, err
			}
		case "rate":
			if err := oneArg(d, &p.Rate); err != nil {
				return nil, err
			}
			if _, _, err := parseRate(p.Rate); err != nil {
				return nil, fail("rate", "%v", err)
			}
		case "burst":
			var s string
			if err := oneArg(d, &s); err != nil {
				return nil, err
			}
			n, err := strconv.ParseInt(s, 10, 64)
			if err != nil || n < 1 {
				return nil, fail("burst", "%q must be a positive integer", s)
			}
			p.Burst = n
		case "cost":
			args := d.RemainingArgs()
			if len(args) != 1 && len(args) != 3 || len(args) == 3 && args[1] != "max" {
				return nil, fail("cost", "expected cost <n | {placeholder}> [max <n>]")
			}
			if _, _, err := parseCost(args[0]); err != nil {
				return nil, fail("cost", "%v", err)
			}
			p.Cost = args[0]
			if len(args) == 3 {
				n, err := strconv.ParseInt(args[2], 10, 64)
				if err != nil || n < 1 {
					return nil, fail("cost", "max %q must be a positive integer", args[2])
				}
				p.MaxCost = n
			}
		case "on_error":
			if err := onErrorArg(d, &p.OnError); err != nil {
				return nil, err
			}
		case "shadow":
			if err := noArg(d); err != nil {
				return nil, err
			}
			p.Shadow = true
		case "wait":
			args := d.RemainingArgs()
			if len(args) < 1 || len(args) > 2 {
				return nil, fail("wait", "expected wait <duration> [<max_held>]")
			}
			dur, err := caddy.ParseDuration(args[0])
			if err != nil || dur <= 0 {
				return nil, fail("wait", "%q is not a positive duration", args[0])
			}
			if dur > maxWait {
				return nil, fail("wait", "%s must be between 0 and %s", dur, maxWait)
			}
			p.Wait = caddy.Duration(dur)
			if len(args) == 2 {
				n, err := strconv.Atoi(args[1])
				if err != nil || n < 1 {
					return nil, fail("wait", "max_held %q must be a positive integer", args[1])
				}
				p.MaxHeld = n
			}
		default:
			return nil, d.Errf("policy %q: unrecognized subdirective %q", p.Name, sub)
		}
	}
	// The checks loading the JSON makes, such as a cost above burst.
	if err := p.settle(); err != nil {
		return nil, at.Errf("policy %q: %v", p.Name, err)
	}
	return p, nil
}

// parseJitter accepts a percentage (20%) or, as mholt/caddy-ratelimit's
// `jitter 0.2`, a bare fraction.
func parseJitter(s string) (float64, error) {
	num, pct := strings.CutSuffix(s, "%")
	v, err := strconv.ParseFloat(num, 64)
	if err != nil || v < 0 || v != v {
		return 0, errNotJitter(s)
	}
	if pct {
		v /= 100
	} else if v > 1 {
		return 0, fmt.Errorf("%q: a bare number is a fraction from 0 to 1; for percent, write %s%%", s, s)
	}
	if v > 10 {
		return 0, errNotJitter(s)
	}
	return v, nil
}

func oneArg(d *caddyfile.Dispenser, dst *string) error {
	sub := d.Val()
	if !d.NextArg() {
		return d.Errf("%s: a value is required", sub)
	}
	*dst = d.Val()
	if d.NextArg() {
		return d.Errf("%s: one value expected, got another: %q", sub, d.Val())
	}
	return nil
}

func noArg(d *caddyfile.Dispenser) error {
	sub := d.Val()
	if d.NextArg() {
		return d.Errf("%s: takes no value, got %q", sub, d.Val())
	}
	return nil
}

func intArg(d *caddyfile.Dispenser, dst *int, least, most int) error {
	sub := d.Val()
	var s string
	if err := oneArg(d, &s); err != nil {
		return err
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < least || n > most {
		return d.Errf("%s: %q must be an integer from %d to %d", sub, s, least, most)
	}
	*dst = n
	return nil
}

func onErrorArg(d *caddyfile.Dispenser, dst *string) error {
	if err := oneArg(d, dst); err != nil {
		return err
	}
	if !validOnError(*dst) {
		return d.Errf("on_error: %q is not fail_open, fail_closed or local", *dst)
	}
	return nil
}

// Interface guard.
var _ caddyfile.Unmarshaler = (*Handler)(nil)

type errNotJitter string

func (e errNotJitter) Error() string {
	return strconv.Quote(string(e)) + " is not a percentage from 0% to 1000% such as 20% (or a fraction such as 0.2)"
}
