// Package calendar computes the calendar periods of a quota: the minute,
// hour, day, week (from Monday), month or year that a zone's wall clock
// shows. Redis has no time zones, so Go computes the boundaries around its
// own clock and the script picks, on Redis TIME, the period it is in
// (Bounds).
//
// A boundary is the first instant at which the zone's wall clock reaches the
// new unit, and the period of an instant is the latest unit the wall clock
// has reached at or before it. So periods follow the wall clock across
// daylight-saving changes (a day lasts 23 or 25 hours), a unit the clock
// skips is no period at all (Pacific/Apia's 2011-12-30), a skipped midnight
// starts the day at the first instant of that day (America/Havana's
// 2012-04-01 began at 01:00), and when the clock goes back the period never
// does: the repeated wall time stays in the period already reached, which
// lasts that much longer (America/New_York's 01:00 hour on the autumn change
// lasts two hours; its 01:59 minute, 61 minutes). Periods are contiguous,
// do not overlap and never go backwards.
//
// All of it is done on the zone's spans of constant offset (ZoneBounds),
// never with time.Date on a local time, whose result for a time the clock
// skips or repeats is not guaranteed.
package calendar

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
	_ "time/tzdata" // zones without /usr/share/zoneinfo: a scratch container works
)

// Unit is the calendar unit of a quota: quota <N>/<unit>.
type Unit uint8

const (
	Minute Unit = iota + 1
	Hour
	Day
	Week
	Month
	Year
)

var unitNames = [...]string{
	Minute: "minute",
	Hour:   "hour",
	Day:    "day",
	Week:   "week",
	Month:  "month",
	Year:   "year",
}

func (u Unit) String() string {
	if u < Minute || u > Year {
		return fmt.Sprintf("Unit(%d)", uint8(u))
	}
	return unitNames[u]
}

// UnitNames are the units' names, minute to year: what ParseUnit reads.
func UnitNames() []string { return append([]string(nil), unitNames[Minute:]...) }

// ParseUnit reads the unit of quota <N>/<unit>: exactly one of the
// names, lower case, singular.
func ParseUnit(s string) (Unit, error) {
	for u := Minute; u <= Year; u++ {
		if s == unitNames[u] {
			return u, nil
		}
	}
	return 0, fmt.Errorf("unknown calendar period %q: want minute, hour, day, week, month or year", s)
}

// ParseZone loads an IANA zone name (America/New_York, UTC). An empty
// name is UTC, the default. "Local" is refused: the period would depend on
// the machine each instance runs on.
func ParseZone(name string) (*time.Location, error) {
	if name == "" {
		return time.UTC, nil
	}
	if name == "Local" {
		return nil, fmt.Errorf("time zone %q depends on the machine: name an IANA zone such as America/New_York or UTC", name)
	}
	loc, err := time.LoadLocation(name)
	if err != nil {
		return nil, fmt.Errorf("unknown time zone %q: want an IANA name such as America/New_York, Europe/Berlin or UTC", name)
	}
	return loc, nil
}

// Wall clock readings are counted in seconds as if the zone's local date
// and time were UTC ("wall seconds"): unix + offset. In those, a unit is
// plain arithmetic on the proleptic Gregorian calendar, with no zone.

const secondsPerDay = 86400

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

