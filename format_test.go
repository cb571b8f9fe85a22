package ratelimit

import (
	"context"
	"os/exec"
	"strconv"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
)

func TestIntervalCodes(t *testing.T) {
	for _, c := range []struct {
		interval, code int64
	}{
		{1, 10}, {999, 1008}, {1000, 1009}, {1010, 1010}, {1500, 1059}, {1501, 0}, {9990, 1908},
		{10_000, 1909}, {100_000, 2809}, {600_000, 3309}, {1_000_000, 3709}, // 10/1s, 100/1m, 1/1s
		{180_000_000, 5589}, {333_333, 0}, {8_571_428, 0}, // 5/15m; 3/1s and 7/1m have no code
		{864 * 100_000_000, 8073}, {213 * 10_000_000_000, 9222}, {214 * 10_000_000_000, 0}, {0, 0}, {-5, 0},
	} {
		if got := intervalCode(c.interval); got != c.code {
			t.Errorf("intervalCode(%d) = %d, want %d", c.interval, got, c.code)
		}
		if c.code != 0 {
			if got := codeInterval(c.code); got != c.interval {
				t.Errorf("codeInterval(%d) = %d, want %d", c.code, got, c.interval)
			}
		}
	}
	for code := int64(minIntervalCode); code <= maxIntervalCode; code++ {
		if i := codeInterval(code); intervalCode(i) != code {
			t.Fatalf("code %d is interval %d, whose code is %d", code, i, intervalCode(i))
		}
	}
}

func TestBucketFormats(t *testing.T) {
	const tat = 1_764_620_000_123_456 // 2025-12-01
	for _, c := range []struct {
		name     string
		tat      int64
		interval int64
		format   int
		want     string
	}{
		{"v1", tat, 600_000, formatV1, "1764620000123456:600000"},
		{"v2", tat, 600_000, formatV2, "3309064620000123456"},
		{"v2, smallest code", formatEpoch, 1, formatV2, "10000000000000000"},
		{"v2, no code: v1", tat, 333_333, formatV2, "1764620000123456:333333"},
		{"v2, beyond 2055: v1", formatEpoch + formatOffsets, 600_000, formatV2, "2700000000000000:600000"},
	} {
		got := encodeBucket(c.tat, c.interval, c.format)
		if got != c.want {
			t.Errorf("%s: encodeBucket = %q, want %q", c.name, got, c.want)
		}
		if tat, interval, ok := decodeBucket(got, 7); !ok || tat != c.tat || interval != c.interval {
			t.Errorf("%s: decodeBucket(%q) = %d, %d, %v", c.name, got, tat, interval, ok)
		}
		if v, err := strconv.ParseInt(got, 10, 64); c.format == formatV2 && len(got) <= 19 && (err != nil || v < 1e16) {
			t.Errorf("%s: %q is not an integer of 17 digits or more (%v)", c.name, got, err)
		}
	}
	// v0, from the first release: the interval is the current one.
	if tat, interval, ok := decodeBucket("1764620000123456", 7); !ok || tat != 1764620000123456 || interval != 7 {
		t.Errorf("v0: %d, %d, %v", tat, interval, ok)
	}
	for _, bad := range []string{"", "x", "12:", ":5", "1:0", "1764620000123456x", "12345678901234567890", "9223000000000000000", "20000x0000000000000", "-2869064620000123"} {
		if _, _, ok := decodeBucket(bad, 7); ok {
			t.Errorf("decodeBucket(%q) took it for a bucket", bad)
		}
	}
}

// TestV02ReadsV2: v0.2 (a fleet rolled back that far without `format v1`)
// reads a v2 value as a v0 TAT (it knows only "<tat>" and
// "<tat>:<interval>"): centuries ahead, so its rebase makes the bucket owe
// all it may, and it denies. v0.3.0 reads v2 as this release does.
func TestV02ReadsV2(t *testing.T) {
	l := limit{interval: 600_000, burst: 100, slack: 600_000 * 100}
	now := int64(1_764_620_000_000_000)
	v := encodeBucket(now+5*l.interval, l.interval, formatV2)
	asV0, err := strconv.ParseFloat(v, 64) // as its Lua's tonumber reads it
	if err != nil {
		t.Fatal(err)
	}
	base := start(l.rebase(int64(asV0), l.interval, now), now)
	if l.fits(base, now, 1, 0) {
		t.Fatalf("v0.2 would admit on %q", v)
	}
	if n, _ := l.tokens(base, now); n != -l.burst {
		t.Fatalf("v0.2 reads %q as %d tokens, want %d (all it may owe)", v, n, -l.burst)
	}
}

// TestV2IsStoredAsAnInteger: Redis keeps a v2 value in the key's object
// itself (OBJECT ENCODING int), which is what makes it smaller than v1.
func TestV2IsStoredAsAnInteger(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rq := bucketRequest{key: "rl:p:{x}", limit: limit{interval: 600_000, burst: 100}, op: opTake, cost: 1}
	for _, format := range []int{formatV1, formatV2} {
		if _, err := evalScriptFormat(ctx, client, decideLua, format, []bucketRequest{rq}, []bucketRequest{rq}); err != nil {
			t.Fatal(err)
		}
		enc, err := client.ObjectEncoding(ctx, rq.key).Result()
		want := map[int]string{formatV1: "embstr", formatV2: "int"}[format]
		if err != nil || enc != want {
			t.Fatalf("format %s: OBJECT ENCODING %q (%v), want %q", formatName(format), enc, err, want)
		}
	}
}

// TestV02ReadsQuota: v0.2, whose
// configs have no quotas and so never read a quota's key, would read a
// quota count as a corrupt rate bucket: it fails that request, it never
// takes the count for a bucket with tokens to give.
func TestV02ReadsQuota(t *testing.T) {
	old, err := exec.Command("git", "show", testcaddy.ReleaseV02+":lua/decide.lua").Output()
	if err != nil {
		t.Fatalf("reading v0.2's script from git history: %v", err)
	}
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	now := redisMicros(t, client)
	client.Set(ctx, "rl:q:{a}", encodeQuota(calendar.Period{Start: now - sec, End: now + 59*sec}, 3), 0)
	// v0.2's ARGV: per request its bucket count, then op (2 * code + shadow),
	// interval, burst, slack, amount, wait.
	res, err := client.Eval(ctx, string(old), []string{"rl:q:{a}"}, 1, 2*1, 600_000, 100, 0, 1, 0).Int64Slice()
	if err != nil {
		t.Fatal(err)
	}
	if res[1] != scriptCorrupt {
		t.Fatalf("v0.2's script on a quota count: %v, want status %d (corrupt)", res, scriptCorrupt)
	}
}
