package calendar

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
)

func TestParsePeriodUnit(t *testing.T) {
	for _, u := range []Unit{Minute, Hour, Day, Week, Month, Year} {
		got, err := ParseUnit(u.String())
		if err != nil || got != u {
			t.Errorf("ParseUnit(%q) = %v, %v", u.String(), got, err)
		}
	}
	for _, s := range []string{"", "minutes", "Month", "MONTH", "1d", "m", "fortnight", "quarter", " day", "day "} {
		_, err := ParseUnit(s)
		if err == nil || !strings.Contains(err.Error(), "minute, hour, day, week, month or year") {
			t.Errorf("ParseUnit(%q): error %v, want one naming the valid units", s, err)
		}
	}
}

func TestParseTimezone(t *testing.T) {
	for name, want := range map[string]string{
		"":                    "UTC",
		"UTC":                 "UTC",
		"America/New_York":    "America/New_York",
		"Australia/Lord_Howe": "Australia/Lord_Howe",
	} {
		loc, err := ParseZone(name)
		if err != nil || loc.String() != want {
			t.Errorf("ParseZone(%q) = %v, %v; want %s", name, loc, err, want)
		}
	}
	for _, name := range []string{"America/New_Yrok", "Mars/Olympus", "Local", "../etc/passwd", "/etc/localtime", "EST5EDT,M3.2.0,M11.1.0"} {
		loc, err := ParseZone(name)
		if err == nil || !strings.Contains(err.Error(), "IANA") || !strings.Contains(err.Error(), name) {
			t.Errorf("ParseZone(%q) = %v, %v; want an error naming it and asking for an IANA name", name, loc, err)
		}
	}
}

// TestCalendarPeriods holds the boundaries to what a wall clock in the zone
// shows, across daylight-saving changes in both directions, skipped and
// repeated midnights, month, year and week ends. start and end are instants
// (written in the zone's offset of the moment, so they read as the wall
// clock does); before is the start of the previous period, after the end
// of the next, when given.
func TestCalendarPeriods(t *testing.T) {
	for _, c := range calendartest.Cases {
		t.Run(c.Name, func(t *testing.T) {
			u, err := ParseUnit(c.Unit)
			if err != nil {
				t.Fatal(err)
			}
			loc := calendartest.Zone(t, c.Zone)
			at := calendartest.Instant(t, c.At)
			p := PeriodAt(u, loc, at)
			start, end := calendartest.Instant(t, c.Start), calendartest.Instant(t, c.End)
			if p.Start != start.UnixMicro() || p.End != end.UnixMicro() {
				got := p.Text(loc)
				t.Fatalf("%s of %s in %s = [%s, %s), want [%s, %s)", u, c.At, c.Zone, got.StartZone, got.EndZone,
					start.In(loc).Format(time.RFC3339), end.In(loc).Format(time.RFC3339))
			}
			if got := time.Duration(p.Seconds()) * time.Second; got != c.Length {
				t.Errorf("length %v, want %v", got, c.Length)
			}
			b := BoundsAt(u, loc, at)
			if b.Period(1) != p {
				t.Errorf("bounds %v: period 1 is not %v", b, p)
			}
			if !(b[0] < b[1] && b[1] <= at.UnixMicro() && at.UnixMicro() < b[2] && b[2] < b[3]) {
				t.Errorf("bounds %v out of order around %d", b, at.UnixMicro())
			}
			if c.Before != "" && b[0] != calendartest.Instant(t, c.Before).UnixMicro() {
				t.Errorf("previous period starts %s, want %s", time.UnixMicro(b[0]).In(loc).Format(time.RFC3339), c.Before)
			}
			if c.After != "" && b[3] != calendartest.Instant(t, c.After).UnixMicro() {
				t.Errorf("next period ends %s, want %s", time.UnixMicro(b[3]).In(loc).Format(time.RFC3339), c.After)
			}
			// The script's choice on a Redis clock anywhere in the three periods.
			for i, us := range []int64{b[0], b[1] - 1, b[1], at.UnixMicro(), b[2] - 1, b[2], b[3] - 1} {
				want := []int{0, 0, 1, 1, 1, 2, 2}[i]
				if got, ok := b.Pick(us); !ok || got != want {
					t.Errorf("pick(%d) = %d, %v; want %d", us, got, ok, want)
				}
			}
			for _, us := range []int64{b[0] - 1, b[3], b[3] + 1e6} {
				if _, ok := b.Pick(us); ok {
					t.Errorf("pick(%d) outside [b0, b3) accepted", us)
				}
			}
		})
	}
}

