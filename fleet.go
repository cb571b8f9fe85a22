package ratelimit

import (
	"context"
	_ "embed"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
)

// The fleet sees itself. Every instance announces itself on each Redis
// database it uses: a record (internal/fleet) of its id, host and pid,
// version, the storage format it writes, and what each of its policies
// there enforces (limit, key, key_prefix, a fingerprint of key_secret),
// written every fleetEvery and kept fleetTTL unless written again. The
// records are in two hashes under one Redis Cluster hash tag, outside
// every key_prefix, so that instances whose key_prefix differs still find
// each other; each database has its own. Each instance compares its
// policies with those of the same name that the other live instances of
// its fleet (same database, same key_prefix) enforce: a disagreement is
// logged once at WARN when it appears, once at INFO when it is gone, and
// the policies in disagreement are counted by
// caddy_rate_limit_fleet_disagreements. The same goroutine probes Redis
// once each config is running (probe.go). Releases before this one do not
// announce themselves, and read none of it.

//go:embed lua/fleet.lua
var fleetLua string

var fleetScript = redis.NewScript(fleetLua)

const (
	// fleetIndexKey holds, per live instance, its record's expiry and
	// digest; fleetRecordsKey the records. Not under a key_prefix.
	fleetIndexKey   = "rate_limit:{fleet}"
	fleetRecordsKey = "rate_limit:{fleet}:records"
	// fleetEvery is how often an instance writes its record and reads the
	// fleet's; a record not written again within fleetTTL is dropped.
	fleetEvery = 5 * time.Second
	fleetTTL   = 3 * fleetEvery
	// fleetSettle gathers the nudges of instances starting or reloading
	// together into one refresh.
	fleetSettle = 100 * time.Millisecond
	// eventFleet, "fleet <instance>" on the events channel: the instance's
	// record changed; the others read the fleet at once.
	eventFleet = "fleet"
)

// hostName and processStarted find the process, in its records.
var (
	hostName, _    = os.Hostname()
	processStarted = time.Now().UnixMilli()
)

// fleetView is one connection's part in the fleet: the handlers that use
// it, what it wrote, and what it saw. It holds what it needs of its Redis
// store: the client, the database, the logger, the bound of a call, the
// end of the connection; and asks it, through the functions it was given,
// for the format it writes, the key prefixes it listens to, and a probe of
// a config that started (probe.go).
type fleetView struct {
	client      redis.UniversalClient
	name        string // the addresses, for logs
	db          int
	logger      *zap.Logger
	callTimeout time.Duration
	closed      <-chan struct{}
	format      func() string
	prefixes    func() []string
	probe       func(hs []*Handler)

	// nudge asks for a refresh now: a config using the connection was
	// provisioned or cleaned up, or another instance's record changed.
	nudge chan struct{}

	regsMu sync.Mutex
	regs   []fleetReg

	// mu makes one refresh at a time, and leaving final.
	mu          sync.Mutex
	left        bool
	written     string                // the digest of the record in Redis, "" for none
	published   string                // the digest last announced on the events channels
	probed      any                   // the config last probed (probe.go)
	probeOK     bool                  // the last probe found Redis deciding
	probeAgain  bool                  // it found Redis away: probe once Redis answers
	known       map[string]fleetKnown // the other live instances' records, by id
	seen        []string              // their ids, as last logged
	warned      map[splitKey]bool     // the disagreements logged and still there
	disagreeing int                   // counted in fleetDisagreements
	failed      string                // the kind of the refresh failure logged last
}

// fleetReg is a handler using the connection, in the config it belongs to.
type fleetReg struct {
	config any
	h      *Handler
}

// fleetKnown is a record read, with the digest of what was read.
type fleetKnown struct {
	digest string
	record fleet.Record
	ok     bool // it decoded
}

// join registers a provisioned handler, whose policies the connection
// announces once its config runs.
func (v *fleetView) join(h *Handler) {
	v.regsMu.Lock()
	v.regs = append(v.regs, fleetReg{h.config, h})
	v.regsMu.Unlock()
	v.nudgeFleet()
}