// truncate is the start, in wall seconds, of the unit holding wall second w.
func (u Unit) truncate(w int64) int64 {
	switch u {
	case Minute:
		return floorDiv(w, 60) * 60
	case Hour:
		return floorDiv(w, 3600) * 3600
	case Day:
		return floorDiv(w, secondsPerDay) * secondsPerDay
	case Week:
		// Day 0, 1970-01-01, was a Thursday: Mondays are days 4 + 7k.
		d := floorDiv(w, secondsPerDay)
		return (floorDiv(d-4, 7)*7 + 4) * secondsPerDay
	case Month:
		y, m, _ := time.Unix(w, 0).UTC().Date()
		return time.Date(y, m, 1, 0, 0, 0, 0, time.UTC).Unix()
	default:
		return time.Date(time.Unix(w, 0).UTC().Year(), 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	}
}

// next is the start, in wall seconds, of the unit after the one starting
// at wall second l.
func (u Unit) next(l int64) int64 {
	switch u {
	case Minute:
		return l + 60
	case Hour:
		return l + 3600
	case Day:
		return l + secondsPerDay
	case Week:
		return l + 7*secondsPerDay
	case Month:
		y, m, _ := time.Unix(l, 0).UTC().Date()
		return time.Date(y, m+1, 1, 0, 0, 0, 0, time.UTC).Unix()
	default:
		return time.Date(time.Unix(l, 0).UTC().Year()+1, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	}
}

// reachWindow bounds how far from an instant a zone change can matter. A
// wall clock is within 16 hours of UTC (tzdata's extremes are the local
// mean times of America/Metlakatla, +15:13:42, and Asia/Manila,
// -15:56:08), so an instant more than 32 hours away shows a wall clock on
// the far side of any wall time within 16 hours of the other's: 40 hours
// leaves room.
const reachWindow = 40 * 3600

// maxSpans bounds the walk over a zone's spans within 2 × reachWindow:
// tzdata changes a zone's offset a few times a year.
const maxSpans = 64

// zoneSpan is the offset (seconds east of UTC) at unix second s and the span
// [start, end) of unix seconds around s over which it holds (math.MinInt64
// and math.MaxInt64 for no bound).
func zoneSpan(loc *time.Location, s int64) (off, start, end int64) {
	t := time.Unix(s, 0).In(loc)
	_, o := t.Zone()
	zs, ze := t.ZoneBounds()
	start, end = math.MinInt64, math.MaxInt64
	if !zs.IsZero() {
		start = zs.Unix()
	}
	if !ze.IsZero() {
		end = ze.Unix()
	}
	if end <= s {
		// Past a zone's last listed change, Go computes the span from the
		// zone's rule one UTC year at a time and ends the year's last span
		// at 365 days (time/zoneinfo.go, tzset): on December 31 of a leap
		// year the span returned ends before s. The offset is right and
		// holds until the next year, where the rule is computed again.
		end = time.Date(time.Unix(s, 0).UTC().Year()+1, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	}
	return int64(o), start, end
}

// firstReach is the first unix second at which loc's wall clock shows wall
// second l or later: l - offset when the clock passes l, or the instant of
// the change when the clock jumps over it.
func firstReach(loc *time.Location, l int64) int64 {
	s := l - reachWindow // the wall clock is before l here and at every earlier instant
	for range maxSpans {
		off, _, end := zoneSpan(loc, s)
		if s+off >= l {
			return s // the clock jumped over l at the start of this span
		}
		if end == math.MaxInt64 || end+off > l {
			return l - off
		}
		s = end
	}
	return s
}

// reached is the latest wall second loc's wall clock has shown at or before
// unix second t: the wall clock at t, or more if the clock went back.
func reached(loc *time.Location, t int64) int64 {
	off, start, _ := zoneSpan(loc, t)
	w := t + off
	for i := 0; i < maxSpans && start > t-reachWindow; i++ {
		// The span before ends at start; its last second read start-1+o.
		o, s, _ := zoneSpan(loc, start-1)
		w = max(w, start-1+o)
		start = s
	}
	return w
}

// periodAround is the period of unit u in loc holding unix second t:
// [start, end) in unix seconds. Boundaries fall on whole seconds.
func periodAround(u Unit, loc *time.Location, t int64) (start, end int64) {
	l := u.truncate(reached(loc, t))
	return firstReach(loc, l), firstReach(loc, u.next(l))
}

// Period is one calendar period, [Start, End) in Unix microseconds.
type Period struct{ Start, End int64 }

// PeriodAt is the period of unit u in loc holding t.
func PeriodAt(u Unit, loc *time.Location, t time.Time) Period {
	s, e := periodAround(u, loc, t.Unix())
	return Period{s * 1e6, e * 1e6}
}

// Seconds is the period's length in seconds: the w of RateLimit-Policy.
// Months, and days across a daylight-saving change, differ.
func (p Period) Seconds() int64 { return (p.End - p.Start) / 1e6 }

// PeriodText is a period as the admin API's inspect shows it: RFC 3339,
// in UTC and in the policy's zone (whose offset tells a repeated wall time
// apart).
type PeriodText struct {
	Start     string `json:"period_start"`
	End       string `json:"period_end"`
	StartZone string `json:"period_start_local"`
	EndZone   string `json:"period_end_local"`
	Zone      string `json:"timezone"`
}

// Text is the period as PeriodText shows it, in loc.
func (p Period) Text(loc *time.Location) PeriodText {
	s, e := time.UnixMicro(p.Start), time.UnixMicro(p.End)
	return PeriodText{
		Start:     s.UTC().Format(time.RFC3339),
		End:       e.UTC().Format(time.RFC3339),
		StartZone: s.In(loc).Format(time.RFC3339),
		EndZone:   e.In(loc).Format(time.RFC3339),
		Zone:      loc.String(),
	}
}

// Bounds are four consecutive boundaries b0 < b1 < b2 < b3 in Unix
// microseconds, around the Go clock's t: [b1, b2) is the period holding t,
// [b0, b1) the one before it, [b2, b3) the one after. The script reads them
// as ARGV and picks, on Redis TIME, the i with b[i] <= now < b[i+1]; a
// Redis clock outside [b0, b3) disagrees with Go's by more than a period,
// and is an error. So two instances whose clocks are apart (but less than a
// period) agree on the period: Redis's clock decides it.
type Bounds [4]int64

// BoundsAt computes the bounds of unit u in loc around t. It costs a
// dozen zone lookups (a few µs): a policy keeps a calendar instead.
func BoundsAt(u Unit, loc *time.Location, t time.Time) Bounds {
	s1, e1 := periodAround(u, loc, t.Unix())
	s0, _ := periodAround(u, loc, s1-1)
	_, e2 := periodAround(u, loc, e1)
	return Bounds{s0 * 1e6, s1 * 1e6, e1 * 1e6, e2 * 1e6}
}

// Pick is what the script does with the bounds: the index i (0, 1 or 2) of
// the period [b[i], b[i+1]) holding nowUS, or false when nowUS is outside
// [b0, b3).
func (b Bounds) Pick(nowUS int64) (int, bool) {
	for i := range 3 {
		if b[i] <= nowUS && nowUS < b[i+1] {
			return i, true
		}
	}
	return 0, false
}

// Period is the i-th period of the bounds (0, 1 or 2; 1 holds the Go
// clock's t).
func (b Bounds) Period(i int) Period { return Period{b[i], b[i+1]} }

// Calendar is a quota policy's unit and zone, with the bounds around the
// present cached: on a request it costs one atomic load and two
// comparisons, and computing anew (a few µs, under a mutex so one request
// does it) happens once a period, when the clock passes a boundary.
//
// No margin before a boundary is needed: just before b2 the bounds already
// hold the next period for a Redis clock that is ahead, and just after it
// the new bounds still hold the last one for a Redis clock that is behind.
type Calendar struct {
	unit   Unit
	loc    *time.Location
	cached atomic.Pointer[cachedBounds]
	mu     sync.Mutex // one computes
}

// cachedBounds is five consecutive boundaries p0..p4 (µs). The bounds for a
// t in [p2, p3) are p1..p4 and, for a request that read the clock just
// before another moved them on, for a t in [p1, p2): p0..p3.
type cachedBounds [5]int64

// New makes the calendar of unit u in zone loc.
func New(u Unit, loc *time.Location) *Calendar {
	return &Calendar{unit: u, loc: loc}
}

// Bounds is BoundsAt(c.unit, c.loc, t), cached. Safe for concurrent use.
func (c *Calendar) Bounds(t time.Time) Bounds {
	us := t.UnixMicro()
	if p := c.cached.Load(); p != nil {
		if b, ok := p.bounds(us); ok {
			return b
		}
	}
	return c.move(t)
}

func (p *cachedBounds) bounds(us int64) (Bounds, bool) {
	switch {
	case p[2] <= us && us < p[3]:
		return Bounds{p[1], p[2], p[3], p[4]}, true
	case p[1] <= us && us < p[2]:
		return Bounds{p[0], p[1], p[2], p[3]}, true
	}
	return Bounds{}, false
}

// move centres the cached bounds on t's period: when the clock passed p3, or jumped
// back before p1.
func (c *Calendar) move(t time.Time) Bounds {
	c.mu.Lock()
	defer c.mu.Unlock()
	us := t.UnixMicro()
	if p := c.cached.Load(); p != nil {
		if b, ok := p.bounds(us); ok {
			return b // another request moved it meanwhile
		}
	}
	b := BoundsAt(c.unit, c.loc, t)
	before, _ := periodAround(c.unit, c.loc, b[0]/1e6-1)
	p := &cachedBounds{before * 1e6, b[0], b[1], b[2], b[3]}
	c.cached.Store(p)
	return b
}
