package ratelimit

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar/calendartest"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/shed"
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
	rs.call([]*pending{p1, p2})
	if errorKind(p1.err) != "clock" || p2.err != nil || !p2.d.admitted || client.Exists(ctx, "rl:q:{c}").Val() != 0 {
		t.Fatalf("a clock outside the bounds: %v; its neighbour: %+v %v", p1.err, p2.d, p2.err)
	}
}

// TestLuaMatchesGoBucket drives the same random request sequences through
// lua/decide.lua on a real Redis and through the Go algorithm (fed the
// script's own clock), and requires identical decisions, stored state,
// remaining tokens and waits, and TTLs that end no later than the bucket is
// full again. Requests take, check, adjust (charges into debt and refunds),
// inspect and reset, under limits that change from request to request (as
// a reload changes them: the state is rebased); calls carry one to four
// requests, which may share buckets, as coalesced calls do: the script
// decides them in order. It runs the script as Redis 7 runs it (a missing
// key created by SET NX GET, undone when the request is denied) and as
// older Redis runs it (GET, then SET). The buckets of two of the policies
// learn their usage (learned_usage.go): their settles remember usage, their
// takes are raised to it, their resets forget it, and the memory Redis
// keeps beside the bucket is the one the Go model keeps, as Go writes it.
func TestLuaMatchesGoBucket(t *testing.T) {
	_, client, _ := newTestRedis(t)
	// Redis 6.2 (REDIS_SERVER) has no SET NX GET: only the other path runs.
	setGet, err := client.Eval(context.Background(), "return "+setGetProbe, nil).Bool()
	if err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	if !strings.Contains(decideLua, setGetProbe) {
		t.Fatalf("decide.lua no longer chooses its path with %q", setGetProbe)
	}
	getThenSet := strings.Replace(decideLua, setGetProbe, "false", 1)
	for _, format := range []int{formatV1, formatV2} {
		t.Run("SET NX GET, "+formatName(format), func(t *testing.T) {
			if !setGet {
				t.Skip("the server is older than Redis 7.0: SET takes no NX and GET together, and the script does not use them")
			}
			luaMatchesGoBucket(t, client, decideLua, format, tokenShapes)
		})
		client.FlushAll(context.Background())
		t.Run("GET then SET, "+formatName(format), func(t *testing.T) {
			luaMatchesGoBucket(t, client, getThenSet, format, tokenShapes)
		})
		client.FlushAll(context.Background())
	}
	// Calls of one request of one bucket, many of them lone takes, which
	// the script decides before its main loop: in both formats and on both
	// paths between them.
	t.Run("lone calls, SET NX GET, v2", func(t *testing.T) {
		if !setGet {
			t.Skip("the server is older than Redis 7.0: SET takes no NX and GET together, and the script does not use them")
		}
		luaMatchesGoBucket(t, client, decideLua, formatV2, loneShapes)
	})
	client.FlushAll(context.Background())
	t.Run("lone calls, GET then SET, v1", func(t *testing.T) { luaMatchesGoBucket(t, client, getThenSet, formatV1, loneShapes) })
	client.FlushAll(context.Background())
}

// setGetProbe is how decide.lua chooses between SET ... NX GET (Redis
// 7.0 and later) and GET then SET: a test replaces it with "false" to run
// the other path on any server.
const setGetProbe = "redis.REDIS_VERSION_NUM ~= nil"

// TestLuaMatchesGoMoney is TestLuaMatchesGoBucket with money policies'
// buckets (unit usd): micro-dollars, so intervals of a few µs to an hour,
// bursts up to thousands of dollars, and costs, refunds and debts of up to
// a dollar a request. The script decides them as Go does, to the
// micro-dollar.
func TestLuaMatchesGoMoney(t *testing.T) {
	_, client, _ := newTestRedis(t)
	for _, format := range []int{formatV1, formatV2} {
		t.Run(formatName(format), func(t *testing.T) { luaMatchesGoBucket(t, client, decideLua, format, moneyShapes) })
		client.FlushAll(context.Background())
	}
}

// bucketShapes are what luaMatchesGoBucket's buckets are: each policy's
// two limits (as two configs before and after a reload may give it), and
// the largest cost and adjustment of a request.
type bucketShapes struct {
	limits       [][2]limit
	costs, delta int64
	steps        int  // script calls; 0: 3,000
	lone         bool // every call one request of one bucket
}

// tokenShapes are token policies' buckets.
var tokenShapes = bucketShapes{limits: [][2]limit{
	{{interval: 1000, burst: 5}, {interval: 500, burst: 8}},                             // 1000/1s burst 5, then 2000/1s burst 8
	{{interval: 20_000, burst: 3, slack: 60_000}, {interval: 20_000, burst: 2}},         // 50/1s with wait, then a lower burst
	{{interval: 333_333, burst: 10, slack: 3_333_330}, {interval: 1_000_000, burst: 4}}, // 3/1s with debt, then 1/1s
	{{interval: 600_000, burst: 100}, {interval: 10_000, burst: 100}},                   // 100/1m, then 100/1s
	{{interval: 1, burst: 1_000_000}, {interval: 1, burst: 1_000_000}},                  // the fastest allowed
	{{interval: 86_400_000_000, burst: 1}, {interval: 60_000_000, burst: 3}},            // 1/1d, then 1/1m burst 3
}, costs: 3, delta: 4}

// loneShapes are tokenShapes' buckets taken one request a call.
var loneShapes = bucketShapes{limits: tokenShapes.limits, costs: tokenShapes.costs, delta: tokenShapes.delta, lone: true}

// moneyShapes are money policies' buckets, in micro-dollars.
var moneyShapes = bucketShapes{limits: [][2]limit{
	{{interval: 720, burst: 5_000_000}, {interval: 1200, burst: 3_000_000}},                                  // $5/1h, then $3/1h
	{{interval: 17_280, burst: 5_000_000, slack: 17_280 * 10_000_000}, {interval: 17_280, burst: 1_500_000}}, // $5/24h with $10 of debt, then a $1.50 burst
	{{interval: 2400, burst: 1_500_000, slack: 2400 * 3_000_000}, {interval: 57_600, burst: 1_500_000}},      // $1.50/1h with debt, then $1.50/24h
	{{interval: 1, burst: 1_000_000_000}, {interval: 1, burst: 1_000_000}},                                   // $1/s (the fastest) burst $1,000, then $1
	{{interval: 3_600_000_000, burst: 1}, {interval: 8_640_000, burst: 100_000_000}},                         // $0.000001/1h, then $1/2400h burst $100
	{{interval: 72, burst: 50_000_000}, {interval: 36, burst: 100_000_000}},                                  // $50/1h, then $100/1h
}, costs: 1_000_000, delta: 1_000_000, steps: 1500}

// parseStored reads a bucket as the script stores it, in any format, and
// checks that it is written as encodeBucket writes it in format.
func parseStored(t *testing.T, v string, format int) storedBucket {
	t.Helper()
	tat, interval, ok := decodeBucket(v, 0)
	if !ok || interval == 0 {
		t.Fatalf("stored bucket %q is not a bucket", v)
	}
	if want := encodeBucket(tat, interval, format); v != want {
		t.Fatalf("stored bucket %q, Go writes %q in format %s", v, want, formatName(format))
	}
	return storedBucket{tat, interval}
}