// part unregisters a handler being cleaned up.
func (v *fleetView) part(h *Handler) {
	v.regsMu.Lock()
	v.regs = slices.DeleteFunc(v.regs, func(r fleetReg) bool { return r.h == h })
	v.regsMu.Unlock()
	v.nudgeFleet()
}

func (v *fleetView) nudgeFleet() {
	select {
	case v.nudge <- struct{}{}:
	default:
	}
}

// running returns the handlers of the running config that use the
// connection; pending while handlers are registered but their config has
// not started (Caddy provisions a config before it runs it, and drops it
// if it fails to start).
func (v *fleetView) running() (config any, hs []*Handler, pending bool) {
	v.regsMu.Lock()
	defer v.regsMu.Unlock()
	if len(v.regs) == 0 {
		return nil, nil, false
	}
	active := caddy.ActiveContext()
	reg := active.GetMetricsRegistry()
	for _, r := range v.regs {
		if reg != nil && r.config == any(reg) {
			config = r.config
			hs = append(hs, r.h)
		}
	}
	return config, hs, config == nil
}

// registered returns the policies of the handlers using the connection
// in the config provisioned last: those its failures apply to.
func (v *fleetView) registered() []*Policy {
	v.regsMu.Lock()
	defer v.regsMu.Unlock()
	if len(v.regs) == 0 {
		return nil
	}
	last := v.regs[len(v.regs)-1].config
	var ps []*Policy
	for _, r := range v.regs {
		if r.config == last {
			ps = append(ps, r.h.Policies...)
		}
	}
	return ps
}

// followFleet refreshes the connection's part in the fleet every
// fleetEvery, and when nudged, until the connection closes.
func (v *fleetView) followFleet() {
	tick := time.NewTicker(fleetEvery)
	defer tick.Stop()
	for {
		select {
		case <-tick.C:
		case <-v.nudge:
			select {
			case <-time.After(fleetSettle):
			case <-v.closed:
				return
			}
		case <-v.closed:
			return
		}
		// Until the config runs: soon, or dropped.
		for wait := 50 * time.Millisecond; !v.refreshFleet(); wait = min(2*wait, time.Second) {
			select {
			case <-time.After(wait):
			case <-v.closed:
				return
			}
		}
	}
}

