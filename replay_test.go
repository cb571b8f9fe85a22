package ratelimit

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
)

// t0 is when the handmade logs begin.
var t0 = time.Date(2025, 3, 3, 9, 0, 0, 0, time.UTC).UnixMicro()

// logged is an entry of a handmade log: a GET of path by key (X-Api-Key)
// from 192.0.2.1, beginning at at after t0 and lasting dur.
func logged(at, dur time.Duration, key, path string, status int) accesslog.Entry {
	e := accesslog.Entry{Start: t0 + at.Microseconds(), End: t0 + (at + dur).Microseconds(), Method: "GET", Host: "api.example.com",
		URI: path, Proto: "HTTP/1.1", RemoteIP: "192.0.2.1", RemotePort: "5555", ClientIP: "192.0.2.1", Status: status,
		Header: map[string][]string{}, RespHeader: map[string][]string{}}
	if key != "" {
		e.Header["X-Api-Key"] = []string{key}
	}
	return e
}

// replayEntries replays entries, written as Caddy writes them (in the
// order of their ends), through a config of one server whose one route
// runs the handlers (JSON objects without "handler").
func replayEntries(t *testing.T, entries []accesslog.Entry, handlers ...string) (*replayReport, *routeTree) {
	t.Helper()
	var hs []string
	for _, h := range handlers {
		hs = append(hs, `{"handler":"rate_limit",`+strings.TrimPrefix(h, "{"))
	}
	return replayJSON(t, entries, `{"apps":{"http":{"servers":{"s":{"routes":[{"handle":[`+strings.Join(hs, ",")+`,{"handler":"static_response"}]}]}}}}}`)
}

func replayJSON(t *testing.T, entries []accesslog.Entry, config string) (*replayReport, *routeTree) {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	tree, err := replayConfig(ctx, []byte(config))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		for _, h := range tree.handlers() {
			_ = h.Cleanup()
		}
	})
	sorted := append([]accesslog.Entry(nil), entries...)
	for i := 1; i < len(sorted); i++ { // by end, as Caddy writes them
		for j := i; j > 0 && sorted[j].End < sorted[j-1].End; j-- {
			sorted[j], sorted[j-1] = sorted[j-1], sorted[j]
		}
	}
	var buf bytes.Buffer
	for i := range sorted {
		buf.Write(accesslog.AppendJSON(nil, &sorted[i]))
	}
	rep, err := replayReader(tree, accesslog.NewReader("test.log", &buf), true)
	if err != nil {
		t.Fatal(err)
	}
	return rep, tree
}

func policyOf(t *testing.T, rep *replayReport, name string) *policyReplay {
	t.Helper()
	for _, p := range rep.Policies {
		if p.Policy == name {
			return p
		}
	}
	t.Fatalf("no policy %s in the report", name)
	return nil
}

// A burst is decided as the handler decides it: 30 requests at once on a
// bucket of 20 deny 10; ten seconds later 10 tokens are back; another key
// is untouched. The keys denied most are the hashes the module stores.
func TestReplayBurst(t *testing.T) {
	var entries []accesslog.Entry
	for i := range 30 {
		entries = append(entries, logged(time.Duration(i)*time.Microsecond, time.Millisecond, "a", "/", 200))
	}
	for i := range 12 {
		entries = append(entries, logged(10*time.Second+time.Duration(i)*time.Microsecond, time.Millisecond, "a", "/", 200))
	}
	for i := range 5 {
		entries = append(entries, logged(time.Duration(i)*time.Second, time.Millisecond, "b", "/", 200))
	}
	rep, tree := replayEntries(t, entries, `{"key_secret":"s","policies":[{"name":"per_key","key":"{http.request.header.X-Api-Key}","rate":"60/1m","burst":20}]}`)
	p := policyOf(t, rep, "per_key")
	if p.Matched != 47 || p.WouldDeny != 12 || p.FirstDenial == nil || p.FirstDenial.UnixMicro() != t0+20 || p.Keys != 2 {
		t.Fatalf("replay: %+v", p)
	}
	h := tree.handlers()[0]
	if len(p.TopDenied) != 1 || p.TopDenied[0].Key != h.Policies[0].storageKey(h.hasher, "a") || p.TopDenied[0].Denials != 12 || p.TopDenied[0].Identity != "a" {
		t.Fatalf("top denied %+v", p.TopDenied)
	}
	if rep.Requests != 47 || rep.Reached != 47 || rep.Late != 0 {
		t.Errorf("report %+v", rep)
	}
}

