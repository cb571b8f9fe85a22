package ratelimit

import (
	"errors"
	"fmt"
	"math"
	"slices"
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
	if err == nil && rl.mholtZone != nil && !orderedByUser(h.Option("order")) {
		warnCaddyfile(rl.mholtZone.file, rl.mholtZone.line, mholtOrderWarning)
	}
	return rl, err
}

// orderedByUser reports whether the Caddyfile's `order` global options
// (the directive order they built, nil without any) moved rate_limit from
// where this module registers it, right after forward_auth.
func orderedByUser(option any) bool {
	order, _ := option.([]string)
	i := slices.Index(order, "rate_limit")
	return i == 0 || i > 0 && order[i-1] != "forward_auth"
}

// mholtOrderWarning is the warning for mholt/caddy-ratelimit's syntax in a
// Caddyfile that leaves rate_limit at this module's place in the directive
// order, which is not that module's.
const mholtOrderWarning = "rate_limit: a zone is mholt/caddy-ratelimit's syntax, whose rate_limit runs before basic_auth by default " +
	"(since July 2024); this module's runs after basic_auth and forward_auth, so that keys can use {http.auth.user.id}. " +
	"A limit meant to stop password guessing now runs after the password check. To keep mholt's order, add " +
	"`order rate_limit before basic_auth` to the global options, or write rate_limit before basic_auth in a route { } block, " +
	"where directives run in the order written (a rate_limit already in such a block is in its place: the global " +
	"option silences this warning). See docs/migrating.md"

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
//	    error_format problem|openai|anthropic
//	    shadow
//	    require_redis
//	    instances  <n>
//	    ipv6_prefix <bits>
//	    ipv4_prefix <bits>
//	    prices {
//	        <model> input <usd> output <usd> [cache_write <usd>] [cache_read <usd>]
//	        file    <path>
//	        unknown deny|<model>
//	    }
//
//	    policy <name> {
//	        match { <request matchers> }
//	        key      <template>
//	        rate     <N>/<duration>   # or: concurrent <n>, with lease <duration>
//	        burst    <n>
//	        unit     tokens|usd
//	        cost     <n | {placeholder} | openai | anthropic> [max <n>]
//	        on_error fail_open|fail_closed|local
//	        error_format problem|openai|anthropic
//	        shadow
//	        wait     <duration> [<max_held>]
//	        charge_if { <response matchers> }
//	        settle   header|trailer <field> [max <n>] [debt <n>]
//	        settle   openai|anthropic [include_usage] [weights input <a> output <b> [cache_write <w>] [cache_read <r>]] [max <n>] [debt <n>]
//	        ipv6_prefix <bits>
//	        ipv4_prefix <bits>
//	        quota    <N>/<minute|hour|day|week|month|year>   # instead of rate
//	        timezone <IANA zone>
//	        durable  replicas <n> | aof
//	        plan     <placeholder> {
//	            <name> [rate <N>/<duration>] [burst <n>] [cost max <n>]   # or: <name> concurrent <n>
//	            <name> quota <N>[/<the policy's unit>] [cost max <n>]       # in a quota policy
//	        }
//	        shed     { concurrent <n>  latency <duration> }   # instead of rate
//	        priority <placeholder> { <class> <share>% ... }
//	    }
//	}
//
// mholt/caddy-ratelimit's syntax is accepted too, so that its Caddyfiles
// adapt unchanged: `zone <name> { match {...} key <k> events <N> window <W> }`
// is `policy <name> { match {...} key <k> rate <N>/<W> burst <N> }` (a zone
// without a key is one bucket for everyone, as there; its `ipv4_prefix`
// and `ipv6_prefix` are the policy's), and its `distributed {...}`,
// `storage <module...>`, `sweep_interval <d>`, `log_key` and
// `disable_metrics` are accepted and ignored with a warning that says why
// they are not needed (its `jitter <fraction>` is ours). A zone in a
// Caddyfile without an `order` for rate_limit gets a warning: mholt's
// rate_limit runs before basic_auth, this one after.
//
// Each block is checked, once read, by the same checks as the JSON config
// (Validate), so that `caddy adapt` reports the same mistakes as `caddy
// validate`, with the line of the subdirective at fault.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	top := newSection(d, "")
	if d.NextArg() {
		return d.Errf("unexpected argument %q: expected rate_limit [<matcher>] { ... }", d.Val())
	}
	var ignored []ignoredSubdirective // mholt/caddy-ratelimit's, warned about below
	policyLines := map[string]int{}
	for d.NextBlock(0) {
		sub := d.Val()
		switch sub {
		case "policy", "zone", "distributed", "storage", "sweep_interval", "log_key", "disable_metrics":
		default:
			if err := top.once(d); err != nil {
				return err
			}
		}
		switch sub {
		case "redis":
			h.Redis = new(RedisConfig)
			if err := h.Redis.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "key_secret":
			if !d.NextArg() {
				// {$VAR} is replaced before the Caddyfile is read: unset, it
				// leaves nothing.
				return d.Errf("key_secret: a value is required: a secret, or {env.RATE_LIMIT_SECRET}, read from the environment when the config loads " +
					"(a {$VAR} whose variable is unset when the Caddyfile is adapted leaves nothing here: export it first)")
			}
			d.Prev()
			if err := top.oneArg(d, &h.KeySecret); err != nil {
				return err
			}
			if h.KeySecret == "" {
				// "" would mean no secret: plain SHA-256, which anyone can
				// reverse for IPv4 addresses.
				return d.Errf(`key_secret: "" is no secret: storage keys would be plain SHA-256 hashes of identities, which can be reversed; give a secret, or {env.RATE_LIMIT_SECRET}, or leave key_secret out`)
			}
		case "on_error":
			if err := top.oneArg(d, &h.OnError); err != nil {
				return err
			}
		case "jitter":
			var s string
			if err := top.oneArg(d, &s); err != nil {
				return err
			}
			j, err := parseJitter(s)
			if err != nil {
				return d.Errf("jitter: %v", err)
			}
			h.Jitter = &j
		case "headers":
			if err := top.oneArg(d, &h.Headers); err != nil {
				return err
			}
		case "error_format":
			if err := top.oneArg(d, &h.ErrorFormat); err != nil {
				return err
			}
		case "shadow":
			if err := top.noArg(d); err != nil {
				return err
			}
			h.Shadow = true
		case "require_redis":
			if err := top.noArg(d); err != nil {
				return err
			}
			h.RequireRedis = true
		case "instances":
			if err := top.intArg(d, &h.Instances, 1); err != nil {
				return err
			}
		case "ipv6_prefix":
			if err := top.prefixArg(d, &h.IPv6Prefix, 128, false); err != nil {
				return err
			}
		case "ipv4_prefix":
			if err := top.prefixArg(d, &h.IPv4Prefix, 32, false); err != nil {
				return err
			}
		case "prices": // prices.go
			h.Prices = new(Prices)
			if err := h.Prices.unmarshalCaddyfile(d); err != nil {
				return err
			}
		case "policy", "zone": // a zone is mholt/caddy-ratelimit's policy
			at := *d // the policy's line
			read := unmarshalPolicy
			if sub == "zone" {
				read = unmarshalZone
			}
			p, err := read(d)
			if err != nil {
				return err
			}
			if sub == "zone" && h.mholtZone == nil {
				h.mholtZone = &sourceLine{file: at.File(), line: at.Line()}
			}
			if line, dup := policyLines[p.Name]; dup {
				if sub == "zone" {
					return at.Errf("zone %q: a zone or policy of that name is defined already (at line %d)", p.Name, line)
				}
				return at.Errf("policy %q: defined twice (first at line %d)", p.Name, line)
			}
			policyLines[p.Name] = at.Line()
			h.Policies = append(h.Policies, p)
		case "distributed", "storage", "sweep_interval", "log_key", "disable_metrics":
			ig, err := skipMholtSubdirective(d)
			if err != nil {
				return err
			}
			ignored = append(ignored, ig)
		default:
			return unknownSubdirective(d, nil, blockOfHandler, sub)
		}
	}
	if err := h.checkOwn(); err != nil {
		return top.fail(err)
	}
	if len(h.Policies) == 0 {
		return top.at.Err("at least one policy is required")
	}
	if err := h.checkPrices(); err != nil {
		return top.fail(err)
	}
	if err := h.checkDurableStore(); err != nil {
		return err
	}
	for _, ig := range ignored {
		warnCaddyfile(ig.file, ig.line, ig.why(h.Redis != nil))
	}
	return nil
}