// luaMatchesGoBucket runs random calls through script, and checks each
// reply and what Redis holds after it against the Go algorithm; with
// shapes.lone every call is one request of one bucket (the script decides
// a lone take before its main loop).
func luaMatchesGoBucket(t *testing.T, client *redis.Client, script string, format int, shapes bucketShapes) {
	lone := shapes.lone
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))

	// Each policy has two limits, as two configs before and after a
	// reload may give it.
	limits := shapes.limits
	ops := []bucketOp{opTake, opTake, opTake, opTake, opTake, opCheck, opAdjust, opAdjust, opInspect}
	learns := func(li int) bool { return li == 2 || li == 3 } // settle policies
	var lastNow int64                                         // Redis's clock in the last call
	var model map[string]storedBucket                         // the Go side's own state
	randomRequest := func() []bucketRequest {
		if rng.IntN(40) == 0 { // an operator's reset
			li := rng.IntN(len(limits))
			return []bucketRequest{{key: fmt.Sprintf("rl:p%d:{id%d}", li, rng.IntN(3)), limit: limits[li][rng.IntN(2)], op: opReset, learns: learns(li)}}
		}
		op := ops[rng.IntN(len(ops))]
		n := 1 + rng.IntN(3)
		if !op.admits() || lone {
			n = 1 // adjustments and reads go alone, as after a response
		}
		var reqs []bucketRequest
		used := map[string]bool{}
		for len(reqs) < n {
			li := rng.IntN(len(limits))
			key := fmt.Sprintf("rl:p%d:{id%d}", li, rng.IntN(3))
			if used[key] {
				continue
			}
			used[key] = true
			l := limits[li][0]
			if rng.IntN(10) == 0 {
				l = limits[li][1]
			}
			rq := bucketRequest{key: key, limit: l, op: op, learns: learns(li)}
			switch op {
			case opTake, opCheck:
				rq.cost = 1 + rng.Int64N(shapes.costs)
				if rng.IntN(20) == 0 {
					rq.cost = l.burst + 1 // can never pass
				}
				rq.shadow = rng.IntN(5) == 0
				if op == opTake && !rq.shadow && l.slack > 0 && rng.IntN(2) == 0 {
					rq.wait = rng.Int64N(l.slack + 1) // may reserve a future turn
				}
				if op == opTake && rng.IntN(3) == 0 {
					op = opCheck // a charge_if policy beside a rate one
					rq.op = opCheck
				}
			case opAdjust:
				rq.delta = rng.Int64N(2*shapes.delta+1) - shapes.delta // a charge after the response, or a refund
				if rq.delta == 0 {
					rq.delta = 3
				}
				if rq.learns {
					rq.class = 1 + rng.Int64N(3) // the class of the settled request's reservation
					if shapes.costs > 3 {
						// Of a reservation as the takes draw them (money's
						// are µ$: classes up to 20), or no take would be
						// raised by what its class learned.
						rq.class = reservationClass(1 + rng.Int64N(shapes.costs))
					}
					if rng.IntN(3) == 0 {
						rq.record = 1 + rng.Int64N(2*l.burst) // a settle beyond its own reservation
					}
				}
				if rq.delta < 0 && rng.IntN(3) > 0 {
					// A give-back of tokens due around the bucket's TAT, or
					// around Redis's clock: some still due, some not.
					due := model[key].tat
					if due == 0 || rng.IntN(3) == 0 {
						due = lastNow
					}
					rq.due = max(1, due+(rng.Int64N(9)-5)*l.interval/2)
					if rng.IntN(2) == 0 {
						rq.due = -rq.due // a hot key's block: only while no token was taken after it
					}
				}
			}
			reqs = append(reqs, rq)
		}
		return reqs
	}
	model = map[string]storedBucket{}
	learnedModel := map[string]learnedUsage{}
	var raised, remembered int
	writtenIn := map[string]int{} // the step that last wrote a bucket
	// The longest call (µs from its TIME to Redis's clock after it) of
	// those that touched a bucket since the one that last wrote it: any of
	// them may have set its TTL, as a call may rewrite a bucket it only
	// reads (a changed limit); beside two CPU hogs, the call that wrote it
	// was once not the longest (TTL 15 ms for a TAT 12.1 ms ahead, slack
	// 2.2 ms).
	callSlack := map[string]int64{}
	var admitted, denied, requests, rebased, compact int
	var loneTakes, loneHeld, loneDenied int // lone takes: all, of a key holding a TAT ahead, denied
	steps := shapes.steps
	if steps == 0 {
		steps = 3000
	}
	for step := range steps {
		batch := make([][]bucketRequest, 1+rng.IntN(4))
		if lone {
			batch = batch[:1]
		}
		for r := range batch {
			batch[r] = randomRequest()
		}
		loneTake := lone && batch[0][0].op == opTake && !batch[0][0].learns
		heldBefore := model[batch[0][0].key].tat
		res, err := evalScriptFormat(ctx, client, script, format, batch...)
		if err != nil {
			t.Fatalf("step %d: script: %v", step, err)
		}
		now, off := res[0], 1
		lastNow = now
		if loneTake {
			loneTakes++
			if heldBefore > now {
				loneHeld++
			}
			if res[1] != scriptAdmitted {
				loneDenied++
			}
		}
		pb := make([]*pending, len(batch))
		for r, reqs := range batch {
			pb[r] = &pending{reqs: reqs}
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			tats := make([]int64, len(reqs))
			lv := make([]int64, len(reqs))
			for i, at := 0, 1; i < len(reqs); i++ {
				rq := reqs[i]
				b := model[rq.key]
				tats[i] = rq.limit.rebase(b.tat, b.interval, now)
				if b.tat > now && b.interval != rq.limit.interval {
					rebased++
				}
				if got := start(out[at+1], now); got != start(tats[i], now) { // rate buckets: allowed, TAT [, learned]
					t.Fatalf("step %d, request %d: bucket %s: Redis held TAT %d, Go %d (now %d)", step, r, rq.key, out[at+1], tats[i], now)
				}
				at += replyWidthOf(rq)
				if rq.learns {
					l := learnedModel[rq.key]
					if rq.op == opTake {
						lv[i] = l.raise(reservationClass(rq.cost), rq.cost)
					} else {
						lv[i] = l.most()
					}
				}
			}
			decided := withLearned(reqs, lv)
			want, next := decideBuckets(tats, now, decided)
			for i, rq := range reqs {
				if rq.learns {
					want.verdicts[i].learned = lv[i]
				}
				if decided[i].cost != rq.cost {
					raised++
				}
			}
			if want.admitted != (out[0] == scriptAdmitted) {
				t.Fatalf("step %d, request %d: Lua status %d, Go admitted %v", step, r, out[0], want.admitted)
			}
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s: Lua-state verdict %+v, Go %+v", step, r, rq.key, got.verdicts[i], want.verdicts[i])
				}
				switch {
				case !applied(reqs, want, i):
				case next[i] <= now:
					delete(model, rq.key)
				default:
					model[rq.key] = storedBucket{next[i], rq.limit.interval}
					writtenIn[rq.key] = step
				}
				switch {
				case !rq.learns:
				case rq.op == opReset:
					delete(learnedModel, rq.key)
				case rq.op == opAdjust:
					l := learnedModel[rq.key]
					if l.push(rq.class, rq.record) {
						learnedModel[rq.key] = l
						remembered++
					}
				}
			}
			if reqs[0].op.admits() {
				if want.admitted {
					admitted++
				} else {
					denied++
				}
			}
			requests++
		}
		if off != len(res) || decodeReply(res, pb) != nil {
			t.Fatalf("step %d: reply of %d numbers for %d requests", step, len(res), len(batch))
		}
		// Redis's clock once the call is over: TTLs are counted from a time
		// Redis takes within the call, after the script read TIME (by up to
		// the call's length, which a loaded machine stretches).
		after, err := client.Time(ctx).Result()
		if err != nil {
			t.Fatal(err)
		}
		callLength := after.UnixMicro() - now
		for _, reqs := range batch {
			for _, rq := range reqs {
				if writtenIn[rq.key] == step {
					callSlack[rq.key] = callLength
				} else {
					callSlack[rq.key] = max(callSlack[rq.key], callLength)
				}
			}
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				if !rq.learns {
					continue
				}
				v, err := client.Get(ctx, rq.key+learnedSuffix).Result()
				if err == redis.Nil {
					v = ""
				} else if err != nil {
					t.Fatal(err)
				}
				if want := encodeLearned(learnedModel[rq.key]); v != want || decodeLearned(v) != learnedModel[rq.key] && want != "" {
					t.Fatalf("step %d: %s%s holds %q, Go %q", step, rq.key, learnedSuffix, v, want)
				}
				if pttl, err := client.PTTL(ctx, rq.key+learnedSuffix).Result(); v != "" && (err != nil || pttl <= 0 || pttl > learnTTL) {
					t.Fatalf("step %d: %s%s: TTL %v (%v), want at most %v", step, rq.key, learnedSuffix, pttl, err, learnTTL)
				}
			}
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				v, err := client.Get(ctx, rq.key).Result()
				if err == redis.Nil {
					// Expired since: Redis expires a key no earlier than its TAT.
					after, err := client.Time(ctx).Result()
					if err != nil {
						t.Fatal(err)
					}
					if model[rq.key].tat > after.UnixMicro() {
						t.Fatalf("step %d: bucket %s: gone at %d, before its TAT %d", step, rq.key, after.UnixMicro(), model[rq.key].tat)
					}
					continue
				} else if err != nil {
					t.Fatal(err)
				}
				stored, want := parseStored(t, v, format), model[rq.key]
				if format == formatV2 && intervalCode(stored.interval) != 0 {
					compact++
				}
				if start(stored.tat, now) != start(want.tat, now) || stored.tat > now && stored.interval != want.interval {
					t.Fatalf("step %d: bucket %s: Redis stored %+v after the call, Go %+v", step, rq.key, stored, want)
				}
				// A live key expires once its bucket is full again, not later
				// (give or take the 2 ms of rounding TTLs to whole ms twice:
				// when set, and in PTTL, and the length of the call that set
				// it: callSlack). PTTL: -1 no expiry, -2 gone since.
				slack := 2000 + callSlack[rq.key]
				if pttl, err := client.PTTL(ctx, rq.key).Result(); err != nil || pttl == -1 ||
					pttl.Microseconds() > max(stored.tat-now, 0)+slack {
					t.Fatalf("step %d: bucket %s: TTL %v (%v) for TAT %d µs ahead (slack %d µs)", step, rq.key, pttl, err, stored.tat-now, slack)
				}
			}
		}
		if rng.IntN(50) == 0 {
			time.Sleep(time.Duration(rng.IntN(30)) * time.Millisecond) // let buckets refill
		}
	}
	if admitted < 500 || denied < 500 || rebased < 100 || format == formatV2 && compact < 500 || raised < 100 || remembered < 100 ||
		lone && (loneTakes < 500 || loneHeld < 200 || loneDenied < 100) {
		t.Fatalf("sequence exercised too little: %d admitted, %d denied, %d rebased, %d stored compact, %d raised to a learned usage, %d usages remembered; %d lone takes, %d of a key holding a TAT ahead, %d denied",
			admitted, denied, rebased, compact, raised, remembered, loneTakes, loneHeld, loneDenied)
	}
	t.Logf("%d requests in %d calls: %d admitted, %d denied, %d buckets read against a changed limit, %d stored in v2, %d takes raised to a learned usage, %d usages remembered; %d lone takes, %d of a key holding a TAT ahead, %d denied; identical in Lua and Go",
		requests, steps, admitted, denied, rebased, compact, raised, remembered, loneTakes, loneHeld, loneDenied)
}

