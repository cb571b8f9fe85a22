package integration_test

import (
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
)

// Limits chosen from evidence: a day of access logs replayed against two
// configs, and a minute of it sent at its own pace through a real Caddy
// whose 429s the replay must have predicted.

// evidenceDay is the generated day the replay tests use: 60,000 regular
// requests of 300 tenants, and the noisy neighbour, the burst and the
// scraper of accesslog.Day.
var evidenceDay = accesslog.Day{Start: time.Date(2025, 3, 3, 0, 0, 0, 0, time.UTC), Requests: 60_000, Tenants: 300, Seed: 11}

// replayJSON is `caddy rate-limit replay --json`'s report, as much of it as
// the tests read.
type replayJSON struct {
	Requests int64 `json:"requests"`
	Reached  int64 `json:"reached"`
	Log      struct {
		Lines int64 `json:"lines"`
	} `json:"log"`
	LinesPerMinute float64 `json:"lines_per_minute"`
	Policies       []struct {
		Policy      string     `json:"policy"`
		Matched     int64      `json:"matched"`
		WouldDeny   int64      `json:"would_deny"`
		FirstDenial *time.Time `json:"first_denial"`
		Keys        int64      `json:"keys"`
		TopDenied   []struct {
			Key      string `json:"key"`
			Identity string `json:"identity"`
			Denials  int64  `json:"denials"`
		} `json:"top_denied"`
		PeakInFlight *int64 `json:"peak_in_flight"`
		Sources      []struct {
			Source   string  `json:"source"`
			Redacted int64   `json:"redacted"`
			Share    float64 `json:"share"`
			Meaning  string  `json:"meaning"`
			Fix      string  `json:"fix"`
		} `json:"sources"`
		NotReplayed []string `json:"not_replayed"`
	} `json:"policies"`
}

func (r replayJSON) policy(t *testing.T, name string) int {
	t.Helper()
	for i, p := range r.Policies {
		if p.Policy == name {
			return i
		}
	}
	t.Fatalf("no policy %s in the replay", name)
	return -1
}

// runReplay runs the built caddy's `rate-limit replay`, returning what it
// printed (with --json, parsed too).
func runReplay(t *testing.T, config string, args ...string) (string, replayJSON) {
	t.Helper()
	cmd := exec.Command(caddyBin, append([]string{"rate-limit", "replay", "--config", config}, args...)...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("caddy rate-limit replay: %v\n%s%s", err, stdout.String(), stderr.String())
	}
	var rep replayJSON
	if strings.Contains(strings.Join(args, " "), "--json") {
		if err := json.Unmarshal(stdout.Bytes(), &rep); err != nil {
			t.Fatalf("replay --json: %v\n%s", err, stdout.String())
		}
	}
	return stdout.String(), rep
}

// writeDay writes the generated day, gzip-compressed, as a rotated log.
func writeDay(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "access.log.1.gz")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	zw := gzip.NewWriter(f)
	if _, err := evidenceDay.WriteTo(zw); err != nil {
		t.Fatal(err)
	}
	if err := zw.Close(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	return path
}