func (c *RedisConfig) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	s := newSection(d, "redis: ")
	if d.NextArg() {
		return s.errf(d, "unexpected argument %q: the addresses go in the block, as address <host:port>...", d.Val())
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		sub := d.Val()
		if sub != "address" {
			if err := s.once(d); err != nil {
				return err
			}
		} else if _, seen := s.seen[sub]; !seen {
			s.seen[sub] = *d
		}
		switch sub {
		case "address":
			addrs := d.RemainingArgs()
			if len(addrs) == 0 {
				return s.errf(d, "address: at least one host:port is required")
			}
			c.Addresses = append(c.Addresses, addrs...)
		case "cluster":
			if err := s.noArg(d); err != nil {
				return err
			}
			c.Cluster = true
		case "sentinel":
			if err := s.oneArg(d, &c.Sentinel); err != nil {
				return err
			}
		case "username":
			if err := s.oneArg(d, &c.Username); err != nil {
				return err
			}
		case "password":
			if err := s.oneArg(d, &c.Password); err != nil {
				return err
			}
		case "db":
			if err := s.intArg(d, &c.DB, 0); err != nil {
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
						return s.errf(d, "tls: %s: a value is required", opt)
					}
					if opt == "ca" {
						c.TLS.CA = d.Val()
					} else {
						c.TLS.ServerName = d.Val()
					}
				default:
					return s.errf(d, "tls: unknown option %q (insecure_skip_verify, ca <pem_file>, server_name <name>)", opt)
				}
			}
		case "timeout":
			if err := s.durationArg(d, &c.Timeout); err != nil {
				return err
			}
		case "pool_size":
			if err := s.intArg(d, &c.PoolSize, 1); err != nil {
				return err
			}
		case "key_prefix":
			if err := s.oneArg(d, &c.KeyPrefix); err != nil {
				return err
			}
		default:
			return unknownSubdirective(d, s, blockOfRedis, sub)
		}
	}
	if err := c.validate(); err != nil {
		return s.fail(err)
	}
	return nil
}

