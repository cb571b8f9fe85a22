// Package fleet is what Caddy instances sharing a Redis say of themselves
// there, and how what they say is compared: each live instance's record
// (its id, version, storage format and, per policy, what it enforces), the
// fleets they form on one Redis database (one per key_prefix), and the
// policies of one name that two live instances of a fleet enforce
// differently. It holds no secret: a key_secret is only ever seen through
// SecretFingerprint.
package fleet

import (
	"crypto/pbkdf2"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"regexp"
	"slices"
	"strconv"
	"strings"
)

// Record is what one instance announces on one Redis database: who it is
// (no identity of a client, no secret) and what each of its policies on
// that database enforces.
type Record struct {
	// ID names the instance: random, new with each process.
	ID string `json:"id"`
	// Host and PID find the process, for the operator.
	Host string `json:"host,omitempty"`
	PID  int    `json:"pid,omitempty"`
	// Version is the module's release; Format the storage format the
	// instance writes buckets in (v1, v2).
	Version string `json:"version"`
	Format  string `json:"format"`
	// DB is the Redis database the instance's buckets are in.
	DB int `json:"db"`
	// Started is when the process announced itself first, in Unix ms.
	Started int64 `json:"started_ms,omitempty"`
	// Policies are sorted by key prefix, then name.
	Policies []Policy `json:"policies"`
	// Truncated: more policies than a record holds (MaxRecordBytes); those
	// past the last one listed are not compared.
	Truncated bool `json:"truncated,omitempty"`
}

// Policy is what one policy enforces: the parts that two instances must
// share for their requests to be counted in the same buckets, against the
// same limit.
type Policy struct {
	Name   string `json:"name"`
	Prefix string `json:"key_prefix"`
	// Limit is the policy's kind and limit (rate and burst, slots and
	// lease, quota and time zone, plans), as its config says it.
	Limit string `json:"limit"`
	// Previous is Limit as the release before this one (v0.4.0) writes it,
	// when that differs (a policy with plans, which it wrote as Go struct
	// dumps): the record stores it as "limit", which that release compares
	// with its own, and Limit as "caddyfile_limit", which this one reads
	// (see MarshalJSON). Never read back.
	Previous string `json:"-"`
	// Key is the key template, with the address mask that keys on a client
	// address keep.
	Key string `json:"key"`
	// Secret is SecretFingerprint of the handler's key_secret.
	Secret string `json:"key_secret"`
}

// The parts of a policy that can differ, by the names logs and answers
// give them.
const (
	PartLimit  = "limit"
	PartKey    = "key"
	PartSecret = "key_secret"
)

// parts are the policy's comparable parts, in the order PartLimit, PartKey,
// PartSecret.
func (p Policy) parts() [3]string { return [3]string{p.Limit, p.Key, p.Secret} }

var partNames = [3]string{PartLimit, PartKey, PartSecret}

// NoSecret is the fingerprint of no key_secret (plain SHA-256 hashes).
const NoSecret = "none"

// fingerprintSalt is fixed: the fingerprint of one secret must be the same
// on every instance. It names what the derivation is for, so that its
// output is of no use for anything else.
const fingerprintSalt = "caddy-ratelimit fleet key_secret fingerprint v1"

// fingerprintIterations makes each guess at a secret cost some 2^15
// HMAC-SHA-256 computations: a weak secret is no cheaper to find from
// its fingerprint than from the storage keys of identities one knows.
const fingerprintIterations = 1 << 15

// fingerprintBytes: 48 bits tell two secrets apart (a chance of 2^-48
// that two differ unseen) without confirming a guessed secret any better.
const fingerprintBytes = 6

// SecretFingerprint stands for a key_secret in records: equal for equal
// secrets, revealing nothing of the secret but what costly guessing (a
// slow, salted derivation, truncated) could confirm. NoSecret for none.
func SecretFingerprint(secret string) string {
	if secret == "" {
		return NoSecret
	}
	k, err := pbkdf2.Key(sha256.New, secret, []byte(fingerprintSalt), fingerprintIterations, fingerprintBytes)
	if err != nil { // only for parameters out of FIPS bounds, not these
		return "unknown"
	}
	return base64.RawURLEncoding.EncodeToString(k)
}

// maxPart is the longest key template or limit a record holds as written;
// a longer one is cut, and the hash of the whole keeps two that differ
// past the cut apart.
const maxPart = 256

// Bound returns s, or, when longer than maxPart bytes, its start and a
// hash of the whole.
func Bound(s string) string {
	if len(s) <= maxPart {
		return s
	}
	sum := sha256.Sum256([]byte(s))
	cut := maxPart - 24
	for cut > 0 && !utf8Start(s[cut]) {
		cut--
	}
	return s[:cut] + "… #" + hex.EncodeToString(sum[:8])
}

func utf8Start(b byte) bool { return b&0xC0 != 0x80 }

// MaxRecordBytes bounds a record: Redis holds one per live instance, and
// each instance reads a record again only when it changed.
const MaxRecordBytes = 32 << 10

