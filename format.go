package ratelimit

import (
	"strconv"
	"strings"
)

// What Redis holds for a rate bucket, and how each release reads it. A
// fleet upgraded one instance at a time runs two releases on one Redis, so
// every format a build writes must be read correctly by the release
// before it, and every format of the release before read by this one.
//
//   - v0 (first wave): "<tat>", the TAT in µs: 16 digits until 2286. Its
//     interval is read as the current one.
//   - v1 (second wave, and this release until the fleet is upgraded):
//     "<tat>:<interval>".
//   - v2 (this release, once the fleet marker says so): one integer, the
//     interval's code followed by the TAT's offset from formatEpoch in 15
//     digits: 17 to 19 digits, below 2^63, so that Redis stores it in the
//     key's object itself (an "int" encoding: about 32 bytes less per key
//     than v1's string). The code stands for intervals of at most three
//     significant digits (m × 10^e µs: 100/1m, 10/1s, 5/15m...); a bucket
//     of another interval, or a TAT beyond formatEpoch + 10^15 µs (2055), is
//     written as v1.
//
// The release before reads a v2 value as a v0 TAT centuries ahead: a bucket
// that owes everything it may owe, which denies. So a v2 value never lets
// an instance of that release over-admit; but it over-denies, which is why
// v2 is written only once the fleet marker (see redisStore.format) says every
// instance reads it. lua/decide.lua reads and writes the same formats;
// TestLuaFormats holds the two to it.

// formatEpoch is where v2's TAT offsets start: 2023-11-14T22:13:20Z in µs.
const formatEpoch = 1_700_000_000_000_000

// formatOffsets is how far a v2 offset goes: 15 decimal digits.
const formatOffsets = 1_000_000_000_000_000

// Formats, as the fleet marker names them.
const (
	formatV1 = 1
	formatV2 = 2
)

// Interval codes of v2, from 10 (so that a v2 value has at least 17 digits
// and is never taken for a v0 TAT) to 9222 (so that it stays below 2^63).
const (
	minIntervalCode = 10
	maxIntervalCode = 9222
)

// intervalCode is the v2 code of an interval, or 0 when v2 cannot state it
// exactly: intervals 1 to 999 are codes 10 to 1008; m × 10^e for m of 100
// to 999 and e ≥ 1, codes from 1009 on, 900 for each e.
func intervalCode(interval int64) int64 {
	if interval < 1 {
		return 0
	}
	if interval < 1000 {
		return minIntervalCode - 1 + interval
	}
	e := int64(0)
	for interval >= 1000 {
		if interval%10 != 0 {
			return 0
		}
		interval /= 10
		e++
	}
	code := 1009 + (e-1)*900 + interval - 100
	if code > maxIntervalCode {
		return 0
	}
	return code
}

// codeInterval is the interval a v2 code stands for (0 for no code).
func codeInterval(code int64) int64 {
	if code < minIntervalCode || code > maxIntervalCode {
		return 0
	}
	i := code - minIntervalCode
	if i < 999 {
		return i + 1
	}
	i -= 999
	interval := i%900 + 100
	for range i/900 + 1 {
		interval *= 10
	}
	return interval
}

// encodeBucket is the value of a bucket whose TAT is tat, written under
// interval, in the given format.
func encodeBucket(tat, interval int64, format int) string {
	if format >= formatV2 {
		off := tat - formatEpoch
		if code := intervalCode(interval); code != 0 && off >= 0 && off < formatOffsets {
			s := strconv.FormatInt(off, 10)
			return strconv.FormatInt(code, 10) + strings.Repeat("0", 15-len(s)) + s
		}
	}
	return strconv.FormatInt(tat, 10) + ":" + strconv.FormatInt(interval, 10)
}

// decodeBucket reads a bucket's value in any format; current is the
// interval a v0 value is read under. ok is false for a value that is not a
// bucket.
func decodeBucket(v string, current int64) (tat, interval int64, ok bool) {
	if t, i, found := strings.Cut(v, ":"); found {
		tat, err1 := strconv.ParseInt(t, 10, 64)
		interval, err2 := strconv.ParseInt(i, 10, 64)
		return tat, interval, err1 == nil && err2 == nil && interval > 0
	}
	if len(v) <= 16 {
		tat, err := strconv.ParseInt(v, 10, 64)
		return tat, current, err == nil
	}
	if len(v) > 19 {
		return 0, 0, false
	}
	code, err1 := strconv.ParseInt(v[:len(v)-15], 10, 64)
	off, err2 := strconv.ParseInt(v[len(v)-15:], 10, 64)
	interval = codeInterval(code)
	if err1 != nil || err2 != nil || interval == 0 || off < 0 {
		return 0, 0, false
	}
	return formatEpoch + off, interval, true
}
