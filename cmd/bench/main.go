// Command bench measures what the limiter costs, side by side with plain
// Caddy in one run: fifteen Caddy instances (plain `respond`; rate_limit with
// Redis and 10,000 identities, nothing denied; the same in-process; one
// abusive identity, nearly everything denied; two policies per request; a
// reservation settled after the response; a concurrency slot; the abusive
// identity again with Retry-After pacing off; the 10,000 identities on
// three plans, without overrides and with 1,000 of them overridden; a
// monthly quota; one key at full speed, a hot key decided from blocks of
// its tokens; (b)'s round trips on a Caddy whose script decides nothing;
// a chat completion settled from its response in tokens and in dollars)
// are loaded in turn with wrk, round after round, each run of a limited one
// paired with a run of plain Caddy next to it; the medians of the pairs'
// ratios are the results. It also reads Redis's own cost per script call,
// round trips per request and bytes per key, the CPU time wrk, Caddy and
// Redis spend per request, and the latency (p50/p99) at half of plain
// Caddy's saturation rate from an open-loop client.
//
// Run it with `make bench` (which installs redis-server and wrk when
// missing). Everything runs on 127.0.0.1 and stops when it ends.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

var (
	rounds      = flag.Int("rounds", 5, "rounds of every scenario, in rotating order")
	duration    = flag.Duration("duration", 5*time.Second, "wrk run per scenario and round")
	connections = flag.Int("connections", 32, "wrk connections")
	threads     = flag.Int("threads", 2, "wrk threads")
	only        = flag.String("only", "abcdefghijqkzlm", "scenarios to run (plain Caddy, (a), always runs); the latency and key-size parts need b and d, the decision's own cost b and z")
	previous    = flag.String("previous", testcaddy.PreviousRelease, "commit of the build to compare with, side by side, on (b), (c), (d), (f), (g) and (k) (empty: no comparison)")
	overrides   = flag.Int("overrides", 1000, "overrides set, of as many of the 10,000 identities, in scenario (j)")
	latency     = flag.Bool("latency", true, "with b: also measure latency one request at a time and open loop")
)

// scenario is one Caddy configuration under load.
type scenario struct {
	name, label string
	handler     map[string]any // nil: plain respond
	redis       bool
	usage       bool   // the response reports a usage (X-Usage-Tokens)
	llm         bool   // the response is a chat completion with its usage
	script      string // wrk Lua: how requests vary
	in          *testcaddy.Instance
	// noop: run on the Caddy whose script decides nothing (scenario (z)).
	noop        bool
	runs        []wrkRun
	calls       []float64 // Redis script calls per request, per run
	usecPerCall []float64
	// Redis's µs per request: script calls carry several requests when
	// concurrent decisions are coalesced.
	usecPerRequest []float64
	ratios         []float64 // req/s over that of the paired plain Caddy run
	// setup runs once the scenario's Caddy is up, before any load.
	setup func(sc *scenario)
}

type wrkRun struct {
	rps, p50, p99 float64 // requests/s; latencies in ms
	requests      float64
	non2xx        float64
	// CPU time per request in µs, of wrk, Caddy and Redis during the run,
	// and the share of the machine's cores the three kept busy.
	wrkCPU, caddyCPU, redisCPU, busy float64
	// caddySys is the part of caddyCPU spent in the kernel, and
	// caddySwitches Caddy's context switches per request (all its threads):
	// where a round trip to Redis costs Caddy (a thread that sleeps for a
	// reply is woken, and its writes wake the reader on the other end).
	caddySys, caddySwitches float64
	// redisScript: Redis's µs in the script per request, and script calls
	// per request (before/after).
	redisScript, redisCalls float64
}

const identitiesLua = `
local n = 0
request = function()
  n = n + 1
  return wrk.format("GET", "/", {["X-User"] = "user-" .. (math.random(10000))})
end
`

const reservingLua = `
request = function()
  return wrk.format("GET", "/", {["X-User"] = "user-" .. (math.random(10000)), ["X-Max-Tokens"] = "10"})
end
`

// chatLua is identitiesLua with each request a chat completion's JSON
// body.
const chatLua = `
local body = '{"model":"gpt-4.1","messages":[{"role":"system","content":"You answer in one short sentence."},{"role":"user","content":"Say hello to the gateway"}],"max_tokens":100}'
request = function()
  return wrk.format("POST", "/v1/chat/completions", {["X-User"] = "user-" .. (math.random(10000)), ["Content-Type"] = "application/json"}, body)
end
`

// chatAnswer is a chat completion's JSON, as OpenAI answers it: the dated
// snapshot of the model asked for, and its usage with cached tokens.
const chatAnswer = `{"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion","created":1741569952,"model":"gpt-4.1-2025-04-14",` +
	`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello, gateway! How can I help you today?","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":24,"completion_tokens":11,"total_tokens":35,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},` +
	`"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default","system_fingerprint":"fp_ef015fa747"}`

// plansLua is identitiesLua with each identity on one of three plans.
const plansLua = `
local plans = {"", "pro", "enterprise"}
request = function()
  local n = math.random(10000)
  return wrk.format("GET", "/", {["X-User"] = "user-" .. n, ["X-Plan"] = plans[n % 3 + 1]})
end
`

