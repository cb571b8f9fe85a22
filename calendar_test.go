package ratelimit

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"
)

func mustZone(t testing.TB, name string) *time.Location {
	t.Helper()
	loc, err := parseTimezone(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

func mustTime(t testing.TB, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestParsePeriodUnit(t *testing.T) {
	for _, u := range []periodUnit{periodMinute, periodHour, periodDay, periodWeek, periodMonth, periodYear} {
		got, err := parsePeriodUnit(u.String())
		if err != nil || got != u {
			t.Errorf("parsePeriodUnit(%q) = %v, %v", u.String(), got, err)
		}
	}
	for _, s := range []string{"", "minutes", "Month", "MONTH", "1d", "m", "fortnight", "quarter", " day", "day "} {
		_, err := parsePeriodUnit(s)
		if err == nil || !strings.Contains(err.Error(), "minute, hour, day, week, month or year") {
			t.Errorf("parsePeriodUnit(%q): error %v, want one naming the valid units", s, err)
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
		loc, err := parseTimezone(name)
		if err != nil || loc.String() != want {
			t.Errorf("parseTimezone(%q) = %v, %v; want %s", name, loc, err, want)
		}
	}
	for _, name := range []string{"America/New_Yrok", "Mars/Olympus", "Local", "../etc/passwd", "/etc/localtime", "EST5EDT,M3.2.0,M11.1.0"} {
		loc, err := parseTimezone(name)
		if err == nil || !strings.Contains(err.Error(), "IANA") || !strings.Contains(err.Error(), name) {
			t.Errorf("parseTimezone(%q) = %v, %v; want an error naming it and asking for an IANA name", name, loc, err)
		}
	}
}

// calendarCase is a row of the boundary table: start and end are instants
// (written in the zone's offset of the moment, so they read as the wall
// clock does); before is the start of the previous period, after the end
// of the next, when given.
type calendarCase struct {
	name, zone string
	unit       periodUnit
	at         string
	start, end string
	length     time.Duration
	before     string
	after      string
}

const hr = time.Hour

// calendarCases is the boundary table, which TestLuaQuotaCalendar also holds
// the script's choice of period to.
var calendarCases = []calendarCase{
	// UTC: plain calendar arithmetic.
	{name: "UTC minute", zone: "UTC", unit: periodMinute, at: "2024-05-05T10:20:30.5Z",
		start: "2024-05-05T10:20:00Z", end: "2024-05-05T10:21:00Z", length: time.Minute,
		before: "2024-05-05T10:19:00Z", after: "2024-05-05T10:22:00Z"},
	{name: "UTC minute at its first microsecond", zone: "UTC", unit: periodMinute, at: "2024-05-05T10:20:00Z",
		start: "2024-05-05T10:20:00Z", end: "2024-05-05T10:21:00Z", length: time.Minute},
	{name: "UTC minute at its last microsecond", zone: "UTC", unit: periodMinute, at: "2024-05-05T10:20:59.999999Z",
		start: "2024-05-05T10:20:00Z", end: "2024-05-05T10:21:00Z", length: time.Minute},
	{name: "UTC hour", zone: "UTC", unit: periodHour, at: "2024-05-05T10:59:59Z",
		start: "2024-05-05T10:00:00Z", end: "2024-05-05T11:00:00Z", length: hr},
	{name: "UTC day", zone: "UTC", unit: periodDay, at: "2024-05-05T00:00:00Z",
		start: "2024-05-05T00:00:00Z", end: "2024-05-06T00:00:00Z", length: 24 * hr},
	{name: "UTC week from Monday, on a Sunday", zone: "UTC", unit: periodWeek, at: "2024-05-05T23:59:59Z",
		start: "2024-04-29T00:00:00Z", end: "2024-05-06T00:00:00Z", length: 7 * 24 * hr,
		before: "2024-04-22T00:00:00Z", after: "2024-05-13T00:00:00Z"},
	{name: "UTC week on its Monday", zone: "UTC", unit: periodWeek, at: "2024-05-06T00:00:00Z",
		start: "2024-05-06T00:00:00Z", end: "2024-05-13T00:00:00Z", length: 7 * 24 * hr},
	{name: "UTC week crossing a month", zone: "UTC", unit: periodWeek, at: "2024-05-31T12:00:00Z",
		start: "2024-05-27T00:00:00Z", end: "2024-06-03T00:00:00Z", length: 7 * 24 * hr},
	{name: "UTC week crossing a year", zone: "UTC", unit: periodWeek, at: "2025-01-01T00:00:00Z",
		start: "2024-12-30T00:00:00Z", end: "2025-01-06T00:00:00Z", length: 7 * 24 * hr},
	{name: "UTC week before 1970", zone: "UTC", unit: periodWeek, at: "1969-12-31T12:00:00Z",
		start: "1969-12-29T00:00:00Z", end: "1970-01-05T00:00:00Z", length: 7 * 24 * hr},
	{name: "UTC month of 31 days, Jan 31 to Feb 28", zone: "UTC", unit: periodMonth, at: "2023-01-31T23:59:59Z",
		start: "2023-01-01T00:00:00Z", end: "2023-02-01T00:00:00Z", length: 31 * 24 * hr,
		before: "2022-12-01T00:00:00Z", after: "2023-03-01T00:00:00Z"},
	{name: "UTC February of 28 days", zone: "UTC", unit: periodMonth, at: "2023-02-28T23:59:59Z",
		start: "2023-02-01T00:00:00Z", end: "2023-03-01T00:00:00Z", length: 28 * 24 * hr},
	{name: "UTC February 29 in a leap year", zone: "UTC", unit: periodMonth, at: "2024-02-29T12:00:00Z",
		start: "2024-02-01T00:00:00Z", end: "2024-03-01T00:00:00Z", length: 29 * 24 * hr},
	{name: "UTC February of 2100, no leap year", zone: "UTC", unit: periodMonth, at: "2100-02-15T00:00:00Z",
		start: "2100-02-01T00:00:00Z", end: "2100-03-01T00:00:00Z", length: 28 * 24 * hr},
	{name: "UTC month of 30 days", zone: "UTC", unit: periodMonth, at: "2024-04-30T23:00:00Z",
		start: "2024-04-01T00:00:00Z", end: "2024-05-01T00:00:00Z", length: 30 * 24 * hr},
	{name: "UTC December into January", zone: "UTC", unit: periodMonth, at: "2024-12-31T23:59:59.999999Z",
		start: "2024-12-01T00:00:00Z", end: "2025-01-01T00:00:00Z", length: 31 * 24 * hr,
		before: "2024-11-01T00:00:00Z", after: "2025-02-01T00:00:00Z"},
	{name: "UTC leap year", zone: "UTC", unit: periodYear, at: "2024-12-31T23:59:59.999999Z",
		start: "2024-01-01T00:00:00Z", end: "2025-01-01T00:00:00Z", length: 366 * 24 * hr,
		before: "2023-01-01T00:00:00Z", after: "2026-01-01T00:00:00Z"},
	{name: "UTC year", zone: "UTC", unit: periodYear, at: "2025-01-01T00:00:00Z",
		start: "2025-01-01T00:00:00Z", end: "2026-01-01T00:00:00Z", length: 365 * 24 * hr},

	// America/New_York: 02:00 -> 03:00 in March, 02:00 -> 01:00 in November.
	{name: "New_York day of spring change lasts 23h", zone: "America/New_York", unit: periodDay, at: "2024-03-10T12:00:00-04:00",
		start: "2024-03-10T00:00:00-05:00", end: "2024-03-11T00:00:00-04:00", length: 23 * hr},
	{name: "New_York day of autumn change lasts 25h", zone: "America/New_York", unit: periodDay, at: "2024-11-03T01:30:00-05:00",
		start: "2024-11-03T00:00:00-04:00", end: "2024-11-04T00:00:00-05:00", length: 25 * hr},
	{name: "New_York hour after the skipped 02:00 starts at the jump", zone: "America/New_York", unit: periodHour, at: "2024-03-10T03:30:00-04:00",
		start: "2024-03-10T03:00:00-04:00", end: "2024-03-10T04:00:00-04:00", length: hr,
		before: "2024-03-10T01:00:00-05:00", after: "2024-03-10T05:00:00-04:00"},
	{name: "New_York hour 01:00 before the jump", zone: "America/New_York", unit: periodHour, at: "2024-03-10T01:59:59-05:00",
		start: "2024-03-10T01:00:00-05:00", end: "2024-03-10T03:00:00-04:00", length: hr},
	{name: "New_York repeated 01:00 hour lasts 2h (first pass)", zone: "America/New_York", unit: periodHour, at: "2024-11-03T01:10:00-04:00",
		start: "2024-11-03T01:00:00-04:00", end: "2024-11-03T02:00:00-05:00", length: 2 * hr},
	{name: "New_York repeated 01:00 hour lasts 2h (second pass)", zone: "America/New_York", unit: periodHour, at: "2024-11-03T01:30:00-05:00",
		start: "2024-11-03T01:00:00-04:00", end: "2024-11-03T02:00:00-05:00", length: 2 * hr},
	{name: "New_York minute 01:59 lasts until 02:00 comes (61 min)", zone: "America/New_York", unit: periodMinute, at: "2024-11-03T01:30:00-05:00",
		start: "2024-11-03T01:59:00-04:00", end: "2024-11-03T02:00:00-05:00", length: 61 * time.Minute},
	{name: "New_York week of spring change", zone: "America/New_York", unit: periodWeek, at: "2024-03-10T23:00:00-04:00",
		start: "2024-03-04T00:00:00-05:00", end: "2024-03-11T00:00:00-04:00", length: 7*24*hr - hr},
	{name: "New_York month of autumn change", zone: "America/New_York", unit: periodMonth, at: "2024-11-30T23:59:59-05:00",
		start: "2024-11-01T00:00:00-04:00", end: "2024-12-01T00:00:00-05:00", length: 30*24*hr + hr},
	{name: "New_York year starts at local midnight", zone: "America/New_York", unit: periodYear, at: "2025-01-01T04:59:59Z",
		start: "2024-01-01T00:00:00-05:00", end: "2025-01-01T00:00:00-05:00", length: 366 * 24 * hr},

	{name: "New_York Dec 31 of a leap year past tzdata's listed changes", zone: "America/New_York", unit: periodDay, at: "2040-12-31T12:00:00-05:00",
		start: "2040-12-31T00:00:00-05:00", end: "2041-01-01T00:00:00-05:00", length: 24 * hr},
	{name: "New_York year 2040 past tzdata's listed changes", zone: "America/New_York", unit: periodYear, at: "2040-12-31T23:59:59-05:00",
		start: "2040-01-01T00:00:00-05:00", end: "2041-01-01T00:00:00-05:00", length: 366 * 24 * hr,
		after: "2042-01-01T00:00:00-05:00"},
	{name: "New_York autumn change of 2044 (from the zone's rule)", zone: "America/New_York", unit: periodDay, at: "2044-11-06T12:00:00-05:00",
		start: "2044-11-06T00:00:00-04:00", end: "2044-11-07T00:00:00-05:00", length: 25 * hr},

	// Europe/Berlin: 02:00 -> 03:00 on the last Sunday of March, 03:00 -> 02:00 in October.
	{name: "Berlin day of spring change lasts 23h", zone: "Europe/Berlin", unit: periodDay, at: "2024-03-31T12:00:00+02:00",
		start: "2024-03-31T00:00:00+01:00", end: "2024-04-01T00:00:00+02:00", length: 23 * hr},
	{name: "Berlin day of autumn change lasts 25h", zone: "Europe/Berlin", unit: periodDay, at: "2024-10-27T02:30:00+01:00",
		start: "2024-10-27T00:00:00+02:00", end: "2024-10-28T00:00:00+01:00", length: 25 * hr},
	{name: "Berlin hour after the jump", zone: "Europe/Berlin", unit: periodHour, at: "2024-03-31T03:15:00+02:00",
		start: "2024-03-31T03:00:00+02:00", end: "2024-03-31T04:00:00+02:00", length: hr},
	{name: "Berlin March loses an hour", zone: "Europe/Berlin", unit: periodMonth, at: "2024-03-15T00:00:00+01:00",
		start: "2024-03-01T00:00:00+01:00", end: "2024-04-01T00:00:00+02:00", length: 31*24*hr - hr},
	{name: "Berlin year end", zone: "Europe/Berlin", unit: periodYear, at: "2024-12-31T23:30:00+01:00",
		start: "2024-01-01T00:00:00+01:00", end: "2025-01-01T00:00:00+01:00", length: 366 * 24 * hr,
		before: "2023-01-01T00:00:00+01:00", after: "2026-01-01T00:00:00+01:00"},
	{name: "Berlin first instant of the year", zone: "Europe/Berlin", unit: periodYear, at: "2024-12-31T23:00:00Z",
		start: "2025-01-01T00:00:00+01:00", end: "2026-01-01T00:00:00+01:00", length: 365 * 24 * hr},

	// Australia/Lord_Howe: a 30-minute change, 02:00 -> 02:30 in October, 02:00 -> 01:30 in April.
	{name: "Lord_Howe day of spring change lasts 23h30", zone: "Australia/Lord_Howe", unit: periodDay, at: "2024-10-06T12:00:00+11:00",
		start: "2024-10-06T00:00:00+10:30", end: "2024-10-07T00:00:00+11:00", length: 23*hr + 30*time.Minute},
	{name: "Lord_Howe day of autumn change lasts 24h30", zone: "Australia/Lord_Howe", unit: periodDay, at: "2024-04-07T12:00:00+10:30",
		start: "2024-04-07T00:00:00+11:00", end: "2024-04-08T00:00:00+10:30", length: 24*hr + 30*time.Minute},
	{name: "Lord_Howe 02:00 hour is half an hour", zone: "Australia/Lord_Howe", unit: periodHour, at: "2024-10-06T02:40:00+11:00",
		start: "2024-10-06T02:30:00+11:00", end: "2024-10-06T03:00:00+11:00", length: 30 * time.Minute,
		before: "2024-10-06T01:00:00+10:30"},
	{name: "Lord_Howe 01:00 hour repeated half lasts 1h30", zone: "Australia/Lord_Howe", unit: periodHour, at: "2024-04-07T01:45:00+10:30",
		start: "2024-04-07T01:00:00+11:00", end: "2024-04-07T02:00:00+10:30", length: 90 * time.Minute},
	{name: "Lord_Howe minute 01:59 lasts 31 min", zone: "Australia/Lord_Howe", unit: periodMinute, at: "2024-04-07T01:40:00+10:30",
		start: "2024-04-07T01:59:00+11:00", end: "2024-04-07T02:00:00+10:30", length: 31 * time.Minute},

	// Asia/Kolkata (+05:30) and Asia/Kathmandu (+05:45): hours start at :00 local.
	{name: "Kolkata hour at :00 local", zone: "Asia/Kolkata", unit: periodHour, at: "2024-06-01T10:45:00+05:30",
		start: "2024-06-01T04:30:00Z", end: "2024-06-01T05:30:00Z", length: hr},
	{name: "Kolkata day at local midnight", zone: "Asia/Kolkata", unit: periodDay, at: "2024-06-01T18:29:59Z",
		start: "2024-05-31T18:30:00Z", end: "2024-06-01T18:30:00Z", length: 24 * hr},
	{name: "Kolkata month", zone: "Asia/Kolkata", unit: periodMonth, at: "2024-06-30T23:59:00+05:30",
		start: "2024-06-01T00:00:00+05:30", end: "2024-07-01T00:00:00+05:30", length: 30 * 24 * hr},
	{name: "Kathmandu hour at :15 UTC", zone: "Asia/Kathmandu", unit: periodHour, at: "2024-06-01T10:14:59Z",
		start: "2024-06-01T09:15:00Z", end: "2024-06-01T10:15:00Z", length: hr},
	{name: "Kathmandu week", zone: "Asia/Kathmandu", unit: periodWeek, at: "2024-06-02T18:14:59Z",
		start: "2024-05-27T00:00:00+05:45", end: "2024-06-03T00:00:00+05:45", length: 7 * 24 * hr},
	{name: "Kathmandu 1986 began at 00:15 (+05:30 -> +05:45)", zone: "Asia/Kathmandu", unit: periodYear, at: "1986-01-01T12:00:00Z",
		start: "1986-01-01T00:15:00+05:45", end: "1987-01-01T00:00:00+05:45", length: 365*24*hr - 15*time.Minute,
		before: "1985-01-01T00:00:00+05:30"},

	// Pacific/Chatham: +12:45, one hour of DST changing at 02:45 / 03:45 local.
	{name: "Chatham day of spring change lasts 23h", zone: "Pacific/Chatham", unit: periodDay, at: "2024-09-29T12:00:00+13:45",
		start: "2024-09-29T00:00:00+12:45", end: "2024-09-30T00:00:00+13:45", length: 23 * hr},
	{name: "Chatham 03:00 hour is 15 minutes after the jump to 03:45", zone: "Pacific/Chatham", unit: periodHour, at: "2024-09-29T03:50:00+13:45",
		start: "2024-09-29T03:45:00+13:45", end: "2024-09-29T04:00:00+13:45", length: 15 * time.Minute,
		before: "2024-09-29T02:00:00+12:45"},
	{name: "Chatham 03:00 hour across the autumn change lasts 2h", zone: "Pacific/Chatham", unit: periodHour, at: "2024-04-07T03:10:00+12:45",
		start: "2024-04-07T03:00:00+13:45", end: "2024-04-07T04:00:00+12:45", length: 2 * hr},

	// Zones whose clock skipped or repeated midnight.
	{name: "Sao_Paulo 2018-11-04 began at 01:00 (midnight skipped)", zone: "America/Sao_Paulo", unit: periodDay, at: "2018-11-04T12:00:00-02:00",
		start: "2018-11-04T01:00:00-02:00", end: "2018-11-05T00:00:00-02:00", length: 23 * hr,
		before: "2018-11-03T00:00:00-03:00"},
	{name: "Sao_Paulo 2019-02-16 lasts 25h (23:00 repeated)", zone: "America/Sao_Paulo", unit: periodDay, at: "2019-02-16T23:30:00-03:00",
		start: "2019-02-16T00:00:00-02:00", end: "2019-02-17T00:00:00-03:00", length: 25 * hr},
	{name: "Sao_Paulo repeated 23:00 hour", zone: "America/Sao_Paulo", unit: periodHour, at: "2019-02-16T23:30:00-03:00",
		start: "2019-02-16T23:00:00-02:00", end: "2019-02-17T00:00:00-03:00", length: 2 * hr},
	{name: "Havana April 2012 began at 01:00 on the 1st", zone: "America/Havana", unit: periodMonth, at: "2012-04-01T12:00:00-04:00",
		start: "2012-04-01T01:00:00-04:00", end: "2012-05-01T00:00:00-04:00", length: 30*24*hr - hr,
		before: "2012-03-01T00:00:00-05:00", after: "2012-06-01T00:00:00-04:00"},
	{name: "Havana March 2012 ends at the jump", zone: "America/Havana", unit: periodMonth, at: "2012-04-01T04:59:59Z",
		start: "2012-03-01T00:00:00-05:00", end: "2012-04-01T01:00:00-04:00", length: 31 * 24 * hr},
	{name: "Tehran week of 2021-03-22 began on Monday at 01:00", zone: "Asia/Tehran", unit: periodWeek, at: "2021-03-22T12:00:00+04:30",
		start: "2021-03-22T01:00:00+04:30", end: "2021-03-29T00:00:00+04:30", length: 7*24*hr - hr,
		before: "2021-03-15T00:00:00+03:30"},
	{name: "Khandyga 2004 began at 01:00 on Jan 1", zone: "Asia/Khandyga", unit: periodYear, at: "2004-01-01T12:00:00Z",
		start: "2004-01-01T01:00:00+10:00", end: "2005-01-01T00:00:00+10:00", length: 366*24*hr - hr},
	{name: "Apia skipped 2011-12-30: Dec 31 follows Dec 29", zone: "Pacific/Apia", unit: periodDay, at: "2011-12-31T00:00:00+14:00",
		start: "2011-12-31T00:00:00+14:00", end: "2012-01-01T00:00:00+14:00", length: 24 * hr,
		before: "2011-12-29T00:00:00-10:00"},
	{name: "Apia repeated 1892-07-04: the day lasts 48h", zone: "Pacific/Apia", unit: periodDay, at: "1892-07-05T11:00:00Z",
		start: "1892-07-03T11:26:56Z", end: "1892-07-05T11:26:56Z", length: 48 * hr},
}

// TestCalendarPeriods holds the boundaries to what a wall clock in the zone
// shows, across daylight-saving changes in both directions, skipped and
// repeated midnights, month, year and week ends. start and end are instants
// (written in the zone's offset of the moment, so they read as the wall
// clock does); before is the start of the previous period, after the end
// of the next, when given.
func TestCalendarPeriods(t *testing.T) {
	cases := calendarCases
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			loc := mustZone(t, c.zone)
			at := mustTime(t, c.at)
			p := periodAt(c.unit, loc, at)
			start, end := mustTime(t, c.start), mustTime(t, c.end)
			if p.start != start.UnixMicro() || p.end != end.UnixMicro() {
				got := p.text(loc)
				t.Fatalf("%s of %s in %s = [%s, %s), want [%s, %s)", c.unit, c.at, c.zone, got.StartZone, got.EndZone,
					start.In(loc).Format(time.RFC3339), end.In(loc).Format(time.RFC3339))
			}
			if got := time.Duration(p.seconds()) * time.Second; got != c.length {
				t.Errorf("length %v, want %v", got, c.length)
			}
			b := periodBoundsAt(c.unit, loc, at)
			if b.period(1) != p {
				t.Errorf("bounds %v: period 1 is not %v", b, p)
			}
			if !(b[0] < b[1] && b[1] <= at.UnixMicro() && at.UnixMicro() < b[2] && b[2] < b[3]) {
				t.Errorf("bounds %v out of order around %d", b, at.UnixMicro())
			}
			if c.before != "" && b[0] != mustTime(t, c.before).UnixMicro() {
				t.Errorf("previous period starts %s, want %s", time.UnixMicro(b[0]).In(loc).Format(time.RFC3339), c.before)
			}
			if c.after != "" && b[3] != mustTime(t, c.after).UnixMicro() {
				t.Errorf("next period ends %s, want %s", time.UnixMicro(b[3]).In(loc).Format(time.RFC3339), c.after)
			}
			// The script's choice on a Redis clock anywhere in the three periods.
			for i, us := range []int64{b[0], b[1] - 1, b[1], at.UnixMicro(), b[2] - 1, b[2], b[3] - 1} {
				want := []int{0, 0, 1, 1, 1, 2, 2}[i]
				if got, ok := b.pick(us); !ok || got != want {
					t.Errorf("pick(%d) = %d, %v; want %d", us, got, ok, want)
				}
			}
			for _, us := range []int64{b[0] - 1, b[3], b[3] + 1e6} {
				if _, ok := b.pick(us); ok {
					t.Errorf("pick(%d) outside [b0, b3) accepted", us)
				}
			}
		})
	}
}

func TestPeriodFields(t *testing.T) {
	ny := mustZone(t, "America/New_York")
	p := periodAt(periodMonth, ny, mustTime(t, "2024-11-15T12:00:00Z"))
	if got, want := p.seconds(), int64(30*86400+3600); got != want {
		t.Errorf("November 2024 in New York: w = %d, want %d", got, want)
	}
	for _, c := range []struct {
		now  string
		want int64
	}{
		{"2024-11-30T23:59:59-05:00", 1},
		{"2024-11-30T23:59:59.000001-05:00", 1}, // never early
		{"2024-11-30T23:59:58.5-05:00", 2},
		{"2024-12-01T00:00:00-05:00", 0},
		{"2024-12-01T00:00:01-05:00", 0},
		{"2024-11-01T00:00:00-04:00", 30*86400 + 3600},
	} {
		if got := p.secondsLeft(mustTime(t, c.now).UnixMicro()); got != c.want {
			t.Errorf("secondsLeft at %s = %d, want %d", c.now, got, c.want)
		}
	}
	got := p.text(ny)
	want := periodText{
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
	h := periodAt(periodHour, ny, mustTime(t, "2024-11-03T01:30:00-05:00")).text(ny)
	if h.StartZone != "2024-11-03T01:00:00-04:00" || h.EndZone != "2024-11-03T02:00:00-05:00" {
		t.Errorf("repeated hour text = %+v", h)
	}
}

var propertyZones = []string{
	"UTC", "America/New_York", "Europe/Berlin", "Australia/Lord_Howe", "Asia/Kolkata",
	"Asia/Kathmandu", "Pacific/Chatham", "America/Sao_Paulo", "America/Havana", "Asia/Tehran",
	"Pacific/Apia", "Asia/Beirut", "Europe/London", "America/Santiago", "Antarctica/Troll",
}

var allUnits = []periodUnit{periodMinute, periodHour, periodDay, periodWeek, periodMonth, periodYear}

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
		loc := mustZone(t, zone)
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

func checkCalendarAt(t *testing.T, u periodUnit, loc *time.Location, us int64) {
	t.Helper()
	at := time.UnixMicro(us)
	b := periodBoundsAt(u, loc, at)
	where := func() string {
		return at.In(loc).Format(time.RFC3339Nano) + " " + loc.String() + " " + u.String()
	}
	if !(b[0] < b[1] && b[1] <= us && us < b[2] && b[2] < b[3]) {
		t.Fatalf("%s: bounds %v not b0 < b1 <= t < b2 < b3", where(), b)
	}
	if p := periodAt(u, loc, time.UnixMicro(b[2]-1)); p != b.period(1) {
		t.Fatalf("%s: period of b2-1µs is %v, not b1's %v", where(), p, b.period(1))
	}
	if p := periodAt(u, loc, time.UnixMicro(b[1])); p != b.period(1) {
		t.Fatalf("%s: period of b1 is %v, not %v", where(), p, b.period(1))
	}
	if next := periodBoundsAt(u, loc, time.UnixMicro(b[2])); [3]int64(next[:3]) != [3]int64(b[1:]) {
		t.Fatalf("%s: bounds at b2 %v do not continue %v", where(), next, b)
	}
	if prev := periodBoundsAt(u, loc, time.UnixMicro(b[1]-1)); [3]int64(prev[1:]) != [3]int64(b[:3]) {
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
	longest := map[periodUnit]int64{ // a unit plus a day of clock going back (Apia 1892)
		periodMinute: 60 + 86400, periodHour: 3600 + 86400, periodDay: 2 * 86400,
		periodWeek: 8 * 86400, periodMonth: 32 * 86400, periodYear: 367 * 86400,
	}
	steps := map[periodUnit]int{periodMinute: 3000, periodHour: 20000, periodDay: 20000, periodWeek: 11000, periodMonth: 2600, periodYear: 210}
	starts := map[periodUnit]string{
		periodMinute: "2024-11-03T00:00:00Z", periodHour: "2022-01-01T00:00:00Z", periodDay: "1890-01-01T00:00:00Z",
		periodWeek: "1890-01-01T00:00:00Z", periodMonth: "1890-01-01T00:00:00Z", periodYear: "1890-01-01T00:00:00Z",
	}
	for _, zone := range propertyZones {
		loc := mustZone(t, zone)
		for _, u := range allUnits {
			t.Run(zone+"/"+u.String(), func(t *testing.T) {
				n := steps[u]
				if testing.Short() {
					n /= 10
				}
				p := periodAt(u, loc, mustTime(t, starts[u]))
				for range n {
					q := periodAt(u, loc, time.UnixMicro(p.end))
					if q.start != p.end {
						t.Fatalf("period after %v starts at %d", p.text(loc), q.start)
					}
					if q.seconds() <= 0 || q.seconds() > longest[u] {
						t.Fatalf("period %+v lasts %ds", q.text(loc), q.seconds())
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
		unit periodUnit
		from string
		step time.Duration
		n    int
	}{
		{"UTC", periodMinute, "2024-12-31T23:58:00Z", 7 * time.Second, 50},
		{"America/New_York", periodHour, "2024-11-03T04:30:00Z", 9 * time.Minute, 40},
		{"Australia/Lord_Howe", periodDay, "2024-04-05T00:00:00Z", 5 * time.Hour, 30},
		{"America/Havana", periodMonth, "2012-03-15T00:00:00Z", 61 * time.Hour, 40},
	} {
		t.Run(c.zone+"/"+c.unit.String(), func(t *testing.T) {
			loc := mustZone(t, c.zone)
			cal := newCalendar(c.unit, loc)
			at := mustTime(t, c.from)
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
					if got, want := cal.bounds(x), periodBoundsAt(c.unit, loc, x); got != want {
						t.Fatalf("bounds(%s) = %v, want %v", x.Format(time.RFC3339), got, want)
					}
				}
			}
			for i := len(times) - 1; i >= 0; i-- {
				if got, want := cal.bounds(times[i]), periodBoundsAt(c.unit, loc, times[i]); got != want {
					t.Fatalf("backwards: bounds(%s) = %v, want %v", times[i].Format(time.RFC3339), got, want)
				}
			}
		})
	}
}

func TestCalendarCacheConcurrent(t *testing.T) {
	loc := mustZone(t, "Europe/Berlin")
	cal := newCalendar(periodMinute, loc)
	base := mustTime(t, "2024-03-31T00:59:00Z")
	done := make(chan struct{})
	for g := range 8 {
		go func() {
			defer func() { done <- struct{}{} }()
			for i := range 2000 {
				x := base.Add(time.Duration(i*37+g*1000) * time.Millisecond)
				if got, want := cal.bounds(x), periodBoundsAt(periodMinute, loc, x); got != want {
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
	loc := mustZone(b, "America/New_York")
	now := time.Now()
	b.Run("cached", func(b *testing.B) {
		cal := newCalendar(periodMonth, loc)
		cal.bounds(now)
		b.ReportAllocs()
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				cal.bounds(now)
			}
		})
	})
	b.Run("compute", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			periodBoundsAt(periodMonth, loc, now)
		}
	})
}
