package topk

import (
	"hash/maphash"
	"strconv"
	"testing"
	"time"
)

// TestTopDenied: the sketch keeps the heavy hitters among a flood of
// distinct identities in fixed memory, counts within its error bound, and
// forgets what is older than its window.
func TestTopDenied(t *testing.T) {
	now := time.Unix(1_000_000, 0)
	top := New()
	top.now = func() time.Time { return now }
	seed1, seed2 := maphash.MakeSeed(), maphash.MakeSeed()
	id := func(s string) [2]uint64 { return [2]uint64{maphash.String(seed1, s), maphash.String(seed2, s)} }
	for i := range 100_000 {
		v := "visitor-" + strconv.Itoa(i)
		top.Record(id(v), v, v)
		if i%20 == 0 {
			top.Record(id("abuser"), "k-abuser", "abuser")
		}
		if i%50 == 0 {
			top.Record(id("second"), "k-second", "second")
		}
	}
	got, truncated := top.Top(3)
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
		if len(s.counters) > maxCounters {
			t.Fatalf("a summary holds %d counters, bound %d", len(s.counters), maxCounters)
		}
	}
	long := string(make([]byte, 10_000))
	top.Record(id(long), "k-long", long)
	now = now.Add(Window + time.Minute)
	if got, truncated := top.Top(10); len(got) != 0 || truncated {
		t.Fatalf("after the window: %+v (truncated %v), want nothing", got, truncated)
	}

	// A few identities: all of them, not truncated, unless n cuts them.
	for i := range 3 {
		v := "few-" + strconv.Itoa(i)
		for range i + 1 {
			top.Record(id(v), v, v)
		}
	}
	if got, truncated := top.Top(3); len(got) != 3 || truncated || got[0].Identity != "few-2" {
		t.Errorf("top 3 of 3: %+v, truncated %v", got, truncated)
	}
	if got, truncated := top.Top(2); len(got) != 2 || !truncated {
		t.Errorf("top 2 of 3: %+v, truncated %v, want truncated", got, truncated)
	}
	// One minute of more identities than the sketch holds: some forgotten.
	for i := range maxCounters + 1 {
		v := "many-" + strconv.Itoa(i)
		top.Record(id(v), v, v)
	}
	if got, truncated := top.Top(1000); !truncated || len(got) > maxCounters+3 {
		t.Errorf("%d identities in a minute: %d listed, truncated %v, want truncated", maxCounters+1, len(got), truncated)
	}
}
