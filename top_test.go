package ratelimit

import (
	"strconv"
	"testing"
	"time"
)

// TestTopDenied: the sketch keeps the heavy hitters among a flood of
// distinct identities in fixed memory, counts within its error bound, and
// forgets what is older than its window.
func TestTopDenied(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	top := newTopDenied()
	top.now = func() time.Time { return now }
	id := func(s string) bucketID { return topIDs.of(s) }
	for i := range 100_000 {
		v := "visitor-" + strconv.Itoa(i)
		top.record(id(v), v, v)
		if i%20 == 0 {
			top.record(id("abuser"), "k-abuser", "abuser")
		}
		if i%50 == 0 {
			top.record(id("second"), "k-second", "second")
		}
	}
	got, truncated := top.top(3)
	if len(got) != 3 || got[0].Identity != "abuser" || got[1].Identity != "second" {
		t.Fatalf("top 3: %+v, want abuser then second", got)
	}
	if !truncated {
		t.Error("top 3 of 100,002 identities: not truncated")
	}
	if got[0].Denials-got[0].Error > 5000 || got[0].Denials < 5000 {
		t.Fatalf("abuser: %d denials (error %d), want a count bounding the true 5,000", got[0].Denials, got[0].Error)
	}
	for _, s := range top.minutes {
		if len(s.counters) > topCounters {
			t.Fatalf("a summary holds %d counters, bound %d", len(s.counters), topCounters)
		}
	}
	long := string(make([]byte, 10_000))
	top.record(id(long), "k-long", long)
	now = now.Add(topWindow + time.Minute)
	if got, truncated := top.top(10); len(got) != 0 || truncated {
		t.Fatalf("after the window: %+v (truncated %v), want nothing", got, truncated)
	}

	// A few identities: all of them, not truncated, unless n cuts them.
	for i := range 3 {
		v := "few-" + strconv.Itoa(i)
		for range i + 1 {
			top.record(id(v), v, v)
		}
	}
	if got, truncated := top.top(3); len(got) != 3 || truncated || got[0].Identity != "few-2" {
		t.Errorf("top 3 of 3: %+v, truncated %v", got, truncated)
	}
	if got, truncated := top.top(2); len(got) != 2 || !truncated {
		t.Errorf("top 2 of 3: %+v, truncated %v, want truncated", got, truncated)
	}
	// One minute of more identities than the sketch holds: some forgotten.
	for i := range topCounters + 1 {
		v := "many-" + strconv.Itoa(i)
		top.record(id(v), v, v)
	}
	if got, truncated := top.top(1000); !truncated || len(got) > topCounters+3 {
		t.Errorf("%d identities in a minute: %d listed, truncated %v, want truncated", topCounters+1, len(got), truncated)
	}
}
