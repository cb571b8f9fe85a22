package ratelimit

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"
	_ "time/tzdata" // zones without /usr/share/zoneinfo: a scratch container works
)

// Calendar periods of a quota: the minute, hour, day, week (from Monday),
// month or year that a zone's wall clock shows. Redis has no time zones, so
// Go computes the boundaries around its own clock and the script picks, on
// Redis TIME, the period it is in (periodBounds).
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

// periodUnit is the calendar unit of a quota: quota <N>/<unit>.
type periodUnit uint8

const (
	periodMinute periodUnit = iota + 1
	periodHour
	periodDay
	periodWeek
	periodMonth
	periodYear
)

var periodUnitNames = [...]string{
	periodMinute: "minute",
	periodHour:   "hour",
	periodDay:    "day",
	periodWeek:   "week",
	periodMonth:  "month",
	periodYear:   "year",
}

func (u periodUnit) String() string {
	if u < periodMinute || u > periodYear {
		return fmt.Sprintf("periodUnit(%d)", uint8(u))
	}
	return periodUnitNames[u]
}

// parsePeriodUnit reads the unit of quota <N>/<unit>: exactly one of the
// names, lower case, singular.
func parsePeriodUnit(s string) (periodUnit, error) {
	for u := periodMinute; u <= periodYear; u++ {
		if s == periodUnitNames[u] {
			return u, nil
		}
	}
	return 0, fmt.Errorf("unknown calendar period %q: want minute, hour, day, week, month or year", s)
}