func unmarshalPolicy(d *caddyfile.Dispenser) (*Policy, error) {
	p := new(Policy)
	s, err := newNamedSection(d, "policy", &p.Name)
	if err != nil {
		return nil, err
	}
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
		case "rate":
			if err := s.oneArg(d, &p.Rate); err != nil {
				return nil, err
			}
		case "burst":
			if err := s.amountArg(d, &p.Burst); err != nil {
				return nil, err
			}
		case "unit": // unit.go
			if err := s.oneArg(d, &p.Unit); err != nil {
				return nil, err
			}
		case "concurrent":
			if err := s.positiveArg(d, &p.Concurrent); err != nil {
				return nil, err
			}
		case "lease":
			if err := s.durationArg(d, &p.Lease); err != nil {
				return nil, err
			}
		case "cost":
			args := d.RemainingArgs()
			if len(args)%2 != 1 {
				return nil, s.errf(d, "cost: expected cost <n | {placeholder} | openai | anthropic> [max <n>] [unbounded max|refuse]")
			}
			p.Cost = caddyhttp.WeakString(args[0])
			for i := 1; i+1 < len(args); i += 2 {
				switch args[i] {
				case "max":
					n, ok := positiveAmount(args[i+1])
					if !ok {
						return nil, s.errf(d, "cost: max %q must be a positive number", args[i+1])
					}
					p.MaxCost = n
				case "unbounded":
					p.Unbounded = args[i+1] // checked with the policy
				default:
					return nil, s.errf(d, "cost: expected cost <n | {placeholder} | openai | anthropic> [max <n>] [unbounded max|refuse], got %q", args[i])
				}
			}
		case "on_error":
			if err := s.oneArg(d, &p.OnError); err != nil {
				return nil, err
			}
		case "error_format":
			if err := s.oneArg(d, &p.ErrorFormat); err != nil {
				return nil, err
			}
		case "shadow":
			if err := s.noArg(d); err != nil {
				return nil, err
			}
			p.Shadow = true
		case "wait":
			args := d.RemainingArgs()
			if len(args) < 1 || len(args) > 2 {
				return nil, s.errf(d, "wait: expected wait <duration> [<max_held>]")
			}
			dur, err := caddy.ParseDuration(args[0])
			if err != nil || dur <= 0 {
				return nil, s.errf(d, "wait: %q is not a positive duration", args[0])
			}
			p.Wait = caddy.Duration(dur)
			if len(args) == 2 {
				n, err := strconv.Atoi(args[1])
				if err != nil || n < 1 {
					return nil, s.errf(d, "wait: max_held %q must be a positive integer", args[1])
				}
				p.MaxHeld = n
			}
		case "charge_if":
			// A response matcher, as Caddy's named ones: charge_if { status
			// 401 403; header X-Failed }, or on one line.
			matchers := map[string]caddyhttp.ResponseMatcher{}
			if err := caddyhttp.ParseNamedResponseMatcher(d.NewFromNextSegment(), matchers); err != nil {
				return nil, fmt.Errorf("%scharge_if: %w", s.prefix, err)
			}
			m := matchers["charge_if"]
			if m.StatusCode == nil && m.Headers == nil {
				return nil, s.errf(d, "charge_if: a response matcher is required, e.g. charge_if { status 401 403 }")
			}
			p.ChargeIf = &m
		case "settle":
			st, err := parseSettle(d.RemainingArgs())
			if err != nil {
				return nil, s.errf(d, "settle: %v", err)
			}
			p.Settle = st
		case "ipv6_prefix":
			if err := s.prefixArg(d, &p.IPv6Prefix, 128, false); err != nil {
				return nil, err
			}
		case "ipv4_prefix":
			if err := s.prefixArg(d, &p.IPv4Prefix, 32, false); err != nil {
				return nil, err
			}
		case "quota":
			if err := s.oneArg(d, &p.Quota); err != nil {
				return nil, err
			}
		case "timezone":
			if err := s.oneArg(d, &p.Timezone); err != nil {
				return nil, err
			}
		case "durable":
			if err := s.unmarshalDurable(d, p); err != nil {
				return nil, err
			}
		case "hot_keys": // hotkeys.go
			if err := s.oneArg(d, &p.HotKeys); err != nil {
				return nil, err
			}
		case "plan": // plan.go
			if err := s.planArg(d, p); err != nil {
				return nil, err
			}
		case "shed":
			if err := s.shedArg(d, p); err != nil {
				return nil, err
			}
		case "priority":
			if err := s.priorityArg(d, p); err != nil {
				return nil, err
			}
		default:
			return nil, unknownSubdirective(d, s, blockOfPolicy, sub)
		}
	}
	if err := p.check(); err != nil {
		return nil, s.fail(err)
	}
	s.warnUnusedPrefix(p)
	return p, nil
}

