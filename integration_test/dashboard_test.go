package integration_test

import (
	"encoding/json"
	"io"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The dashboard and alerting rules operators load, and the guide that
// says how (its metrics site and Prometheus config).
const (
	dashboardFile  = "../docs/grafana/rate-limit-dashboard.json"
	alertRulesFile = "../docs/prometheus/rate-limit-alerts.yml"
	operatorsGuide = "../docs/operators-guide.md"
)

// guidePrometheusConfig is the operators' guide's prometheus.yml with the
// test's targets (the instances' metrics sites), a scrape and an
// evaluation every second instead of every 15 s, and the rules file's
// path. The guide's targets are on its metrics site's port.
func guidePrometheusConfig(t *testing.T, targets []string) string {
	t.Helper()
	config := docsBlock(t, operatorsGuide, "yaml", "scrape_configs:")
	rules, err := filepath.Abs(alertRulesFile)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct{ re, with string }{
		{`(?m)^(\s*)scrape_interval: 15s$`, "${1}scrape_interval: 1s\n${1}scrape_timeout: 1s"},
		{`(?m)^(\s*)evaluation_interval: 15s$`, "${1}evaluation_interval: 1s"},
		{`(?m)^(\s*)- rate-limit-alerts\.yml$`, "${1}- " + strconv.Quote(rules)},
		{`(?m)^(\s*)- targets: \["caddy-1\.internal:9180".*\]$`, "${1}- targets: [" + quoteAll(targets) + "]"},
	} {
		re := regexp.MustCompile(r.re)
		if !re.MatchString(config) {
			t.Fatalf("%s: the Prometheus config has no line matching %s:\n%s", operatorsGuide, r.re, config)
		}
		config = re.ReplaceAllString(config, r.with)
	}
	if strings.Contains(config, "metrics_path") || strings.Contains(config, "2019") {
		t.Fatalf("%s: the Prometheus config should scrape the metrics site's /metrics, not the admin API:\n%s", operatorsGuide, config)
	}
	t.Logf("prometheus.yml:\n%s", config)
	return config
}

// grafanaPanel is what the test reads of a dashboard's panel.
type grafanaPanel struct {
	ID         int    `json:"id"`
	Type       string `json:"type"`
	Title      string `json:"title"`
	Datasource struct {
		UID string `json:"uid"`
	} `json:"datasource"`
	Targets []struct {
		RefID string `json:"refId"`
		Expr  string `json:"expr"`
	} `json:"targets"`
	Panels []grafanaPanel `json:"panels"` // a collapsed row's
}

type grafanaDashboard struct {
	Panels     []grafanaPanel `json:"panels"`
	Templating struct {
		List []struct {
			Name       string `json:"name"`
			Definition string `json:"definition"`
		} `json:"list"`
	} `json:"templating"`
}

// readDashboard parses the dashboard and lists its panels with queries,
// rows' panels included.
func readDashboard(t *testing.T) (grafanaDashboard, []grafanaPanel) {
	t.Helper()
	raw, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d grafanaDashboard
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s is not a dashboard: %v", dashboardFile, err)
	}
	var panels []grafanaPanel
	var walk func(ps []grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			if p.Type == "row" {
				walk(p.Panels)
				continue
			}
			panels = append(panels, p)
		}
	}
	walk(d.Panels)
	return d, panels
}

// grafanaVars are the values the test gives the dashboard's variables: all
// instances and policies ("All" is .*), and for Grafana's rate interval
// (4 scrape intervals, at least) 10 s: room for a scrape of a busy instance
// that timed out.
var grafanaVars = strings.NewReplacer("$__rate_interval", "10s", "$instance", ".*", "$policy", ".*")

// fleetDisagreements is the gauge of instances that enforce a policy
// differently: the two instances here agree, so it returns 0 (data).
const fleetDisagreements = "caddy_rate_limit_fleet_disagreements"