// refreshFleet probes Redis for a config that started running, writes
// this instance's record, reads the others' and notes the disagreements.
// It returns false while the registered config has not started.
func (v *fleetView) refreshFleet() bool {
	config, hs, pending := v.running()
	if pending {
		return false
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	if v.left {
		return true
	}
	if config != nil && config != v.probed {
		v.probed = config
		v.probe(hs)
	}
	self := v.fleetRecord(hs)
	var raw []byte
	var digest string
	if len(self.Policies) > 0 {
		raw, digest = fleet.Encode(self)
	}
	if digest == "" && v.written == "" {
		v.noteSplits(nil)
		return true // nothing to say, nothing said
	}
	ctx, cancel := context.WithTimeout(context.Background(), v.callTimeout)
	defer cancel()
	_, live, err := fleetCall(ctx, v.client, instanceID, digest, raw, false)
	if err != nil {
		v.fleetFailed(err)
		return true
	}
	if v.failed != "" && !away(v.failed) { // what was warned about is fixed
		v.logger.Info("this instance announces itself to the fleet again", zap.String("redis", v.name))
	}
	v.failed = ""
	if v.probeAgain && config != nil {
		v.probe(hs) // Redis answers again: does it decide?
	}
	v.written = digest
	if digest == "" {
		v.noteSplits(nil)
		return true
	}
	if err := v.readRecords(ctx, live); err != nil {
		v.fleetFailed(err)
		return true
	}
	if digest != v.published {
		// The others of its fleets read the fleet at once.
		v.published = digest
		for _, prefix := range recordPrefixes(self) {
			if err := v.client.Publish(ctx, eventsChannel(prefix), eventFleet+" "+instanceID).Err(); err != nil {
				v.logger.Debug("announcing a change of this instance's fleet record", zap.String("redis", v.name), zap.Error(err))
			}
		}
	}
	others := make([]fleet.Record, 0, len(v.known))
	ids := make([]string, 0, len(v.known))
	for id, k := range v.known {
		ids = append(ids, id)
		if k.ok {
			others = append(others, k.record)
		}
	}
	slices.Sort(ids)
	if !slices.Equal(ids, v.seen) {
		v.seen = ids
		v.logger.Debug("the other live instances on this Redis database", zap.String("redis", v.name), zap.Int("db", v.db), zap.Strings("instances", ids))
	}
	v.noteSplits(fleet.Against(self, others))
	return true
}

// fleetRecord is what this instance announces on the connection: the
// policies of hs that use Redis.
func (v *fleetView) fleetRecord(hs []*Handler) fleet.Record {
	r := fleet.Record{
		ID: instanceID, Host: hostName, PID: os.Getpid(), Version: Version,
		Format: v.format(), DB: v.db, Started: processStarted,
	}
	for _, h := range hs {
		for _, p := range h.Policies {
			if !p.usesStore() {
				continue
			}
			fp := fleet.Policy{Name: p.Name, Prefix: h.keyPrefix, Limit: fleet.Bound(p.limitShape()),
				Key: fleet.Bound(p.keyShape()), Secret: h.hasher.fingerprint()}
			if p.Plan != nil { // v0.4.0 compares its plans' Go dumps
				fp.Previous = fleet.Bound(p.limitShapeOf(true))
			}
			if !slices.Contains(r.Policies, fp) { // the same policy in two handlers
				r.Policies = append(r.Policies, fp)
			}
		}
	}
	return r
}

// usesStore reports whether the policy's buckets are in the handler's
// store: all but a shed policy's adaptive limit alone, which is this
// instance's.
func (p *Policy) usesStore() bool { return p.kind != kindShed || p.capacity().has(slotCapacity) }

func recordPrefixes(r fleet.Record) []string {
	var out []string
	for _, p := range r.Policies {
		if !slices.Contains(out, p.Prefix) {
			out = append(out, p.Prefix)
		}
	}
	return out
}

// readRecords reads the records of the live instances whose record
// changed since last read, and forgets those no longer live.
func (v *fleetView) readRecords(ctx context.Context, live []fleetEntry) error {
	if v.known == nil {
		v.known = map[string]fleetKnown{}
	}
	var need []string
	alive := map[string]bool{}
	for _, e := range live {
		if e.id == instanceID {
			continue
		}
		alive[e.id] = true
		if k, ok := v.known[e.id]; !ok || k.digest != e.digest {
			need = append(need, e.id)
		}
	}
	for id := range v.known {
		if !alive[id] {
			delete(v.known, id)
		}
	}
	if len(need) == 0 {
		return nil
	}
	// HGETs in one round trip: the ACL the limiter needs has HGET already.
	gets := make([]*redis.StringCmd, len(need))
	if _, err := v.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, id := range need {
			gets[i] = p.HGet(ctx, fleetRecordsKey, id)
		}
		return nil
	}); err != nil && !errors.Is(err, redis.Nil) {
		return err
	}
	for i, get := range gets {
		raw := get.Val()
		if raw == "" {
			delete(v.known, need[i]) // it left meanwhile
			continue
		}
		r, err := fleet.Decode([]byte(raw))
		v.known[need[i]] = fleetKnown{digest: fleet.Digest([]byte(raw)), record: r, ok: err == nil && r.ID == need[i]}
	}
	return nil
}

// fleetEntry is a live instance as the index says it.
type fleetEntry struct {
	id     string
	expiry int64 // ms of Redis time
	digest string
	record string // when asked for
}

