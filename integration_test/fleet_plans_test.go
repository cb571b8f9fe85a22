package integration_test

import (
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// v040 is v0.4.0's Caddy binary, built once.
var v040 struct {
	once sync.Once
	bin  string
	err  error
}

func v040Bin(t *testing.T) string {
	t.Helper()
	v040.once.Do(func() {
		v040.bin = filepath.Join(filepath.Dir(caddyBin), "caddy-v040")
		v040.err = testcaddy.BuildRelease(".", testcaddy.ReleaseV04, v040.bin)
	})
	if v040.err != nil {
		t.Fatalf("building v0.4.0 (%s): %v", testcaddy.ReleaseV04, v040.err)
	}
	return v040.bin
}

// TestFleetPlansBesideV040: a policy with plans, enforced alike by an
// instance of the previous release (v0.4.0, which wrote each plan's limit
// as a Go struct's dump) and one of this release (which shows it as the
// Caddyfile writes it): neither reports a disagreement, on either side, and
// this release's `fleet` shows both instances' plans in the Caddyfile's
// form.
func TestFleetPlansBesideV040(t *testing.T) {
	srv := testredis.Start(t)
	policy := fleetPolicy("10/1m")
	policy["plan"] = map[string]any{
		"from": "{http.request.header.X-Plan}",
		"plans": map[string]any{
			"pro":  map[string]any{"rate": "60/1h", "burst": 20},
			"team": map[string]any{"max_cost": 5},
		},
	}
	handler := func() map[string]any { return limiter(srv.Addr, map[string]any{"key_secret": "secret-one"}, policy) }
	old := startBinary(t, v040Bin(t), handler(), echo())
	cur := startCaddy(t, handler(), echo())

	for deadline := time.Now().Add(10 * time.Second); len(fleetOf(t, cur).Stores[0].Instances) != 2; time.Sleep(100 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("not 2 live instances within 10 s")
		}
	}
	time.Sleep(3 * time.Second) // both compared the records (each refresh reads what changed)
	for _, f := range fleetOf(t, cur).Stores[0].Fleets {
		for _, s := range f.Splits {
			t.Errorf("this release sees policy %s enforced in %d ways: %+v", s.Policy, len(s.Variants), s.Variants)
		}
	}
	for name, in := range map[string]*instance{"v0.4.0": old, "this release": cur} {
		if n := countLog(t, in, disagreement); n != 0 {
			raw, _ := os.ReadFile(in.Log)
			t.Errorf("%s logged %d disagreements, want none:\n%s", name, n, raw)
		}
		if g := metricValue(t, in, "caddy_rate_limit_fleet_disagreements", nil); g != 0 {
			t.Errorf("%s: caddy_rate_limit_fleet_disagreements %v, want 0", name, g)
		}
	}
	out := rateLimitCLI(t, cur, "fleet")
	t.Logf("caddy rate-limit fleet:\n%s", out)
	if strings.Contains(out, "DISAGREEMENT") || strings.Contains(out, "{Rate:") {
		t.Errorf("caddy rate-limit fleet shows a disagreement or a Go dump")
	}
	resp, err := http.Get(cur.Admin + "/rate_limit/fleet")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	raw := string(body)
	if strings.Contains(raw, "{Rate:") || strings.Count(raw, "pro rate 60/1h burst 20; team cost max 5;") != 2 {
		t.Errorf("/rate_limit/fleet, want both instances' plans as the Caddyfile writes them:\n%s", raw)
	}
}
