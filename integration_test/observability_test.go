package integration_test

import (
	"bufio"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Identities the client sends; none may appear in logs or metrics.
const (
	secretAPIKey = "sk_live_SECRET4242"
	secretUserID = "user-ident-7781"
)

// debugWithAccessLog turns on DEBUG logs and the server's access log, both
// into the instance's log file.
func debugWithAccessLog(cfg map[string]any) {
	cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": "DEBUG"}}}
	srv := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
	srv["logs"] = map[string]any{}
}

// logAppend adds a placeholder to the access log, as `log_append` does.
func logAppend(key, value string) map[string]any {
	return map[string]any{"handler": "log_append", "key": key, "value": value}
}

func scrape(t *testing.T, in *instance) (map[string]*dto.MetricFamily, string) {
	t.Helper()
	resp, err := http.Get(in.Admin + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("/metrics: %d %s", resp.StatusCode, raw)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	mfs, err := p.TextToMetricFamilies(strings.NewReader(string(raw)))
	if err != nil {
		t.Fatalf("/metrics is not Prometheus text: %v", err)
	}
	return mfs, string(raw)
}

// decisionCounts reads caddy_rate_limit_decisions_total as policy/outcome.
func decisionCounts(mfs map[string]*dto.MetricFamily) map[string]float64 {
	out := map[string]float64{}
	mf := mfs["caddy_rate_limit_decisions_total"]
	if mf == nil {
		return out
	}
	for _, m := range mf.Metric {
		var policy, outcome string
		for _, l := range m.Label {
			switch l.GetName() {
			case "policy":
				policy = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		if v := m.GetCounter().GetValue(); v != 0 {
			out[policy+"/"+outcome] += v // summed over classes and plans
		}
	}
	return out
}

// TestObservability: counters per policy and outcome after traffic that
// allows, denies, shadow-denies and (with Redis stopped) fails open; the
// access log reads the placeholders; no identity in logs or metrics; the
// metrics survive a reload.
func TestObservability(t *testing.T) {
	srv := testredis.Start(t)
	handlers := []map[string]any{
		logAppend("rl_decision", "{http.rate_limit.decision}"),
		logAppend("rl_policy", "{http.rate_limit.policy}"),
		logAppend("rl_remaining", "{http.rate_limit.remaining}"),
		logAppend("rl_retry_after", "{http.rate_limit.retry_after}"),
		redisLimiter(srv.Addr, "100ms", nil,
			map[string]any{"name": "per_key", "key": "{http.request.header.X-Api-Key}", "rate": "2/1m"},
			map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "100/1m"},
			map[string]any{"name": "dry", "key": "{http.request.header.X-User}", "rate": "1/1m", "shadow": true},
		),
		echo(),
	}
	in := startCaddyTuned(t, debugWithAccessLog, handlers...)
	send := func() response { return get(t, in.URL, "X-Api-Key", secretAPIKey, "X-User", secretUserID) }

	var got []int
	for range 3 {
		got = append(got, send().status)
	}
	if got[0] != 200 || got[1] != 200 || got[2] != 429 {
		t.Fatalf("statuses %v, want 200 200 429", got)
	}
	// The config's probe at start reports Redis as it finds it (an ERROR
	// when it finds Redis away, by design): it is to find it up, as the
	// requests did.
	waitForLog(t, in, 10*time.Second, "the start's probe", func(e map[string]any) bool {
		return e["level"] == "info" && strings.HasPrefix(e["msg"].(string), "Redis decides for ")
	})
	srv.Stop()
	// Ten failed calls over more than the breaker's span of 250 ms.
	for i := range 10 {
		if i > 0 {
			time.Sleep(30 * time.Millisecond)
		}
		if r := send(); r.status != 200 {
			t.Fatalf("fail_open: %d", r.status)
		}
	}

	mfs, text := scrape(t, in)
	counts := decisionCounts(mfs)
	want := map[string]float64{
		"per_key/allowed": 2, "per_key/denied": 1, "per_key/fail_open": 10,
		"per_user/allowed": 2, "per_user/fail_open": 10,
		"dry/allowed": 1, "dry/shadow_denied": 2, "dry/fail_open": 10,
	}
	for k, v := range want {
		if counts[k] != v {
			t.Errorf("decisions_total{%s} = %v, want %v", k, counts[k], v)
		}
	}
	for k := range counts {
		if _, ok := want[k]; !ok {
			t.Errorf("unexpected decisions_total{%s} = %v", k, counts[k])
		}
	}
	t.Logf("decisions_total: %v", counts)
	if n := mfs["caddy_rate_limit_store_duration_seconds"].GetMetric()[0].GetHistogram().GetSampleCount(); n < 3 {
		t.Errorf("store_duration_seconds has %d samples, want at least the 3 Redis decisions", n)
	}
	errs := 0.0
	for _, m := range mfs["caddy_rate_limit_store_errors_total"].GetMetric() {
		errs += m.GetCounter().GetValue()
	}
	if errs != 10 {
		t.Errorf("store_errors_total sums to %v, want 10 (one per failed call, each of one request)", errs)
	}
	if mfs["caddy_rate_limit_circuit_open"].GetMetric()[0].GetGauge().GetValue() != 1 {
		t.Errorf("circuit_open is not 1 after 10 failed calls in a row over 270 ms")
	}
	for _, secret := range []string{secretAPIKey, secretUserID} {
		if strings.Contains(text, secret) {
			t.Errorf("/metrics contains the identity %q", secret)
		}
	}

	// Logs: access log fields from the placeholders; no identity anywhere;
	// failures logged once, not once per request.
	access, ours := readLogs(t, in.Log)
	if len(access) < 4 {
		raw, _ := os.ReadFile(in.Log)
		t.Fatalf("%d access log entries, want 13:\n%s", len(access), raw)
	}
	var decisions []string
	for _, e := range access {
		decisions = append(decisions, e["rl_decision"].(string))
	}
	if strings.Join(decisions[:4], ",") != "allowed,shadow_denied,denied,fail_open" {
		t.Errorf("access log decisions %v", decisions)
	}
	if e := access[2]; e["rl_policy"] != "per_key" || e["rl_remaining"] != "0" || e["rl_retry_after"] == "0" {
		t.Errorf("access log of the denial: %v", e)
	}
	if e := access[0]; e["rl_policy"] != "per_key" || e["rl_remaining"] != "1" || e["rl_retry_after"] != "0" {
		t.Errorf("access log of the first request: %v", e)
	}
	warns, denials := 0, 0
	for _, e := range ours {
		if e["level"] == "warn" || e["level"] == "error" {
			warns++
		}
		if e["msg"] == "rate limit exceeded" {
			denials++
			if e["level"] != "debug" {
				t.Errorf("a denial logged at %v, want debug", e["level"])
			}
		}
	}
	if denials != 1 {
		t.Errorf("%d denial log entries, want 1", denials)
	}
	if warns == 0 || warns > 2 {
		t.Errorf("%d warnings from the limiter for 10 failed decisions, want 1 or 2 (store down, circuit open)", warns)
	}
	raw, _ := os.ReadFile(in.Log)
	for _, secret := range []string{secretAPIKey, secretUserID} {
		for _, line := range strings.Split(string(raw), "\n") {
			// The access log records request headers as sent: that is
			// Caddy's log, not ours, and an operator can redact it.
			if strings.Contains(line, secret) && !strings.Contains(line, `"logger":"http.log.access`) {
				t.Errorf("log line contains the identity %q: %s", secret, line)
			}
		}
	}

	// A reload: the new config's registry serves the counters.
	in.reload(t, handlers...)
	mfs, _ = scrape(t, in)
	if c := decisionCounts(mfs); c["per_key/allowed"] != 2 {
		t.Errorf("after a reload, decisions_total{per_key/allowed} = %v, want 2", c["per_key/allowed"])
	}
}

// readLogs splits a Caddy log into access log entries and the limiter's
// own entries.
func readLogs(t *testing.T, path string) (access, ours []map[string]any) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var e map[string]any
		if json.Unmarshal(sc.Bytes(), &e) != nil {
			continue
		}
		logger, _ := e["logger"].(string)
		switch {
		case strings.HasPrefix(logger, "http.log.access"):
			access = append(access, e)
		case strings.HasPrefix(logger, "http.handlers.rate_limit"):
			ours = append(ours, e)
		}
	}
	return access, ours
}