// TestReplayDay: a generated day of logs (a burst, a noisy neighbour, a
// scraper, Authorization REDACTED as Caddy logs it) replayed against two
// configs with `caddy rate-limit replay`. The first keys a policy on the
// bearer token: the replay names the redaction, what it means and what to
// log; the noisy neighbour is the key denied most, named by the hash the
// module stores, first denied when it starts; the burst and the scraper
// are denied when they come. The second, keyed on what the log has and
// looser, names nothing and denies less.
func TestReplayDay(t *testing.T) {
	dir := t.TempDir()
	day := writeDay(t, dir)
	strict := filepath.Join(dir, "strict.caddyfile")
	os.WriteFile(strict, []byte(`api.example.com {
	rate_limit {
		key_secret evidence-secret
		policy per_key {
			match header X-Api-Key *
			key {http.request.header.X-Api-Key}
			rate 100/1m
			burst 20
		}
		policy per_ip {
			key {client_ip}
			rate 300/1m
		}
		policy per_token {
			key {http.rate_limit.bearer}
			rate 600/1m
		}
		policy exports {
			match path /v1/export
			key {http.request.header.X-Api-Key}
			concurrent 2
		}
		policy logins {
			match path /v1/login
			key {client_ip}
			rate 5/15m
			charge_if {
				status 401
			}
		}
		policy llm {
			match path /v1/chat
			key {http.request.header.X-Api-Key}
			rate 20000/1m
			cost {http.request.header.X-Max-Tokens} max 8000
			settle header X-Usage-Tokens
		}
	}
	respond 200
}
`), 0o600)
	loose := filepath.Join(dir, "loose.caddyfile")
	os.WriteFile(loose, []byte(`api.example.com {
	rate_limit {
		key_secret evidence-secret
		policy per_key {
			match header X-Api-Key *
			key {http.request.header.X-Api-Key}
			rate 300/1m
			burst 100
		}
		policy per_ip {
			key {client_ip}
			rate 1200/1m
		}
	}
	respond 200
}
`), 0o600)

	began := time.Now()
	text, _ := runReplay(t, strict, day)
	t.Logf("caddy rate-limit replay --config strict.caddyfile access.log.1.gz (%v):\n%s", time.Since(began).Round(time.Millisecond), text)
	_, rep := runReplay(t, strict, day, "--json")
	if rep.Requests < 190_000 || rep.Reached != rep.Requests || rep.Policies[rep.policy(t, "per_key")].Matched != rep.Requests-2400 {
		t.Fatalf("replayed %d requests, %d reached the handler", rep.Requests, rep.Reached)
	}
	start := evidenceDay.Start
	pk := rep.Policies[rep.policy(t, "per_key")]
	if len(pk.TopDenied) == 0 || pk.TopDenied[0].Key != secretKey("evidence-secret", "per_key", accesslog.NoisyKey) || pk.TopDenied[0].Identity != "" {
		t.Errorf("per_key: the key denied most is %+v, want the noisy neighbour's hash %s, no identity", pk.TopDenied, secretKey("evidence-secret", "per_key", accesslog.NoisyKey))
	}
	if f := pk.FirstDenial; f == nil || f.Before(start.Add(accesslog.NoisyFrom)) || f.After(start.Add(accesslog.NoisyFrom+time.Minute)) {
		t.Errorf("per_key first denied at %v, want within a minute of the noisy neighbour's start", f)
	}
	var burstDenied bool
	for _, k := range pk.TopDenied {
		burstDenied = burstDenied || k.Key == secretKey("evidence-secret", "per_key", accesslog.BurstKey) && k.Denials >= 250
	}
	if !burstDenied {
		t.Errorf("per_key: the burst (300 in 5s on a bucket of 20) is not among the keys denied most: %+v", pk.TopDenied)
	}
	ip := rep.Policies[rep.policy(t, "per_ip")]
	if len(ip.TopDenied) == 0 || ip.TopDenied[0].Key != secretKey("evidence-secret", "per_ip", accesslog.ScraperIP) ||
		ip.FirstDenial == nil || ip.FirstDenial.Before(start.Add(accesslog.ScraperFrom)) || ip.FirstDenial.After(start.Add(accesslog.ScraperFrom+time.Minute)) {
		t.Errorf("per_ip: %+v, first denial %v: want the scraper, from 14:00", ip.TopDenied, ip.FirstDenial)
	}
	tok := rep.Policies[rep.policy(t, "per_token")]
	if tok.Keys > 2 || len(tok.Sources) == 0 || tok.Sources[0].Redacted == 0 || tok.Sources[0].Share < 0.95 ||
		!strings.Contains(tok.Sources[0].Meaning, "REDACTED") || !strings.Contains(tok.Sources[0].Fix, "request>headers>Authorization hash") {
		t.Errorf("per_token: the redaction is not named: keys %d, %+v", tok.Keys, tok.Sources)
	}
	if !strings.Contains(text, "per_token: its key reads request header Authorization: the log shows it as REDACTED on") {
		t.Errorf("the replay's text does not name the redaction")
	}
	ex := rep.Policies[rep.policy(t, "exports")]
	if ex.PeakInFlight == nil || *ex.PeakInFlight < 3 || ex.WouldDeny == 0 {
		t.Errorf("exports: peak in flight %v, %d denials", ex.PeakInFlight, ex.WouldDeny)
	}
	if llm := rep.Policies[rep.policy(t, "llm")]; llm.Matched == 0 || len(llm.NotReplayed) != 0 || len(llm.Sources) != 0 {
		t.Errorf("llm (settled from a logged header): %+v", llm)
	}

	_, lrep := runReplay(t, loose, day, "--json")
	for _, name := range []string{"per_key", "per_ip"} {
		s, l := rep.Policies[rep.policy(t, name)], lrep.Policies[lrep.policy(t, name)]
		if l.Matched != s.Matched || l.WouldDeny >= s.WouldDeny || len(l.Sources) != 0 || len(s.Sources) != 0 {
			t.Errorf("%s: the looser config denies %d of %d, the stricter %d of %d", name, l.WouldDeny, l.Matched, s.WouldDeny, s.Matched)
		}
		t.Logf("%s: strict %d would-be denials of %d, loose %d", name, s.WouldDeny, s.Matched, l.WouldDeny)
	}
}

