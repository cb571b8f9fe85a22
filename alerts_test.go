package ratelimit

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
)

// The alerting rules operators load (docs/operators-guide.md, Alerts), and
// their promtool tests.
const (
	alertRulesFile = "docs/prometheus/rate-limit-alerts.yml"
	alertTestsFile = "docs/prometheus/rate-limit-alerts.test.yml"
)

// TestAlertRules checks the rules file with promtool and runs its unit
// tests (`promtool test rules`): each alert fires for what it is about,
// with its labels and annotations, and not for what it is not. Every
// alert of the file has a test in which it fires. promtool comes with
// Debian's prometheus package, which `make test` installs when missing.
func TestAlertRules(t *testing.T) {
	promtool, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool not found (run `make test`, which installs Debian's prometheus package, or apt-get install prometheus): %v", err)
	}
	dir, rules := filepath.Dir(alertRulesFile), filepath.Base(alertRulesFile)
	for _, args := range [][]string{{"check", "rules", rules}, {"test", "rules", filepath.Base(alertTestsFile)}} {
		cmd := exec.Command(promtool, args...)
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("promtool %v: %v\n%s", args, err, out)
		}
		t.Logf("promtool %v:\n%s", args, out)
	}

	raw, err := os.ReadFile(alertRulesFile)
	if err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile(alertTestsFile)
	if err != nil {
		t.Fatal(err)
	}
	alerts := regexp.MustCompile(`(?m)^\s*- alert: (\w+)$`).FindAllStringSubmatch(string(raw), -1)
	if len(alerts) < 7 {
		t.Fatalf("%d alerts in %s, it has more", len(alerts), alertRulesFile)
	}
	for _, a := range alerts {
		fires := regexp.MustCompile(`alertname: ` + a[1] + `\n\s+exp_alerts:\n\s+- exp_labels:`)
		if !fires.Match(tests) {
			t.Errorf("%s: no test in %s in which it fires", a[1], alertTestsFile)
		}
	}
}