// oneKeyLua is every request on one identity: a hot key.
const oneKeyLua = `
request = function()
  return wrk.format("GET", "/", {["X-User"] = "the-one"})
end
`

const abuserLua = `
request = function()
  return wrk.format("GET", "/", {["X-User"] = "abuser"})
end
`

func main() {
	flag.Parse()
	s := testcaddy.NewSession("bench")
	defer s.Close()
	s.CloseOnSignal(nil, 130)
	wrk, err := exec.LookPath("wrk")
	if err != nil {
		s.Fatalf("wrk not found: `make bench` installs it (apt-get install wrk)")
	}

	fmt.Println("Building Caddy with the module...")
	bin := filepath.Join(s.TempDir(), "caddy")
	if err := testcaddy.Build(bin); err != nil {
		s.Fatalf("building caddy: %v", err)
	}
	var previousBin string
	if *previous != "" {
		fmt.Printf("Building the build to compare with (%.12s)...\n", *previous)
		previousBin = filepath.Join(s.TempDir(), "caddy-previous")
		if err := testcaddy.BuildRelease(".", *previous, previousBin); err != nil {
			s.Fatalf("building %s: %v", *previous, err)
		}
	}
	redis := testredis.Start(s)
	dir := s.TempDir()
	writeScript := func(name, body string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
			s.Fatalf("%v", err)
		}
		return p
	}
	identities, abuser, reserving := writeScript("identities.lua", identitiesLua), writeScript("abuser.lua", abuserLua), writeScript("reserving.lua", reservingLua)
	chat := writeScript("chat.lua", chatLua)
	oneKey := writeScript("one-key.lua", oneKeyLua)
	planned := writeScript("plans.lua", plansLua)

	limiter := func(withRedis bool, policies ...map[string]any) map[string]any {
		h := map[string]any{"handler": "rate_limit", "key_secret": "bench", "policies": policies}
		if withRedis {
			h["redis"] = map[string]any{"addresses": []string{redis.Addr}, "timeout": "1s"}
		}
		return h
	}
	perUser := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "100000/1s"}
	abusive := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "10/1s", "burst": 10}
	scenarios := []*scenario{
		{name: "a", label: "plain Caddy respond", script: identities},
		{name: "b", label: "rate_limit, Redis, 10,000 identities", redis: true, script: identities, handler: limiter(true, perUser)},
		{name: "c", label: "rate_limit, in-process, 10,000 identities", script: identities, handler: limiter(false, perUser)},
		{name: "d", label: "rate_limit, Redis, one abusive identity", redis: true, script: abuser, handler: limiter(true, abusive)},
		{name: "e", label: "rate_limit, Redis, two policies", redis: true, script: identities, handler: limiter(true, perUser,
			map[string]any{"name": "global", "key": "global", "rate": "1000000/1s"})},
		// A reservation of 10 tokens settled against the 3 the response
		// reports in a header: two script operations per request.
		{name: "f", label: "rate_limit, Redis, settle header, 10,000 identities", redis: true, script: reserving, usage: true, handler: limiter(true,
			map[string]any{"name": "tokens", "key": "{http.request.header.X-User}", "rate": "100000/1s", "cost": "{http.request.header.X-Max-Tokens}", "max_cost": 10,
				"settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}})},
		// A concurrency slot taken and freed per request.
		{name: "g", label: "rate_limit, Redis, concurrent, 10,000 identities", redis: true, script: identities, handler: limiter(true,
			map[string]any{"name": "slots", "key": "{http.request.header.X-User}", "concurrent": 100})},
		// (d) with pacing off: the first denial of each of wrk's new
		// connections is not held (see docs/http.md), so the two side by
		// side show what pacing costs a client that ignores Retry-After.
		{name: "h", label: "rate_limit, Redis, one abusive identity, jitter 0", redis: true, script: abuser, handler: withJitter0(limiter(true, abusive))},
		// (b) on three plans, without overrides and (another policy name, so
		// that each has its own overrides) with *overrides of them set.
		{name: "i", label: "rate_limit, Redis, 10,000 identities on three plans", redis: true, script: planned, handler: limiter(true, onPlans("tenants"))},
		{name: "j", label: fmt.Sprintf("rate_limit, Redis, 10,000 identities on three plans, %d overrides", *overrides), redis: true, script: planned,
			handler: limiter(true, onPlans("tenants_overridden")), setup: func(sc *scenario) { setOverrides(s, sc, "tenants_overridden", *overrides) }},
		// One key at full speed through one instance, nothing denied: hot,
		// decided from blocks of its tokens (docs/hot-keys.md).
		{name: "k", label: "rate_limit, Redis, one key at full speed (a hot key)", redis: true, script: oneKey, handler: limiter(true,
			map[string]any{"name": "per_key", "key": "{http.request.header.X-User}", "rate": "1000000/1s"})},
		// (b)'s calls, arguments and replies, on a Caddy whose script
		// decides nothing (built with -tags ratelimit_noop_script): the
		// round trip's own cost, against which (b) shows what a decision
		// adds.
		{name: "z", label: "(b) with a script that decides nothing", redis: true, script: identities, handler: limiter(true, perUser), noop: true},
		// (b) with a monthly quota instead of the rate: a count per
		// identity in its calendar period, nothing denied.
		{name: "q", label: "rate_limit, Redis, quota per month, 10,000 identities", redis: true, script: identities, handler: limiter(true,
			map[string]any{"name": "monthly", "key": "{http.request.header.X-User}", "quota": "1000000000/month", "timezone": "America/New_York"})},
		// A chat completion reserved from its body and settled from its
		// response's usage, in tokens (l), then in dollars at the prices of
		// the model the request and the response name (m): what pricing
		// adds to a settle.
		{name: "l", label: "rate_limit, Redis, settle openai in tokens, 10,000 identities", redis: true, script: chat, llm: true, handler: limiter(true,
			map[string]any{"name": "llm_tokens", "key": "{http.request.header.X-User}", "rate": "1000000/1s", "burst": 1_000_000_000, "cost": "openai", "max_cost": 8000,
				"settle": map[string]any{"from": "openai"}})},
		{name: "m", label: "rate_limit, Redis, settle openai in dollars, 10,000 identities", redis: true, script: chat, llm: true, handler: withPrices(limiter(true,
			map[string]any{"name": "llm_usd", "key": "{http.request.header.X-User}", "unit": "usd", "rate": "1/1s", "burst": 1000, "cost": "openai", "max_cost": 1,
				"settle": map[string]any{"from": "openai"}}))},
	}
	byName := map[string]*scenario{}
	kept := scenarios[:0]
	for _, sc := range scenarios {
		if sc.name == "a" || strings.Contains(*only, sc.name) {
			kept = append(kept, sc)
			byName[sc.name] = sc
		}
	}
	scenarios = kept
	respond := map[string]any{"handler": "static_response", "status_code": 200, "body": "ok"}
	reporting := map[string]any{"handler": "static_response", "status_code": 200, "body": "ok",
		"headers": map[string]any{"X-Usage-Tokens": []string{"3"}}}
	answering := map[string]any{"handler": "static_response", "status_code": 200, "body": chatAnswer,
		"headers": map[string]any{"Content-Type": []string{"application/json"}}}
	start := func(bin string, sc *scenario) *testcaddy.Instance {
		switch {
		case sc.handler == nil:
			return testcaddy.Start(s, bin, nil, respond)
		case sc.llm:
			return testcaddy.Start(s, bin, nil, sc.handler, answering)
		case sc.usage:
			return testcaddy.Start(s, bin, nil, sc.handler, reporting)
		default:
			return testcaddy.Start(s, bin, nil, sc.handler, respond)
		}
	}
	var noopBin string
	if byName["z"] != nil {
		fmt.Println("Building Caddy with the script that decides nothing (-tags ratelimit_noop_script), for (z)...")
		noopBin = filepath.Join(s.TempDir(), "caddy-noop")
		if err := testcaddy.BuildTags(noopBin, "ratelimit_noop_script"); err != nil {
			s.Fatalf("building caddy for (z): %v", err)
		}
	}
	for _, sc := range scenarios {
		if sc.noop {
			sc.in = start(noopBin, sc)
			continue
		}
		sc.in = start(bin, sc)
	}
	// This build's buckets are written in the compact format (v2), as a
	// fleet all on this release writes them (see docs/redis.md); the build
	// compared with keeps its own keys, under another prefix.
	if _, err := redis.Do("SET", "rl:format", "v2"); err != nil {
		s.Fatalf("setting the storage format marker: %v", err)
	}
	for _, sc := range scenarios {
		if sc.redis {
			waitFormat(s, sc.in, "v2")
		}
	}
	for _, sc := range scenarios {
		if sc.setup != nil {
			sc.setup(sc)
		}
	}

	fmt.Printf("wrk -t%d -c%d -d%s, %d rounds, scenarios in rotating order; Redis %s on the same 2 cores.\n\n",
		*threads, *connections, *duration, *rounds, redis.Addr)
	measure := func(r int, sc *scenario) wrkRun {
		run := runWrk(s, wrk, sc.in.URL, sc.script, []int{sc.in.Pid(), redis.Pid()}, func() {
			if sc.redis {
				_, _ = redis.Do("CONFIG", "RESETSTAT")
			}
		})
		sc.runs = append(sc.runs, run)
		if sc.redis {
			calls, usec := scriptStats(s, redis)
			sc.calls = append(sc.calls, calls/run.requests)
			sc.usecPerCall = append(sc.usecPerCall, usec/max(calls, 1))
			sc.usecPerRequest = append(sc.usecPerRequest, usec/run.requests)
		}
		fmt.Printf("round %d %s: %.0f req/s, p50 %.2f ms, p99 %.2f ms\n", r+1, sc.name, run.rps, run.p50, run.p99)
		return run
	}
	// Each run of a scenario is paired with a run of plain Caddy right
	// before or after it (the order alternates): the machine's speed drifts
	// by several percent within a minute, and a ratio of two runs seconds
	// apart sees less of that drift than a ratio of medians.
	plain, limited := scenarios[0], scenarios[1:]
	for r := range *rounds {
		for i := range limited {
			n := (i + r) % len(limited)
			sc := limited[n]
			if (r+n)%2 == 0 { // each scenario's order flips from round to round
				p := measure(r, plain)
				sc.ratios = append(sc.ratios, measure(r, sc).rps/p.rps)
			} else {
				l := measure(r, sc)
				sc.ratios = append(sc.ratios, l.rps/measure(r, plain).rps)
			}
		}
	}

	base := median(pick(plain.runs, func(w wrkRun) float64 { return w.rps }))
	fmt.Printf("\nRatio to (a): the median of each run's req/s over its paired plain run's; the range of those ratios beside it.\n")
	tw := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\t\tmedian req/s\tratio to (a)\trange\tp50 ms\tp99 ms\tRedis calls/request\tRedis µs/call\tRedis µs/request")
	for _, sc := range scenarios {
		rps := median(pick(sc.runs, func(w wrkRun) float64 { return w.rps }))
		ratio, spread := "1.00", "-"
		if sc != plain {
			lo, hi := slices.Min(sc.ratios), slices.Max(sc.ratios)
			ratio, spread = fmt.Sprintf("%.2f", median(sc.ratios)), fmt.Sprintf("%.2f-%.2f", lo, hi)
		}
		calls, usec, usecReq := "-", "-", "-"
		if sc.redis {
			calls = fmt.Sprintf("%.3f", median(sc.calls))
			usec = fmt.Sprintf("%.2f", median(sc.usecPerCall))
			usecReq = fmt.Sprintf("%.2f", median(sc.usecPerRequest))
		}
		fmt.Fprintf(tw, "(%s)\t%s\t%.0f\t%s\t%s\t%.2f\t%.2f\t%s\t%s\t%s\n", sc.name, sc.label, rps, ratio, spread,
			median(pick(sc.runs, func(w wrkRun) float64 { return w.p50 })),
			median(pick(sc.runs, func(w wrkRun) float64 { return w.p99 })), calls, usec, usecReq)
	}
	tw.Flush()

	// Where the machine's time goes: wrk, Caddy and Redis share the cores.
	fmt.Printf("\nCPU time per request (µs; medians; Caddy and Redis from /proc, wrk from its rusage):\n")
	tw = tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\twrk\tCaddy\tof which kernel\tCaddy's context switches/request\tRedis\ttotal\tcores busy")
	for _, sc := range scenarios {
		m := func(f func(wrkRun) float64) float64 { return median(pick(sc.runs, f)) }
		wrkCPU, caddyCPU, redisCPU := m(func(w wrkRun) float64 { return w.wrkCPU }), m(func(w wrkRun) float64 { return w.caddyCPU }), m(func(w wrkRun) float64 { return w.redisCPU })
		fmt.Fprintf(tw, "(%s)\t%.1f\t%.1f\t%.1f\t%.2f\t%.1f\t%.1f\t%.0f%%\n", sc.name, wrkCPU, caddyCPU,
			m(func(w wrkRun) float64 { return w.caddySys }), m(func(w wrkRun) float64 { return w.caddySwitches }),
			redisCPU, wrkCPU+caddyCPU+redisCPU, 100*m(func(w wrkRun) float64 { return w.busy }))
	}
	tw.Flush()
	decisionCost(plain, byName["b"], byName["z"])
	moneyCost(byName["l"], byName["m"])
	moneyAtOnce(s, wrk, redis, byName["l"], byName["m"])
	if d := byName["d"]; d != nil {
		deniedShare := median(pick(d.runs, func(w wrkRun) float64 { return w.non2xx / w.requests }))
		fmt.Printf("\n(d): %.4f of requests denied; Redis calls per denied request %.4f\n", deniedShare, median(d.calls)/deniedShare)
		fmt.Printf("Bytes per live key (MEMORY USAGE): %s\n", keyBytes(s, redis, d.in.URL))
	}
	if previousBin != "" {
		beforeAfter(s, wrk, redis, previousBin, plain, byName, start)
	}
	b := byName["b"]
	if b == nil || !*latency {
		return
	}

	// What one Redis round trip adds to a request on an idle machine: one
	// connection, one request at a time. Beside (b), the scenarios whose
	// responses wait at their end for the work they leave to reach Redis
	// (a settle, a slot's release: docs/concurrency.md): a second round
	// trip.
	fmt.Printf("\nOne connection, one request at a time (wrk -t1 -c1), %s each, alternating, 3 rounds:\n", *duration)
	oneAtATime := []*scenario{b}
	for _, name := range []string{"f", "g", "c", "k"} {
		if sc := byName[name]; sc != nil {
			oneAtATime = append(oneAtATime, sc)
		}
	}
	alternately(scenarios[0], oneAtATime, func(sc *scenario) (p50, p99 float64, note string) {
		run := runWrkWith(s, wrk, sc.in.URL, sc.script, 1, 1, nil, func() {})
		return run.p50, run.p99, ""
	})

	// Latency at half of plain Caddy's saturation rate, open loop; and, as
	// that may be beyond what (b) sustains on these shared cores, at half of
	// (b)'s own.
	for _, at := range []struct {
		rate float64
		what string
	}{
		{base / 2, "half of (a)'s median"},
		{median(pick(b.runs, func(w wrkRun) float64 { return w.rps })) / 2, "half of (b)'s median"},
	} {
		fmt.Printf("\nOpen-loop latency at %.0f req/s (%s), 5s each, alternating, 3 rounds:\n", at.rate, at.what)
		alternately(scenarios[0], []*scenario{b}, func(sc *scenario) (p50, p99 float64, note string) {
			p50, p99, errs := openLoop(sc.in.URL, at.rate, 5*time.Second)
			return p50, p99, fmt.Sprintf(", %d errors", errs)
		})
	}
}

// alternately measures plain Caddy and each limited scenario in turn, 3
// rounds, the order flipped from round to round, and prints the medians
// of p50 and p99 (ms), each against plain Caddy's.
func alternately(plain *scenario, limited []*scenario, measure func(*scenario) (p50, p99 float64, note string)) {
	all := append([]*scenario{plain}, limited...)
	p50s, p99s := make([][]float64, len(all)), make([][]float64, len(all))
	for r := range 3 {
		for k := range all {
			i := k
			if r%2 == 1 {
				i = len(all) - 1 - k
			}
			sc := all[i]
			p50, p99, note := measure(sc)
			fmt.Printf("round %d %s: p50 %.3f ms, p99 %.3f ms%s\n", r+1, sc.name, p50, p99, note)
			p50s[i], p99s[i] = append(p50s[i], p50), append(p99s[i], p99)
		}
	}
	for i, sc := range limited {
		fmt.Printf("median p50: plain %.3f ms, (%s) %.3f ms (+%.3f ms); median p99: plain %.3f ms, (%s) %.3f ms (+%.3f ms)\n",
			median(p50s[0]), sc.name, median(p50s[i+1]), median(p50s[i+1])-median(p50s[0]),
			median(p99s[0]), sc.name, median(p99s[i+1]), median(p99s[i+1])-median(p99s[0]))
	}
}

var (
	rpsRe    = regexp.MustCompile(`Requests/sec:\s+([0-9.]+)`)
	latRe    = regexp.MustCompile(`(?m)^\s+(50|99)%\s+([0-9.]+)(us|ms|s)\s*$`)
	totalRe  = regexp.MustCompile(`(\d+) requests in`)
	non2xxRe = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)
	callsRe  = regexp.MustCompile(`cmdstat_(evalsha|eval):calls=(\d+),usec=(\d+)`)
)

// runWrk loads url for the configured duration, after a 1 s warm-up and
// then ready. pids are Caddy's and Redis's, whose CPU time it measures.
func runWrk(s *testcaddy.Session, wrk, url, script string, pids []int, ready func()) wrkRun {
	return runWrkWith(s, wrk, url, script, *threads, *connections, pids, ready)
}

func runWrkWith(s *testcaddy.Session, wrk, url, script string, threads, connections int, pids []int, ready func()) wrkRun {
	warm := exec.Command(wrk, "-t1", "-c4", "-d1s", "-s", script, url)
	_ = warm.Run()
	ready()
	before, sysBefore := make([]time.Duration, len(pids)), make([]time.Duration, len(pids))
	for i, pid := range pids {
		user, sys := cpuTimes(pid)
		before[i], sysBefore[i] = user+sys, sys
	}
	var switchesBefore int64
	if len(pids) > 0 {
		switchesBefore = contextSwitches(pids[0])
	}
	start := time.Now()
	cmd := exec.Command(wrk, "-t"+strconv.Itoa(threads), "-c"+strconv.Itoa(connections),
		"-d"+duration.String(), "--latency", "-s", script, url)
	out, err := cmd.CombinedOutput()
	if err != nil {
		s.Fatalf("wrk: %v\n%s", err, out)
	}
	elapsed := time.Since(start)
	text := string(out)
	var run wrkRun
	if m := totalRe.FindStringSubmatch(text); m != nil && len(pids) == 2 {
		n, _ := strconv.ParseFloat(m[1], 64)
		perRequest := func(d time.Duration) float64 { return float64(d.Microseconds()) / n }
		wrkCPU := cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime()
		caddyUser, caddySys := cpuTimes(pids[0])
		caddyCPU, redisCPU := caddyUser+caddySys-before[0], cpuTime(pids[1])-before[1]
		run.wrkCPU, run.caddyCPU, run.redisCPU = perRequest(wrkCPU), perRequest(caddyCPU), perRequest(redisCPU)
		run.caddySys = perRequest(caddySys - sysBefore[0])
		run.caddySwitches = float64(contextSwitches(pids[0])-switchesBefore) / n
		run.busy = float64(wrkCPU+caddyCPU+redisCPU) / float64(elapsed) / float64(runtime.NumCPU())
	}
	if m := rpsRe.FindStringSubmatch(text); m != nil {
		run.rps, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := totalRe.FindStringSubmatch(text); m != nil {
		run.requests, _ = strconv.ParseFloat(m[1], 64)
	}
	if m := non2xxRe.FindStringSubmatch(text); m != nil {
		run.non2xx, _ = strconv.ParseFloat(m[1], 64)
	}
	for _, m := range latRe.FindAllStringSubmatch(text, -1) {
		v, _ := strconv.ParseFloat(m[2], 64)
		switch m[3] {
		case "us":
			v /= 1000
		case "s":
			v *= 1000
		}
		if m[1] == "50" {
			run.p50 = v
		} else {
			run.p99 = v
		}
	}
	if run.rps == 0 || run.requests == 0 {
		s.Fatalf("could not read wrk's output:\n%s", text)
	}
	return run
}

// cpuTime is the user and system CPU time a process has used so far, from
// /proc/<pid>/stat (in clock ticks of 10 ms, Linux's fixed USER_HZ).
func cpuTime(pid int) time.Duration {
	user, sys := cpuTimes(pid)
	return user + sys
}

// cpuTimes is a process's user and system CPU time so far, apart.
func cpuTimes(pid int) (user, sys time.Duration) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0
	}
	// The command name, in parentheses, may hold spaces: count after it.
	f := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	if len(f) < 13 {
		return 0, 0
	}
	utime, _ := strconv.ParseInt(f[11], 10, 64)
	stime, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(utime) * 10 * time.Millisecond, time.Duration(stime) * 10 * time.Millisecond
}

