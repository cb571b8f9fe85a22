package ratelimit

import (
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// Quotas: how much over a calendar period. A quota policy counts the units
// a key used in the current period of its calendar (internal/calendar), and a
// request of cost k is admitted iff used + k <= N, all-or-nothing with the
// request's other buckets. At the boundary usage starts again from 0, on
// every instance at the same instant, with no job or timer anywhere: a
// stored count records the period it belongs to, and a count of another
// period reads as 0.
//
// Redis has no time zones, so Go computes the period boundaries around its
// own clock (four of them: the period holding now, the one before and the
// one after) and the script picks, on Redis TIME, the period it is in. Two
// instances whose clocks disagree by less than a period therefore agree on
// the period: Redis's clock decides. A Redis clock outside the four bounds
// disagrees with this instance's by more than a period: that request fails
// (its policies' on_error), counted as store error kind "clock".
//
// This file is the Go reference of the quota's arithmetic, bucket by
// bucket, as decideBuckets applies it; lua/decide.lua (codes 12 and up) is
// the same, and TestLuaMatchesGoQuota holds the two together. A quota
// bucket is a bucketRequest whose quota is set: its op is one of the rate
// verbs (take, check, adjust, inspect, reset), its limit.burst is N (the
// quota's limit: a plan or an override replaces it there, as it replaces a
// rate's), its limit.slack the most a settle may charge beyond N, and its
// limit.interval unused (0).

// quotaSpec is what a quota policy's bucket requests carry beside their
// limit: where its periods come from and what confirms its decisions. It is
// shared by every request of the policy and never changes once provisioned.
type quotaSpec struct {
	periods periodSource
	unit    calendar.Unit
	loc     *time.Location
	durable durability
	// member is the policy's RateLimit-Policy member for the period last
	// shown: q is fixed, but w is the period's length, which months and
	// days across a daylight-saving change do not share. counts is the
	// policy's unit (its member's qu).
	name   string
	counts unit
	member atomic.Pointer[quotaMember]
	// used observes the share of the quota each decision found used
	// (caddy_rate_limit_quota_used_ratio).
	used prometheus.Observer
}

// periodSource gives a quota's bounds around an instant: a calendar, or in
// tests bounds placed anywhere.
type periodSource interface {
	Bounds(t time.Time) calendar.Bounds
}

// durability is what a quota's admissions wait for before they count:
// `durable replicas <n>` (WAIT) and/or `durable aof` (WAITAOF). See
// durable.go.
type durability struct {
	replicas int
	aof      bool
}

func (d durability) wanted() bool { return d.replicas > 0 || d.aof }

// notePeriod records, in a quota bucket request, the period its decision
// counted it in: a charge after the response (settle, charge_if) belongs
// to that period, and is dropped if it is over by then.
func (rq *bucketRequest) notePeriod(v verdict) {
	if rq.kind() == quotaBucket {
		rq.period = v.period
		observeQuotaUsed(rq.quota.used, v, *rq)
	}
}

// What Redis holds for a quota: "q:<start>:<end>:<used>", the period's
// bounds in Unix µs and the units used in it (44 bytes or less, which Redis
// keeps in the key's object, up to 99,999,999 used), under <key_prefix><policy>:{<hash>} like any bucket, with a
// TTL that ends quotaKeyMargin after the period. Its tag sets it apart from
// every rate format (format.go: all digits, or "<tat>:<interval>"), and the
// release before this one (v0.2) reads it as a rate bucket whose TAT is not
// a number: a corrupt bucket, which never admits. v0.2 never reads a quota
// key anyway: its configs have no quota policies, and a key is named by its
// policy. A rate bucket found under a quota's key (an earlier config gave
// the name to a rate policy) is replaced, as are concurrency slots; and the
// rate reader replaces a quota's count.

// quotaKeyMargin is how long a quota's key outlives its period. A count of
// a past period reads as 0 whether or not its key is still there; the
// margin only keeps TTLs, whole milliseconds counted from the call's start
// on Redis's clock, from ever ending before the period.
const quotaKeyMargin = time.Second

// encodeQuota is a quota count as the script stores it.
func encodeQuota(p calendar.Period, used int64) string {
	return "q:" + strconv.FormatInt(p.Start, 10) + ":" + strconv.FormatInt(p.End, 10) + ":" + strconv.FormatInt(used, 10)
}

// decodeQuota reads a stored quota count; ok is false for a value that is
// not one.
func decodeQuota(v string) (p calendar.Period, used int64, ok bool) {
	rest, found := strings.CutPrefix(v, "q:")
	if !found {
		return calendar.Period{}, 0, false
	}
	f := strings.Split(rest, ":")
	if len(f) != 3 {
		return calendar.Period{}, 0, false
	}
	var n [3]int64
	for i, s := range f {
		x, err := strconv.ParseInt(s, 10, 64)
		if err != nil || x < 0 || strings.HasPrefix(s, "+") {
			return calendar.Period{}, 0, false
		}
		n[i] = x
	}
	return calendar.Period{Start: n[0], End: n[1]}, n[2], true
}