// sliceOf is the entries of the day that begin in [from, from+d), by start.
func sliceOf(from, d time.Duration) []accesslog.Entry {
	lo, hi := evidenceDay.Start.Add(from).UnixMicro(), evidenceDay.Start.Add(from+d).UnixMicro()
	var out []accesslog.Entry
	_ = evidenceDay.Each(func(e *accesslog.Entry) error {
		if e.Start >= lo && e.Start < hi {
			c := *e
			c.Header, c.RespHeader = map[string][]string{}, map[string][]string{}
			for k, v := range e.Header {
				c.Header[k] = append([]string(nil), v...)
			}
			for k, v := range e.RespHeader {
				c.RespHeader[k] = append([]string(nil), v...)
			}
			out = append(out, c)
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Start < out[j].Start })
	return out
}

// replayUpstream answers as the log says the request was answered: the
// status and the usage header the test sends it, at the time the request
// ended (X-Replay-Until, Unix ns: the test and the upstream share a clock),
// so that a request sent late still ends when its line says.
func replayUpstream(t *testing.T, arrived *sync.Map) *httptest.Server {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if id := r.Header.Get("X-Replay-Id"); id != "" && arrived != nil {
			arrived.Store(id, time.Now())
		}
		until, _ := strconv.ParseInt(r.Header.Get("X-Replay-Until"), 10, 64)
		time.Sleep(time.Until(time.Unix(0, until)) - 500*time.Microsecond) // the answer's way back through Caddy
		if u := r.Header.Get("X-Replay-Usage"); u != "" {
			w.Header().Set("X-Usage-Tokens", u)
		}
		status, _ := strconv.Atoi(r.Header.Get("X-Replay-Status"))
		if status == 0 {
			status = 200
		}
		w.WriteHeader(status)
	}))
	t.Cleanup(srv.Close)
	return srv
}