// contextSwitches is the context switches, voluntary and not, of all a
// process's threads so far (a thread that ended is no longer counted: Go
// keeps its threads).
func contextSwitches(pid int) int64 {
	tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for _, line := range strings.Split(string(b), "\n") {
			if name, v, ok := strings.Cut(line, ":"); ok && (name == "voluntary_ctxt_switches" || name == "nonvoluntary_ctxt_switches") {
				c, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				n += c
			}
		}
	}
	return n
}

// scriptStats reads the script calls and Redis's µs in them since the last
// CONFIG RESETSTAT.
func scriptStats(s *testcaddy.Session, redis *testredis.Server) (calls, usec float64) {
	info, err := redis.Do("INFO", "commandstats")
	if err != nil {
		s.Fatalf("INFO commandstats: %v", err)
	}
	for _, m := range callsRe.FindAllStringSubmatch(info, -1) {
		c, _ := strconv.ParseFloat(m[2], 64)
		u, _ := strconv.ParseFloat(m[3], 64)
		calls += c
		usec += u
	}
	return calls, usec
}

// keyBytes is MEMORY USAGE of a few bucket keys, as "min to max", each
// read right after a request created it (a key lives until its bucket is
// full again: 100 ms on (d)'s policy).
func keyBytes(s *testcaddy.Session, redis *testredis.Server, url string) string {
	var sizes []float64
	for i := range 5 {
		_, _ = redis.Do("FLUSHALL")
		_, _ = redis.Do("SET", "rl:format", "v2") // the fleet marker stays
		req, _ := http.NewRequest("GET", url, nil)
		req.Header.Set("X-User", "sizing-"+strconv.Itoa(i))
		if resp, err := http.DefaultClient.Do(req); err == nil {
			resp.Body.Close()
		}
		var key string
		var err error
		for range 20 { // the bucket's key, not the marker's
			if key, err = redis.Do("RANDOMKEY"); err != nil || strings.HasSuffix(key, "}") {
				break
			}
		}
		if err != nil || !strings.HasSuffix(key, "}") {
			continue
		}
		n, err := redis.Do("MEMORY", "USAGE", key)
		if err != nil {
			continue
		}
		v, _ := strconv.ParseFloat(n, 64)
		sizes = append(sizes, v)
	}
	if len(sizes) == 0 {
		return "no live key"
	}
	sort.Float64s(sizes)
	return fmt.Sprintf("%.0f to %.0f bytes (%d keys sampled)", sizes[0], sizes[len(sizes)-1], len(sizes))
}

