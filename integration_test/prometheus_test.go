package integration_test

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// prometheus is a real Prometheus server (Debian's package, which `make
// test` installs) on a free loopback port with its own storage, scraping
// Caddy instances every second and evaluating rules every second.
type prometheus struct {
	URL string
	cmd *exec.Cmd
	log string
}

// startPrometheus runs prometheus scraping targets (host:port of admin
// APIs), with the rule files given, until the test ends.
func startPrometheus(t *testing.T, targets []string, ruleFiles ...string) *prometheus {
	t.Helper()
	var rules []string
	for _, f := range ruleFiles {
		abs, err := filepath.Abs(f)
		if err != nil {
			t.Fatal(err)
		}
		rules = append(rules, strconv.Quote(abs))
	}
	config := fmt.Sprintf(`global:
  scrape_interval: 1s
  scrape_timeout: 1s
  evaluation_interval: 1s
rule_files: [%s]
scrape_configs:
  - job_name: caddy
    metrics_path: /metrics
    static_configs:
      - targets: [%s]
`, strings.Join(rules, ", "), quoteAll(targets))
	return startPrometheusConfig(t, config)
}

// quoteAll is a YAML flow list's items: each quoted, comma-separated.
func quoteAll(items []string) string {
	quoted := make([]string, len(items))
	for i, s := range items {
		quoted[i] = strconv.Quote(s)
	}
	return strings.Join(quoted, ", ")
}

// startPrometheusConfig runs prometheus with the config (prometheus.yml's
// text) until the test ends.
func startPrometheusConfig(t *testing.T, config string) *prometheus {
	t.Helper()
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		t.Fatalf("prometheus not found (run `make test`, which installs Debian's prometheus package, or apt-get install prometheus): %v", err)
	}
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(config), 0o600); err != nil {
		t.Fatal(err)
	}
	port := testredis.FreePort(t)
	logPath := filepath.Join(dir, "prometheus.log")
	logFile, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "--config.file="+cfgPath, "--storage.tsdb.path="+filepath.Join(dir, "data"),
		"--web.listen-address=127.0.0.1:"+strconv.Itoa(port), "--log.level=warn")
	cmd.Stdout, cmd.Stderr = logFile, logFile
	testproc.DieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("starting prometheus: %v", err)
	}
	p := &prometheus{URL: "http://127.0.0.1:" + strconv.Itoa(port), cmd: cmd, log: logPath}
	t.Cleanup(func() {
		p.stop()
		logFile.Close()
		if t.Failed() {
			out, _ := os.ReadFile(logPath)
			t.Logf("prometheus log:\n%s", out)
		}
	})
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := http.Get(p.URL + "/-/ready")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return p
			}
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logPath)
			t.Fatalf("prometheus not ready within 30s:\n%s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// stop stops the process (SIGTERM, then SIGKILL after 5 s).
func (p *prometheus) stop() {
	if p.cmd.ProcessState == nil {
		testproc.Stop(p.cmd, 5*time.Second)
	}
}

// api calls the HTTP API and decodes its data into out.
func (p *prometheus) api(t *testing.T, path string, query url.Values, out any) error {
	t.Helper()
	resp, err := http.Get(p.URL + path + "?" + query.Encode())
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	var answer struct {
		Status string          `json:"status"`
		Error  string          `json:"error"`
		Data   json.RawMessage `json:"data"`
	}
	if err := json.Unmarshal(raw, &answer); err != nil {
		return fmt.Errorf("%s: %d %s", path, resp.StatusCode, raw)
	}
	if answer.Status != "success" {
		return fmt.Errorf("%s: %s", path, answer.Error)
	}
	return json.Unmarshal(answer.Data, out)
}

// series is one series of a range query's answer.
type series struct {
	Metric map[string]string `json:"metric"`
	Values [][2]any          `json:"values"`
}

// queryRange runs a PromQL range query from start to end, a step a second.
func (p *prometheus) queryRange(t *testing.T, expr string, start, end time.Time) ([]series, error) {
	t.Helper()
	var data struct {
		Result []series `json:"result"`
	}
	err := p.api(t, "/api/v1/query_range", url.Values{
		"query": {expr}, "start": {unixString(start)}, "end": {unixString(end)}, "step": {"1"},
	}, &data)
	return data.Result, err
}

func unixString(t time.Time) string {
	return strconv.FormatFloat(float64(t.UnixMilli())/1000, 'f', 3, 64)
}

// maxValue is the largest finite value of a range query's series (NaN
// and ±Inf, as histogram_quantile gives without samples, are not values).
func maxValue(result []series) (float64, bool) {
	best, any := 0.0, false
	for _, s := range result {
		for _, v := range s.Values {
			str, _ := v[1].(string)
			f, err := strconv.ParseFloat(str, 64)
			if err != nil || f != f || f > 1e308 || f < -1e308 {
				continue
			}
			if !any || f > best {
				best, any = f, true
			}
		}
	}
	return best, any
}

// scrapedSince waits (at most 10 s) until Prometheus has scraped every
// target after since: what happened before since is in its data.
func (p *prometheus) scrapedSince(t *testing.T, since time.Time, targets int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		var data struct {
			Result []struct {
				Value [2]any `json:"value"`
			} `json:"result"`
		}
		err := p.api(t, "/api/v1/query", url.Values{"query": {`timestamp(up == 1)`}}, &data)
		fresh := 0
		for _, r := range data.Result {
			str, _ := r.Value[1].(string)
			if ts, _ := strconv.ParseFloat(str, 64); ts >= float64(since.UnixMilli())/1000 {
				fresh++
			}
		}
		if err == nil && fresh == targets {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("prometheus did not scrape the %d targets within 10s (%d fresh): %v", targets, fresh, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}