// TestLuaSlots: concurrency slots in lua/decide.lua, against the Go
// decision: at most N leases held; a request denied by any policy takes no
// slot and charges no bucket, and one denied a slot charges nothing;
// releasing from a full set announces it; an unrenewed lease expires and
// is counted; renewing a lease that expired says so; a key of another type
// fails alone, except a rate bucket left by an earlier config, replaced.
func TestLuaSlots(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	slots := limit{interval: 200_000, burst: 2} // 2 slots, leases of 200 ms
	acquire := func(key, lease string) bucketRequest {
		return bucketRequest{key: key, limit: slots, op: opAcquire, cost: 1, lease: lease, events: "rl:events"}
	}
	decide := func(reqs ...bucketRequest) decision {
		t.Helper()
		d, err := rs.decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	if d := decide(acquire("rl:s:{a}", "l1")); !d.admitted || d.verdicts[0].remaining != 1 {
		t.Fatalf("first slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{a}", "l2")); !d.admitted || d.verdicts[0].remaining != 0 {
		t.Fatalf("second slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{a}", "l3")); d.admitted || d.verdicts[0].allowed || d.verdicts[0].untilFits != slotWait {
		t.Fatalf("third slot of 2: %+v, want denied", d)
	}
	// All or nothing: a full set of slots leaves the rate bucket uncharged,
	// and an empty rate bucket leaves the slot untaken.
	rate := bucketRequest{key: "rl:r:{a}", limit: limit{interval: 1_000_000, burst: 1}, op: opTake, cost: 1}
	if d := decide(acquire("rl:s:{a}", "l4"), rate); d.admitted || !d.verdicts[1].allowed {
		t.Fatalf("slot full, rate free: %+v", d)
	}
	if d := decide(rate); !d.admitted {
		t.Fatalf("the rate bucket was charged by a request denied a slot: %+v", d)
	}
	if d := decide(acquire("rl:s:{b}", "l5"), rate); d.admitted || !d.verdicts[0].allowed {
		t.Fatalf("rate empty, slot free: %+v", d)
	}
	if n := client.ZCard(ctx, "rl:s:{b}").Val(); n != 0 {
		t.Fatalf("%d slots taken by a request the rate policy denied", n)
	}
	// Releasing from a full set announces it to every instance.
	sub := client.Subscribe(ctx, "rl:events")
	defer sub.Close()
	if _, err := sub.Receive(ctx); err != nil {
		t.Fatal(err)
	}
	rel := acquire("rl:s:{a}", "l1")
	rel.op = opRelease
	decide(rel)
	select {
	case msg := <-sub.Channel():
		if msg.Payload != "freed rl:s:{a}" {
			t.Fatalf("announced %q", msg.Payload)
		}
	case <-time.After(2 * time.Second):
		t.Fatal("no announcement of a slot freed from a full set")
	}
	// l2 is not renewed: it expires, and the next read reclaims it.
	renew := acquire("rl:s:{a}", "l2")
	renew.op = opRenew
	time.Sleep(250 * time.Millisecond)
	if d := decide(renew); d.verdicts[0].allowed {
		t.Fatalf("renewing an expired lease: %+v, want not held", d)
	}
	d := decide(acquire("rl:s:{a}", "l6"), acquire("rl:s:{a}", "l7"))
	if !d.admitted {
		t.Fatalf("after the leases expired: %+v", d)
	}
	held := acquire("rl:s:{a}", "l6")
	held.op = opRenew
	if d := decide(held); !d.verdicts[0].allowed {
		t.Fatalf("renewing a held lease: %+v", d)
	}
	// Another type under the key: a hash fails alone; a rate bucket of an
	// earlier config is replaced.
	client.HSet(ctx, "rl:s:{hash}", "x", "1")
	client.Set(ctx, "rl:s:{old}", "1:1000", 0)
	p := &pending{reqs: []bucketRequest{acquire("rl:s:{hash}", "l8")}}
	q := &pending{reqs: []bucketRequest{acquire("rl:s:{old}", "l9")}}
	rs.call([]*pending{p, q})
	if errorKind(p.err) != "wrongtype" || q.err != nil || !q.d.admitted {
		t.Fatalf("a hash: %v; an old rate bucket: %+v %v", p.err, q.d, q.err)
	}
}

// countedLeases counts what leasesExpired is given.
type countedLeases struct{ n atomic.Int64 }

func (c *countedLeases) Add(v float64) { c.n.Add(int64(v)) }

// TestLuaSlotsFaults: a restore puts back a lease the store lost; a reset
// (free) keeps the leases of running requests and drops the stale ones;
// expired leases are counted by whatever op finds them: a denied acquire, a
// renewal, a count.
func TestLuaSlotsFaults(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	slots := limit{interval: 10_000_000, burst: 2} // 2 slots, leases of 10 s
	expired := &countedLeases{}
	op := func(o bucketOp, key, lease string) bucketRequest {
		return bucketRequest{key: key, limit: slots, op: o, lease: lease, events: "rl:events", leasesExpired: expired}
	}
	decide := func(reqs ...bucketRequest) decision {
		t.Helper()
		d, err := rs.decide(ctx, reqs)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	decide(op(opAcquire, "rl:s:{f}", "a"))
	client.Del(ctx, "rl:s:{f}") // as a FLUSHALL would
	if d := decide(op(opRenew, "rl:s:{f}", "a")); d.verdicts[0].allowed {
		t.Fatalf("renewing a lost lease: %+v, want not held", d)
	}
	decide(op(opRestore, "rl:s:{f}", "a"))
	if d := decide(op(opRenew, "rl:s:{f}", "a")); !d.verdicts[0].allowed {
		t.Fatalf("renewing a restored lease: %+v, want held", d)
	}
	// Free: a lease with 9 s left is a running request's; one with 1 s left
	// was not renewed for most of its lease: stale.
	now := time.Now().UnixMicro()
	client.ZAdd(ctx, "rl:s:{f}", redis.Z{Score: float64(now + 1_000_000), Member: "stale"})
	free := op(opFree, "rl:s:{f}", "")
	free.delta = slots.interval / staleAfter
	if d := decide(free); d.verdicts[0].remaining != 1 || d.verdicts[0].expired != 1 {
		t.Fatalf("reset: %+v, want 1 running kept (1 free) and 1 stale dropped", d)
	}
	if members := client.ZRange(ctx, "rl:s:{f}", 0, -1).Val(); len(members) != 1 || members[0] != "a" {
		t.Fatalf("after the reset the slots hold %v, want [a]", members)
	}
	expired.n.Store(0)
	// Expired leases, found by a denied acquire, a renewal and a count.
	past := float64(now - 1_000_000)
	for _, key := range []string{"rl:s:{d}", "rl:s:{r}", "rl:s:{c}"} {
		client.ZAdd(ctx, key, redis.Z{Score: past, Member: "gone"}, redis.Z{Score: float64(now + 9_000_000), Member: "x"}, redis.Z{Score: float64(now + 9_000_000), Member: "y"})
	}
	client.ZAdd(ctx, "rl:s:{d}", redis.Z{Score: float64(now + 9_000_000), Member: "z"}) // still full without "gone"
	if d := decide(op(opAcquire, "rl:s:{d}", "new")); d.admitted {
		t.Fatalf("acquire on a full set: %+v", d)
	}
	decide(op(opRenew, "rl:s:{r}", "x"))
	decide(op(opCount, "rl:s:{c}", ""))
	if n := expired.n.Load(); n != 3 {
		t.Fatalf("leases_expired counted %d, want 3 (a denied acquire, a renewal, a count)", n)
	}
}

// TestLuaMatchesGoOverrides drives random requests through lua/decide.lua,
// every bucket overridable, while overrides are set, changed and deleted
// beside the buckets between calls (valid ones of either kind, and values
// that are not overrides, which the script ignores as decodeOverride does),
// and through the Go algorithm under the same overrides (limitFor), and
// requires the same decisions, the same limits in the reply, the same
// verdicts and stored state.
func TestLuaMatchesGoOverrides(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	limits := []limit{
		{interval: 1000, burst: 5},
		{interval: 20_000, burst: 3, slack: 60_000},        // wait 60ms
		{interval: 333_333, burst: 10, slack: 6_666_660},   // settle: twice the burst of debt
		{interval: 600_000, burst: 100, slack: 1_000_000},  // wait 1s
		{interval: 86_400_000_000, burst: 1, slack: 0},     // 1/1d
		{interval: 100_000, burst: 20, slack: 100_000 * 7}, // settle max 7
	}
	rules := [][2]int64{{0, 0}, {60_000, 0}, {0, -2}, {1_000_000, 0}, {0, 0}, {0, 7}}
	values := []string{
		"o1 r 500 8", "o1 r 2000 2", "o1 r 100000 50", "o1 r 1000000 1", "o1 r 10 1000",
		"o1 c 0 4",                                                                    // another kind: ignored
		"o1 r 0 5", "garbage", "o1 r 12345678901234567 1", "o1 c 12345678901234567 4", // not overrides: ignored
	}
	keyOf := func(li, id int) string { return fmt.Sprintf("rl:p%d:{id%d}", li, id) }
	model := map[string]storedBucket{}
	overrides := map[string]override{} // the valid ones in force
	ops := []bucketOp{opTake, opTake, opTake, opCheck, opAdjust, opInspect}
	var requests, under, ignored int
	for step := range 2000 {
		if rng.IntN(4) == 0 { // an operator changes an override
			li, id := rng.IntN(len(limits)), rng.IntN(3)
			okey := overrideKey(keyOf(li, id))
			switch n := rng.IntN(len(values) + 2); {
			case n >= len(values):
				client.Del(ctx, okey)
				delete(overrides, keyOf(li, id))
			default:
				client.Set(ctx, okey, values[n], 0)
				if o, ok := decodeOverride(values[n]); ok {
					overrides[keyOf(li, id)] = o
				} else {
					delete(overrides, keyOf(li, id))
				}
			}
		}
		batch := make([][]bucketRequest, 1+rng.IntN(3))
		for r := range batch {
			op := ops[rng.IntN(len(ops))]
			n := 1 + rng.IntN(2)
			if !op.admits() {
				n = 1
			}
			used := map[string]bool{}
			for len(batch[r]) < n {
				li, id := rng.IntN(len(limits)), rng.IntN(3)
				if used[keyOf(li, id)] {
					continue
				}
				used[keyOf(li, id)] = true
				rq := bucketRequest{key: keyOf(li, id), limit: limits[li], op: op, cost: 1 + rng.Int64N(3),
					overridable: true, overrideWait: rules[li][0], overrideDebt: rules[li][1]}
				if op == opAdjust {
					rq.cost, rq.delta = 0, rng.Int64N(9)-4
				}
				if op == opTake && rng.IntN(2) == 0 {
					rq.wait = rules[li][0]
				}
				batch[r] = append(batch[r], rq)
			}
		}
		res, err := evalDecide(ctx, client, batch...)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		now, off := res[0], 1
		for r, reqs := range batch {
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			eff := append([]bucketRequest(nil), reqs...) // as decided: under the overrides

			tats := make([]int64, len(reqs))
			for i, rq := range reqs {
				if o, ok := overrides[rq.key]; ok {
					eff[i] = rq.applyOverride(o)
				}
				b := model[rq.key]
				tats[i] = eff[i].limit.rebase(b.tat, b.interval, now)
			}
			want, next := decideBuckets(tats, now, eff)
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s (override %+v): Lua verdict %+v, Go %+v", step, r, rq.key, overrides[rq.key], got.verdicts[i], want.verdicts[i])
				}
				if applied(eff, want, i) {
					if next[i] <= now {
						delete(model, rq.key)
					} else {
						model[rq.key] = storedBucket{next[i], eff[i].limit.interval}
					}
				}
			}
			requests += len(reqs)
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				if _, ok := overrides[rq.key]; ok {
					under++
				} else if v, err := client.Get(ctx, overrideKey(rq.key)).Result(); err == nil && v != "" {
					ignored++
				}
				v, err := client.Get(ctx, rq.key).Result()
				if err == redis.Nil {
					continue
				} else if err != nil {
					t.Fatal(err)
				}
				stored, want := parseStored(t, v, formatV1), model[rq.key]
				if start(stored.tat, now) != start(want.tat, now) || stored.tat > now && stored.interval != want.interval {
					t.Fatalf("step %d: bucket %s: Redis stored %+v, Go %+v", step, rq.key, stored, want)
				}
			}
		}
		if rng.IntN(50) == 0 {
			time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
		}
	}
	if under < 500 || ignored < 100 {
		t.Fatalf("too little exercised: %d buckets decided under an override, %d beside a value ignored", under, ignored)
	}
	t.Logf("%d bucket operations: %d under an override, %d beside a value that is not one (ignored); identical in Lua and Go", requests, under, ignored)
}