// Encode returns the record as stored, its policies sorted and, when it
// would exceed MaxRecordBytes, the last ones dropped (Truncated set), and
// its digest: equal records, equal digests.
func Encode(r Record) (raw []byte, digest string) {
	r.Policies = slices.Clone(r.Policies)
	slices.SortFunc(r.Policies, func(a, b Policy) int {
		if c := strings.Compare(a.Prefix, b.Prefix); c != 0 {
			return c
		}
		return strings.Compare(a.Name, b.Name)
	})
	for {
		raw, _ = json.Marshal(r)
		if len(raw) <= MaxRecordBytes || len(r.Policies) == 0 {
			break
		}
		// Drop about as many policies as the excess takes, at least one.
		drop := max(1, len(r.Policies)*(len(raw)-MaxRecordBytes)/len(raw))
		r.Policies = r.Policies[:len(r.Policies)-drop]
		r.Truncated = true
	}
	return raw, Digest(raw)
}

// Digest identifies a record's content.
func Digest(raw []byte) string {
	sum := sha256.Sum256(raw)
	return base64.RawURLEncoding.EncodeToString(sum[:9])
}

// Decode reads a stored record. A plan's limit written by the release
// before this one (v0.4.0), a Go struct's dump (`pro {Rate:60/1h Burst:20
// MaxCost:0 Concurrent:0 Quota:};`), is read as this one writes it (`pro
// rate 60/1h burst 20;`), so that a fleet mixing the two agrees on a policy
// both enforce alike, and shows it as a Caddyfile says it.
func Decode(raw []byte) (Record, error) {
	var r Record
	err := json.Unmarshal(raw, &r)
	return r, err
}

// storedPolicy is a Policy as a record stores it.
type storedPolicy struct {
	Name   string `json:"name"`
	Prefix string `json:"key_prefix"`
	Limit  string `json:"limit"`
	// Caddyfile is the limit as this release writes it, when "limit" is
	// the release before's (Policy.Previous).
	Caddyfile string `json:"caddyfile_limit,omitempty"`
	Key       string `json:"key"`
	Secret    string `json:"key_secret"`
}

// MarshalJSON stores the policy with its limit as both releases of a
// mixed fleet compare it: "limit" as the release before writes it, and
// the Caddyfile's form beside it when that differs.
func (p Policy) MarshalJSON() ([]byte, error) {
	s := storedPolicy{Name: p.Name, Prefix: p.Prefix, Limit: p.Limit, Key: p.Key, Secret: p.Secret}
	if p.Previous != "" && p.Previous != p.Limit {
		s.Limit, s.Caddyfile = p.Previous, p.Limit
	}
	return json.Marshal(s)
}

// UnmarshalJSON reads a stored policy: its Caddyfile form when stored, or
// its "limit" with the release before's plan dumps read as this one
// writes them.
func (p *Policy) UnmarshalJSON(raw []byte) error {
	var s storedPolicy
	if err := json.Unmarshal(raw, &s); err != nil {
		return err
	}
	*p = Policy{Name: s.Name, Prefix: s.Prefix, Limit: s.Caddyfile, Key: s.Key, Secret: s.Secret}
	if p.Limit == "" {
		p.Limit = planDumps.ReplaceAllStringFunc(s.Limit, planOfDump)
	}
	return nil
}

// planDumps are the plan limits the release before this one wrote.
var planDumps = regexp.MustCompile(`\{Rate:(\S*) Burst:(\d+) MaxCost:(\d+) Concurrent:(\d+) Quota:(\S*)\}`)

// planOfDump is a dumped plan limit as PlanLimit writes it.
func planOfDump(dump string) string {
	m := planDumps.FindStringSubmatch(dump)
	atoi := func(s string) int64 { n, _ := strconv.ParseInt(s, 10, 64); return n }
	return PlanLimit(m[1], float64(atoi(m[2])), float64(atoi(m[3])), atoi(m[4]), m[5])
}

// PlanLimit is a plan's limit as the Caddyfile writes it: `rate <N>/<d>
// burst <n> cost max <n>`, `concurrent <n>` or `quota <N>`, each part given;
// burst and max in the policy's unit (dollars for a money policy).
func PlanLimit(rate string, burst, maxCost float64, concurrent int64, quota string) string {
	var parts []string
	if rate != "" {
		parts = append(parts, "rate "+rate)
	}
	if burst != 0 {
		parts = append(parts, "burst "+strconv.FormatFloat(burst, 'f', -1, 64))
	}
	if maxCost != 0 {
		parts = append(parts, "cost max "+strconv.FormatFloat(maxCost, 'f', -1, 64))
	}
	if concurrent != 0 {
		parts = append(parts, "concurrent "+strconv.FormatInt(concurrent, 10))
	}
	if quota != "" {
		parts = append(parts, "quota "+quota)
	}
	return strings.Join(parts, " ")
}

// Variant is one way a policy is enforced, and the instances enforcing it
// so.
type Variant struct {
	Limit     string   `json:"limit"`
	Key       string   `json:"key"`
	Secret    string   `json:"key_secret"`
	Instances []string `json:"instances"`
}