// A concurrency policy holds a slot from a request's start to its end (the
// line's ts): lines written in the order requests ended are decided in the
// order they began. The log's own peak in flight is reported.
func TestReplayConcurrentFromDurations(t *testing.T) {
	entries := []accesslog.Entry{
		logged(0, 10*time.Second, "k", "/export", 200),
		logged(time.Second, 10*time.Second, "k", "/export", 200),
		logged(2*time.Second, time.Second, "k", "/export", 200),          // a third in flight: denied
		logged(10500*time.Millisecond, time.Second, "k", "/export", 200), // the first ended: admitted
		logged(10600*time.Millisecond, time.Second, "k", "/export", 200), // two in flight again: denied
		logged(12*time.Second, time.Second, "k", "/export", 200),
	}
	rep, _ := replayEntries(t, entries, `{"policies":[{"name":"exports","key":"{http.request.header.X-Api-Key}","concurrent":2}]}`)
	p := policyOf(t, rep, "exports")
	if p.Matched != 6 || p.WouldDeny != 2 || p.PeakInFlight == nil || *p.PeakInFlight != 3 {
		t.Fatalf("replay: %+v (peak %v)", p, p.PeakInFlight)
	}
	if rep.Late != 0 {
		t.Errorf("%d late", rep.Late)
	}
}

// charge_if charges only the logged responses that match; settle header
// settles at the logged usage; wait admits what it would hold.
func TestReplayAfterResponse(t *testing.T) {
	var entries []accesslog.Entry
	for i := range 10 {
		entries = append(entries, logged(time.Duration(i)*time.Second, 10*time.Millisecond, "a", "/login", 200))
	}
	for i := range 6 {
		entries = append(entries, logged(20*time.Second+time.Duration(i)*time.Second, 10*time.Millisecond, "a", "/login", 401))
	}
	for i := range 10 {
		e := logged(time.Duration(i)*time.Second, 500*time.Millisecond, "a", "/chat", 200)
		e.RespHeader["X-Usage"] = []string{"10"}
		entries = append(entries, e)
	}
	for i := range 5 {
		entries = append(entries, logged(time.Duration(i)*time.Millisecond, time.Millisecond, "w", "/wait", 200))
	}
	rep, _ := replayEntries(t, entries,
		`{"policies":[{"name":"logins","match":{"path":["/login"]},"key":"{client_ip}","rate":"3/1h","charge_if":{"status_code":[401]}}]}`,
		`{"policies":[{"name":"llm","match":{"path":["/chat"]},"key":"{http.request.header.X-Api-Key}","rate":"300/1h","burst":300,"cost":"100","settle":{"from":"header","field":"X-Usage"}}]}`,
		`{"policies":[{"name":"waits","match":{"path":["/wait"]},"key":"{http.request.header.X-Api-Key}","rate":"60/1m","burst":2,"wait":"10s"}]}`)
	if p := policyOf(t, rep, "logins"); p.Matched != 16 || p.WouldDeny != 3 {
		t.Errorf("charge_if: %+v", p)
	}
	// Each reserves 100 and settles at 10: the 4th would be denied unsettled.
	if p := policyOf(t, rep, "llm"); p.Matched != 10 || p.WouldDeny != 0 || len(p.Sources) != 0 || len(p.NotReplayed) != 0 {
		t.Errorf("settle: %+v", p)
	}
	if p := policyOf(t, rep, "waits"); p.Matched != 5 || p.WouldDeny != 0 || p.Delayed != 3 {
		t.Errorf("wait: %+v", p)
	}
}