// fleetCall runs lua/fleet.lua on one Redis database: writes the record
// of instance id (none with id "", leaves with a nil record), and returns
// Redis's time in ms and the live instances, with their records if asked.
func fleetCall(ctx context.Context, s redis.Scripter, id, digest string, record []byte, withRecords bool) (int64, []fleetEntry, error) {
	with := "0"
	if withRecords {
		with = "1"
	}
	res, err := fleetScript.Run(ctx, s, []string{fleetIndexKey, fleetRecordsKey}, id, digest, string(record), fleetTTL.Milliseconds(), with).Slice()
	if err != nil {
		return 0, nil, err
	}
	return parseFleetReply(res, withRecords)
}

func parseFleetReply(res []any, withRecords bool) (int64, []fleetEntry, error) {
	width := 3
	if withRecords {
		width = 4
	}
	var now int64
	ok := len(res) > 0
	if ok {
		now, ok = res[0].(int64)
	}
	if !ok || (len(res)-1)%width != 0 {
		return 0, nil, fmt.Errorf("%w: the fleet script's reply has %d values", errScriptReply, len(res))
	}
	var out []fleetEntry
	for i := 1; i < len(res); i += width {
		var e fleetEntry
		e.id, _ = res[i].(string)
		e.expiry, _ = res[i+1].(int64)
		e.digest, _ = res[i+2].(string)
		if withRecords {
			e.record, _ = res[i+3].(string)
		}
		out = append(out, e)
	}
	return now, out, nil
}

// fleetFailed logs a failed refresh once per kind of failure: Redis being
// away is the decisions' to report; a Redis user without the fleet's keys
// is told how to grant them.
func (v *fleetView) fleetFailed(err error) {
	if errors.Is(err, redis.ErrClosed) {
		return
	}
	kind := errorKind(err)
	if kind == v.failed {
		return
	}
	v.failed = kind
	fields := []zap.Field{zap.String("redis", v.name), zap.String("kind", kind), zap.Error(err)}
	switch {
	case away(kind): // the decisions report it
		v.logger.Debug("announcing this instance to the fleet", fields...)
	case kind == "noperm":
		v.logger.Warn("this instance cannot announce itself to the fleet: the Redis user may not run its script or use its keys; "+
			"grant ~"+fleetIndexKey+"* with the ACL of docs/redis.md. Decisions are not affected, but `caddy rate-limit fleet` "+
			"does not list this instance, and instances that disagree on a policy are not told", fields...)
	default:
		v.logger.Warn("this instance cannot announce itself to the fleet; decisions are not affected", fields...)
	}
}

// leaveFleet removes this instance's record (waiting at most until
// deadline), so that the others see at once that it stopped, and takes
// its disagreements off the gauge. Nothing is announced on the connection
// after it.
func (v *fleetView) leaveFleet(deadline time.Time) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.left = true
	// Off the gauge, without saying the fleet agrees: this instance leaves.
	fleetDisagreements.Add(-float64(v.disagreeing))
	v.disagreeing, v.warned = 0, nil
	if v.written == "" {
		return
	}
	ctx, cancel := context.WithDeadline(context.Background(), deadline)
	defer cancel()
	if _, _, err := fleetCall(ctx, v.client, instanceID, "", nil, false); err != nil {
		v.logger.Debug("removing this instance's fleet record", zap.String("redis", v.name), zap.Error(err))
		return
	}
	for _, prefix := range v.prefixes() {
		_ = v.client.Publish(ctx, eventsChannel(prefix), eventFleet+" "+instanceID).Err()
	}
}