// Split is a policy of one name that the live instances of one fleet
// enforce in more than one way: they do not share one budget.
type Split struct {
	Policy string `json:"policy"`
	Prefix string `json:"key_prefix"`
	// Differs names the parts that are not the same in every variant:
	// limit, key, key_secret.
	Differs  []string  `json:"differs"`
	Variants []Variant `json:"variants"`
}

// Fleet is the live instances on one Redis database that share a
// key_prefix: those that can share buckets.
type Fleet struct {
	DB     int    `json:"db"`
	Prefix string `json:"key_prefix"`
	// Instances are the ids of those with a policy under this prefix.
	Instances []string `json:"instances"`
	// Splits are the policies its instances do not agree on.
	Splits []Split `json:"disagreements"`
}

type fleetID struct {
	db     int
	prefix string
}

// Fleets groups the live instances' records into fleets, by database and
// key prefix (an instance may be in several), and finds each fleet's
// splits. Fleets are sorted by database, then prefix; instances as given.
func Fleets(records []Record) []Fleet {
	byID := map[fleetID]*Fleet{}
	var order []fleetID
	for _, r := range records {
		for _, p := range r.Policies {
			id := fleetID{r.DB, p.Prefix}
			f := byID[id]
			if f == nil {
				f = &Fleet{DB: r.DB, Prefix: p.Prefix}
				byID[id] = f
				order = append(order, id)
			}
			if !slices.Contains(f.Instances, r.ID) {
				f.Instances = append(f.Instances, r.ID)
			}
		}
	}
	slices.SortFunc(order, func(a, b fleetID) int {
		if a.db != b.db {
			return a.db - b.db
		}
		return strings.Compare(a.prefix, b.prefix)
	})
	out := make([]Fleet, 0, len(order))
	for _, id := range order {
		f := byID[id]
		f.Splits = splits(records, id, "")
		out = append(out, *f)
	}
	return out
}

// Against returns the splits of self's policies with the other live
// instances of its fleets: for each policy of self that some other
// instance of the same database and key prefix enforces differently, the
// variants (self's first) and the parts that differ from self's. Others
// may include self, which is skipped.
func Against(self Record, others []Record) []Split {
	records := make([]Record, 0, len(others)+1)
	records = append(records, self)
	for _, r := range others {
		if r.ID != self.ID {
			records = append(records, r)
		}
	}
	var out []Split
	seen := map[fleetID]bool{}
	for _, p := range self.Policies {
		id := fleetID{self.DB, p.Prefix}
		if seen[id] {
			continue
		}
		seen[id] = true
		out = append(out, splits(records, id, self.ID)...)
	}
	return out
}

// splits finds the policies enforced in more than one way in one fleet.
// With self set, only self's policies, and Differs relative to self's
// variant, which comes first.
func splits(records []Record, id fleetID, self string) []Split {
	type entry struct {
		variants []Variant
		mine     int // index of self's variant, or -1
	}
	byName := map[string]*entry{}
	var names []string
	for _, r := range records {
		if r.DB != id.db {
			continue
		}
		for _, p := range r.Policies {
			if p.Prefix != id.prefix {
				continue
			}
			e := byName[p.Name]
			if e == nil {
				e = &entry{mine: -1}
				byName[p.Name] = e
				names = append(names, p.Name)
			}
			i := slices.IndexFunc(e.variants, func(v Variant) bool {
				return v.Limit == p.Limit && v.Key == p.Key && v.Secret == p.Secret
			})
			if i < 0 {
				e.variants = append(e.variants, Variant{Limit: p.Limit, Key: p.Key, Secret: p.Secret})
				i = len(e.variants) - 1
			}
			if !slices.Contains(e.variants[i].Instances, r.ID) {
				e.variants[i].Instances = append(e.variants[i].Instances, r.ID)
			}
			if r.ID == self && self != "" {
				e.mine = i
			}
		}
	}
	slices.Sort(names)
	var out []Split
	for _, name := range names {
		e := byName[name]
		if len(e.variants) < 2 || self != "" && e.mine < 0 {
			continue
		}
		vs := e.variants
		if e.mine > 0 { // self's first
			vs = append([]Variant{vs[e.mine]}, append(slices.Clone(vs[:e.mine]), vs[e.mine+1:]...)...)
		}
		out = append(out, Split{Policy: name, Prefix: id.prefix, Differs: differs(vs), Variants: vs})
	}
	return out
}

// differs names the parts not the same in every variant: those in which
// some variant differs from the first (self's, when there is a self).
func differs(vs []Variant) []string {
	var out []string
	for part, name := range partNames {
		first := variantParts(vs[0])[part]
		for _, v := range vs[1:] {
			if variantParts(v)[part] != first {
				out = append(out, name)
				break
			}
		}
	}
	return out
}

func variantParts(v Variant) [3]string {
	return Policy{Limit: v.Limit, Key: v.Key, Secret: v.Secret}.parts()
}