func TestPeriodFields(t *testing.T) {
	ny := calendartest.Zone(t, "America/New_York")
	p := PeriodAt(Month, ny, calendartest.Instant(t, "2024-11-15T12:00:00Z"))
	if got, want := p.Seconds(), int64(30*86400+3600); got != want {
		t.Errorf("November 2024 in New York: w = %d, want %d", got, want)
	}
	got := p.Text(ny)
	want := PeriodText{
		Start:     "2024-11-01T04:00:00Z",
		End:       "2024-12-01T05:00:00Z",
		StartZone: "2024-11-01T00:00:00-04:00",
		EndZone:   "2024-12-01T00:00:00-05:00",
		Zone:      "America/New_York",
	}
	if got != want {
		t.Errorf("text = %+v, want %+v", got, want)
	}
	// A repeated wall time reads apart by its offset.
	h := PeriodAt(Hour, ny, calendartest.Instant(t, "2024-11-03T01:30:00-05:00")).Text(ny)
	if h.StartZone != "2024-11-03T01:00:00-04:00" || h.EndZone != "2024-11-03T02:00:00-05:00" {
		t.Errorf("repeated hour text = %+v", h)
	}
}

var propertyZones = []string{
	"UTC", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata",
	"Asia/Kathmandu", "Pacific/Chatham", "America/Sao_Paulo", "America/Havana", "Asia/Tehran",
	"Pacific/Apia", "Asia/Beirut", "Europe/London", "America/Santiago", "Antarctica/Troll",
}

var allUnits = []Unit{Minute, Hour, Day, Week, Month, Year}

// wallAt reads loc's wall clock at unix second s from the date and time
// fields, as wall seconds: independent of the offsets the code walks.
func wallAt(loc *time.Location, s int64) int64 {
	lt := time.Unix(s, 0).In(loc)
	y, m, d := lt.Date()
	hh, mm, ss := lt.Clock()
	return time.Date(y, m, d, hh, mm, ss, 0, time.UTC).Unix()
}

// zoneChanges lists loc's changes of offset between 1890 and 2100, to aim
// random instants at them.
func zoneChanges(loc *time.Location) []int64 {
	var out []int64
	s := time.Date(1890, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	last := time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC).Unix()
	for s < last {
		_, _, end := zoneSpan(loc, s)
		if end == int64(^uint64(0)>>1) || end > last {
			break
		}
		out = append(out, end)
		s = end
	}
	return out
}

