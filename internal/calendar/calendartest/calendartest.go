// Package calendartest holds the boundary table of calendar periods: the
// periods a wall clock shows across daylight-saving changes, skipped and
// repeated midnights, month, year and week ends. The calendar's own tests
// hold its computation to it, and the root's TestLuaQuotaCalendar the
// script's choice of period, so both read one table.
package calendartest

import (
	"testing"
	"time"
)

// Zone loads an IANA zone for a test.
func Zone(t testing.TB, name string) *time.Location {
	t.Helper()
	loc, err := time.LoadLocation(name)
	if err != nil {
		t.Fatal(err)
	}
	return loc
}

// Instant reads an RFC 3339 instant for a test.
func Instant(t testing.TB, s string) time.Time {
	t.Helper()
	v, err := time.Parse(time.RFC3339Nano, s)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// Case is a row of the boundary table: the period of Unit (a unit's name,
// as calendar.ParseUnit reads it) in Zone holding the instant At is
// [Start, End), of Length. Start and End are instants written in the
// zone's offset of the moment, so they read as the wall clock does; Before
// is the start of the previous period, After the end of the next, when
// given.
type Case struct {
	Name, Zone string
	Unit       string
	At         string
	Start, End string
	Length     time.Duration
	Before     string
	After      string
}

const hr = time.Hour

// Cases is the boundary table.
var Cases = []Case{
	// UTC: plain calendar arithmetic.
	{Name: "UTC minute", Zone: "UTC", Unit: "minute", At: "2024-05-05T10:20:30.5Z",
		Start: "2024-05-05T10:20:00Z", End: "2024-05-05T10:21:00Z", Length: time.Minute,
		Before: "2024-05-05T10:19:00Z", After: "2024-05-05T10:22:00Z"},
	{Name: "UTC minute at its first microsecond", Zone: "UTC", Unit: "minute", At: "2024-05-05T10:20:00Z",
		Start: "2024-05-05T10:20:00Z", End: "2024-05-05T10:21:00Z", Length: time.Minute},
	{Name: "UTC minute at its last microsecond", Zone: "UTC", Unit: "minute", At: "2024-05-05T10:20:59.999999Z",
		Start: "2024-05-05T10:20:00Z", End: "2024-05-05T10:21:00Z", Length: time.Minute},
	{Name: "UTC hour", Zone: "UTC", Unit: "hour", At: "2024-05-05T10:59:59Z",
		Start: "2024-05-05T10:00:00Z", End: "2024-05-05T11:00:00Z", Length: hr},
	{Name: "UTC day", Zone: "UTC", Unit: "day", At: "2024-05-05T00:00:00Z",
		Start: "2024-05-05T00:00:00Z", End: "2024-05-06T00:00:00Z", Length: 24 * hr},
	{Name: "UTC week from Monday, on a Sunday", Zone: "UTC", Unit: "week", At: "2024-05-05T23:59:59Z",
		Start: "2024-04-29T00:00:00Z", End: "2024-05-06T00:00:00Z", Length: 7 * 24 * hr,
		Before: "2024-04-22T00:00:00Z", After: "2024-05-13T00:00:00Z"},
	{Name: "UTC week on its Monday", Zone: "UTC", Unit: "week", At: "2024-05-06T00:00:00Z",
		Start: "2024-05-06T00:00:00Z", End: "2024-05-13T00:00:00Z", Length: 7 * 24 * hr},
	{Name: "UTC week crossing a month", Zone: "UTC", Unit: "week", At: "2024-05-31T12:00:00Z",
		Start: "2024-05-27T00:00:00Z", End: "2024-06-03T00:00:00Z", Length: 7 * 24 * hr},
	{Name: "UTC week crossing a year", Zone: "UTC", Unit: "week", At: "2025-01-01T00:00:00Z",
		Start: "2024-12-30T00:00:00Z", End: "2025-01-06T00:00:00Z", Length: 7 * 24 * hr},
	{Name: "UTC week before 1970", Zone: "UTC", Unit: "week", At: "1969-12-31T12:00:00Z",
		Start: "1969-12-29T00:00:00Z", End: "1970-01-05T00:00:00Z", Length: 7 * 24 * hr},
	{Name: "UTC month of 31 days, Jan 31 to Feb 28", Zone: "UTC", Unit: "month", At: "2023-01-31T23:59:59Z",
		Start: "2023-01-01T00:00:00Z", End: "2023-02-01T00:00:00Z", Length: 31 * 24 * hr,
		Before: "2022-12-01T00:00:00Z", After: "2023-03-01T00:00:00Z"},
	{Name: "UTC February of 28 days", Zone: "UTC", Unit: "month", At: "2023-02-28T23:59:59Z",
		Start: "2023-02-01T00:00:00Z", End: "2023-03-01T00:00:00Z", Length: 28 * 24 * hr},
	{Name: "UTC February 29 in a leap year", Zone: "UTC", Unit: "month", At: "2024-02-29T12:00:00Z",
		Start: "2024-02-01T00:00:00Z", End: "2024-03-01T00:00:00Z", Length: 29 * 24 * hr},
	{Name: "UTC February of 2100, no leap year", Zone: "UTC", Unit: "month", At: "2100-02-15T00:00:00Z",
		Start: "2100-02-01T00:00:00Z", End: "2100-03-01T00:00:00Z", Length: 28 * 24 * hr},
	{Name: "UTC month of 30 days", Zone: "UTC", Unit: "month", At: "2024-04-30T23:00:00Z",
		Start: "2024-04-01T00:00:00Z", End: "2024-05-01T00:00:00Z", Length: 30 * 24 * hr},
	{Name: "UTC December into January", Zone: "UTC", Unit: "month", At: "2024-12-31T23:59:59.999999Z",
		Start: "2024-12-01T00:00:00Z", End: "2025-01-01T00:00:00Z", Length: 31 * 24 * hr,
		Before: "2024-11-01T00:00:00Z", After: "2025-02-01T00:00:00Z"},
	{Name: "UTC leap year", Zone: "UTC", Unit: "year", At: "2024-12-31T23:59:59.999999Z",
		Start: "2024-01-01T00:00:00Z", End: "2025-01-01T00:00:00Z", Length: 366 * 24 * hr,
		Before: "2023-01-01T00:00:00Z", After: "2026-01-01T00:00:00Z"},
	{Name: "UTC year", Zone: "UTC", Unit: "year", At: "2025-01-01T00:00:00Z",
		Start: "2025-01-01T00:00:00Z", End: "2026-01-01T00:00:00Z", Length: 365 * 24 * hr},

	// America/New_York: 02:00 -> 03:00 in March, 02:00 -> 01:00 in November.
	{Name: "New_York day of spring change lasts 23h", Zone: "America/New_York", Unit: "day", At: "2024-03-10T12:00:00-04:00",
		Start: "2024-03-10T00:00:00-05:00", End: "2024-03-11T00:00:00-04:00", Length: 23 * hr},
	{Name: "New_York day of autumn change lasts 25h", Zone: "America/New_York", Unit: "day", At: "2024-11-03T01:30:00-05:00",
		Start: "2024-11-03T00:00:00-04:00", End: "2024-11-04T00:00:00-05:00", Length: 25 * hr},
	{Name: "New_York hour after the skipped 02:00 starts at the jump", Zone: "America/New_York", Unit: "hour", At: "2024-03-10T03:30:00-04:00",
		Start: "2024-03-10T03:00:00-04:00", End: "2024-03-10T04:00:00-04:00", Length: hr,
		Before: "2024-03-10T01:00:00-05:00", After: "2024-03-10T05:00:00-04:00"},
	{Name: "New_York hour 01:00 before the jump", Zone: "America/New_York", Unit: "hour", At: "2024-03-10T01:59:59-05:00",
		Start: "2024-03-10T01:00:00-05:00", End: "2024-03-10T03:00:00-04:00", Length: hr},
	{Name: "New_York repeated 01:00 hour lasts 2h (first pass)", Zone: "America/New_York", Unit: "hour", At: "2024-11-03T01:10:00-04:00",
		Start: "2024-11-03T01:00:00-04:00", End: "2024-11-03T02:00:00-05:00", Length: 2 * hr},
	{Name: "New_York repeated 01:00 hour lasts 2h (second pass)", Zone: "America/New_York", Unit: "hour", At: "2024-11-03T01:30:00-05:00",
		Start: "2024-11-03T01:00:00-04:00", End: "2024-11-03T02:00:00-05:00", Length: 2 * hr},
	{Name: "New_York minute 01:59 lasts until 02:00 comes (61 min)", Zone: "America/New_York", Unit: "minute", At: "2024-11-03T01:30:00-05:00",
		Start: "2024-11-03T01:59:00-04:00", End: "2024-11-03T02:00:00-05:00", Length: 61 * time.Minute},
	{Name: "New_York week of spring change", Zone: "America/New_York", Unit: "week", At: "2024-03-10T23:00:00-04:00",
		Start: "2024-03-04T00:00:00-05:00", End: "2024-03-11T00:00:00-04:00", Length: 7*24*hr - hr},
	{Name: "New_York month of autumn change", Zone: "America/New_York", Unit: "month", At: "2024-11-30T23:59:59-05:00",
		Start: "2024-11-01T00:00:00-04:00", End: "2024-12-01T00:00:00-05:00", Length: 30*24*hr + hr},
	{Name: "New_York year starts at local midnight", Zone: "America/New_York", Unit: "year", At: "2025-01-01T04:59:59Z",
		Start: "2024-01-01T00:00:00-05:00", End: "2025-01-01T00:00:00-05:00", Length: 366 * 24 * hr},

	{Name: "New_York Dec 31 of a leap year past tzdata's listed changes", Zone: "America/New_York", Unit: "day", At: "2040-12-31T12:00:00-05:00",
		Start: "2040-12-31T00:00:00-05:00", End: "2041-01-01T00:00:00-05:00", Length: 24 * hr},
	{Name: "New_York year 2040 past tzdata's listed changes", Zone: "America/New_York", Unit: "year", At: "2040-12-31T23:59:59-05:00",
		Start: "2040-01-01T00:00:00-05:00", End: "2041-01-01T00:00:00-05:00", Length: 366 * 24 * hr,
		After: "2042-01-01T00:00:00-05:00"},
	{Name: "New_York autumn change of 2044 (from the zone's rule)", Zone: "America/New_York", Unit: "day", At: "2044-11-06T12:00:00-05:00",
		Start: "2044-11-06T00:00:00-04:00", End: "2044-11-07T00:00:00-05:00", Length: 25 * hr},

	// Europe/Berlin: 02:00 -> 03:00 on the last Sunday of March, 03:00 -> 02:00 in October.
	{Name: "Berlin day of spring change lasts 23h", Zone: "Europe/Berlin", Unit: "day", At: "2024-03-31T12:00:00+02:00",
		Start: "2024-03-31T00:00:00+01:00", End: "2024-04-01T00:00:00+02:00", Length: 23 * hr},
	{Name: "Berlin day of autumn change lasts 25h", Zone: "Europe/Berlin", Unit: "day", At: "2024-10-27T02:30:00+01:00",
		Start: "2024-10-27T00:00:00+02:00", End: "2024-10-28T00:00:00+01:00", Length: 25 * hr},
	{Name: "Berlin hour after the jump", Zone: "Europe/Berlin", Unit: "hour", At: "2024-03-31T03:15:00+02:00",
		Start: "2024-03-31T03:00:00+02:00", End: "2024-03-31T04:00:00+02:00", Length: hr},
	{Name: "Berlin March loses an hour", Zone: "Europe/Berlin", Unit: "month", At: "2024-03-15T00:00:00+01:00",
		Start: "2024-03-01T00:00:00+01:00", End: "2024-04-01T00:00:00+02:00", Length: 31*24*hr - hr},
	{Name: "Berlin year end", Zone: "Europe/Berlin", Unit: "year", At: "2024-12-31T23:30:00+01:00",
		Start: "2024-01-01T00:00:00+01:00", End: "2025-01-01T00:00:00+01:00", Length: 366 * 24 * hr,
		Before: "2023-01-01T00:00:00+01:00", After: "2026-01-01T00:00:00+01:00"},
	{Name: "Berlin first instant of the year", Zone: "Europe/Berlin", Unit: "year", At: "2024-12-31T23:00:00Z",
		Start: "2025-01-01T00:00:00+01:00", End: "2026-01-01T00:00:00+01:00", Length: 365 * 24 * hr},

	// Australia/Lord_Howe: a 30-minute change, 02:00 -> 02:30 in October, 02:00 -> 01:30 in April.
	{Name: "Lord_Howe day of spring change lasts 23h30", Zone: "Australia/Lord_Howe", Unit: "day", At: "2024-10-06T12:00:00+11:00",
		Start: "2024-10-06T00:00:00+10:30", End: "2024-10-07T00:00:00+11:00", Length: 23*hr + 30*time.Minute},
	{Name: "Lord_Howe day of autumn change lasts 24h30", Zone: "Australia/Lord_Howe", Unit: "day", At: "2024-04-07T12:00:00+10:30",
		Start: "2024-04-07T00:00:00+11:00", End: "2024-04-08T00:00:00+10:30", Length: 24*hr + 30*time.Minute},
	{Name: "Lord_Howe 02:00 hour is half an hour", Zone: "Australia/Lord_Howe", Unit: "hour", At: "2024-10-06T02:40:00+11:00",
		Start: "2024-10-06T02:30:00+11:00", End: "2024-10-06T03:00:00+11:00", Length: 30 * time.Minute,
		Before: "2024-10-06T01:00:00+10:30"},
	{Name: "Lord_Howe 01:00 hour repeated half lasts 1h30", Zone: "Australia/Lord_Howe", Unit: "hour", At: "2024-04-07T01:45:00+10:30",
		Start: "2024-04-07T01:00:00+11:00", End: "2024-04-07T02:00:00+10:30", Length: 90 * time.Minute},
	{Name: "Lord_Howe minute 01:59 lasts 31 min", Zone: "Australia/Lord_Howe", Unit: "minute", At: "2024-04-07T01:40:00+10:30",
		Start: "2024-04-07T01:59:00+11:00", End: "2024-04-07T02:00:00+10:30", Length: 31 * time.Minute},

	// Asia/Kolkata (+05:30) and Asia/Kathmandu (+05:45): hours start at :00 local.
	{Name: "Kolkata hour at :00 local", Zone: "Asia/Kolkata", Unit: "hour", At: "2024-06-01T10:45:00+05:30",
		Start: "2024-06-01T04:30:00Z", End: "2024-06-01T05:30:00Z", Length: hr},
	{Name: "Kolkata day at local midnight", Zone: "Asia/Kolkata", Unit: "day", At: "2024-06-01T18:29:59Z",
		Start: "2024-05-31T18:30:00Z", End: "2024-06-01T18:30:00Z", Length: 24 * hr},
	{Name: "Kolkata month", Zone: "Asia/Kolkata", Unit: "month", At: "2024-06-30T23:59:00+05:30",
		Start: "2024-06-01T00:00:00+05:30", End: "2024-07-01T00:00:00+05:30", Length: 30 * 24 * hr},
	{Name: "Kathmandu hour at :15 UTC", Zone: "Asia/Kathmandu", Unit: "hour", At: "2024-06-01T10:14:59Z",
		Start: "2024-06-01T09:15:00Z", End: "2024-06-01T10:15:00Z", Length: hr},
	{Name: "Kathmandu week", Zone: "Asia/Kathmandu", Unit: "week", At: "2024-06-02T18:14:59Z",
		Start: "2024-05-27T00:00:00+05:45", End: "2024-06-03T00:00:00+05:45", Length: 7 * 24 * hr},
	{Name: "Kathmandu 1986 began at 00:15 (+05:30 -> +05:45)", Zone: "Asia/Kathmandu", Unit: "year", At: "1986-01-01T12:00:00Z",
		Start: "1986-01-01T00:15:00+05:45", End: "1987-01-01T00:00:00+05:45", Length: 365*24*hr - 15*time.Minute,
		Before: "1985-01-01T00:00:00+05:30"},

	// Pacific/Chatham: +12:45, one hour of DST changing at 02:45 / 03:45 local.
	{Name: "Chatham day of spring change lasts 23h", Zone: "Pacific/Chatham", Unit: "day", At: "2024-09-29T12:00:00+13:45",
		Start: "2024-09-29T00:00:00+12:45", End: "2024-09-30T00:00:00+13:45", Length: 23 * hr},
	{Name: "Chatham 03:00 hour is 15 minutes after the jump to 03:45", Zone: "Pacific/Chatham", Unit: "hour", At: "2024-09-29T03:50:00+13:45",
		Start: "2024-09-29T03:45:00+13:45", End: "2024-09-29T04:00:00+13:45", Length: 15 * time.Minute,
		Before: "2024-09-29T02:00:00+12:45"},
	{Name: "Chatham 03:00 hour across the autumn change lasts 2h", Zone: "Pacific/Chatham", Unit: "hour", At: "2024-04-07T03:10:00+12:45",
		Start: "2024-04-07T03:00:00+13:45", End: "2024-04-07T04:00:00+12:45", Length: 2 * hr},

	// Zones whose clock skipped or repeated midnight.
	{Name: "Sao_Paulo 2018-11-04 began at 01:00 (midnight skipped)", Zone: "America/Sao_Paulo", Unit: "day", At: "2018-11-04T12:00:00-02:00",
		Start: "2018-11-04T01:00:00-02:00", End: "2018-11-05T00:00:00-02:00", Length: 23 * hr,
		Before: "2018-11-03T00:00:00-03:00"},
	{Name: "Sao_Paulo 2019-02-16 lasts 25h (23:00 repeated)", Zone: "America/Sao_Paulo", Unit: "day", At: "2019-02-16T23:30:00-03:00",
		Start: "2019-02-16T00:00:00-02:00", End: "2019-02-17T00:00:00-03:00", Length: 25 * hr},
	{Name: "Sao_Paulo repeated 23:00 hour", Zone: "America/Sao_Paulo", Unit: "hour", At: "2019-02-16T23:30:00-03:00",
		Start: "2019-02-16T23:00:00-02:00", End: "2019-02-17T00:00:00-03:00", Length: 2 * hr},
	{Name: "Havana April 2012 began at 01:00 on the 1st", Zone: "America/Havana", Unit: "month", At: "2012-04-01T12:00:00-04:00",
		Start: "2012-04-01T01:00:00-04:00", End: "2012-05-01T00:00:00-04:00", Length: 30*24*hr - hr,
		Before: "2012-03-01T00:00:00-05:00", After: "2012-06-01T00:00:00-04:00"},
	{Name: "Havana March 2012 ends at the jump", Zone: "America/Havana", Unit: "month", At: "2012-04-01T04:59:59Z",
		Start: "2012-03-01T00:00:00-05:00", End: "2012-04-01T01:00:00-04:00", Length: 31 * 24 * hr},
	{Name: "Tehran week of 2021-03-22 began on Monday at 01:00", Zone: "Asia/Tehran", Unit: "week", At: "2021-03-22T12:00:00+04:30",
		Start: "2021-03-22T01:00:00+04:30", End: "2021-03-29T00:00:00+04:30", Length: 7*24*hr - hr,
		Before: "2021-03-15T00:00:00+03:30"},
	{Name: "Khandyga 2004 began at 01:00 on Jan 1", Zone: "Asia/Khandyga", Unit: "year", At: "2004-01-01T12:00:00Z",
		Start: "2004-01-01T01:00:00+10:00", End: "2005-01-01T00:00:00+10:00", Length: 366*24*hr - hr},
	{Name: "Apia skipped 2011-12-30: Dec 31 follows Dec 29", Zone: "Pacific/Apia", Unit: "day", At: "2011-12-31T00:00:00+14:00",
		Start: "2011-12-31T00:00:00+14:00", End: "2012-01-01T00:00:00+14:00", Length: 24 * hr,
		Before: "2011-12-29T00:00:00-10:00"},
	{Name: "Apia repeated 1892-07-04: the day lasts 48h", Zone: "Pacific/Apia", Unit: "day", At: "1892-07-05T11:00:00Z",
		Start: "1892-07-03T11:26:56Z", End: "1892-07-05T11:26:56Z", Length: 48 * hr},
}