// TestLuaMatchesGoQuotaOverrides drives random requests through
// lua/decide.lua on quota buckets that are all overridable, while an
// operator sets, changes and deletes their overrides between calls (quota
// overrides that raise or lower N below the units used, overrides of
// another kind and values that are not overrides, which a quota ignores),
// and through the Go algorithm under the same overrides (quotaLimitFor);
// it requires the same decisions, the same limits in the reply, the same
// verdicts and the same counts stored.
func TestLuaMatchesGoQuotaOverrides(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(23, 24))
	t0 := redisMicros(t, client)
	// One period, from half an hour before the test to an hour after it:
	// this test is about limits, TestLuaMatchesGoQuota about periods.
	spec := &quotaSpec{periods: fixedBounds{t0 - 3600*sec, t0 - 1800*sec, t0 + 3600*sec, t0 + 7200*sec}, name: "q"}
	shapes := []struct {
		l    limit
		debt int64 // the policy's debt rule (debtRule)
	}{
		{limit{burst: 6}, 0},
		{limit{burst: 4, slack: 8}, -2}, // settle: twice the quota
		{limit{burst: 10, slack: 3}, 3}, // settle max 3
	}
	values := []string{
		"o1 q 0 2", "o1 q 0 9", "o1 q 0 20", "o1 q 0 1", "o1 q 5 3",
		"o1 r 500 8", "o1 c 0 4", // another kind: ignored
		"o1 q 0 0", "garbage", "o1 q 0 12345678901234567", // not overrides: ignored
	}
	keyOf := func(si, id int) string { return fmt.Sprintf("rl:q%d:{id%d}", si, id) }
	model := map[string]int64{}        // units used in the period
	overrides := map[string]override{} // the valid ones in force
	ops := []bucketOp{opTake, opTake, opTake, opCheck, opAdjust, opInspect, opReset}
	var requests, under, ignored, lowered, admitted, denied int
	for step := range 2000 {
		if rng.IntN(3) == 0 {
			si, id := rng.IntN(len(shapes)), rng.IntN(2)
			okey := overrideKey(keyOf(si, id))
			if n := rng.IntN(len(values) + 2); n >= len(values) {
				client.Del(ctx, okey)
				delete(overrides, keyOf(si, id))
			} else {
				client.Set(ctx, okey, values[n], 0)
				if o, ok := decodeOverride(values[n]); ok && o.kind == overrideQuota {
					overrides[keyOf(si, id)] = o
				} else {
					delete(overrides, keyOf(si, id))
				}
			}
		}
		batch := make([][]bucketRequest, 1+rng.IntN(3))
		for r := range batch {
			op := ops[rng.IntN(len(ops))]
			n := 1 + rng.IntN(2)
			if !op.admits() {
				n = 1
			}
			used := map[string]bool{}
			for len(batch[r]) < n {
				si, id := rng.IntN(len(shapes)), rng.IntN(2)
				if used[keyOf(si, id)] {
					continue
				}
				used[keyOf(si, id)] = true
				rq := bucketRequest{key: keyOf(si, id), limit: shapes[si].l, op: op, cost: 1 + rng.Int64N(3), quota: spec,
					overridable: true, overrideDebt: shapes[si].debt}
				if op == opAdjust {
					rq.cost, rq.delta = 0, rng.Int64N(13)-6
				}
				batch[r] = append(batch[r], rq)
			}
		}
		res, err := evalDecide(ctx, client, batch...)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		now, off := res[0], 1
		for r, reqs := range batch {
			out := res[off : off+replyLen(reqs)]
			off += len(out)
			eff := append([]bucketRequest(nil), reqs...)
			tats := make([]int64, len(reqs))
			for i, rq := range reqs {
				if o, ok := overrides[rq.key]; ok {
					eff[i] = rq.applyOverride(o)
					if model[rq.key] > o.burst {
						lowered++ // decided under an N below what it used
					}
				}
				tats[i] = model[rq.key]
			}
			want, next := decideBuckets(tats, now, eff)
			got, _, err := decodeRequest(now, out, reqs)
			if err != nil {
				t.Fatalf("step %d, request %d: %v", step, r, err)
			}
			if got.admitted != want.admitted {
				t.Fatalf("step %d, request %d: Lua admitted %v, Go %v", step, r, got.admitted, want.admitted)
			}
			for i, rq := range reqs {
				if got.verdicts[i] != want.verdicts[i] {
					t.Fatalf("step %d, request %d: bucket %s (override %+v): Lua verdict %+v, Go %+v", step, r, rq.key, overrides[rq.key], got.verdicts[i], want.verdicts[i])
				}
				if applied(eff, want, i) {
					model[rq.key] = next[i]
				}
				if _, ok := overrides[rq.key]; ok {
					under++
				} else if v, err := client.Get(ctx, overrideKey(rq.key)).Result(); err == nil && v != "" {
					ignored++
				}
			}
			if reqs[0].op.admits() {
				if want.admitted {
					admitted++
				} else {
					denied++
				}
			}
			requests += len(reqs)
		}
		for _, reqs := range batch {
			for _, rq := range reqs {
				v, err := client.Get(ctx, rq.key).Result()
				switch {
				case err == redis.Nil && model[rq.key] == 0:
				case err != nil:
					t.Fatalf("step %d: quota %s: %v, the model has %d used", step, rq.key, err, model[rq.key])
				default:
					_, stored, ok := decodeQuota(v)
					if !ok || stored != model[rq.key] {
						t.Fatalf("step %d: quota %s holds %q, the model %d used", step, rq.key, v, model[rq.key])
					}
				}
			}
		}
	}
	if under < 500 || ignored < 200 || lowered < 50 || admitted < 300 || denied < 300 {
		t.Fatalf("too little exercised: %d under an override (%d below the units used), %d beside a value ignored; %d admitted, %d denied", under, lowered, ignored, admitted, denied)
	}
	t.Logf("%d quota bucket operations: %d under an override (%d of them below the units used), %d beside a value a quota ignores; %d requests admitted, %d denied; identical in Lua and Go",
		requests, under, lowered, ignored, admitted, denied)
}