// What a key reads that the log redacts or lacks is named, with what it
// means and what to log; what the log has under another form is read.
func TestReplaySources(t *testing.T) {
	var entries []accesslog.Entry
	for i := range 20 {
		e := logged(time.Duration(i)*time.Second, time.Millisecond, "", "/", 200)
		e.Header["Authorization"] = []string{accesslog.Redacted}
		e.UserID = "user" + strconv.Itoa(i%4)
		entries = append(entries, e)
	}
	for i := range 10 { // Caddy's hash filter: 8 hex digits, one per client
		e := logged(30*time.Second+time.Duration(i)*time.Second, time.Millisecond, "", "/", 200)
		e.Header["Authorization"] = []string{"0123abc" + strconv.Itoa(i%5)}
		e.Fields = map[string]string{}
		entries = append(entries, e)
	}
	rep, _ := replayEntries(t, entries, `{"policies":[
		{"name":"by_bearer","key":"{http.rate_limit.bearer}","rate":"100/1m"},
		{"name":"by_user","key":"{http.auth.user.id}","rate":"100/1m"},
		{"name":"by_tenant","key":"{http.auth.user.tenant}","rate":"100/1m"},
		{"name":"by_body","key":"global","rate":"100/1m","cost":"openai","settle":{"from":"openai"}}]}`)
	b := policyOf(t, rep, "by_bearer")
	if b.Keys != 6 || len(b.Sources) != 1 || b.Sources[0].Redacted != 20 || !strings.Contains(b.Sources[0].Meaning, "REDACTED on 67%") ||
		!strings.Contains(b.Sources[0].Fix, "request>headers>Authorization hash") {
		t.Errorf("bearer: keys %d, %+v", b.Keys, b.Sources)
	}
	u := policyOf(t, rep, "by_user")
	if u.Keys != 5 || len(u.Sources) != 1 || u.Sources[0].Missing != 10 {
		t.Errorf("user_id: keys %d, %+v", u.Keys, u.Sources)
	}
	tn := policyOf(t, rep, "by_tenant")
	if tn.Keys != 1 || len(tn.Sources) != 1 || !strings.Contains(tn.Sources[0].Fix, "log_append http.auth.user.tenant {http.auth.user.tenant}") ||
		!strings.Contains(tn.Sources[0].Meaning, "every request is one key") {
		t.Errorf("tenant: keys %d, %+v", tn.Keys, tn.Sources)
	}
	bo := policyOf(t, rep, "by_body")
	if len(bo.NotReplayed) != 2 || !strings.Contains(bo.NotReplayed[0], "settle openai: the usage is in the response body") {
		t.Errorf("body: %+v", bo.NotReplayed)
	}

	// A log_append field of the placeholder's name is read as its value.
	for i := range entries {
		entries[i].Fields = map[string]string{"http.auth.user.tenant": "t" + strconv.Itoa(i%3)}
	}
	rep, _ = replayEntries(t, entries, `{"policies":[{"name":"by_tenant2","key":"{http.auth.user.tenant}","rate":"100/1m"}]}`)
	if tn := policyOf(t, rep, "by_tenant2"); tn.Keys != 3 || len(tn.Sources) != 0 {
		t.Errorf("tenant from log_append: keys %d, %+v", tn.Keys, tn.Sources)
	}
}

