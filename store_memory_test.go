package ratelimit

import (
	"os"
	"runtime"
	"strconv"
	"strings"
	"testing"
)

func TestMemoryStoreSweepsFullBuckets(t *testing.T) {
	c := &clock{t: sec}
	m := newMemoryStore(c.now)
	for i := range 100_000 {
		mustDecide(t, m, req(strconv.Itoa(i), sec, 10, 1))
		if i%1000 == 0 {
			c.t += 10 * sec // everything so far is full again
		}
	}
	n := 0
	for i := range m.shards {
		n += len(m.shards[i].buckets)
	}
	if n > 2*memoryShards*minSweep {
		t.Fatalf("%d buckets kept for at most 1000 live ones", n)
	}
}

// TestMemoryStoreBound: a flood of 1,000,000 identities, none of whose
// buckets refills during it, keeps the store within memoryMaxBuckets and
// its heap within a few bytes per bucket of that bound; what it forgets
// are the buckets nearest to full: 100,000 drained first are all still
// drained after 900,000 nearly full ones.
func TestMemoryStoreBound(t *testing.T) {
	c := &clock{t: sec}
	m := newMemoryStore(c.now)
	var before runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	rssBefore := processRSS()
	const drained, nearlyFull = 100_000, 900_000
	for i := range drained {
		mustDecide(t, m, req("d"+strconv.Itoa(i), 60*sec, 10, 10)) // all 10 tokens: 10 minutes to refill
	}
	for i := range nearlyFull {
		mustDecide(t, m, req("f"+strconv.Itoa(i), 60*sec, 1000, 1)) // 1 of 1,000 tokens
	}
	var after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&after)
	n := m.len()
	grew := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("1,000,000 identities: %d buckets kept (bound %d), heap +%.1f MiB (%.0f bytes per bucket kept); the test process's RSS %.0f MiB before, %.0f MiB after",
		n, memoryMaxBuckets, float64(grew)/(1<<20), float64(grew)/float64(n), float64(rssBefore)/1024, float64(processRSS())/1024)
	if n > memoryMaxBuckets {
		t.Fatalf("%d buckets kept, more than the bound %d", n, memoryMaxBuckets)
	}
	if grew > 128*memoryMaxBuckets {
		t.Fatalf("heap grew %d bytes for at most %d buckets", grew, memoryMaxBuckets)
	}
	for i := range drained {
		if d := mustDecide(t, m, req("d"+strconv.Itoa(i), 60*sec, 10, 1)); d.admitted {
			t.Fatalf("drained bucket %d was forgotten (admitted again) while nearly full ones were kept", i)
		}
	}
}

// processRSS is this process's resident set size in KiB, from /proc.
func processRSS() int64 {
	b, _ := os.ReadFile("/proc/self/status")
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			n, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			return n
		}
	}
	return 0
}