// TestLuaShedClasses: shed { concurrent 4 } with the design's classes
// through lua/decide.lua on a real Redis: every class acquires in one set
// of slots, each checked against its own cap (shed.ClassLimit: batch 2, default
// 3, critical 4), so what batch holds counts against everyone and batch
// never takes the last slots. The Redis store checks each reply against
// the Go decision (decodeRequest), so Lua and Go agree on every step.
func TestLuaShedClasses(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	const key = "rl:capacity:{g}"
	caps := map[string]int64{}
	for i, class := range []string{"critical", "default", "batch"} {
		caps[class] = shed.ClassLimit(4, []int64{10000, 8000, 5000}[i], i == 0, 1)
	}
	if caps["critical"] != 4 || caps["default"] != 3 || caps["batch"] != 2 {
		t.Fatalf("caps %v", caps)
	}
	n := 0
	acquire := func(class string) (bucketRequest, bool) {
		t.Helper()
		n++
		rq := bucketRequest{key: key, limit: limit{interval: 30_000_000, burst: caps[class]}, op: opAcquire, cost: 1,
			lease: fmt.Sprintf("lease-%d", n), events: "rl:events"}
		d, err := rs.decide(ctx, []bucketRequest{rq})
		if err != nil {
			t.Fatal(err)
		}
		return rq, d.admitted
	}
	var heldBatch []bucketRequest
	for _, step := range []struct {
		class string
		want  bool
	}{
		{"batch", true}, {"batch", true}, {"batch", false}, // batch: 2 of 4
		{"default", true}, {"default", false}, // default: up to 3
		{"critical", true}, {"critical", false}, // critical: the last one
		{"batch", false},
	} {
		rq, ok := acquire(step.class)
		if ok != step.want {
			t.Fatalf("acquire %d (%s) with %d held: admitted %v, want %v", n, step.class, client.ZCard(ctx, key).Val(), ok, step.want)
		}
		if ok && step.class == "batch" {
			heldBatch = append(heldBatch, rq)
		}
	}
	if held := client.ZCard(ctx, key).Val(); held != 4 {
		t.Fatalf("%d leases in the set, want 4", held)
	}
	// A batch request ends: 3 held, so batch and default are still over
	// their caps, and critical has a slot again.
	rel := heldBatch[0]
	rel.op = opRelease
	if _, err := rs.decide(ctx, []bucketRequest{rel}); err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		class string
		want  bool
	}{{"batch", false}, {"default", false}, {"critical", true}} {
		if _, ok := acquire(step.class); ok != step.want {
			t.Fatalf("after a release, %s: admitted %v, want %v", step.class, ok, step.want)
		}
	}
}