// noteSplits logs the disagreements that appeared (WARN) and those gone
// (INFO), and counts those there in the gauge.
func (v *fleetView) noteSplits(splits []fleet.Split) {
	now := make(map[splitKey]bool, len(splits))
	still := map[policyIn]bool{}
	for _, s := range splits {
		k := splitKey{policyIn{s.Prefix, s.Policy}, strings.Join(s.Differs, ",")}
		now[k] = true
		still[k.policy] = true
		if !v.warned[k] {
			msg, fields := splitMessage(s)
			v.logger.Warn(msg, append(fields, zap.String("redis", v.name), zap.String("instance", instanceID))...)
		}
	}
	for k := range v.warned {
		if !now[k] && !still[k.policy] {
			still[k.policy] = true // once per policy
			v.logger.Info("the live instances of this fleet agree again on policy "+k.policy.name,
				zap.String("policy", k.policy.name), zap.String("key_prefix", k.policy.prefix), zap.String("redis", v.name))
		}
	}
	v.warned = now
	if n := len(splits); n != v.disagreeing {
		fleetDisagreements.Add(float64(n - v.disagreeing))
		v.disagreeing = n
	}
}

// policyIn is a policy name under a key prefix; splitKey one of its
// disagreements, by what differs.
type policyIn struct{ prefix, name string }

type splitKey struct {
	policy  policyIn
	differs string
}

// splitMessage says what a disagreement is, relative to this instance
// (the first variant): the policy, what differs, and what to do. Never a
// secret: a key_secret differs or not.
func splitMessage(s fleet.Split) (string, []zap.Field) {
	what, others, fields := splitDetails(s)
	who := "another live instance"
	if len(others) > 1 {
		who = fmt.Sprintf("%d other live instances", len(others))
	}
	msg := fmt.Sprintf("policy %s is enforced with %s by %s of this fleet (same Redis database and key_prefix): "+
		"they do not share one budget, so together they admit more than it. "+
		"Make their configs agree (`caddy rate-limit fleet` lists the live instances and what each enforces)",
		s.Policy, strings.Join(what, " and "), who)
	return msg, fields
}

// splitDetails says what differs from this instance's variant (the
// first), which other instances differ, and the fields that show it.
func splitDetails(s fleet.Split) (what, others []string, fields []zap.Field) {
	mine := s.Variants[0]
	for _, v := range s.Variants[1:] {
		others = append(others, v.Instances...)
	}
	theirs := func(part func(fleet.Variant) string) string {
		var vals []string
		for _, v := range s.Variants[1:] {
			if x := part(v); x != part(mine) && !slices.Contains(vals, x) {
				vals = append(vals, x)
			}
		}
		return strings.Join(vals, " | ")
	}
	fields = []zap.Field{zap.String("policy", s.Policy), zap.String("key_prefix", s.Prefix), zap.Strings("differs", s.Differs)}
	for _, d := range s.Differs {
		switch d {
		case fleet.PartSecret:
			what = append(what, "another key_secret (each hashes identities into buckets of its own)")
		case fleet.PartLimit:
			there := theirs(func(v fleet.Variant) string { return v.Limit })
			what = append(what, "another limit ("+there+" there; "+mine.Limit+" here)")
			fields = append(fields, zap.String("limit_here", mine.Limit), zap.String("limit_there", there))
		case fleet.PartKey:
			there := theirs(func(v fleet.Variant) string { return v.Key })
			what = append(what, "another key ("+there+" there; "+mine.Key+" here)")
			fields = append(fields, zap.String("key_here", mine.Key), zap.String("key_there", there))
		}
	}
	return what, others, append(fields, zap.Strings("other_instances", others))
}

// differText names the parts that differ: "key_secret differs", "limit
// and key differ".
func differText(parts []string) string {
	if len(parts) == 1 {
		return parts[0] + " differs"
	}
	return strings.Join(parts, " and ") + " differ"
}

// readFleets reads the live instances of the connection's database and,
// on a single Redis, of its other databases, on a client of its own: an
// operator's listing may take longer than the decisions' timeout, and
// SELECT changes a connection's database, which must not go back to the
// decisions' pool.
func (v *fleetView) readFleets(ctx context.Context) (fleetStore, error) {
	st := fleetStore{Store: "Redis " + v.name}
	client := v.listingClient()
	defer client.Close()
	now, live, err := fleetCall(ctx, client, "", "", nil, true)
	if err != nil {
		return st, err
	}
	st.Instances = liveInstances(v.db, now, live)
	if single, ok := client.(*redis.Client); ok { // a Redis Cluster has one database
		others, note := readOtherDatabases(ctx, single, v.db)
		st.Instances, st.OtherDatabases = append(st.Instances, others...), note
	}
	var records []fleet.Record
	for _, in := range st.Instances {
		records = append(records, in.Record)
	}
	st.Fleets = fleet.Fleets(records)
	return st, nil
}