// openLoop sends requests at a fixed rate for d, whatever the responses'
// pace, and measures each from its scheduled start (no coordinated
// omission). It returns p50 and p99 in ms and the failed requests.
func openLoop(url string, rate float64, d time.Duration) (p50, p99 float64, errs int) {
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 256, MaxConnsPerHost: 256}, Timeout: 10 * time.Second}
	n := int(rate * d.Seconds())
	interval := time.Duration(float64(time.Second) / rate)
	lat := make([]float64, n)
	var failed int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	sem := make(chan struct{}, 256)
	start := time.Now()
	for i := range n {
		at := start.Add(time.Duration(i) * interval)
		time.Sleep(time.Until(at))
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			req, _ := http.NewRequest("GET", url, nil)
			req.Header.Set("X-User", "user-"+strconv.Itoa(i%10000))
			resp, err := client.Do(req)
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			if err != nil || resp.StatusCode != 200 {
				mu.Lock()
				failed++
				mu.Unlock()
			}
			lat[i] = float64(time.Since(at)) / float64(time.Millisecond)
		}()
	}
	wg.Wait()
	sort.Float64s(lat)
	return lat[n/2], lat[n*99/100], int(failed)
}

func pick(runs []wrkRun, f func(wrkRun) float64) []float64 {
	var out []float64
	for _, r := range runs {
		out = append(out, f(r))
	}
	return out
}