// TestDashboard runs every query of every panel of the Grafana dashboard
// (parsed from its JSON, so that the test cannot drift from it) against a
// real Prometheus, configured as the operators' guide says, scraping the
// guide's metrics site on two Caddy instances under a short load that
// exercises every panel: a shared budget, a shadow policy, a quota, a
// settle whose upstream reports no usage, a concurrency limit, a shed
// policy with two priority classes, and policies whose Redis is down
// (fail_open, fail_closed, local). Each query returns data with a value
// above 0 over the load. The same Prometheus evaluates the alerting rules:
// each is healthy, and the alerts the load is about are pending or firing.
func TestDashboard(t *testing.T) {
	dash, panels := readDashboard(t)
	if len(panels) < 12 {
		t.Fatalf("%d panels in %s, it has more", len(panels), dashboardFile)
	}
	ids := map[int]bool{}
	for _, p := range panels {
		if ids[p.ID] || p.Title == "" || len(p.Targets) == 0 || p.Datasource.UID != "${datasource}" {
			t.Errorf("panel %d %q: want a unique id, a title, queries and the ${datasource} variable", p.ID, p.Title)
		}
		ids[p.ID] = true
	}

	srv := testredis.Start(t)
	down := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t)) // a Redis that is not there
	upstream := startHoldingUpstream(t)                        // holds each request X-Hold ms
	routes := dashboardRoutes(srv.Addr, down, upstream.addr)

	// Each instance serves its metrics on the operators' guide's metrics
	// site (adapted by caddy adapt), on a port of its own, and Prometheus
	// scrapes them with the guide's config: the admin API is not scraped.
	site := servers(t, caddyAdapt(t, docsBlock(t, operatorsGuide, "caddyfile", "\tmetrics\n")))
	for _, s := range site {
		if listen, _ := json.Marshal(s.(map[string]any)["listen"]); len(site) != 1 || string(listen) != `[":9180"]` {
			t.Fatalf("the guide's metrics site: want one site on :9180, its Prometheus targets' port: %v", site)
		}
	}
	var fleet []*instance
	var targets []string
	for range 2 {
		metricsAddr := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
		tune := func(cfg map[string]any) {
			srvs := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)
			srvs["test"].(map[string]any)["routes"] = routes
			for _, s := range site {
				metrics := map[string]any{}
				for k, v := range s.(map[string]any) {
					metrics[k] = v
				}
				metrics["listen"] = []string{metricsAddr}
				srvs["metrics"] = metrics
			}
		}
		fleet = append(fleet, startCaddyTuned(t, tune, respond()))
		targets = append(targets, metricsAddr)
	}
	prom := startPrometheusConfig(t, guidePrometheusConfig(t, targets))
	prom.scrapedSince(t, time.Now(), len(fleet)) // the load is seen from its start

	start := time.Now()
	sent := dashboardLoad(t, fleet, 8*time.Second)
	end := time.Now()
	t.Logf("load: %v over %v", sent, end.Sub(start).Round(time.Millisecond))
	prom.scrapedSince(t, end, len(fleet))

	for _, p := range panels {
		t.Run(p.Title, func(t *testing.T) {
			for _, target := range p.Targets {
				expr := grafanaVars.Replace(target.Expr)
				if strings.Contains(expr, "$") {
					t.Fatalf("%s: a variable the test does not know: %s", target.RefID, expr)
				}
				result, err := prom.queryRange(t, expr, start, time.Now())
				if err != nil {
					t.Fatalf("%s: %v", target.RefID, err)
				}
				top, ok := maxValue(result)
				t.Logf("%s: %d series, max %v: %s", target.RefID, len(result), top, expr)
				switch {
				case len(result) == 0 || !ok:
					t.Errorf("%s returned no data: %s", target.RefID, expr)
				case top <= 0 && !strings.Contains(expr, fleetDisagreements): // two instances in agreement: 0
					t.Errorf("%s: every value is 0 under a load meant to show it: %s", target.RefID, expr)
				}
				if t.Failed() { // were the instances scraped all along?
					up, _ := prom.queryRange(t, "up", start, time.Now())
					t.Logf("up over the load: %v", up)
				}
			}
		})
	}

	// The variables' queries (label_values(metric, label)) find values.
	labelValues := regexp.MustCompile(`^label_values\((\w+), (\w+)\)$`)
	for _, v := range dash.Templating.List {
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil {
			continue
		}
		var values []string
		if err := prom.api(t, "/api/v1/label/"+m[2]+"/values", url.Values{"match[]": {m[1]}}, &values); err != nil || len(values) == 0 {
			t.Errorf("variable %s (%s): %v, %v", v.Name, v.Definition, values, err)
		}
	}

	checkAlertRules(t, prom)
}