// warnUnusedPrefix warns when the policy sets a prefix length but its key
// holds no client address to apply it to: a key read from a header (as
// X-Real-IP) is not masked.
func (s *section) warnUnusedPrefix(p *Policy) {
	if p.keyTmpl.usesAddr() {
		return
	}
	for _, sub := range []string{"ipv6_prefix", "ipv4_prefix"} {
		if at, ok := s.seen[sub]; ok {
			warnCaddyfile(at.File(), at.Line(), fmt.Sprintf("rate_limit: %s%s applies to a client address in the key "+
				"({client_ip}, {remote_host}, {http.request.remote}), and key %s has none: it does nothing. "+
				"Behind a proxy, key on {client_ip} with the server's trusted_proxies instead of on a header", s.prefix, sub, p.Key))
		}
	}
}

// parseSettle reads the arguments of `settle header|trailer <field>
// [max <n>] [debt <n>]` and `settle openai|anthropic [weights input <a>
// output <b> [cache_write <w>] [cache_read <r>]] [max <n>] [debt <n>]`;
// the options in any order. What the values mean is checked with the
// policy (Settle.check).
func parseSettle(args []string) (*Settle, error) {
	const syntax = "expected settle header|trailer <field> [max <n>] [debt <n>], or settle openai|anthropic [include_usage] [weights input <a> output <b> [cache_write <w>] [cache_read <r>]] [max <n>] [debt <n>]"
	st := new(Settle)
	if len(args) == 0 {
		return nil, errors.New(syntax)
	}
	st.From, args = args[0], args[1:]
	if (st.From == settleHeader || st.From == settleTrailer) && len(args) > 0 {
		st.Field, args = args[0], args[1:]
	}
	for len(args) > 0 {
		switch opt := args[0]; opt {
		case "max", "debt":
			dst := &st.Max
			if opt == "debt" {
				dst = &st.Debt
			}
			if *dst != 0 {
				return nil, fmt.Errorf("%s: given twice", opt)
			}
			if len(args) < 2 {
				return nil, fmt.Errorf("%s: a value is required", opt)
			}
			n, ok := positiveAmount(args[1])
			if !ok {
				return nil, fmt.Errorf("%s %q must be a positive number", opt, args[1])
			}
			*dst, args = n, args[2:]
		case "include_usage":
			if st.IncludeUsage {
				return nil, errors.New("include_usage: given twice")
			}
			st.IncludeUsage, args = true, args[1:]
		case "weights":
			if st.Weights != nil {
				return nil, errors.New("weights: given twice")
			}
			st.Weights = new(SettleWeights)
			args = args[1:]
			for len(args) > 0 {
				w := map[string]**float64{"input": &st.Weights.Input, "output": &st.Weights.Output,
					"cache_write": &st.Weights.CacheWrite, "cache_read": &st.Weights.CacheRead}[args[0]]
				if w == nil {
					break
				}
				if *w != nil {
					return nil, fmt.Errorf("weights: %s given twice", args[0])
				}
				if len(args) < 2 {
					return nil, fmt.Errorf("weights: %s: a number is required", args[0])
				}
				v, err := strconv.ParseFloat(args[1], 64)
				if err != nil {
					return nil, fmt.Errorf("weights: %s %q is not a number", args[0], args[1])
				}
				*w, args = &v, args[2:]
			}
			if st.Weights.Input == nil || st.Weights.Output == nil {
				return nil, errors.New("weights: expected weights input <a> output <b> [cache_write <w>] [cache_read <r>], input and output both")
			}
		default:
			return nil, fmt.Errorf("unexpected %q: %s", opt, syntax)
		}
	}
	return st, nil
}

