package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"sort"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
)

// redisMicros is Redis's clock.
func redisMicros(t *testing.T, client *redis.Client) int64 {
	t.Helper()
	now, err := client.Time(context.Background()).Result()
	if err != nil {
		t.Fatal(err)
	}
	return now.UnixMicro()
}

// quotaGrid is a calendar of boundaries a test lays out, periods of
// various lengths: boundsAt is the four bounds Go would send around x.
type quotaGrid []int64

func newQuotaGrid(rng *rand.Rand, from int64, n int, minLen, maxLen int64) quotaGrid {
	g := quotaGrid{from}
	for len(g) < n {
		g = append(g, g[len(g)-1]+minLen+rng.Int64N(maxLen-minLen+1))
	}
	return g
}

func (g quotaGrid) boundsAt(x int64) calendar.Bounds {
	k := sort.Search(len(g), func(i int) bool { return g[i] > x }) - 1 // g[k] <= x < g[k+1]
	k = min(max(k, 1), len(g)-3)
	return calendar.Bounds{g[k-1], g[k], g[k+1], g[k+2]}
}

// TestLuaMatchesGoQuota drives random sequences of quota operations
// (takes, checks, charges and refunds after the response, of the current
// period or of one that is over, inspects, resets), many beside rate
// buckets in the same request, through lua/decide.lua on a real Redis and
// through the Go reference (quota.go, fed the script's clock), and
// requires the same period chosen, the same decisions, verdicts and stored
// values, and TTLs that end a second after the period. The bounds are laid
// out around Redis's real TIME on calendars of 5 to 40 ms periods, and sent
// as an instance whose clock is behind or ahead would send them: Redis's
// clock then falls in the period before or after the middle one, or
// (further off) outside them all, an error for that request alone. Keys
// switch calendars now and then, as a reload that changes the unit or the
// zone: a count of another period reads as 0. Calls carry one to four
// requests, which may share keys, as coalesced calls do.
func TestLuaMatchesGoQuota(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(24, 2026))
	t0 := redisMicros(t, client)
	// Two calendars: the second's periods are three of the first's, as an
	// hour is sixty minutes: a period of either may start when one of the
	// other does, and is still another period.
	fine := newQuotaGrid(rng, t0-60*sec, 40_000, 5_000, 40_000)
	var coarse quotaGrid
	for i := 0; i < len(fine); i += 3 {
		coarse = append(coarse, fine[i])
	}
	grids := [2]quotaGrid{fine, coarse}
	type quotaShape struct{ n, slack int64 }
	shapes := [][2]quotaShape{ // before and after a reload
		{{5, 0}, {8, 0}},
		{{3, 6}, {3, 6}}, // settle's debt up to 6 beyond the quota
		{{1000, 0}, {1000, 0}},
		{{1, 0}, {2, 0}},
	}
	rate := limit{interval: 2000, burst: 4}
	type storedCount struct {
		p    calendar.Period
		used int64
	}
	model := map[string]storedCount{}
	// The Redis time of the call that last wrote a key, and the time just
	// after it: Redis counts a TTL from when SET runs, within the call.
	writtenNow, writtenAfter := map[string]int64{}, map[string]int64{}
	rates := map[string]storedBucket{}
	var stats struct {
		admitted, denied, clock, otherPeriod, over int
		picked                                     [3]int
	}
	lastNow := t0
	for step := range 3000 {
		batch := make([][]bucketRequest, 1+rng.IntN(4))
		for r := range batch {
			op := []bucketOp{opTake, opTake, opTake, opTake, opTake, opTake, opCheck, opAdjust, opAdjust, opInspect, opReset}[rng.IntN(11)]
			n := 1 + rng.IntN(3)
			if op != opTake && op != opCheck {
				n = 1
			}
			// The Go clock the bounds are taken around: mostly this one's,
			// now and then a period or two behind or ahead, rarely off by
			// far more (outside the bounds).
			skew := int64(0)
			switch x := rng.IntN(100); {
			case x < 8:
				skew = -25_000
			case x < 16:
				skew = 25_000
			case x < 18:
				skew = 150_000 * (1 - 2*int64(rng.IntN(2)))
			}
			goNow := lastNow + 500 + skew
			used := map[string]bool{}
			var reqs []bucketRequest
			for len(reqs) < n {
				if (op == opTake || op == opCheck) && rng.IntN(4) == 0 {
					key := fmt.Sprintf("rl:r:{id%d}", rng.IntN(3))
					if !used[key] {
						used[key] = true
						reqs = append(reqs, bucketRequest{key: key, limit: rate, op: op, cost: 1 + rng.Int64N(2)})
					}
					continue
				}
				si := rng.IntN(len(shapes))
				key := fmt.Sprintf("rl:q%d:{id%d}", si, rng.IntN(3))
				if used[key] {
					continue
				}
				used[key] = true
				shape := shapes[si][0]
				if rng.IntN(8) == 0 {
					shape = shapes[si][1]
				}
				grid := grids[0]
				if si == 0 && rng.IntN(10) == 0 {
					grid = grids[1]
				}
				rq := bucketRequest{key: key, limit: limit{burst: shape.n, slack: shape.slack}, op: op,
					quota: &quotaSpec{periods: fixedBounds(grid.boundsAt(goNow)), name: key}}
				switch op {
				case opTake, opCheck:
					rq.cost = 1 + rng.Int64N(2)
					if rng.IntN(25) == 0 {
						rq.cost = shape.n + 1 // never fits
					}
					rq.shadow = rng.IntN(6) == 0
				case opAdjust:
					rq.delta = rng.Int64N(9) - 5
					if rq.delta == 0 {
						rq.delta = 7
					}
					switch rng.IntN(3) {
					case 0: // the period the key's count is of: current, or over
						rq.period = model[key].p
					case 1: // one surely over
						b := grid.boundsAt(lastNow - 200_000)
						rq.period = b.Period(1)
					}
				}
				reqs = append(reqs, rq)
			}
			batch[r] = reqs
		}
		res, err := evalDecide(ctx, client, batch...)
		if err != nil {
			t.Fatalf("step %d: script: %v", step, err)
		}
		now, off := res[0], 1
		lastNow = now
		for r, reqs := range batch {
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			// The Go side: the period of each quota bucket, its count in it.
			tats := make([]int64, len(reqs))
			outside := false
			at := 1
			for i, rq := range reqs {
				switch {
				case rq.quota != nil:
					b := rq.quota.periods.Bounds(time.Time{})
					k, ok := b.Pick(now)
					if !ok {
						outside = true
						break
					}
					stats.picked[k]++
					p := b.Period(k)
					if m, found := model[rq.key]; found && m.p == p {
						tats[i] = m.used
					} else if found && m.used > 0 {
						stats.otherPeriod++
					}
					if out[at+1] != tats[i] || out[at+2] != p.Start {
						t.Fatalf("step %d, request %d, bucket %s: Lua read %d used in the period from %d, Go %d in %v (now %d, bounds %v)",
							step, r, rq.key, out[at+1], out[at+2], tats[i], p, now, b)
					}
				default:
					b := rates[rq.key]
					tats[i] = rq.limit.rebase(b.tat, b.interval, now)
				}
				at += bucketReplyWidth(rq)
			}
			got, _, derr := decodeRequest(now, out, reqs)
			if outside {
				var bad *badBucketError
				if out[0] != scriptClock || !errors.As(derr, &bad) || bad.kind != "clock" {
					t.Fatalf("step %d, request %d: Redis's clock outside a quota's bounds: status %d, error %v", step, r, out[0], derr)
				}
				stats.clock++
				continue
			}
			if derr != nil {
				t.Fatalf("step %d, request %d: %v", step, r, derr)
			}
			want, next := decideBuckets(tats, now, reqs)
			if want.admitted != (out[0] == scriptAdmitted) {
				t.Fatalf("step %d, request %d: Lua status %d, Go admitted %v", step, r, out[0], want.admitted)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d, bucket %s: Lua-state verdict %+v, Go %+v", step, r, rq.key, got.verdicts[i], want.verdicts[i])
				}
				if !applied(reqs, want, i) {
					continue
				}
				if rq.quota == nil {
					if next[i] <= now {
						delete(rates, rq.key)
					} else {
						rates[rq.key] = storedBucket{next[i], rq.limit.interval}
					}
					continue
				}
				if rq.op == opAdjust && rq.period != (calendar.Period{}) && rq.period != want.verdicts[i].period {
					stats.over++
				}
				if next[i] > 0 {
					model[rq.key] = storedCount{want.verdicts[i].period, next[i]}
					writtenNow[rq.key], writtenAfter[rq.key] = now, 0
				} else {
					delete(model, rq.key)
				}
			}
			if reqs[0].op.admits() {
				if want.admitted {
					stats.admitted++
				} else {
					stats.denied++
				}
			}
		}
		// What Redis holds now: the model's counts, as encodeQuota writes
		// them, expiring a second after their period.
		after := redisMicros(t, client)
		for key, a := range writtenAfter {
			if a == 0 {
				writtenAfter[key] = after
			}
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				if rq.quota == nil {
					continue
				}
				m, found := model[rq.key]
				v, err := client.Get(ctx, rq.key).Result()
				margin := int64(quotaKeyMargin / time.Microsecond)
				switch {
				case err == redis.Nil && found && m.p.End+margin > after+500_000:
					t.Fatalf("step %d: quota %s: gone, the model holds %+v (now %d)", step, rq.key, m, now)
				case err == redis.Nil:
					delete(model, rq.key) // expired since its period ended
				case err != nil:
					t.Fatal(err)
				case !found:
					t.Fatalf("step %d: quota %s holds %q, the model nothing", step, rq.key, v)
				case v != encodeQuota(m.p, m.used):
					t.Fatalf("step %d: quota %s holds %q, the model %q", step, rq.key, v, encodeQuota(m.p, m.used))
				default:
					// It expires a second after its period, give or take the
					// rounding of TTLs to whole ms (when set, and in PTTL) and
					// the time from the script's TIME to its SET.
					pttl, err := client.PTTL(ctx, rq.key).Result()
					read := redisMicros(t, client)
					most := m.p.End + margin - after + 2000 + (writtenAfter[rq.key] - writtenNow[rq.key])
					least := m.p.End + margin - read - 2000
					if err != nil || pttl == -1 || pttl.Microseconds() > most || pttl.Microseconds() < least {
						t.Fatalf("step %d: quota %s: TTL %v (%v), want from %d to %d µs (its period ends in %d µs)", step, rq.key, pttl, err, least, most, m.p.End-now)
					}
				}
			}
		}
	}
	if stats.admitted < 500 || stats.denied < 500 || stats.clock < 50 || stats.otherPeriod < 100 || stats.over < 50 ||
		stats.picked[0] < 100 || stats.picked[2] < 100 {
		t.Fatalf("sequence exercised too little: %+v", stats)
	}
	t.Logf("3000 calls: %d requests admitted, %d denied, %d with Redis's clock outside the bounds; periods picked %v (before, middle, after); "+
		"%d counts of another period read as 0; %d charges of a period that was over dropped: identical in Lua and Go",
		stats.admitted, stats.denied, stats.clock, stats.picked, stats.otherPeriod, stats.over)
}