// liveRecords reads the records of the live instances of the connection's
// database, on a client of its own, as readFleets does.
func (v *fleetView) liveRecords(ctx context.Context) (db int, records []fleet.Record, err error) {
	client := v.listingClient()
	defer client.Close()
	now, live, err := fleetCall(ctx, client, "", "", nil, true)
	if err != nil {
		return v.db, nil, err
	}
	for _, in := range liveInstances(v.db, now, live) {
		records = append(records, in.Record)
	}
	return v.db, records, nil
}

// listingClient is a client of one connection to the connection's Redis
// (each node's, for a Cluster), whose reads may take listingTimeout.
func (v *fleetView) listingClient() redis.UniversalClient {
	switch cl := v.client.(type) {
	case *redis.ClusterClient:
		opt := *cl.Options()
		opt.PoolSize, opt.MinIdleConns, opt.MaxIdleConns = 1, 0, 1
		opt.ReadTimeout, opt.WriteTimeout = listingTimeout, listingTimeout
		return redis.NewClusterClient(&opt)
	case *redis.Client: // a single Redis, or a master found through Sentinel
		opt := *cl.Options()
		opt.PoolSize, opt.MinIdleConns, opt.MaxIdleConns = 1, 0, 1
		opt.ReadTimeout, opt.WriteTimeout = listingTimeout, listingTimeout
		return redis.NewClient(&opt)
	}
	return nil
}

// readOtherDatabases reads the fleets of a single Redis's databases other
// than own, until one is out of range; note says why not all were read.
func readOtherDatabases(ctx context.Context, cl *redis.Client, own int) (out []fleetInstance, note string) {
	conn := cl.Conn()
	defer conn.Close()
	for db := 0; db < maxListedDBs; db++ {
		if db == own {
			continue
		}
		var res *redis.Cmd
		_, err := conn.Pipelined(ctx, func(p redis.Pipeliner) error {
			p.Select(ctx, db)
			res = p.Eval(ctx, fleetLua, []string{fleetIndexKey, fleetRecordsKey}, "", "", "", fleetTTL.Milliseconds(), "1")
			return nil
		})
		switch {
		case err != nil && strings.Contains(err.Error(), "out of range"):
			return out, ""
		case err != nil && strings.HasPrefix(err.Error(), "NOPERM"):
			return out, "databases other than " + fmt.Sprint(own) + " not read: the Redis user may not SELECT them (" + err.Error() + ")"
		case err != nil:
			return out, fmt.Sprintf("databases from %d on not read: %v", db, err)
		}
		vals, err := res.Slice()
		if err != nil {
			return out, fmt.Sprintf("database %d not read: %v", db, err)
		}
		now, live, err := parseFleetReply(vals, true)
		if err != nil {
			return out, fmt.Sprintf("database %d not read: %v", db, err)
		}
		out = append(out, liveInstances(db, now, live)...)
	}
	return out, fmt.Sprintf("databases from %d on not read", maxListedDBs)
}

// liveInstances decodes the records read from database db; those that do
// not decode are left out.
func liveInstances(db int, now int64, live []fleetEntry) []fleetInstance {
	var out []fleetInstance
	for _, e := range live {
		r, err := fleet.Decode([]byte(e.record))
		if err != nil || r.ID != e.id {
			continue
		}
		r.DB = db // where it was read: what it shares
		out = append(out, fleetInstance{Record: r, ExpiresIn: float64(e.expiry-now) / 1000, Self: e.id == instanceID})
	}
	return out
}