// TestLuaBadKeys: a bucket key holding a hash (WRONGTYPE) or a string that
// is not a bucket fails only the requests that touch it; the other requests
// of the same call are decided and charged as usual, and the bad keys are
// left as they are. A key holding a concurrency policy's slots (a sorted
// set, from a config that gave the name to another kind of policy) is
// replaced.
func TestLuaBadKeys(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	// Buckets that live long enough to be read back on a loaded machine.
	l := limit{interval: 1_000_000, burst: 5}
	client.HSet(ctx, "rl:p:{hash}", "debug", "1")
	client.Set(ctx, "rl:p:{garbage}", "not a bucket", 0)
	client.ZAdd(ctx, "rl:p:{slots}", redis.Z{Score: 1, Member: "lease"})
	take := func(key string) []bucketRequest {
		return []bucketRequest{{key: key, limit: l, op: opTake, cost: 1}}
	}
	res, err := evalDecide(ctx, client, take("rl:p:{a}"), take("rl:p:{hash}"), append(take("rl:p:{b}"), take("rl:p:{garbage}")...), take("rl:p:{slots}"), take("rl:p:{b}"))
	if err != nil {
		t.Fatalf("a call with bad keys failed as a whole: %v", err)
	}
	// Each request: status, then 2 numbers per bucket.
	statuses := []int64{res[1], res[4], res[7], res[12], res[15]}
	want := []int64{scriptAdmitted, scriptWrongType, scriptCorrupt, scriptAdmitted, scriptAdmitted}
	if fmt.Sprint(statuses) != fmt.Sprint(want) {
		t.Fatalf("statuses %v, want %v (reply %v)", statuses, want, res)
	}
	if res[10] != scriptCorrupt || res[8] != 1 {
		t.Fatalf("the bad bucket of a two-bucket request: reply %v", res[7:11])
	}
	// {b} was charged once: by the last request, not by the one whose other
	// bucket was bad.
	if v := client.Get(ctx, "rl:p:{b}").Val(); v == "" {
		t.Fatal("{b} not charged")
	} else if b := parseStored(t, v, formatV1); b.tat-res[0] != l.interval {
		t.Fatalf("{b} charged %d µs, want one token (%d)", b.tat-res[0], l.interval)
	}
	if typ := client.Type(ctx, "rl:p:{hash}").Val(); typ != "hash" {
		t.Fatalf("the hash was replaced by a %s", typ)
	}
	if v := client.Get(ctx, "rl:p:{garbage}").Val(); v != "not a bucket" {
		t.Fatalf("the bad string became %q", v)
	}
	if typ := client.Type(ctx, "rl:p:{slots}").Val(); typ != "string" {
		t.Fatalf("the old slots are a %s, want replaced by a bucket", typ)
	}
	p := &pending{reqs: take("rl:p:{hash}")}
	if err := decodeReply([]int64{res[0], res[4], res[5], res[6]}, []*pending{p}); err != nil || p.err == nil || errorKind(p.err) != "wrongtype" || !strings.Contains(p.err.Error(), "rl:p:{hash}") {
		t.Fatalf("a WRONGTYPE request: call error %v, request error %v (kind %s)", err, p.err, errorKind(p.err))
	}
}