func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	c := append([]float64(nil), v...)
	sort.Float64s(c)
	if len(c)%2 == 1 {
		return c[len(c)/2]
	}
	return (c[len(c)/2-1] + c[len(c)/2]) / 2
}

// withJitter0 turns Retry-After pacing off in a rate_limit handler.
func withJitter0(h map[string]any) map[string]any {
	h["jitter"] = 0
	return h
}

// waitFormat waits (at most 15 s) until the instance writes buckets in the
// given format.
func waitFormat(s *testcaddy.Session, in *testcaddy.Instance, format string) {
	deadline := time.Now().Add(15 * time.Second)
	for {
		resp, err := http.Post(in.Admin+"/rate_limit/format", "application/json", strings.NewReader(`{"format":"`+format+`"}`))
		if err == nil {
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if strings.Contains(string(body), `"writes":"`+format+`"`) {
				return
			}
		}
		if time.Now().After(deadline) {
			s.Fatalf("the instance at %s does not write %s buckets", in.URL, format)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// beforeAfter runs (b), (c), (d), (f), (g) and (k) on the build compared with and on
// this one, side by side: in each round, each scenario on both builds, each
// run paired with a run of plain Caddy next to it, the order alternating;
// then the medians of the ratios, of Caddy's and Redis's CPU per request,
// and the bytes of a live key.
func beforeAfter(s *testcaddy.Session, wrk string, redis *testredis.Server, previousBin string, plain *scenario, byName map[string]*scenario,
	start func(bin string, sc *scenario) *testcaddy.Instance) {
	type side struct {
		sc     *scenario
		ratios []float64
	}
	var pairs [][2]*side
	for _, name := range []string{"b", "c", "d", "f", "g", "k"} {
		cur := byName[name]
		if cur == nil {
			continue
		}
		prev := *cur
		prev.runs, prev.calls, prev.usecPerCall, prev.usecPerRequest, prev.ratios = nil, nil, nil, nil, nil
		if prev.handler != nil {
			prev.handler = withPrefix(prev.handler, "prev:")
		}
		prev.in = start(previousBin, &prev)
		pairs = append(pairs, [2]*side{{sc: &prev}, {sc: cur}})
	}
	if len(pairs) == 0 {
		return
	}
	fmt.Printf("\nThis build against the previous one (%s), side by side, %d rounds:\n", filepath.Base(previousBin), *rounds)
	measure := func(sc *scenario) wrkRun {
		run := runWrk(s, wrk, sc.in.URL, sc.script, []int{sc.in.Pid(), redis.Pid()}, func() { _, _ = redis.Do("CONFIG", "RESETSTAT") })
		if sc.redis {
			calls, usec := scriptStats(s, redis)
			run.redisScript, run.redisCalls = usec/run.requests, calls/run.requests
		}
		return run
	}
	var runs [][2][]wrkRun = make([][2][]wrkRun, len(pairs))
	for r := range *rounds {
		for i, pair := range pairs {
			for k := range 2 {
				side := pair[(k+r+i)%2]
				var p, l wrkRun
				if (r+i+k)%2 == 0 {
					p, l = measure(plain), measure(side.sc)
				} else {
					l, p = measure(side.sc), measure(plain)
				}
				side.ratios = append(side.ratios, l.rps/p.rps)
				w := 0
				if side == pair[1] {
					w = 1
				}
				runs[i][w] = append(runs[i][w], l)
				fmt.Printf("round %d (%s) %s: %.0f req/s, %.2f of plain\n", r+1, pair[1].sc.name, []string{"before", "after"}[w], l.rps, l.rps/p.rps)
			}
		}
	}
	tw := tabwriter.NewWriter(os.Stdout, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "scenario\tratio before\trange\tratio after\trange\tCaddy µs/req before\tafter\tRedis script µs/req before\tafter\tRedis calls/req before\tafter")
	for i, pair := range pairs {
		m := func(w int, f func(wrkRun) float64) float64 { return median(pick(runs[i][w], f)) }
		cpu := func(w wrkRun) float64 { return w.caddyCPU }
		script := func(w wrkRun) float64 { return w.redisScript }
		calls := func(w wrkRun) float64 { return w.redisCalls }
		fmt.Fprintf(tw, "(%s)\t%.2f\t%.2f-%.2f\t%.2f\t%.2f-%.2f\t%.1f\t%.1f\t%.2f\t%.2f\t%.3f\t%.3f\n", pair[1].sc.name,
			median(pair[0].ratios), slices.Min(pair[0].ratios), slices.Max(pair[0].ratios),
			median(pair[1].ratios), slices.Min(pair[1].ratios), slices.Max(pair[1].ratios),
			m(0, cpu), m(1, cpu), m(0, script), m(1, script), m(0, calls), m(1, calls))
	}
	tw.Flush()
	for _, pair := range pairs {
		if pair[1].sc.name == "d" { // its keys live long enough to be weighed (100 ms)
			fmt.Printf("Bytes per live key (MEMORY USAGE) of (d), before: %s; after (format v2): %s\n",
				keyBytes(s, redis, pair[0].sc.in.URL), keyBytes(s, redis, pair[1].sc.in.URL))
		}
	}
	fmt.Printf("Plain Caddy's CPU per request (the main rounds): %.1f µs\n", median(pick(plain.runs, func(w wrkRun) float64 { return w.caddyCPU })))
}

// withPrefix is a copy of a rate_limit handler whose buckets live under
// another key prefix.
func withPrefix(h map[string]any, prefix string) map[string]any {
	c := map[string]any{}
	for k, v := range h {
		c[k] = v
	}
	if r, ok := h["redis"].(map[string]any); ok {
		rc := map[string]any{}
		for k, v := range r {
			rc[k] = v
		}
		rc["key_prefix"] = prefix
		c["redis"] = rc
	}
	return c
}

// onPlans is (b)'s policy on three plans: its own limit, pro's and
// enterprise's, none of which denies under the load.
func onPlans(name string) map[string]any {
	return map[string]any{"name": name, "key": "{http.request.header.X-User}", "rate": "100000/1s",
		"plan": map[string]any{"from": "{http.request.header.X-Plan}", "plans": map[string]any{
			"pro": map[string]any{"rate": "200000/1s"}, "enterprise": map[string]any{"rate": "400000/1s"}}}}
}

// setOverrides sets overrides of the policy for user-1 to user-n through the
// scenario's admin API, as an operator would, one call each.
func setOverrides(s *testcaddy.Session, sc *scenario, policy string, n int) {
	start := time.Now()
	for i := 1; i <= n; i++ {
		body := fmt.Sprintf(`{"policy":%q,"identity":"user-%d","rate":"300000/1s"}`, policy, i)
		resp, err := http.Post(sc.in.Admin+"/rate_limit/override", "application/json", strings.NewReader(body))
		if err != nil {
			s.Fatalf("setting override %d: %v", i, err)
		}
		raw, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 {
			s.Fatalf("setting override %d: %d %s", i, resp.StatusCode, raw)
		}
	}
	fmt.Printf("(%s): %d overrides set in %v\n", sc.name, n, time.Since(start).Round(time.Millisecond))
}

// decisionCost prints the Caddy CPU per request that (b)'s Redis decisions
// add to plain Caddy's, against what (z) adds: the same coalesced round
// trips, arguments and replies, with a script that decides nothing. Their
// difference is what a decision costs Caddy beyond its round trip.
// moneyCost prints what settling in dollars costs Caddy beside settling
// in tokens: (m) against (l), Caddy CPU per request.
func moneyCost(l, m *scenario) {
	if l == nil || m == nil {
		return
	}
	cpu := func(sc *scenario) float64 { return median(pick(sc.runs, func(w wrkRun) float64 { return w.caddyCPU })) }
	var ratios []float64
	for i := range min(len(l.runs), len(m.runs)) {
		ratios = append(ratios, m.runs[i].caddyCPU/l.runs[i].caddyCPU)
	}
	fmt.Printf("\nA settle in dollars (m) against one in tokens (l), Caddy CPU per request (medians of this run): %.1f µs against %.1f, %.3f times "+
		"(round by round %.3f-%.3f; target: at most 1.05).\n", cpu(m), cpu(l), cpu(m)/cpu(l), slices.Min(ratios), slices.Max(ratios))
}

// moneyAtOnce loads (l) and (m) at the same time, each with half the
// connections, round after round, and compares their Caddy CPU per
// request within each round: whatever else the machine runs weighs on both
// alike, which runs seconds apart do not share.
func moneyAtOnce(s *testcaddy.Session, wrk string, redis *testredis.Server, l, m *scenario) {
	if l == nil || m == nil {
		return
	}
	fmt.Printf("\n(l) and (m) loaded at once (wrk -t1 -c%d each), %d rounds of %s:\n", *connections/2, *rounds, *duration)
	var ratios, ls, ms []float64
	for r := range *rounds {
		var runs [2]wrkRun
		var wg sync.WaitGroup
		for i, sc := range []*scenario{l, m} {
			wg.Add(1)
			go func() {
				defer wg.Done()
				runs[i] = runWrkWith(s, wrk, sc.in.URL, sc.script, 1, *connections/2, []int{sc.in.Pid(), redis.Pid()}, func() {})
			}()
		}
		wg.Wait()
		ratios = append(ratios, runs[1].caddyCPU/runs[0].caddyCPU)
		ls, ms = append(ls, runs[0].caddyCPU), append(ms, runs[1].caddyCPU)
		fmt.Printf("round %d: (l) %.0f req/s, Caddy %.1f µs a request; (m) %.0f req/s, Caddy %.1f µs a request; (m)/(l) %.3f\n",
			r+1, runs[0].rps, runs[0].caddyCPU, runs[1].rps, runs[1].caddyCPU, ratios[r])
	}
	fmt.Printf("Caddy CPU per request at once: (m) %.1f µs, (l) %.1f µs (medians); (m)/(l) median %.3f, range %.3f-%.3f (target: at most 1.05).\n",
		median(ms), median(ls), median(ratios), slices.Min(ratios), slices.Max(ratios))
}

func decisionCost(plain, b, z *scenario) {
	if b == nil || z == nil {
		return
	}
	cpu := func(sc *scenario) float64 { return median(pick(sc.runs, func(w wrkRun) float64 { return w.caddyCPU })) }
	calls := func(sc *scenario) float64 { return median(sc.calls) }
	addB, addZ := cpu(b)-cpu(plain), cpu(z)-cpu(plain)
	fmt.Printf("\nWhat a decision adds (Caddy CPU per request, medians of this run): (b) %.1f µs over plain Caddy's %.1f; (z), the same round trips "+
		"(%.3f calls per request, against (b)'s %.3f) with a script that decides nothing, %.1f: (b) adds %.2f times what (z) adds (target: at most 1.25).\n",
		addB, cpu(plain), calls(z), calls(b), addZ, addB/addZ)
}

// withPrices gives a handler the prices of the money scenario: the model
// the requests ask for (and its dated snapshot, the responses').
func withPrices(h map[string]any) map[string]any {
	h["prices"] = map[string]any{"models": []any{map[string]any{"model": "gpt-4.1", "input": 2, "output": 8, "cache_read": 0.5}}}
	return h
}
