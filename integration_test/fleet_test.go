package integration_test

import (
	"math"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The fleet: four Caddy instances, one budget of burst 10 then 20 per
// second, a client spreading its requests across all four.
const (
	fleetSize  = 4
	fleetBurst = 10
	fleetRate  = 20 // per second
	fleetRun   = 5 * time.Second
)

// fleetResult is what a client sees across the fleet.
type fleetResult struct {
	admitted, denied, other int
	elapsed                 time.Duration
}

// budget is what one shared bucket admits over the run: the full burst at
// the first request, then the rate for the time that followed.
func (r fleetResult) budget() float64 {
	return fleetBurst + fleetRate*r.elapsed.Seconds()
}

// hammer drives 8 workers over the fleet for fleetRun with one tenant's key.
func hammer(t *testing.T, fleet []*instance) fleetResult {
	t.Helper()
	tl := drive(t, fleet, 8, fleetRun, "X-Api-Key", "tenant-42")
	st := tl.statuses()
	return fleetResult{st[200], st[429], len(tl.shots) - st[200] - st[429], tl.elapsed}
}

func fleetLimiter(redisAddr string) map[string]any {
	h := map[string]any{
		"handler": "rate_limit",
		"policies": []any{map[string]any{
			"name":  "per_key",
			"key":   "{http.request.header.X-Api-Key}",
			"rate":  "20/1s",
			"burst": fleetBurst,
		}},
	}
	if redisAddr != "" {
		h["redis"] = map[string]any{"addresses": []string{redisAddr}, "timeout": "2s"}
	}
	return h
}

// TestFleetSharesOneBudget is the reason this module exists: four
// instances sharing Redis admit one budget between them; four instances
// with in-process buckets admit about four budgets.
func TestFleetSharesOneBudget(t *testing.T) {
	srv := testredis.Start(t)

	var shared, local []*instance
	for range fleetSize {
		shared = append(shared, startCaddy(t, fleetLimiter(srv.Addr), respond()))
		local = append(local, startCaddy(t, fleetLimiter(""), respond()))
	}

	r := hammer(t, shared)
	t.Logf("Redis store, %d instances: admitted %d of a budget of %.1f (burst %d + %d/s × %.2fs); %d denied, %d other",
		fleetSize, r.admitted, r.budget(), fleetBurst, fleetRate, r.elapsed.Seconds(), r.denied, r.other)
	if r.other != 0 {
		t.Errorf("Redis store: %d responses were neither 200 nor 429", r.other)
	}
	if float64(r.admitted) > r.budget()+2 {
		t.Errorf("Redis store: admitted %d, want %.1f ± 2", r.admitted, r.budget())
	}
	// The client saturates the budget: ten denials an admission at least.
	requireOver(t, "Redis store", r.admitted+r.denied+r.other, r.budget(), 11)
	if float64(r.admitted) < r.budget()-2 {
		t.Errorf("Redis store: admitted %d, want %.1f ± 2", r.admitted, r.budget())
	}

	l := hammer(t, local)
	t.Logf("In-process store, %d instances: admitted %d = %.2f × the budget of %.1f; %d denied, %d other",
		fleetSize, l.admitted, float64(l.admitted)/l.budget(), l.budget(), l.denied, l.other)
	if l.other != 0 {
		t.Errorf("in-process store: %d responses were neither 200 nor 429", l.other)
	}
	// Each instance's bucket saturated: a quarter of the requests each.
	requireOver(t, "in-process store", l.admitted+l.denied+l.other, fleetSize*l.budget(), 2)
	if want := fleetSize * l.budget(); math.Abs(float64(l.admitted)-want) > 2*fleetSize {
		t.Errorf("in-process store: admitted %d, want about %d × %.1f = %.1f (± %d)", l.admitted, fleetSize, l.budget(), want, 2*fleetSize)
	}
}