// TestLuaLargeCall: one call of 64 requests of five buckets each (1,984
// numbers, which the script unpacks 1,000 at a time) decides each request
// in order, as the calls of one request would, and names each lease by its
// own string.
func TestLuaLargeCall(t *testing.T) {
	_, client, rs := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000_000, burst: 3}
	var batch []*pending
	for r := range 64 {
		var reqs []bucketRequest
		for j := range 4 { // request r's keys are those of r+16, r+32 and r+48
			reqs = append(reqs, bucketRequest{key: fmt.Sprintf("rl:big:{%d}:%d", r%16, j), limit: rate, op: opTake, cost: 1})
		}
		reqs = append(reqs, bucketRequest{key: "rl:big-slots", limit: limit{interval: 60_000_000, burst: 100}, op: opAcquire, cost: 1,
			lease: fmt.Sprintf("lease-%d", r), events: "rl:events"})
		batch = append(batch, &pending{reqs: reqs})
	}
	rs.call(batch)
	var want []string
	for r, p := range batch {
		if p.err != nil {
			t.Fatalf("request %d: %v", r, p.err)
		}
		// Each key's 3 tokens go to the first three requests that take it.
		if p.d.admitted != (r < 48) || p.d.verdicts[0].allowed != (r < 48) || !p.d.verdicts[4].allowed {
			t.Fatalf("request %d: %+v, want admitted iff it is among the first 48", r, p.d)
		}
		if r < 48 {
			want = append(want, fmt.Sprintf("lease-%d", r))
		}
	}
	held, err := client.ZRange(ctx, "rl:big-slots", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(held)
	slices.Sort(want)
	if !slices.Equal(held, want) {
		t.Fatalf("leases held %v, want those of the 48 admitted requests %v", held, want)
	}
}

// TestLuaOverrideValues: for each stored value, beside a rate bucket,
// beside a concurrency policy's slots and beside a quota's count (under
// each debt rule: none, settle max 7, settle's twice the N), the script
// decides under the limit decodeOverride and limitFor (quotaLimitFor) give
// (the sent one for a value that is not an override, or one of another
// kind).
func TestLuaOverrideValues(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000, burst: 5, slack: 2_000_000}
	slots := limit{interval: 30_000_000, burst: 1}
	quota := limit{burst: 5, slack: 10} // settle, twice the quota of debt
	year := &quotaSpec{periods: calendar.New(calendar.Year, time.UTC), unit: calendar.Year, loc: time.UTC, name: "q"}
	for i, v := range []string{
		"o1 r 12000 500", "o1 c 0 10", "o1 c 7 3", "o1 r 0 5", "o1 c 0 0", "o1 r 12345678901234567 1", "o1 c 12345678901234567 4",
		"o1 c 0 12345678901234567", "o1 r 2 2251799813685248", "o1 r 1 2251799813685248", "o1 x 1 1", " o1 r 1 1", "o1 r 1 1 ", "",
		"o1 q 0 5000", "o1 q 3 7", "o1 q 0 1", "o1 q 0 0", "o1 q 0 4503599627370496", "o1 q 0 9007199254740991",
		"o1 q 0 9007199254740992", "o1 q 0 9007199254740993", "o1 c 0 9007199254740993", "o1 q 0 12345678901234567", "o1 q 0 -5",
	} {
		for _, rq := range []bucketRequest{
			{key: fmt.Sprintf("rl:r:{v%d}", i), limit: rate, op: opTake, cost: 1, overridable: true, overrideWait: 2_000_000},
			{key: fmt.Sprintf("rl:s:{v%d}", i), limit: slots, op: opAcquire, cost: 1, lease: "l", events: "rl:events", overridable: true},
			{key: fmt.Sprintf("rl:q:{v%d}", i), limit: quota, op: opTake, cost: 1, quota: year, overridable: true, overrideDebt: -2},
			{key: fmt.Sprintf("rl:qm:{v%d}", i), limit: limit{burst: 5, slack: 7}, op: opCheck, cost: 1, quota: year, overridable: true, overrideDebt: 7},
			{key: fmt.Sprintf("rl:q0:{v%d}", i), limit: limit{burst: 5}, op: opInspect, quota: year, overridable: true},
		} {
			client.Set(ctx, overrideKey(rq.key), v, 0)
			res, err := evalDecide(ctx, client, []bucketRequest{rq})
			if err != nil {
				t.Fatalf("%q: %v", v, err)
			}
			o := 1 + 1 + bucketReplyWidth(rq) // now, status, the op's numbers
			got := limit{interval: res[o], burst: res[o+1], slack: res[o+2]}
			want := rq.limit
			if ov, ok := decodeOverride(v); ok {
				want = rq.applyOverride(ov).limit
			}
			if got != want {
				t.Errorf("%q beside %s: Lua decided under %+v, Go %+v", v, rq.key, got, want)
			}
		}
	}
}

// TestLuaOverrideAfterSlots: an overridable bucket after a concurrency
// slot in one call (a request of a `concurrent` and a rate policy, or an
// inspect that rode with a slot's release) reads its override. The
// script made its table of overrides with the first overridable bucket's
// other tables, which a slot makes too: the call failed as a whole
// ("attempt to index local 'overrides'"), found beside two CPU hogs by
// TestConcurrentWithRate.
func TestLuaOverrideAfterSlots(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	rate := limit{interval: 1_000_000, burst: 5, slack: 2_000_000}
	year := &quotaSpec{periods: calendar.New(calendar.Year, time.UTC), unit: calendar.Year, loc: time.UTC, name: "q"}
	slot := bucketRequest{key: "rl:s:{after}", limit: limit{interval: 30_000_000, burst: 1}, op: opAcquire, cost: 1, lease: "l", events: "rl:events"}
	for _, rq := range []bucketRequest{
		{key: "rl:r:{after}", limit: rate, op: opTake, cost: 1, overridable: true, overrideWait: 2_000_000},
		{key: "rl:r:{after}", limit: rate, op: opInspect, overridable: true},
		{key: "rl:q:{after}", limit: limit{burst: 5}, op: opTake, cost: 1, quota: year, overridable: true},
	} {
		client.Set(ctx, overrideKey(rq.key), "o1 r 12000 500", 0)
		if rq.quota != nil {
			client.Set(ctx, overrideKey(rq.key), "o1 q 0 5000", 0)
		}
		client.Del(ctx, slot.key)
		res, err := evalDecide(ctx, client, []bucketRequest{slot, rq})
		if err != nil {
			t.Fatalf("a slot, then %s (op %d): %v", rq.key, rq.op, err)
		}
		o := 1 + 1 + bucketReplyWidth(slot) + bucketReplyWidth(rq) // now, status, the slot's numbers, this op's
		got := limit{interval: res[o], burst: res[o+1], slack: res[o+2]}
		v, _ := client.Get(ctx, overrideKey(rq.key)).Result()
		ov, _ := decodeOverride(v)
		if want := rq.applyOverride(ov).limit; got != want {
			t.Errorf("a slot, then %s (op %d): decided under %+v, want the override's %+v", rq.key, rq.op, got, want)
		}
	}
}