// checkAlertRules: every rule of the rules file evaluates without error,
// and the alerts about what the load did are pending or firing.
func checkAlertRules(t *testing.T, prom *prometheus) {
	t.Helper()
	want := []string{"RateLimitRedisUnreachable", "RateLimitCircuitOpen", "RateLimitFailingOpen", "RateLimitOnErrorFallback", "RateLimitChargesLost", "RateLimitShedding"}
	type rule struct {
		Name      string `json:"name"`
		Health    string `json:"health"`
		LastError string `json:"lastError"`
		State     string `json:"state"`
		Query     string `json:"query"`
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		var data struct {
			Groups []struct {
				Rules []rule `json:"rules"`
			} `json:"groups"`
		}
		if err := prom.api(t, "/api/v1/rules", nil, &data); err != nil {
			t.Fatal(err)
		}
		rules := map[string]rule{}
		for _, g := range data.Groups {
			for _, r := range g.Rules {
				rules[r.Name] = r
			}
		}
		var waiting []string
		for _, name := range want {
			if r := rules[name]; r.State != "pending" && r.State != "firing" {
				waiting = append(waiting, name+" "+r.State)
			}
		}
		bad := false
		for _, r := range rules {
			if r.Health == "err" || r.LastError != "" {
				t.Errorf("rule %s: %s %s", r.Name, r.Health, r.LastError)
				bad = true
			}
		}
		if len(rules) < 9 || bad {
			t.Fatalf("%d rules loaded from %s", len(rules), alertRulesFile)
		}
		if len(waiting) == 0 {
			for _, r := range rules {
				t.Logf("alert %s: %s (%s)", r.Name, r.State, r.Health)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("alerts not pending or firing after the load: %v", waiting)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// dashboardRoutes is the two instances' config: a route per thing the
// dashboard shows.
func dashboardRoutes(redisAddr, downAddr, upstream string) []any {
	shared := func(policies ...map[string]any) map[string]any {
		return redisLimiter(redisAddr, "1s", nil, policies...)
	}
	route := func(path string, handlers ...map[string]any) map[string]any {
		return map[string]any{"match": []any{map[string]any{"path": []string{path}}}, "handle": handlers}
	}
	key := "{http.request.header.X-Api-Key}"
	return []any{
		route("/api",
			shared(
				map[string]any{"name": "per_key", "key": key, "rate": "20/1s", "burst": 10},
				map[string]any{"name": "per_key_trial", "key": key, "rate": "5/1s", "burst": 5, "shadow": true},
			),
			respond()),
		route("/quota", // its own route: its denials go on once the quotas are used up
			shared(map[string]any{"name": "monthly", "key": "{http.request.header.X-Tenant}", "quota": "60/minute"}),
			respond()),
		route("/llm", // its own route, so that its lost charges go on while the quota above denies
			shared(map[string]any{"name": "tokens", "key": key, "rate": "100000/1m", "cost": 10, "settle": map[string]any{"from": "header", "field": "X-Usage-Tokens"}}),
			respond()),
		route("/export",
			shared(map[string]any{"name": "exports", "key": "global", "concurrent": 2}),
			proxyTo(upstream)),
		route("/shed",
			shared(map[string]any{"name": "capacity", "key": "global",
				"shed":     map[string]any{"concurrent": 4, "latency": "50ms"},
				"priority": map[string]any{"from": "{http.request.header.X-Priority}", "classes": []any{map[string]any{"name": "critical", "share": "100%"}, map[string]any{"name": "batch", "share": "50%"}}}}),
			proxyTo(upstream)),
		route("/money", // a money budget: spend, and requests for a model with no price
			func() map[string]any {
				h := shared(map[string]any{"name": "team_usd", "key": key, "unit": "usd", "rate": "100/1h", "cost": "openai", "max_cost": 0.01,
					"settle": map[string]any{"from": "openai"}})
				h["prices"] = map[string]any{"models": []any{map[string]any{"model": "gpt-4.1", "input": 2, "output": 8}}}
				return h
			}(),
			map[string]any{"handler": "static_response", "status_code": 200, "headers": map[string]any{"Content-Type": []string{"application/json"}},
				"body": `{"model":"gpt-4.1-2025-04-14","usage":{"prompt_tokens":100,"completion_tokens":20,"total_tokens":120}}`}),
		route("/down/open",
			redisLimiter(downAddr, "100ms", nil, map[string]any{"name": "down_open", "key": "global", "rate": "1000/1s"}),
			respond()),
		route("/down/closed",
			redisLimiter(downAddr, "100ms", map[string]any{"on_error": "fail_closed"}, map[string]any{"name": "down_closed", "key": "global", "rate": "1000/1s"}),
			respond()),
		route("/down/local",
			redisLimiter(downAddr, "100ms", map[string]any{"on_error": "local", "instances": 2}, map[string]any{"name": "down_local", "key": "{http.request.header.X-Api-Key}", "rate": "5/1s"}),
			respond()),
	}
}

// dashboardLoad sends requests to every route of both instances for d,
// from a few workers per route, and counts the statuses by route.
func dashboardLoad(t *testing.T, fleet []*instance, d time.Duration) map[string]map[int]int {
	t.Helper()
	type worker struct {
		path    string
		headers []string
		pause   time.Duration
		body    string // a POST's
	}
	var workers []worker
	for range 4 {
		workers = append(workers, worker{"/api", []string{"X-Api-Key", "shared-key"}, 5 * time.Millisecond, ""})
	}
	for i := range 2 {
		workers = append(workers, worker{"/quota", []string{"X-Tenant", "tenant-" + strconv.Itoa(i)}, 10 * time.Millisecond, ""})
	}
	for range 4 {
		workers = append(workers, worker{"/export", []string{"X-Hold", "200"}, 10 * time.Millisecond, ""})
	}
	for i := range 8 {
		workers = append(workers, worker{"/shed", []string{"X-Hold", "200", "X-Priority", []string{"critical", "batch"}[i%2]}, 10 * time.Millisecond, ""})
	}
	for _, p := range []string{"/llm", "/down/open", "/down/closed", "/down/local"} {
		workers = append(workers, worker{p, []string{"X-Api-Key", "shared-key"}, 20 * time.Millisecond, ""})
	}
	for _, model := range []string{"gpt-4.1", "gpt-4.1-2025-04-14", "a-model-without-a-price"} {
		workers = append(workers, worker{"/money", []string{"X-Api-Key", "money-key", "Content-Type", "application/json"}, 20 * time.Millisecond,
			`{"model":"` + model + `","messages":[{"role":"user","content":"Say hi"}],"max_tokens":20}`})
	}
	counts := map[string]map[int]int{}
	var mu sync.Mutex
	var wg sync.WaitGroup
	stop := time.Now().Add(d)
	client := newClient()
	for i, w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for n := 0; time.Now().Before(stop); n++ {
				method, body := "GET", io.Reader(nil)
				if w.body != "" {
					method, body = "POST", strings.NewReader(w.body)
				}
				req, _ := http.NewRequest(method, fleet[(i+n)%len(fleet)].URL+w.path, body)
				for j := 0; j+1 < len(w.headers); j += 2 {
					req.Header.Set(w.headers[j], w.headers[j+1])
				}
				status := 0
				if resp, err := client.Do(req); err == nil {
					resp.Body.Close()
					status = resp.StatusCode
				}
				mu.Lock()
				if counts[w.path] == nil {
					counts[w.path] = map[int]int{}
				}
				counts[w.path][status]++
				mu.Unlock()
				time.Sleep(w.pause)
			}
		}()
	}
	wg.Wait()
	return counts
}
