package pace

import (
	"context"
	"net/http/httptest"
	"strconv"
	"testing"
	"time"
)

const second = int64(time.Second / time.Microsecond)

// TestPace: the denied clients of one bucket, each on its own connection,
// are given turns a stride apart, the first at least a second and at least
// its true wait away; each returns (the hold, then Retry-After) within its
// turn, never before its true wait. A connection back before it was told
// takes no turn and is not held; so is every denial while too many are
// held; a bucket forgotten starts its calendar again; jitter 0 is the true
// wait, rounded up.
func TestPace(t *testing.T) {
	now := 1000 * second
	p := New(func() int64 { return now })
	const wait, stride, jitter = second / 2, 2 * second, 0.2
	turn := func(i int64) (from, to int64) { return now + second + i*stride, now + second + (i+1)*stride }
	check := func(what string, i int64, ra int64, hold time.Duration) {
		t.Helper()
		back := now + hold.Microseconds() + ra*second
		from, to := turn(i)
		if ra < 1 || hold < 0 || hold >= time.Second || back < now+wait || back < from || back >= to {
			t.Errorf("%s: Retry-After %d after %v: back at +%d µs, want within turn %d [+%d, +%d)", what, ra, hold, back-now, i, from-now, to-now)
		}
	}
	for i := range int64(10) {
		ra, hold := p.Pace("conn-"+strconv.FormatInt(i, 10), "bucket", wait, stride, jitter)
		check("client "+strconv.FormatInt(i, 10), i, ra, hold)
	}
	// Back at once, long before its turn: answered at once, no turn taken.
	if ra, hold := p.Pace("conn-3", "bucket", wait, stride, jitter); hold != 0 || ra < 1 {
		t.Errorf("an early return: Retry-After %d after %v, want no hold", ra, hold)
	}
	ra, hold := p.Pace("conn-10", "bucket", wait, stride, jitter)
	check("the client after an early return", 10, ra, hold)
	// Too many held at once: none more.
	p.held.Store(maxPacedDenials)
	if _, hold := p.Pace("conn-11", "other", wait, stride, jitter); hold != 0 {
		t.Errorf("with %d denials held: held %v more", maxPacedDenials, hold)
	}
	p.held.Store(0)
	// An operator's reset: the calendar starts again.
	p.Forget("bucket")
	ra, hold = p.Pace("conn-12", "bucket", wait, stride, jitter)
	check("after Forget", 0, ra, hold)
	// jitter 0: the true wait in whole seconds, at least one, no hold.
	for w, want := range map[int64]int64{0: 1, 1: 1, second: 1, second + 1: 2, 90 * second: 90} {
		if ra, hold := p.Pace("conn-13", "bucket", w, stride, 0); ra != want || hold != 0 {
			t.Errorf("jitter 0, a wait of %d µs: Retry-After %d after %v, want %d at once", w, ra, hold, want)
		}
	}
}

// TestHoldDenial: a held denial ends when its client goes away.
func TestHoldDenial(t *testing.T) {
	p := New(func() int64 { return 0 })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	r := httptest.NewRequest("GET", "/", nil).WithContext(ctx)
	done := make(chan struct{})
	go func() {
		p.HoldDenial(r, time.Hour)
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("a denial held for its client, gone: still held after 10 s")
	}
	if p.held.Load() != 0 {
		t.Errorf("%d denials held after it ended", p.held.Load())
	}
}