// TestLuaLoneTake: the script decides a lone take (one request of one
// rate take) before its main loop; for every kind of value its key may
// hold, on both paths between Redis versions, in both formats, shadow or
// not, within burst or beyond, it replies and leaves in Redis what the
// main loop does for the same call.
func TestLuaLoneTake(t *testing.T) {
	_, client, _ := newTestRedis(t)
	ctx := context.Background()
	const shortcut = "if #KEYS == 1 and #ARGV[2] == 56 then"
	if !strings.Contains(decideLua, shortcut) {
		t.Fatalf("decide.lua no longer takes its lone takes with %q", shortcut)
	}
	mainLoop := strings.Replace(decideLua, shortcut, "if false then", 1)
	key := "rl:p:{lone}"
	hour := int64(3_600_000_000)
	wide := limit{interval: 1_000_000, burst: 100_000}               // a TAT an hour ahead is not capped
	narrow := limit{interval: 1_000_000, burst: 5, slack: 2_000_000} // it is: denied
	clock, err := client.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	base := clock.UnixMicro()
	// Each state the key may hold, the same for both paths.
	states := []struct {
		name          string
		set           func()
		held, written int64 // the bucket it holds (0: none)
	}{
		{"missing", func() {}, 0, 0},
		{"v0, ahead", func() { client.Set(ctx, key, strconv.FormatInt(base+hour, 10), 0) }, base + hour, 1_000_000},
		{"v1, ahead", func() { client.Set(ctx, key, encodeBucket(base+hour, 1_000_000, formatV1), 0) }, base + hour, 1_000_000},
		{"v2, ahead", func() { client.Set(ctx, key, encodeBucket(base+hour, 1_000_000, formatV2), 0) }, base + hour, 1_000_000},
		{"v1, ahead, another interval", func() { client.Set(ctx, key, encodeBucket(base+hour, 3_000_000, formatV1), 0) }, base + hour, 3_000_000},
		{"v1, past", func() { client.Set(ctx, key, encodeBucket(base-hour, 1_000_000, formatV1), 0) }, base - hour, 1_000_000},
		{"a quota's count", func() { client.Set(ctx, key, "q:0:1:3", 0) }, 0, 0},
		{"slots", func() { client.ZAdd(ctx, key, redis.Z{Score: float64(base + hour), Member: "lease"}) }, 0, 0},
		{"a hash", func() { client.HSet(ctx, key, "debug", "1") }, 0, 0},
		{"not a bucket", func() { client.Set(ctx, key, "not a bucket", 0) }, 0, 0},
	}
	// outcome is a call's reply and what the key holds after it.
	type outcome struct {
		now, rebased, status, allowed, before int64
		typ, value                            string
		tat, interval                         int64
		expires                               int64 // ms on Redis's clock (-1: none)
	}
	run := func(t *testing.T, script string, format int, rq bucketRequest, set func(), held, written int64) outcome {
		t.Helper()
		client.Del(ctx, key)
		set()
		res, err := evalScriptFormat(ctx, client, script, format, []bucketRequest{rq})
		if err != nil || len(res) != 4 {
			t.Fatalf("reply %v, %v", res, err)
		}
		o := outcome{now: res[0], status: res[1], allowed: res[2], before: res[3], typ: client.Type(ctx, key).Val()}
		if held != 0 {
			o.rebased = rq.limit.rebase(held, written, o.now)
		}
		if o.typ == "string" {
			o.value = client.Get(ctx, key).Val()
			o.tat, o.interval, _ = decodeBucket(o.value, rq.limit.interval)
			// The TTL as of the call's own clock: read with Redis's clock
			// at once, so that a read made later (a loaded machine) finds
			// the same.
			left, err := client.Eval(ctx, "local t = redis.call('TIME'); return {redis.call('PTTL', KEYS[1]), tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)}", []string{key}).Int64Slice()
			if err != nil || len(left) != 2 {
				t.Fatalf("PTTL: %v, %v", left, err)
			}
			o.expires = left[0] // -1: none
			if left[0] >= 0 {
				o.expires += left[1]
			}
		}
		return o
	}
	// A TAT is the same when it is as held (the same in both calls), the
	// same from each call's now (capped, or charged from now), or from each
	// call's held TAT rebased at its now (Go's rebase); a key's expiry the
	// same, or as far from each call's now, within rounding.
	sameTAT := func(a, b outcome, ta, tb int64) bool {
		return ta == tb || ta-a.now == tb-b.now || ta-a.rebased == tb-b.rebased
	}
	ahead := func(o outcome) int64 { return o.expires - o.now/1000 } // ms from the call's now
	same := func(a, b outcome) bool {
		apart := int64(2) // ms: the TTL's rounding up, and each now's to the ms
		return a.status == b.status && a.allowed == b.allowed && sameTAT(a, b, a.before, b.before) && a.typ == b.typ &&
			sameTAT(a, b, a.tat, b.tat) && a.interval == b.interval &&
			strings.Contains(a.value, ":") == strings.Contains(b.value, ":") && (a.tat == 0) == (b.tat == 0) &&
			(a.expires < 0) == (b.expires < 0) && (max(a.expires-b.expires, b.expires-a.expires) <= apart || max(ahead(a)-ahead(b), ahead(b)-ahead(a)) <= apart)
	}
	var n int
	for _, getSet := range []bool{true, false} {
		lone, main := decideLua, mainLoop
		if !getSet {
			lone, main = strings.Replace(lone, setGetProbe, "false", 1), strings.Replace(main, setGetProbe, "false", 1)
		}
		for _, format := range []int{formatV1, formatV2} {
			for _, l := range []limit{wide, narrow} {
				for _, shadow := range []bool{false, true} {
					for _, cost := range []int64{1, l.burst + 1} {
						for _, st := range states {
							rq := bucketRequest{key: key, limit: l, op: opTake, cost: cost, shadow: shadow}
							got, want := run(t, lone, format, rq, st.set, st.held, st.written), run(t, main, format, rq, st.set, st.held, st.written)
							if !same(got, want) {
								t.Fatalf("SET NX GET %v, %s, burst %d, shadow %v, cost %d, key %s: the lone take %+v, the main loop %+v",
									getSet, formatName(format), l.burst, shadow, cost, st.name, got, want)
							}
							n++
						}
					}
				}
			}
		}
	}
	t.Logf("%d lone takes decided as the main loop decides them", n)
}