// section is one block of the Caddyfile being read: its line, the prefix
// of its errors (`policy "api": `, `redis: `) and the line of each of its
// subdirectives, so that a mistake found once the block is read (by the
// checks the JSON config runs too) is reported at its own line.
type section struct {
	at     caddyfile.Dispenser
	prefix string
	seen   map[string]caddyfile.Dispenser
}

func newSection(d *caddyfile.Dispenser, prefix string) *section {
	return &section{at: *d, prefix: prefix, seen: map[string]caddyfile.Dispenser{}}
}

// newNamedSection reads the name of a `policy <name> {` (or `zone`) line
// into name.
func newNamedSection(d *caddyfile.Dispenser, kind string, name *string) (*section, error) {
	if !d.NextArg() {
		return nil, d.Errf("%s: a name is required, as in %s <name> { ... }", kind, kind)
	}
	*name = d.Val()
	if !policyName.MatchString(*name) {
		return nil, d.Errf("%s %q: the name must be 1 to 64 letters, digits, '_', '-' or '.'", kind, *name)
	}
	s := newSection(d, fmt.Sprintf("%s %q: ", kind, *name))
	if d.NextArg() {
		return nil, s.errf(d, "unexpected argument %q: expected %s <name> { ... }", d.Val(), kind)
	}
	return s, nil
}