// Routes lead a request to the handlers Caddy would run: the site of its
// host, the first matching route of a group, nothing after a responder.
func TestReplayRoutes(t *testing.T) {
	entries := []accesslog.Entry{
		logged(0, time.Millisecond, "a", "/v1/x", 200),
		logged(time.Second, time.Millisecond, "a", "/health", 200),
	}
	other := logged(2*time.Second, time.Millisecond, "a", "/v1/x", 200)
	other.Host = "other.example.com"
	entries = append(entries, other)
	config := `{"apps":{"http":{"servers":{"s":{"routes":[
		{"match":[{"host":["api.example.com"]}],"handle":[{"handler":"subroute","routes":[
			{"group":"g","match":[{"path":["/health"]}],"handle":[{"handler":"static_response","body":"ok"}]},
			{"group":"g","handle":[{"handler":"rate_limit","policies":[{"name":"api","key":"global","rate":"1/1h"}]},{"handler":"reverse_proxy"}]}
		]}],"terminal":true},
		{"handle":[{"handler":"rate_limit","policies":[{"name":"rest","key":"global","rate":"1/1h"}]}]}
	]}}}}}`
	rep, _ := replayJSON(t, entries, config)
	if p := policyOf(t, rep, "api"); p.Matched != 1 {
		t.Errorf("api: %+v", p)
	}
	if p := policyOf(t, rep, "rest"); p.Matched != 1 {
		t.Errorf("rest: %+v", p)
	}
	if rep.Reached != 2 {
		t.Errorf("reached %d, want 2", rep.Reached)
	}
}

// replayLogs writes generated logs in dir: a day, and two days of the
// same tenants (twice the lines, the same keys).
func replayLogs(dir string) (map[string]string, error) {
	out := map[string]string{}
	for name, length := range map[string]time.Duration{"day": 24 * time.Hour, "two-days": 48 * time.Hour} {
		f, err := os.Create(filepath.Join(dir, name+".log"))
		if err != nil {
			return nil, err
		}
		d := accesslog.Day{Start: time.Date(2025, 3, 3, 0, 0, 0, 0, time.UTC), Length: length, Requests: 250_000 * int(length/time.Hour) / 24, Tenants: 2000, Seed: 7}
		_, err = d.WriteTo(f)
		f.Close()
		if err != nil {
			return nil, err
		}
		out[name] = f.Name()
	}
	return out, nil
}

// benchConfig is the config of three policies the benchmark replays.
const benchConfig = `{"apps":{"http":{"servers":{"s":{"routes":[{"handle":[{"handler":"rate_limit","key_secret":"bench","policies":[
	{"name":"per_key","key":"{http.request.header.X-Api-Key}","rate":"100/1m","burst":20},
	{"name":"per_ip","key":"{client_ip}","rate":"600/1m"},
	{"name":"exports","match":{"path":["/v1/export"]},"key":"{http.request.header.X-Api-Key}","concurrent":2}
]},{"handler":"static_response"}]}]}}}}}`

// BenchmarkReplay replays a generated day (about 330,000 lines), and two
// days of the same tenants, through three policies: lines/min is the
// figure `replay` must keep above a million on 2 cores; heap-MB is what
// the heap holds at the replay's end, the store and the counts
// included: the same for twice the lines (bounded by the keys).
func BenchmarkReplay(b *testing.B) {
	logs, err := replayLogs(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	for _, name := range []string{"day", "two-days"} {
		b.Run(name, func(b *testing.B) {
			var lines int64
			var heap uint64
			for range b.N {
				var rep *replayReport
				rep, heap, err = replayMeasured(logs[name])
				if err != nil {
					b.Fatal(err)
				}
				lines += rep.Log.Lines
			}
			b.ReportMetric(float64(lines)/b.Elapsed().Minutes(), "lines/min")
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(lines), "ns/line")
			b.ReportMetric(float64(heap)/(1<<20), "heap-MB")
		})
	}
}

// replayMeasured replays the log at path through benchConfig, and
// measures the heap the replay holds when it is done.
func replayMeasured(path string) (*replayReport, uint64, error) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	tree, err := replayConfig(ctx, []byte(benchConfig))
	if err != nil {
		return nil, 0, err
	}
	defer func() {
		for _, h := range tree.handlers() {
			_ = h.Cleanup()
		}
	}()
	rd, err := accesslog.Open([]string{path})
	if err != nil {
		return nil, 0, err
	}
	defer rd.Close()
	rep, err := replayReader(tree, rd, false)
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	runtime.KeepAlive(tree)
	return rep, ms.HeapAlloc, err
}
