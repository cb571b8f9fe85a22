package ratelimit

import (
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// gathered is what a registry holding only c exposes, by family name.
func gathered(t *testing.T, c prometheus.Collector) map[string]*dto.MetricFamily {
	t.Helper()
	reg := prometheus.NewRegistry()
	reg.MustRegister(c)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]*dto.MetricFamily{}
	for _, mf := range mfs {
		out[mf.GetName()] = mf
	}
	return out
}

// withPolicy is the metric of mf labelled policy=name.
func withPolicy(mf *dto.MetricFamily, name string) *dto.Metric {
	for _, m := range mf.GetMetric() {
		for _, l := range m.GetLabel() {
			if l.GetName() == "policy" && l.GetValue() == name {
				return m
			}
		}
	}
	return nil
}

// TestQuotaUsedRatio: each decision of a quota policy observes the share
// of the quota its identity had used once decided, admitted or denied.
func TestQuotaUsedRatio(t *testing.T) {
	h := testHandler(t, &Handler{Policies: []*Policy{
		{Name: "quota-used-test", Key: "{http.request.header.X-User}", Quota: "10/day", Cost: "3"},
	}}, nil)
	user := "quota-used-" + t.Name()
	var statuses []int
	for range 4 {
		statuses = append(statuses, serve([]*Handler{h}, nil, "X-User", user).status)
	}
	if statuses[3] != 429 {
		t.Fatalf("statuses %v: the fourth request of cost 3 should not fit a quota of 10", statuses)
	}
	m := withPolicy(gathered(t, quotaUsed)["caddy_rate_limit_quota_used_ratio"], "quota-used-test")
	if m == nil {
		t.Fatal("no caddy_rate_limit_quota_used_ratio{policy=\"quota-used-test\"}")
	}
	hist := m.GetHistogram()
	// 0.3, 0.6, 0.9 admitted, then 0.9 denied.
	if hist.GetSampleCount() != 4 || hist.GetSampleSum() < 2.69 || hist.GetSampleSum() > 2.71 {
		t.Errorf("%d observations summing to %v, want 4 summing to 2.7 (0.3 0.6 0.9 0.9)", hist.GetSampleCount(), hist.GetSampleSum())
	}
	for _, b := range hist.GetBucket() {
		if b.GetUpperBound() == 0.5 && b.GetCumulativeCount() != 1 || b.GetUpperBound() == 0.9 && b.GetCumulativeCount() != 4 {
			t.Errorf("bucket le=%v holds %d", b.GetUpperBound(), b.GetCumulativeCount())
		}
	}
}

// TestSlotsGauge: caddy_rate_limit_slots is each concurrency policy's N,
// and a shed policy's concurrent capacity; a rate policy has none.
func TestSlotsGauge(t *testing.T) {
	testHandler(t, &Handler{Policies: []*Policy{
		{Name: "slots-test", Key: "global", Concurrent: 3},
		{Name: "slots-shed-test", Key: "global", Shed: &Shed{Concurrent: 40}},
		{Name: "slots-rate-test", Key: "global", Rate: "1/1s"},
	}}, nil)
	mf := gathered(t, slots)["caddy_rate_limit_slots"]
	for name, want := range map[string]float64{"slots-test": 3, "slots-shed-test": 40} {
		if m := withPolicy(mf, name); m == nil || m.GetGauge().GetValue() != want {
			t.Errorf("caddy_rate_limit_slots{policy=%q} = %v, want %v", name, m, want)
		}
	}
	if withPolicy(mf, "slots-rate-test") != nil {
		t.Error("a rate policy has slots")
	}
}