// errf is an error at the dispenser's line, in the section.
func (s *section) errf(d *caddyfile.Dispenser, format string, args ...any) error {
	return d.Errf("%s%s", s.prefix, fmt.Sprintf(format, args...))
}

// once records where the subdirective at d is, and fails when the block
// has it already: a second key, rate or timeout would silently win.
func (s *section) once(d *caddyfile.Dispenser) error {
	sub := d.Val()
	if first, seen := s.seen[sub]; seen {
		return s.errf(d, "%s: defined twice (first at line %d)", sub, first.Line())
	}
	s.seen[sub] = *d
	return nil
}

// caddyfileNames are the subdirectives that set JSON fields of other names.
var caddyfileNames = map[string]string{"addresses": "address", "max_cost": "cost", "max_held": "wait"}

// fail reports err, from checking the block's values, at the line of the
// subdirective that set the field it names (the block's line otherwise).
func (s *section) fail(err error) error {
	at, msg := s.at, err.Error()
	var fe *fieldError
	if errors.As(err, &fe) {
		sub := fe.field
		if name, ok := caddyfileNames[sub]; ok {
			sub = name
			if !strings.HasPrefix(msg, name+":") {
				msg = name + ": " + msg
			}
		}
		if d, ok := s.seen[sub]; ok {
			at = d
		}
	}
	return at.Errf("%s%s", s.prefix, msg)
}

// matchArg reads a policy's (or zone's) match block.
func (s *section) matchArg(d *caddyfile.Dispenser, p *Policy) error {
	set, err := caddyhttp.ParseCaddyfileNestedMatcherSet(d)
	if err != nil { // it has the line already
		return fmt.Errorf("%smatch: %w", s.prefix, err)
	}
	p.MatchRaw = set
	return nil
}

func (s *section) oneArg(d *caddyfile.Dispenser, dst *string) error {
	sub := d.Val()
	if !d.NextArg() {
		return s.errf(d, "%s: a value is required", sub)
	}
	*dst = d.Val()
	if d.NextArg() {
		return s.errf(d, "%s: one value expected, got another: %q", sub, d.Val())
	}
	return nil
}

func (s *section) noArg(d *caddyfile.Dispenser) error {
	sub := d.Val()
	if d.NextArg() {
		return s.errf(d, "%s: takes no value, got %q", sub, d.Val())
	}
	return nil
}