// TestLuaQuotaCalendar holds the script's choice of period to the boundary
// table (calendartest.Cases): each row's bounds, computed in its zone around its
// instant, are sent as if that instant were a second after the period's
// start, a second before its end, a second into the next period or the
// previous one, or a second outside all three; the period Redis picks on
// its own clock, through the store as requests use it, is the row's.
func TestLuaQuotaCalendar(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	checked := 0
	for ci, c := range calendartest.Cases {
		unit, err := calendar.ParseUnit(c.Unit)
		if err != nil {
			t.Fatal(err)
		}
		loc := calendartest.Zone(t, c.Zone)
		b := calendar.BoundsAt(unit, loc, calendartest.Instant(t, c.At))
		if b.Period(1) != (calendar.Period{Start: calendartest.Instant(t, c.Start).UnixMicro(), End: calendartest.Instant(t, c.End).UnixMicro()}) {
			t.Fatalf("%s: bounds %v do not hold the row's period", c.Name, b)
		}
		for pi, probe := range []struct {
			x    int64
			want int // the period index, -1: outside
		}{
			{b[1] + sec, 1}, {b[2] - sec, 1}, {b[2] + sec, 2}, {b[1] - sec, 0}, {b[0] + sec, 0}, {b[3] - sec, 2},
			{b[0] - sec, -1}, {b[3] + sec, -1},
		} {
			r := redisMicros(t, client)
			shift := r - probe.x // Redis's clock, read as the probe
			var moved calendar.Bounds
			for i := range b {
				moved[i] = b[i] + shift
			}
			key := fmt.Sprintf("rl:cal:{%d-%d}", ci, pi)
			rq := bucketRequest{key: key, limit: limit{burst: 10}, op: opTake, cost: 1,
				quota: &quotaSpec{periods: fixedBounds(moved), name: "cal"}}
			d, err := rs.decide(ctx, []bucketRequest{rq})
			if took := redisMicros(t, client) - r; took > 900_000 {
				t.Fatalf("%s: the call took %d µs: the probe may have crossed a boundary", c.Name, took)
			}
			if probe.want < 0 {
				var bad *badBucketError
				if !errors.As(err, &bad) || bad.kind != "clock" {
					t.Fatalf("%s, probe %d outside the bounds: %+v %v, want a clock error", c.Name, pi, d, err)
				}
				continue
			}
			if err != nil || !d.admitted {
				t.Fatalf("%s, probe %d: %+v %v", c.Name, pi, d, err)
			}
			got := d.verdicts[0].period
			if want := b.Period(probe.want); got.Start-shift != want.Start || got.End-shift != want.End {
				g, w := calendar.Period{Start: got.Start - shift, End: got.End - shift}.Text(loc), want.Text(loc)
				t.Fatalf("%s, probe %d: Redis picked [%s, %s), want [%s, %s)", c.Name, pi, g.StartZone, g.EndZone, w.StartZone, w.EndZone)
			}
			if v := client.Get(ctx, key).Val(); v != encodeQuota(got, 1) {
				t.Fatalf("%s, probe %d: stored %q, want %q", c.Name, pi, v, encodeQuota(got, 1))
			}
			checked++
		}
	}
	t.Logf("%d rows of the boundary table, %d probes in their periods, the script's choice identical to Go's", len(calendartest.Cases), checked)
}