// parseTimezone loads an IANA zone name (America/New_York, UTC). An empty
// name is UTC, the default. "Local" is refused: the period would depend on
// the machine each instance runs on.
func parseTimezone(name string) (*time.Location, error) {
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
func (u periodUnit) truncate(w int64) int64 {
	switch u {
	case periodMinute:
		return floorDiv(w, 60) * 60
	case periodHour:
		return floorDiv(w, 3600) * 3600
	case periodDay:
		return floorDiv(w, secondsPerDay) * secondsPerDay
	case periodWeek:
		// Day 0, 1970-01-01, was a Thursday: Mondays are days 4 + 7k.
		d := floorDiv(w, secondsPerDay)
		return (floorDiv(d-4, 7)*7 + 4) * secondsPerDay
	case periodMonth:
		y, m, _ := time.Unix(w, 0).UTC().Date()
		return time.Date(y, m, 1, 0, 0, 0, 0, time.UTC).Unix()
	default:
		return time.Date(time.Unix(w, 0).UTC().Year(), 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	}
}

// next is the start, in wall seconds, of the unit after the one starting
// at wall second l.
func (u periodUnit) next(l int64) int64 {
	switch u {
	case periodMinute:
		return l + 60
	case periodHour:
		return l + 3600
	case periodDay:
		return l + secondsPerDay
	case periodWeek:
		return l + 7*secondsPerDay
	case periodMonth:
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
func periodAround(u periodUnit, loc *time.Location, t int64) (start, end int64) {
	l := u.truncate(reached(loc, t))
	return firstReach(loc, l), firstReach(loc, u.next(l))
}

// period is one calendar period, [start, end) in Unix microseconds.
type period struct{ start, end int64 }

// periodAt is the period of unit u in loc holding t.
func periodAt(u periodUnit, loc *time.Location, t time.Time) period {
	s, e := periodAround(u, loc, t.Unix())
	return period{s * 1e6, e * 1e6}
}

// seconds is the period's length in seconds: the w of RateLimit-Policy.
// Months, and days across a daylight-saving change, differ.
func (p period) seconds() int64 { return (p.end - p.start) / 1e6 }

// secondsLeft is the whole seconds from nowUS to the period's end, rounded
// up (a boundary is never announced early): the t of RateLimit, and the
// least Retry-After of a denied request. 0 at or after the end.
func (p period) secondsLeft(nowUS int64) int64 { return ceilSeconds(p.end - nowUS) }

// periodText is a period as the admin API's inspect shows it: RFC 3339,
// in UTC and in the policy's zone (whose offset tells a repeated wall time
// apart).
type periodText struct {
	Start     string `json:"period_start"`
	End       string `json:"period_end"`
	StartZone string `json:"period_start_local"`
	EndZone   string `json:"period_end_local"`
	Zone      string `json:"timezone"`
}

func (p period) text(loc *time.Location) periodText {
	s, e := time.UnixMicro(p.start), time.UnixMicro(p.end)
	return periodText{
		Start:     s.UTC().Format(time.RFC3339),
		End:       e.UTC().Format(time.RFC3339),
		StartZone: s.In(loc).Format(time.RFC3339),
		EndZone:   e.In(loc).Format(time.RFC3339),
		Zone:      loc.String(),
	}
}

// periodBounds are four consecutive boundaries b0 < b1 < b2 < b3 in Unix
// microseconds, around the Go clock's t: [b1, b2) is the period holding t,
// [b0, b1) the one before it, [b2, b3) the one after. The script reads them
// as ARGV and picks, on Redis TIME, the i with b[i] <= now < b[i+1]; a
// Redis clock outside [b0, b3) disagrees with Go's by more than a period,
// and is an error. So two instances whose clocks are apart (but less than a
// period) agree on the period: Redis's clock decides it.
type periodBounds [4]int64

// periodBoundsAt computes the bounds of unit u in loc around t. It costs a
// dozen zone lookups (a few µs): a policy keeps a calendar instead.
func periodBoundsAt(u periodUnit, loc *time.Location, t time.Time) periodBounds {
	s1, e1 := periodAround(u, loc, t.Unix())
	s0, _ := periodAround(u, loc, s1-1)
	_, e2 := periodAround(u, loc, e1)
	return periodBounds{s0 * 1e6, s1 * 1e6, e1 * 1e6, e2 * 1e6}
}

// pick is what the script does with the bounds: the index i (0, 1 or 2) of
// the period [b[i], b[i+1]) holding nowUS, or false when nowUS is outside
// [b0, b3).
func (b periodBounds) pick(nowUS int64) (int, bool) {
	for i := range 3 {
		if b[i] <= nowUS && nowUS < b[i+1] {
			return i, true
		}
	}
	return 0, false
}

// period is the i-th period of the bounds (0, 1 or 2; 1 holds the Go
// clock's t).
func (b periodBounds) period(i int) period { return period{b[i], b[i+1]} }

// calendar is a quota policy's unit and zone, with the bounds around the
// present cached: on a request it costs one atomic load and two
// comparisons, and computing anew (a few µs, under a mutex so one request
// does it) happens once a period, when the clock passes a boundary.
//
// No margin before a boundary is needed: just before b2 the bounds already
// hold the next period for a Redis clock that is ahead, and just after it
// the new bounds still hold the last one for a Redis clock that is behind.
type calendar struct {
	unit periodUnit
	loc  *time.Location
	span atomic.Pointer[calendarSpan]
	mu   sync.Mutex // one computes
}

// calendarSpan is five consecutive boundaries p0..p4 (µs). The bounds for a
// t in [p2, p3) are p1..p4 and, for a request that read the clock just
// before another moved the span on, for a t in [p1, p2): p0..p3.
type calendarSpan [5]int64

func newCalendar(u periodUnit, loc *time.Location) *calendar {
	return &calendar{unit: u, loc: loc}
}

// bounds is periodBoundsAt(c.unit, c.loc, t), cached. Safe for concurrent use.
func (c *calendar) bounds(t time.Time) periodBounds {
	us := t.UnixMicro()
	if p := c.span.Load(); p != nil {
		if b, ok := p.bounds(us); ok {
			return b
		}
	}
	return c.move(t)
}

func (p *calendarSpan) bounds(us int64) (periodBounds, bool) {
	switch {
	case p[2] <= us && us < p[3]:
		return periodBounds{p[1], p[2], p[3], p[4]}, true
	case p[1] <= us && us < p[2]:
		return periodBounds{p[0], p[1], p[2], p[3]}, true
	}
	return periodBounds{}, false
}

// move centres the span on t's period: when the clock passed p3, or jumped
// back before p1.
func (c *calendar) move(t time.Time) periodBounds {
	c.mu.Lock()
	defer c.mu.Unlock()
	us := t.UnixMicro()
	if p := c.span.Load(); p != nil {
		if b, ok := p.bounds(us); ok {
			return b // another request moved it meanwhile
		}
	}
	b := periodBoundsAt(c.unit, c.loc, t)
	before, _ := periodAround(c.unit, c.loc, b[0]/1e6-1)
	p := &calendarSpan{before * 1e6, b[0], b[1], b[2], b[3]}
	c.span.Store(p)
	return b
}