// intArg reads an integer of at least least (the checks of the JSON
// config bound it above): in the Caddyfile, 0 cannot mean the default as it
// does in JSON.
func (s *section) intArg(d *caddyfile.Dispenser, dst *int, least int) error {
	sub := d.Val()
	var v string
	if err := s.oneArg(d, &v); err != nil {
		return err
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < least {
		return s.errf(d, "%s: %q must be an integer of at least %d", sub, v, least)
	}
	*dst = n
	return nil
}

// positiveArg reads a positive integer: in the Caddyfile, 0 cannot mean
// the default as it does in JSON.
func (s *section) positiveArg(d *caddyfile.Dispenser, dst *int64) error {
	sub := d.Val()
	var v string
	if err := s.oneArg(d, &v); err != nil {
		return err
	}
	n, ok := positive(v)
	if !ok {
		return s.errf(d, "%s: %q must be a positive integer", sub, v)
	}
	*dst = n
	return nil
}

// prefixArg reads a prefix length, 1 to all bits (0 too when zero, for
// mholt/caddy-ratelimit's zones, where 0 means the whole address).
func (s *section) prefixArg(d *caddyfile.Dispenser, dst *int, all int, zero bool) error {
	sub := d.Val()
	var v string
	if err := s.oneArg(d, &v); err != nil {
		return err
	}
	least := 1
	if zero {
		least = 0
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < least || n > all || strings.HasPrefix(v, "+") {
		return s.errf(d, "%s: %q must be an integer from %d to %d (the leading bits of a client address kept in keys)", sub, v, least, all)
	}
	if n == 0 {
		n = all
	}
	*dst = n
	return nil
}

// amountArg reads a positive number: an integer of tokens, or under
// `unit usd` dollars (whose decimals the policy's checks read, as in
// JSON).
func (s *section) amountArg(d *caddyfile.Dispenser, dst *float64) error {
	sub := d.Val()
	var v string
	if err := s.oneArg(d, &v); err != nil {
		return err
	}
	n, ok := positiveAmount(v)
	if !ok {
		return s.errf(d, "%s: %q must be a positive number", sub, v)
	}
	*dst = n
	return nil
}

// positiveAmount parses a positive decimal number (1, 1.50), as JSON
// holds it.
func positiveAmount(v string) (float64, bool) {
	n, err := strconv.ParseFloat(v, 64)
	return n, err == nil && n > 0 && !math.IsInf(n, 0) && !strings.ContainsAny(v, "xXpP_") && !strings.HasPrefix(v, "+")
}

// positive parses a positive integer.
func positive(v string) (int64, bool) {
	n, err := strconv.ParseInt(v, 10, 64)
	return n, err == nil && n >= 1
}

// durationArg reads a positive duration.
func (s *section) durationArg(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	sub := d.Val()
	var v string
	if err := s.oneArg(d, &v); err != nil {
		return err
	}
	dur, err := caddy.ParseDuration(v)
	if err != nil || dur <= 0 {
		return s.errf(d, "%s: %q is not a positive duration", sub, v)
	}
	*dst = caddy.Duration(dur)
	return nil
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
	if v > maxJitter {
		return 0, errNotJitter(s)
	}
	return v, nil
}

// Interface guard.
var _ caddyfile.Unmarshaler = (*Handler)(nil)

type errNotJitter string

func (e errNotJitter) Error() string {
	return strconv.Quote(string(e)) + " is not a percentage from 0% to 1000% such as 20% (or a fraction such as 0.2)"
}

// shedArg reads a policy's shed { concurrent <n>  latency <duration> }.
func (s *section) shedArg(d *caddyfile.Dispenser, p *Policy) error {
	if d.NextArg() {
		return s.errf(d, "shed: unexpected %q: the capacity goes in a block, shed { concurrent <n>  latency <duration> }", d.Val())
	}
	sh := new(Shed)
	in := newSection(d, s.prefix+"shed: ")
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if err := in.once(d); err != nil {
			return err
		}
		switch opt := d.Val(); opt {
		case "concurrent":
			if err := in.positiveArg(d, &sh.Concurrent); err != nil {
				return err
			}
		case "latency":
			if err := in.durationArg(d, &sh.Latency); err != nil {
				return err
			}
		default:
			return in.errf(d, "unrecognized subdirective %q: shed takes concurrent <n> and latency <duration>", opt)
		}
	}
	p.Shed = sh
	return nil
}

// priorityArg reads a policy's priority <placeholder> { <class> <share>% ... },
// checking each class at its own line.
func (s *section) priorityArg(d *caddyfile.Dispenser, p *Policy) error {
	pr, at := new(Priority), *d
	if !d.NextArg() {
		return s.errf(d, "priority: the placeholder that names the class is required, e.g. priority {http.request.header.X-Priority} { ... }")
	}
	pr.From = d.Val()
	if d.NextArg() {
		return s.errf(d, "priority: unexpected %q: the classes go in a block, one per line, highest first: <class> <share>%%", d.Val())
	}
	if err := pr.checkFrom(); err != nil {
		return s.errf(d, "%v", err)
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		var share string
		if !d.NextArg() {
			return s.errf(d, "priority: class %q: a share is required, e.g. %s 50%%", name, name)
		}
		share = d.Val()
		if d.NextArg() {
			return s.errf(d, "priority: class %q: one share expected, got another: %q", name, d.Val())
		}
		pr.Classes = append(pr.Classes, PriorityClass{Name: name, Share: share})
		// The classes before this one passed: a mistake now is this line's.
		if _, err := pr.check(); err != nil {
			return s.errf(d, "%v", err)
		}
	}
	if len(pr.Classes) == 0 {
		return s.errf(&at, "priority: at least one class is required, highest first, e.g. critical 100%%")
	}
	p.Priority = pr
	return nil
}