// TestLuaQuotaKeys: a quota's count lands in Redis as "q:<start>:<end>:<used>"
// under its key, expiring a second after its period; a request that matches
// a rate policy and a quota is decided all-or-nothing; a key of another
// kind is replaced (a rate bucket or slots left by an earlier config) or
// fails alone (a hash, a string that is neither); and a quota's count
// under a rate policy's key is replaced.
func TestLuaQuotaKeys(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	now := redisMicros(t, client)
	cur := calendar.Period{Start: now - 10*sec, End: now + 50*sec}
	q := &quotaSpec{periods: fixedBounds{cur.Start - 60*sec, cur.Start, cur.End, cur.End + 60*sec}, name: "q"}
	quota := func(key string, n, cost int64) bucketRequest {
		return bucketRequest{key: key, limit: limit{burst: n}, op: opTake, cost: cost, quota: q}
	}
	rateLimit := limit{interval: 1_000_000, burst: 2}
	rate := func(key string) bucketRequest { return bucketRequest{key: key, limit: rateLimit, op: opTake, cost: 1} }
	decide := func(reqs ...bucketRequest) (decision, error) { return rs.decide(ctx, reqs) }

	d, err := decide(quota("rl:q:{a}", 5, 3))
	if err != nil || !d.admitted || d.verdicts[0].remaining != 2 || d.verdicts[0].period != cur {
		t.Fatalf("first take of 3 of 5: %+v %v", d, err)
	}
	if v := client.Get(ctx, "rl:q:{a}").Val(); v != encodeQuota(cur, 3) {
		t.Fatalf("stored %q, want %q", v, encodeQuota(cur, 3))
	}
	if pttl := client.PTTL(ctx, "rl:q:{a}").Val(); pttl < 50*time.Second || pttl > 51*time.Second+10*time.Millisecond {
		t.Fatalf("TTL %v, want the period's 50 s left and a second", pttl)
	}
	// All or nothing, both ways.
	if d, _ := decide(quota("rl:q:{a}", 5, 3), rate("rl:r:{a}")); d.admitted || d.verdicts[0].allowed || !d.verdicts[1].allowed {
		t.Fatalf("quota short, rate free: %+v", d)
	}
	if n := client.Exists(ctx, "rl:r:{a}").Val(); n != 0 {
		t.Fatal("the rate bucket was charged by a request the quota denied")
	}
	decide(rate("rl:r:{b}"))
	decide(rate("rl:r:{b}"))
	if d, _ := decide(quota("rl:q:{a}", 5, 1), rate("rl:r:{b}")); d.admitted || !d.verdicts[0].allowed {
		t.Fatalf("quota free, rate empty: %+v", d)
	}
	if v := client.Get(ctx, "rl:q:{a}").Val(); v != encodeQuota(cur, 3) {
		t.Fatalf("the quota was charged by a request the rate denied: %q", v)
	}
	// Keys of other kinds.
	client.Set(ctx, "rl:q:{rate}", "1764620000123456:600000", 0)
	client.ZAdd(ctx, "rl:q:{slots}", redis.Z{Score: 1, Member: "lease"})
	client.HSet(ctx, "rl:q:{hash}", "x", "1")
	client.Set(ctx, "rl:q:{garbage}", "not a count", 0)
	client.Set(ctx, "rl:r:{quota}", encodeQuota(cur, 5), 0)
	for key, want := range map[string]string{"rl:q:{rate}": encodeQuota(cur, 1), "rl:q:{slots}": encodeQuota(cur, 1)} {
		if d, err := decide(quota(key, 5, 1)); err != nil || !d.admitted || d.verdicts[0].remaining != 4 {
			t.Fatalf("%s: %+v %v", key, d, err)
		}
		if v := client.Get(ctx, key).Val(); v != want {
			t.Fatalf("%s: %q, want replaced by %q", key, v, want)
		}
	}
	for key, kind := range map[string]string{"rl:q:{hash}": "wrongtype", "rl:q:{garbage}": "corrupt"} {
		_, err := decide(quota(key, 5, 1))
		var bad *badBucketError
		if !errors.As(err, &bad) || bad.kind != kind || bad.key != key {
			t.Fatalf("%s: %v, want a %s error naming the key", key, err, kind)
		}
	}
	if d, err := decide(rate("rl:r:{quota}")); err != nil || !d.admitted || d.verdicts[0].remaining != 1 {
		t.Fatalf("a rate bucket over a quota's count: %+v %v", d, err)
	}
	// Redis's clock outside the bounds: that request alone fails.
	behind := &quotaSpec{periods: fixedBounds{now - 4*sec, now - 3*sec, now - 2*sec, now - sec}, name: "q"}
	p1 := &pending{reqs: []bucketRequest{{key: "rl:q:{c}", limit: limit{burst: 5}, op: opTake, cost: 1, quota: behind}}}
	p2 := &pending{reqs: []bucketRequest{quota("rl:q:{d}", 5, 1)}}
	rs.conn.call([]*pending{p1, p2})
	if errorKind(p1.err) != "clock" || p2.err != nil || !p2.d.admitted || client.Exists(ctx, "rl:q:{c}").Val() != 0 {
		t.Fatalf("a clock outside the bounds: %v; its neighbour: %+v %v", p1.err, p2.d, p2.err)
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
