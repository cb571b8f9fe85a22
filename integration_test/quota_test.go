package integration_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Quotas through real Caddy processes and a real Redis: a calendar minute
// over four instances and three boundaries, settle within a quota, a
// reload raising it, the operator's controls, and durability with a real
// primary and replica through a failover.

// quotaShot is one request of TestQuotaMinuteBoundaries, as its client saw
// it: when it was sent and answered, and what the answer said.
type quotaShot struct {
	sent, received time.Time
	status         int
	q, w, r, t     int64
	retryAfter     int64
	instance       int
}

// boundary is the one whole minute in (sent + t - 1 s, received + t]: the
// end of the period the request was decided in, t being the seconds (rounded
// up) from Redis's decision, between sending and receiving, to it.
func (s quotaShot) boundary() (time.Time, bool) {
	lo, hi := s.sent.Add(time.Duration(s.t-1)*time.Second), s.received.Add(time.Duration(s.t)*time.Second)
	b := hi.Truncate(time.Minute)
	return b, b.After(lo)
}

// TestQuotaMinuteBoundaries: `quota 30/minute` shared by four instances
// admits exactly 30 requests in each calendar minute of Redis time, over
// three boundaries: the test starts two seconds before a minute ends
// (Redis runs on this machine's clock) and sends 4 × 20 requests a second
// until a second after the third boundary. In each minute the 30 admitted
// responses carry r = 29, 28, ..., 0 once each (one count, decided
// atomically, whichever instance answered); the first request sent after a
// boundary is admitted; every response's t is the seconds from its
// decision to the boundary, its w 60 and q 30; a denial's Retry-After is
// never before the boundary and at most 12 s (20% of the minute) past it.
// About 2 min 5 s of load, after waiting up to a minute for the start.
func TestQuotaMinuteBoundaries(t *testing.T) {
	srv := testredis.Start(t)
	policy := map[string]any{"name": "per_minute", "key": "{http.request.header.X-Tenant}", "quota": "30/minute"}
	// On a loaded machine a call may take longer than the default 100 ms:
	// the test is about counting, so Redis is given 2 s, and a call that
	// still fails answers 503 (fail_closed) rather than admit uncounted.
	h := limiter("", map[string]any{"on_error": "fail_closed", "redis": map[string]any{"addresses": []string{srv.Addr}, "timeout": "2s"}}, policy)
	var fleet []*instance
	for range 4 {
		fleet = append(fleet, startCaddy(t, h, echo()))
	}
	start := startBeforeMinute(t)
	b1 := start.Truncate(time.Minute).Add(time.Minute)
	stop := b1.Add(2*time.Minute + time.Second)
	t.Logf("boundaries at %s, %s and %s", b1.Format("15:04:05"), b1.Add(time.Minute).Format("15:04:05"), b1.Add(2*time.Minute).Format("15:04:05"))
	began := time.Now()
	defer func() {
		// Redis counts minutes on the wall clock; a step of it during the
		// load would explain a failure, so it is told.
		if step := time.Now().Round(0).Sub(began.Round(0)) - time.Since(began); step > 500*time.Millisecond || step < -500*time.Millisecond {
			t.Logf("the wall clock stepped %v during the load", step.Round(time.Millisecond))
		}
	}()

	var mu sync.Mutex
	var shots []quotaShot
	var wg sync.WaitGroup
	for i, in := range fleet {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c := newClient()
			tick := time.NewTicker(50 * time.Millisecond)
			defer tick.Stop()
			for range tick.C {
				if time.Now().After(stop) {
					return
				}
				req, _ := http.NewRequest("GET", in.URL, nil)
				req.Header.Set("X-Tenant", "acme")
				s := quotaShot{sent: time.Now(), instance: i}
				resp, err := c.Do(req)
				s.received = time.Now()
				if err != nil {
					t.Error(err)
					return
				}
				resp.Body.Close()
				s.status = resp.StatusCode
				if pol := parseFields(t, resp.Header, "RateLimit-Policy"); len(pol) == 1 {
					s.q, s.w = pol[0].params["q"], pol[0].params["w"]
				}
				if lim := parseFields(t, resp.Header, "RateLimit"); len(lim) == 1 {
					s.r, s.t = lim[0].params["r"], lim[0].params["t"]
				}
				s.retryAfter, _ = strconv.ParseInt(resp.Header.Get("Retry-After"), 10, 64)
				mu.Lock()
				shots = append(shots, s)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if t.Failed() {
		return
	}

	sort.Slice(shots, func(i, j int) bool { return shots[i].sent.Before(shots[j].sent) })
	type minute struct {
		admitted, denied int
		remaining        []int64
		first            *quotaShot
		byInstance       [4]int
	}
	minutes := map[time.Time]*minute{}
	for i := range shots {
		s := &shots[i]
		if s.status != 200 && s.status != 429 {
			t.Fatalf("request at %s: status %d (503: Redis did not answer within 2s)", s.sent.Format("15:04:05.000"), s.status)
		}
		b, ok := s.boundary()
		if !ok {
			t.Fatalf("request sent %s, answered %s with t=%d: no minute boundary in (sent + t - 1 s, received + t]",
				s.sent.Format("15:04:05.000"), s.received.Format("15:04:05.000"), s.t)
		}
		if s.q != 30 || s.w != 60 {
			t.Fatalf("request at %s: q=%d w=%d, want q=30 w=60", s.sent.Format("15:04:05.000"), s.q, s.w)
		}
		m := minutes[b]
		if m == nil {
			m = &minute{first: s}
			minutes[b] = m
		}
		switch s.status {
		case 200:
			m.admitted++
			m.remaining = append(m.remaining, s.r)
			m.byInstance[s.instance]++
		case 429:
			m.denied++
			least, most := int64(b.Sub(s.received).Seconds()), int64(b.Sub(s.sent).Seconds())+1+12
			if s.r != 0 || s.retryAfter < max(least, 1) || s.retryAfter > most {
				t.Fatalf("denial at %s: r=%d Retry-After %d, want r=0 and from %d to %d s (the boundary %s, spread by 20%% of a minute)",
					s.sent.Format("15:04:05.000"), s.r, s.retryAfter, least, most, b.Format("15:04:05"))
			}
		default:
			t.Fatalf("request at %s: status %d (503: Redis did not answer within 2s)", s.sent.Format("15:04:05.000"), s.status)
		}
	}
	var counts []string
	for k := range 4 {
		b := b1.Add(time.Duration(k) * time.Minute)
		m := minutes[b]
		if m == nil {
			t.Fatalf("no request decided in the minute to %s", b.Format("15:04:05"))
		}
		first := ""
		if k > 0 {
			first = fmt.Sprintf(", the first sent %v after the boundary: %d with t=%d", m.first.sent.Sub(b.Add(-time.Minute)).Round(time.Millisecond), m.first.status, m.first.t)
		}
		counts = append(counts, fmt.Sprintf("to %s: %d admitted (by instance %v), %d denied%s", b.Format("15:04:05"), m.admitted, m.byInstance, m.denied, first))
		if k > 0 && m.first.status != 200 {
			t.Errorf("the first request after the boundary %s (sent %s) was %d, want admitted", b.Add(-time.Minute).Format("15:04:05"),
				m.first.sent.Format("15:04:05.000"), m.first.status)
		}
		if k == 3 {
			break // the minute after the third boundary has run a second
		}
		sort.Slice(m.remaining, func(i, j int) bool { return m.remaining[i] > m.remaining[j] })
		want := make([]int64, 30)
		for i := range want {
			want[i] = int64(29 - i)
		}
		if m.admitted != 30 || fmt.Sprint(m.remaining) != fmt.Sprint(want) {
			t.Errorf("minute to %s: %d admitted with r %v, want exactly 30 with r 29..0", b.Format("15:04:05"), m.admitted, m.remaining)
		}
	}
	if len(minutes) != 4 {
		t.Errorf("requests decided in %d minutes, want 4", len(minutes))
	}
	t.Logf("%d requests over %d instances from %s: %s", len(shots), len(fleet), start.Format("15:04:05"), strings.Join(counts, "; "))
}

// startBeforeMinute waits until 2 s before a minute of the wall clock ends
// and returns that instant. Quota periods are the wall clock's (Redis reads
// it), and a machine's wall clock can step while a test waits: a CI VM's
// once stepped some 7 s ahead during this minute's wait, so the load began
// after the first boundary. The wait follows the wall clock a second at a
// time, and if it stepped past the start, the next minute is taken, twice
// at most.
func startBeforeMinute(t *testing.T) time.Time {
	t.Helper()
	for tries := 0; ; tries++ {
		now := time.Now()
		start := now.Truncate(time.Minute).Add(58 * time.Second) // wall time: Truncate drops the monotonic reading
		if start.Before(now.Add(500 * time.Millisecond)) {
			start = start.Add(time.Minute)
		}
		t.Logf("waiting %v for %s", time.Until(start).Round(time.Millisecond), start.Format("15:04:05"))
		for d := time.Until(start); d > 0; d = time.Until(start) {
			time.Sleep(min(d, time.Second))
		}
		late := time.Since(start)
		if late < 500*time.Millisecond {
			return start
		}
		if tries == 2 {
			t.Fatalf("the wall clock stepped past the start three times (last %v past %s)", late.Round(time.Millisecond), start.Format("15:04:05"))
		}
		t.Logf("the wall clock stepped: %v past %s; the next minute is taken", late.Round(time.Millisecond), start.Format("15:04:05"))
	}
}

// quotaAnswer is the admin API's answer for a quota.
type quotaAnswer struct {
	Policy  string `json:"policy"`
	Kind    string `json:"kind"`
	Tokens  int64  `json:"tokens"`
	Quota   int64  `json:"quota"`
	Unit    string `json:"unit"`
	Used    int64  `json:"used"`
	Granted int64  `json:"granted"`
	Period  struct {
		Start      string `json:"period_start"`
		End        string `json:"period_end"`
		StartLocal string `json:"period_start_local"`
		EndLocal   string `json:"period_end_local"`
		Zone       string `json:"timezone"`
	} `json:"period"`
}

func inspectQuota(t *testing.T, in *instance, policy, identity string) quotaAnswer {
	t.Helper()
	var q quotaAnswer
	if err := json.Unmarshal([]byte(rateLimitCLI(t, in, "inspect", policy, identity, "--json")), &q); err != nil {
		t.Fatal(err)
	}
	return q
}

// TestQuotaSettleAndReload: a daily quota in Tokyo reserves 10 per request
// and settles against the usage the upstream reports (3 each): 5 requests
// over two instances use 15 of 100; a reload raising a quota of 5 a day to
// 8 keeps the usage (3 more admitted, not 8); and the operator's controls:
// inspect shows used, the quota and the period in UTC and in the zone,
// grant gives units back, reset zeroes the period, top lists the tenant
// denied. With Redis and in-process.
func TestQuotaSettleAndReload(t *testing.T) {
	stores(t, func(t *testing.T, redisAddr string) {
		reporting := map[string]any{"handler": "static_response", "status_code": 200, "body": "ok",
			"headers": map[string]any{"X-Usage-Tokens": []string{"3"}}}
		tokens := map[string]any{"name": "tokens", "key": "{http.request.header.X-Tenant}", "quota": "100/day", "timezone": "Asia/Tokyo",
			"cost": 10, "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}}
		var fleet []*instance
		n := 2
		if redisAddr == "" {
			n = 1 // in-process: one instance's count
		}
		for range n {
			fleet = append(fleet, startCaddy(t, limiter(redisAddr, map[string]any{"jitter": 0}, tokens), reporting))
		}
		for i := range 5 {
			// The previous request's settle reached Redis before its
			// response ended: this one is read against it, on either instance.
			r := get(t, fleet[i%n].URL, "X-Tenant", "acme")
			lim := parseFields(t, r.header, "RateLimit")
			if r.status != 200 || len(lim) != 1 || lim[0].params["r"] != int64(100-3*(i+1)) {
				t.Fatalf("request %d: %d %v, want r=%d (each settled at 3)", i+1, r.status, lim, 100-3*(i+1))
			}
		}
		q := inspectQuota(t, fleet[0], "tokens", "acme")
		tokyo, _ := time.LoadLocation("Asia/Tokyo")
		day := time.Now().In(tokyo)
		midnight := time.Date(day.Year(), day.Month(), day.Day(), 0, 0, 0, 0, tokyo)
		if q.Used != 15 || q.Quota != 100 || q.Unit != "day" || q.Period.StartLocal != midnight.Format(time.RFC3339) ||
			q.Period.Start != midnight.UTC().Format(time.RFC3339) || q.Period.EndLocal != midnight.AddDate(0, 0, 1).Format(time.RFC3339) {
			t.Fatalf("inspect: %+v", q)
		}
		t.Logf("caddy rate-limit inspect tokens acme:\n%s", rateLimitCLI(t, fleet[0], "inspect", "tokens", "acme"))

		// A reload raising a quota keeps what was used.
		small := map[string]any{"name": "small", "key": "{http.request.header.X-Tenant}", "quota": "5/day"}
		in := fleet[0]
		in.reload(t, limiter(redisAddr, map[string]any{"jitter": 0}, small), echo())
		statuses := func(k int) []int {
			var s []int
			for range k {
				s = append(s, get(t, in.URL, "X-Tenant", "acme").status)
			}
			return s
		}
		if s := statuses(6); fmt.Sprint(s) != "[200 200 200 200 200 429]" {
			t.Fatalf("quota 5/day: %v", s)
		}
		small["quota"] = "8/day"
		in.reload(t, limiter(redisAddr, map[string]any{"jitter": 0}, small), echo())
		if s := statuses(4); fmt.Sprint(s) != "[200 200 200 429]" {
			t.Fatalf("after a reload to 8/day: %v, want 3 more admitted (5 used kept)", s)
		}

		// grant, reset, top.
		out := rateLimitCLI(t, in, "grant", "small", "acme", "2")
		if !strings.Contains(out, "granted 2 units; 6 of 8 used") {
			t.Fatalf("grant: %q", out)
		}
		if s := statuses(3); fmt.Sprint(s) != "[200 200 429]" {
			t.Fatalf("after a grant of 2: %v", s)
		}
		out = rateLimitCLI(t, in, "reset", "small", "acme")
		if !strings.Contains(out, "reset; 0 of 8 used") {
			t.Fatalf("reset: %q", out)
		}
		if q := inspectQuota(t, in, "small", "acme"); q.Used != 0 || q.Tokens != 8 {
			t.Fatalf("after the reset: %+v", q)
		}
		// The identity only when asked (--show-keys): a listing is copied
		// around, and an identity may be an API key.
		if out := rateLimitCLI(t, in, "top", "small"); strings.Contains(out, "acme") {
			t.Fatalf("top without --show-keys: %q, want no identity", out)
		}
		if out := rateLimitCLI(t, in, "top", "small", "--show-keys"); !strings.Contains(out, `"acme"`) {
			t.Fatalf("top --show-keys: %q, want acme, denied 3 times", out)
		}
	})
}

// TestQuotaDurableFailover, with a real primary, its replica (replicating
// through a proxy the test can freeze, a partition) and three sentinels:
// what `durable replicas 1` buys in a failover. 40 requests of a durable
// quota and 40 of one that is not are admitted; then the replica stops
// receiving: 10 more requests of the plain quota are admitted and counted
// on the primary alone, while the durable quota's requests, unconfirmed,
// answer 503 (fail_closed) within the timeout and count nothing. The
// primary is killed and the sentinels promote the replica: it holds all 40
// of the durable quota's usage, and 40 of the plain one's 50: the 10
// admitted while the replica lagged are lost. The promoted primary has no
// replica: a fail_closed durable quota answers 503 within its timeout, a
// fail_open one admits without counting, and the plain quota is not held.
func TestQuotaDurableFailover(t *testing.T) {
	primary := testredis.Start(t)
	link := testredis.StartProxy(t, primary.Addr, 0)
	replica := testredis.StartReplicaVia(t, primary, link.Addr)
	// failover-timeout 60s: with the default 5 s, on a loaded machine the
	// sentinels pointed the replica at the primary itself before the
	// partition (+fix-slave-config), and the frozen link partitioned
	// nothing.
	sn := testredis.WatchWithSentinelsFor(t, primary, replica, time.Minute)
	// A timeout long enough for a replica's acknowledgement on a loaded
	// machine (every unconfirmed request below waits it out).
	const timeout = 800 * time.Millisecond
	redis := map[string]any{"addresses": sn.Addrs(), "sentinel": testredis.MasterName, "timeout": timeout.String()}
	handler := map[string]any{"handler": "rate_limit", "redis": redis, "jitter": 0, "policies": []map[string]any{
		{"name": "durable", "match": map[string]any{"path": []string{"/durable"}}, "key": "{http.request.header.X-Tenant}",
			"quota": "1000/day", "durable": map[string]any{"replicas": 1}, "on_error": "fail_closed"},
		{"name": "durable_open", "match": map[string]any{"path": []string{"/open"}}, "key": "{http.request.header.X-Tenant}",
			"quota": "1000/day", "durable": map[string]any{"replicas": 1}, "on_error": "fail_open"},
		{"name": "plain", "match": map[string]any{"path": []string{"/plain"}}, "key": "{http.request.header.X-Tenant}",
			"quota": "1000/day"},
	}}
	var fleet []*instance
	for range 2 {
		fleet = append(fleet, startCaddy(t, handler, echo()))
	}
	var slowest time.Duration
	for i := range 40 {
		for _, path := range []string{"/durable", "/plain"} {
			start := time.Now()
			r := get(t, fleet[i%2].URL+path, "X-Tenant", "acme")
			slowest = max(slowest, time.Since(start))
			if r.status != 200 {
				t.Fatalf("%s request %d before the partition: %d", path, i, r.status)
			}
		}
	}
	t.Logf("40 durable requests confirmed by the replica and 40 plain ones, the slowest in %v", slowest.Round(time.Millisecond))

	// Every admission above reached the replica (the plain ones are
	// replicated after their answers), then the replica stops receiving.
	waitFor(t, "the replica has caught up", func() bool {
		ok, err := testredis.CaughtUp(primary, replica)
		return ok && err == nil
	})
	if info, _ := replica.Do("INFO", "replication"); !strings.Contains(info, "master_port:"+link.Addr[strings.LastIndex(link.Addr, ":")+1:]) {
		t.Fatalf("the replica no longer replicates through the link the test partitions:\n%s", info)
	}
	if err := link.Pause(); err != nil {
		t.Fatal(err)
	}
	for i := range 10 {
		if r := get(t, fleet[i%2].URL+"/plain", "X-Tenant", "acme"); r.status != 200 {
			t.Fatalf("plain request %d during the partition: %d", i, r.status)
		}
	}
	var partitioned []time.Duration
	for i := range 3 {
		start := time.Now()
		r := get(t, fleet[i%2].URL+"/durable", "X-Tenant", "acme")
		took := time.Since(start)
		partitioned = append(partitioned, took.Round(time.Millisecond))
		if r.status != 503 || took < timeout || took > 2*timeout {
			t.Fatalf("durable request %d during the partition: %d after %v, want 503 after the %v timeout", i, r.status, took, timeout)
		}
	}
	if q := inspectQuota(t, fleet[0], "plain", "acme"); q.Used != 50 {
		t.Fatalf("the primary holds %d of the plain quota, want 50", q.Used)
	}
	waitFor(t, "the unconfirmed durable charges undone on the primary", func() bool {
		return inspectQuota(t, fleet[0], "durable", "acme").Used == 40
	})

	primary.Stop() // SIGKILL: nothing flushed, nothing handed over
	killed := time.Now()
	// The sentinels would fail over by themselves (about 1.4 s here), but
	// an election they lose (on a loaded machine, all three can ask for
	// votes at once) is retried only after twice the failover-timeout:
	// 2 minutes with the one above. One sentinel is told to fail over, as
	// an operator would: it needs no votes. Caddy learns of the new
	// primary from the sentinels either way.
	if _, err := sn.Sentinels[0].Do("SENTINEL", "FAILOVER", testredis.MasterName); err != nil && !strings.Contains(err.Error(), "INPROG") {
		t.Fatalf("SENTINEL FAILOVER: %v", err)
	}
	var promoted time.Duration
	for time.Since(killed) < 30*time.Second {
		if role, _ := replica.Role(); role == "master" {
			promoted = time.Since(killed)
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if promoted == 0 {
		t.Fatal("the sentinels did not promote the replica within 30s")
	}
	// Caddy follows the failover: a bounded wait, as its client asks the
	// sentinels again once the old primary's connections fail.
	var durable, plain quotaAnswer
	deadline := time.Now().Add(15 * time.Second)
	for {
		status, body := adminCall(t, fleet[1], "POST", "/rate_limit/inspect", `{"policy":"durable","identity":"acme"}`)
		if status == 200 && json.Unmarshal([]byte(body), &durable) == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("inspect after the failover: %d %s", status, body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	plain = inspectQuota(t, fleet[1], "plain", "acme")
	t.Logf("replica promoted %v after the primary was killed: it holds %d of the durable quota's 40 confirmed, %d of the plain quota's 50 admitted",
		promoted.Round(time.Millisecond), durable.Used, plain.Used)
	if durable.Used != 40 || plain.Used != 40 {
		t.Fatalf("after the failover: durable %d used (want the 40 confirmed), plain %d (want 40: the 10 admitted during the partition never reached the replica)",
			durable.Used, plain.Used)
	}

	// The promoted primary has no replica: durable quotas cannot be
	// confirmed.
	var closedTook []time.Duration
	for i := range 3 {
		start := time.Now()
		r := get(t, fleet[i%2].URL+"/durable", "X-Tenant", "acme")
		took := time.Since(start)
		closedTook = append(closedTook, took.Round(time.Millisecond))
		if r.status != 503 || r.problem(t).Type != "https://iana.org/assignments/http-problem-types#temporary-reduced-capacity" || took > 2*timeout {
			t.Fatalf("fail_closed durable request %d without a replica: %d after %v, want 503 within the timeout", i, r.status, took)
		}
	}
	for i := range 3 {
		if r := get(t, fleet[i%2].URL+"/open", "X-Tenant", "acme"); r.status != 200 || string(r.body) != "fail_open  " {
			t.Fatalf("fail_open durable request %d without a replica: %d %q", i, r.status, r.body)
		}
	}
	start := time.Now()
	if r := get(t, fleet[0].URL+"/plain", "X-Tenant", "acme"); r.status != 200 || time.Since(start) >= timeout {
		t.Fatalf("a quota that is not durable: %d after %v", r.status, time.Since(start))
	}
	waitFor(t, "the unconfirmed charges undone", func() bool {
		return inspectQuota(t, fleet[0], "durable", "acme").Used == 40 && inspectQuota(t, fleet[0], "durable_open", "acme").Used == 0
	})
	kinds := storeErrorKinds(t, fleet[0])
	if kinds["not_durable"] < 1 {
		t.Fatalf("store errors %v, want not_durable counted", kinds)
	}
	if !logMentions(t, fleet[0], "did not confirm the usage within "+timeout.String()) {
		t.Fatal("the log does not say the usage was not confirmed")
	}
	t.Logf("during the partition: durable 503 after %v; after the failover, without a replica: fail_closed 503 after %v, fail_open admitted uncounted; store errors %v",
		partitioned, closedTook, kinds)
}