// TestCalendarProperties checks, for random instants (half of them within
// two days of one of the zone's changes), that the bounds are ordered and
// contiguous, that the period of b2-1µs is b1's, and that each boundary is
// the first instant at which the wall clock reaches its unit, read from the
// wall clock itself every 15 minutes over the 40 hours before it.
func TestCalendarProperties(t *testing.T) {
	rng := rand.New(rand.NewPCG(24, 25))
	lo := time.Date(1900, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
	hi := time.Date(2100, 1, 1, 0, 0, 0, 0, time.UTC).UnixMicro()
	n := 60
	if testing.Short() {
		n = 20
	}
	for _, zone := range propertyZones {
		loc := calendartest.Zone(t, zone)
		changes := zoneChanges(loc)
		for _, u := range allUnits {
			t.Run(zone+"/"+u.String(), func(t *testing.T) {
				for range n {
					us := lo + rng.Int64N(hi-lo)
					if len(changes) > 0 && rng.IntN(2) == 0 {
						us = changes[rng.IntN(len(changes))]*1e6 + rng.Int64N(4*86400e6) - 2*86400e6
					}
					checkCalendarAt(t, u, loc, us)
				}
			})
		}
	}
}

func checkCalendarAt(t *testing.T, u Unit, loc *time.Location, us int64) {
	t.Helper()
	at := time.UnixMicro(us)
	b := BoundsAt(u, loc, at)
	where := func() string {
		return at.In(loc).Format(time.RFC3339Nano) + " " + loc.String() + " " + u.String()
	}
	if !(b[0] < b[1] && b[1] <= us && us < b[2] && b[2] < b[3]) {
		t.Fatalf("%s: bounds %v not b0 < b1 <= t < b2 < b3", where(), b)
	}
	if p := PeriodAt(u, loc, time.UnixMicro(b[2]-1)); p != b.Period(1) {
		t.Fatalf("%s: period of b2-1µs is %v, not b1's %v", where(), p, b.Period(1))
	}
	if p := PeriodAt(u, loc, time.UnixMicro(b[1])); p != b.Period(1) {
		t.Fatalf("%s: period of b1 is %v, not %v", where(), p, b.Period(1))
	}
	if next := BoundsAt(u, loc, time.UnixMicro(b[2])); [3]int64(next[:3]) != [3]int64(b[1:]) {
		t.Fatalf("%s: bounds at b2 %v do not continue %v", where(), next, b)
	}
	if prev := BoundsAt(u, loc, time.UnixMicro(b[1]-1)); [3]int64(prev[1:]) != [3]int64(b[:3]) {
		t.Fatalf("%s: bounds at b1-1µs %v do not lead into %v", where(), prev, b)
	}
	// Each boundary: the wall clock has reached a new unit, and had never
	// shown it (or anything later) before.
	for i, bi := range b {
		s := bi / 1e6
		if bi%1e6 != 0 {
			t.Fatalf("%s: boundary %d is not on a whole second", where(), bi)
		}
		l := u.truncate(wallAt(loc, s))
		if i > 0 && l <= u.truncate(wallAt(loc, b[i-1]/1e6)) {
			t.Fatalf("%s: unit at boundary %d (%d) is not after the one at boundary %d", where(), i, l, i-1)
		}
		for x := s - reachWindow; x < s; x += 900 {
			if u.truncate(wallAt(loc, x)) >= l {
				t.Fatalf("%s: the wall clock showed unit %d at %s, before its boundary %s",
					where(), l, time.Unix(x, 0).In(loc).Format(time.RFC3339), time.Unix(s, 0).In(loc).Format(time.RFC3339))
			}
		}
		if u.truncate(wallAt(loc, s-1)) >= l {
			t.Fatalf("%s: the wall clock showed unit %d a second before its boundary", where(), l)
		}
	}
}

// TestCalendarWalk walks consecutive periods through two centuries of each
// zone's history: every period starts where the last ended, is never empty
// and no longer than its unit can be stretched by a clock going back.
func TestCalendarWalk(t *testing.T) {
	longest := map[Unit]int64{ // a unit plus a day of clock going back (Apia 1892)
		Minute: 60 + 86400, Hour: 3600 + 86400, Day: 2 * 86400,
		Week: 8 * 86400, Month: 32 * 86400, Year: 367 * 86400,
	}
	steps := map[Unit]int{Minute: 3000, Hour: 20000, Day: 20000, Week: 11000, Month: 2600, Year: 210}
	starts := map[Unit]string{
		Minute: "2024-11-03T00:00:00Z", Hour: "2022-01-01T00:00:00Z", Day: "1890-01-01T00:00:00Z",
		Week: "1890-01-01T00:00:00Z", Month: "1890-01-01T00:00:00Z", Year: "1890-01-01T00:00:00Z",
	}
	for _, zone := range propertyZones {
		loc := calendartest.Zone(t, zone)
		for _, u := range allUnits {
			t.Run(zone+"/"+u.String(), func(t *testing.T) {
				n := steps[u]
				if testing.Short() {
					n /= 10
				}
				p := PeriodAt(u, loc, calendartest.Instant(t, starts[u]))
				for range n {
					q := PeriodAt(u, loc, time.UnixMicro(p.End))
					if q.Start != p.End {
						t.Fatalf("period after %v starts at %d", p.Text(loc), q.Start)
					}
					if q.Seconds() <= 0 || q.Seconds() > longest[u] {
						t.Fatalf("period %+v lasts %ds", q.Text(loc), q.Seconds())
					}
					p = q
				}
			})
		}
	}
}

// TestCalendarCache holds the cached bounds to the computed ones as a clock
// moves through boundaries, forwards, late and backwards.
func TestCalendarCache(t *testing.T) {
	for _, c := range []struct {
		zone string
		unit Unit
		from string
		step time.Duration
		n    int
	}{
		{"UTC", Minute, "2024-12-31T23:58:00Z", 7 * time.Second, 50},
		{"America/New_York", Hour, "2024-11-03T04:30:00Z", 9 * time.Minute, 40},
		{"Australia/Lord_Howe", Day, "2024-04-05T00:00:00Z", 5 * time.Hour, 30},
		{"America/Havana", Month, "2012-03-15T00:00:00Z", 61 * time.Hour, 40},
	} {
		t.Run(c.zone+"/"+c.unit.String(), func(t *testing.T) {
			loc := calendartest.Zone(t, c.zone)
			cal := New(c.unit, loc)
			at := calendartest.Instant(t, c.from)
			var times []time.Time
			for i := range c.n {
				times = append(times, at.Add(time.Duration(i)*c.step))
			}
			// forwards, then a request that read the clock just before
			// another moved the span on, then backwards.
			for i, tt := range times {
				check := []time.Time{tt}
				if i > 0 {
					check = append(check, times[i-1])
				}
				for _, x := range check {
					if got, want := cal.Bounds(x), BoundsAt(c.unit, loc, x); got != want {
						t.Fatalf("bounds(%s) = %v, want %v", x.Format(time.RFC3339), got, want)
					}
				}
			}
			for i := len(times) - 1; i >= 0; i-- {
				if got, want := cal.Bounds(times[i]), BoundsAt(c.unit, loc, times[i]); got != want {
					t.Fatalf("backwards: bounds(%s) = %v, want %v", times[i].Format(time.RFC3339), got, want)
				}
			}
		})
	}
}

func TestCalendarCacheConcurrent(t *testing.T) {
	loc := calendartest.Zone(t, "Europe/Berlin")
	cal := New(Minute, loc)
	base := calendartest.Instant(t, "2024-03-31T00:59:00Z")
	done := make(chan struct{})
	for g := range 8 {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range 2000 {
				x := base.Add(time.Duration(i*37+g*1000) * time.Millisecond)
				if got, want := cal.Bounds(x), BoundsAt(Minute, loc, x); got != want {
					t.Errorf("bounds(%s) = %v, want %v", x.Format(time.RFC3339Nano), got, want)
					return
				}
			}
		}()
	}
	for range 8 {
		<-done
	}
}

// BenchmarkCalendar: the per-request cost (cached) and a computation.
func BenchmarkCalendar(b *testing.B) {
	loc := calendartest.Zone(b, "America/New_York")
	now := time.Now()
	b.Run("cached", func(b *testing.B) {
		cal := New(Month, loc)
		cal.Bounds(now)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				cal.Bounds(now)
			}
		})
	})
	b.Run("compute", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			BoundsAt(Month, loc, now)
		}
	})
}