// agreementPolicies are the policies of the agreement test: the limits of
// TestReplayDay's stricter config, tighter where the slice would not
// reach them.
func agreementPolicies() []map[string]any {
	return []map[string]any{
		{"name": "per_key", "match": map[string]any{"header": map[string]any{"X-Api-Key": []string{"*"}}}, "key": "{http.request.header.X-Api-Key}", "rate": "100/1m", "burst": 20},
		{"name": "per_ip", "key": "{client_ip}", "rate": "300/1m", "burst": 30},
		{"name": "exports", "match": map[string]any{"path": []string{"/v1/export"}}, "key": "{http.request.header.X-Api-Key}", "concurrent": 1},
		{"name": "logins", "match": map[string]any{"path": []string{"/v1/login"}}, "key": "{client_ip}", "rate": "2/1m", "charge_if": map[string]any{"status_code": []int{401}}},
		{"name": "llm", "match": map[string]any{"path": []string{"/v1/chat"}}, "key": "{http.request.header.X-Api-Key}", "rate": "8000/1m", "burst": 8000,
			"cost": "{http.request.header.X-Max-Tokens}", "max_cost": 4000, "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}},
	}
}

// TestReplayAgreesWithCaddy: the minute of the day from 09:00 (the burst,
// the noisy neighbour, the tenants) is sent at its own pace through a real
// Caddy with the agreement policies, each request answered upstream as the
// log says (status, usage header, the time it ended). Caddy writes its own
// access log of the minute; `caddy rate-limit replay` of that log, through
// the same config, must name in its would-be denials the policies Caddy's
// 429s named, within 2% per policy (of the larger count, at least one
// request: a count that small cannot differ by a fraction of one): the
// replay runs the module's own decision code on the times Caddy saw.
//
// The replay of the minute as generated is compared too. Its requests
// cannot leave exactly on time: in the burst, one every 17 ms, a request
// leaving a few ms late can take the token another would have had, which
// changes what the request's other policies decide (a slot, a charge); so
// it is held to 2% only when every request left within 5 ms of its time
// (a quiet machine), and reported otherwise. Its concurrency policy is
// reported only: which export holds the slot, for seconds, is decided by
// which of the burst's requests took per_key's token first, and a request
// a millisecond later, or decided a millisecond later by a loaded Caddy,
// moves every later decision of that slot (4, 9 and 13 denied in three
// runs of one machine, the replay of Caddy's own log equal to Caddy's
// each time, then 8 against Caddy's 9 in 2 of 4 later runs: Caddy's log
// gives a request's start, and requests of one key that reach Caddy within
// a millisecond may be decided in another order than their starts, which
// moves the slot just the same; llm, whose charge follows per_key's
// decision, the same way, see below). The other rate policies of the replay of
// Caddy's own log are held to 2% when Caddy passed every admitted request
// on within 5 ms of the start its log gives (0.6 to 1.5 ms in 11 runs
// alone), reported otherwise: once, in a full run of the suite, the replay
// of its log gave 7 more per_key denials and 9 fewer llm ones than Caddy
// (314 and 50 against 307 and 59), as requests Caddy decided later than
// their logged start do (a later decision finds more refilled).
func TestReplayAgreesWithCaddy(t *testing.T) {
	entries := sliceOf(accesslog.BurstAt, time.Minute)
	// Requests still running a second after the minute end then (in the
	// slice as sent and as replayed): the test need not wait for exports of
	// up to 20 s.
	until := evidenceDay.Start.Add(accesslog.BurstAt + time.Minute + time.Second).UnixMicro()
	for i := range entries {
		entries[i].End = min(entries[i].End, until)
	}
	var arrived sync.Map // X-Replay-Id → when the upstream got it
	up := replayUpstream(t, &arrived)
	handler := limiter("", map[string]any{"key_secret": "evidence-secret", "jitter": 0}, agreementPolicies()...)
	proxy := map[string]any{"handler": "reverse_proxy", "upstreams": []map[string]any{{"dial": strings.TrimPrefix(up.URL, "http://")}}}
	dir := t.TempDir()
	accessLog := filepath.Join(dir, "caddy-access.log")
	tune := func(cfg map[string]any) {
		srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
		srv["trusted_proxies"] = map[string]any{"source": "static", "ranges": []string{"127.0.0.1/32"}}
		srv["client_ip_headers"] = []string{"X-Forwarded-For"}
		srv["logs"] = map[string]any{}
		cfg["logging"] = map[string]any{"logs": map[string]any{
			"default": map[string]any{"level": "WARN", "exclude": []string{"http.log.access"}},
			"access": map[string]any{"writer": map[string]any{"output": "file", "filename": accessLog},
				"encoder": map[string]any{"format": "json"}, "include": []string{"http.log.access"}},
		}}
	}
	in := startCaddyTuned(t, tune, handler, proxy)

	// The same config, for the replay.
	config := filepath.Join(dir, "caddy.json")
	cfg := map[string]any{"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"test": map[string]any{
		"routes": []any{map[string]any{"handle": []any{handler, proxy}}}}}}}}
	raw, _ := json.Marshal(cfg)
	os.WriteFile(config, raw, 0o600)
	var log bytes.Buffer
	for i := range entries {
		log.Write(accesslog.AppendJSON(nil, &entries[i]))
	}
	logPath := filepath.Join(dir, "minute.log")
	os.WriteFile(logPath, log.Bytes(), 0o600)

	// At its own pace: each request sent at its start's offset.
	client := &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: 256, DisableCompression: true}}
	caddyDenied := map[string]int64{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	var late time.Duration
	first := entries[0].Start
	began := time.Now().Add(200 * time.Millisecond)
	for i, e := range entries {
		wg.Add(1)
		go func() {
			defer wg.Done()
			at := began.Add(time.Duration(e.Start-first) * time.Microsecond)
			time.Sleep(time.Until(at))
			l := time.Since(at)
			req, _ := http.NewRequest(e.Method, in.URL+e.URI, nil)
			for k, vs := range e.Header {
				if k != "Authorization" {
					req.Header[k] = vs
				}
			}
			req.Header.Set("X-Forwarded-For", e.ClientIP)
			req.Header.Set("X-Replay-Id", strconv.Itoa(i))
			req.Header.Set("X-Replay-Status", strconv.Itoa(e.Status))
			req.Header.Set("X-Replay-Until", strconv.FormatInt(began.Add(time.Duration(e.End-first)*time.Microsecond).UnixNano(), 10))
			if u := e.RespHeader["X-Usage-Tokens"]; len(u) > 0 {
				req.Header.Set("X-Replay-Usage", u[0])
			}
			resp, err := client.Do(req)
			if err != nil {
				t.Errorf("sending: %v", err)
				return
			}
			body, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			mu.Lock()
			defer mu.Unlock()
			late = max(late, l)
			if resp.StatusCode != 429 {
				return
			}
			var p struct {
				Violated []string `json:"violated-policies"`
			}
			if err := json.Unmarshal(body, &p); err != nil {
				t.Errorf("a 429's body: %v: %s", err, body)
			}
			for _, name := range p.Violated {
				caddyDenied[name]++
			}
		}()
	}
	wg.Wait()
	sent := time.Since(began)
	in.Stop() // its access log complete

	compare := func(what string, rep replayJSON, strict func(policy string) bool) {
		t.Helper()
		if rep.Requests != int64(len(entries)) {
			t.Fatalf("%s: replayed %d requests of %d", what, rep.Requests, len(entries))
		}
		var table []string
		for _, p := range rep.Policies {
			c := caddyDenied[p.Policy]
			tolerance := max(1, int64(math.Ceil(0.02*float64(max(c, p.WouldDeny)))))
			diff := c - p.WouldDeny
			table = append(table, fmt.Sprintf("%-8s matched %5d  replay %5d  caddy %5d  difference %+d (allowed %d)", p.Policy, p.Matched, p.WouldDeny, c, diff, tolerance))
			if strict(p.Policy) && (diff > tolerance || -diff > tolerance) {
				t.Errorf("%s: %s: the replay would deny %d, Caddy denied %d: more than 2%% apart", what, p.Policy, p.WouldDeny, c)
			}
		}
		t.Logf("%s against Caddy's 429s:\n%s", what, strings.Join(table, "\n"))
	}
	onTime := late < 5*time.Millisecond
	t.Logf("%d requests of the minute from 09:00 sent at their pace in %v, the latest %v late", len(entries), sent.Round(time.Millisecond), late.Round(100*time.Microsecond))
	_, rep := runReplay(t, config, logPath, "--json")
	compare("the replay of the minute as generated", rep, func(policy string) bool { return onTime && policy != "exports" })
	if !onTime {
		t.Logf("a request left %v late (a loaded machine): the replay of the minute as generated is reported, not held to 2%%", late.Round(100*time.Microsecond))
	}
	// Caddy's log says when each request began; the replay decides it
	// then. A request Caddy decided later (its process held off the CPU
	// between the two) may have found a token the replay does not give it:
	// how late Caddy was is the time its upstream got the request less the
	// start its log gives.
	lag := decisionLag(t, accessLog, &arrived)
	t.Logf("Caddy passed every admitted request on within %v of the start its log gives", lag.Round(100*time.Microsecond))
	_, own := runReplay(t, config, accessLog, "--json")
	// llm, like exports, is reported only: which of two requests of one key
	// that began within a millisecond Caddy decided first is not in its log,
	// and when per_key admits the other one, llm charges that one's tokens
	// (thousands, of a budget of 8000) instead: one swap moved llm by 6 of 58
	// in a full run of the suite, per_key by 2. A decision time in the access
	// log, for the replay to decide by, would let both be held.
	compare("the replay of Caddy's own access log of the minute", own, func(policy string) bool {
		return lag < 5*time.Millisecond && policy != "exports" && policy != "llm"
	})
	if lag >= 5*time.Millisecond {
		t.Logf("Caddy passed a request on %v after the start its log gives (a loaded machine): the replay of its log is reported, not held to 2%%", lag.Round(100*time.Microsecond))
	}
}

// decisionLag is the longest time between a request's start in Caddy's
// access log and its arrival upstream (arrived, by X-Replay-Id).
func decisionLag(t *testing.T, accessLog string, arrived *sync.Map) time.Duration {
	t.Helper()
	log, err := accesslog.Open([]string{accessLog})
	if err != nil {
		t.Fatal(err)
	}
	defer log.Close()
	var lag time.Duration
	var e accesslog.Entry
	for log.Next(&e) {
		ids := e.Header["X-Replay-Id"]
		if len(ids) == 0 {
			continue
		}
		if at, ok := arrived.Load(ids[0]); ok {
			lag = max(lag, at.(time.Time).Sub(time.UnixMicro(e.Start)))
		}
	}
	if err := log.Err(); err != nil {
		t.Fatal(err)
	}
	return lag
}
