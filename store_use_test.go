package ratelimit

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// TestStoreUse: a handler's store is let go once, when the handler has
// been cleaned up and no request of it runs, whichever comes last; never
// while one runs.
func TestStoreUse(t *testing.T) {
	for _, tc := range []struct {
		name  string
		steps string // e: a request enters, l: one leaves, c: Cleanup
		// closedAt is the step after which the store is let go (-1: never).
		closedAt int
	}{
		{"no request", "c", 0},
		{"one of two still running at cleanup", "eelc", -1},
		{"requests ended before, then cleanup", "eellc", 4},
		{"cleanup while one runs", "ecl", 2},
		{"cleanup while two run", "eecll", 4},
		{"still running", "eec", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var closes atomic.Int32
			closed := make(chan struct{}, 8)
			u := &storeUse{close: func() error { closes.Add(1); closed <- struct{}{}; return nil }}
			for i, step := range tc.steps {
				switch step {
				case 'e':
					u.enter()
				case 'l':
					u.leave()
				case 'c':
					_ = u.end()
				}
				if i == tc.closedAt {
					select { // leave lets go in a goroutine of its own
					case <-closed:
					case <-time.After(5 * time.Second):
						t.Fatalf("%q: not let go after step %d", tc.steps, i)
					}
				}
				if n := closes.Load(); (i < tc.closedAt || tc.closedAt < 0) && n != 0 {
					t.Fatalf("%q: let go after step %d, want after step %d", tc.steps, i, tc.closedAt)
				}
			}
			if tc.closedAt >= 0 && closes.Load() != 1 {
				t.Fatalf("%q: let go %d times, want once", tc.steps, closes.Load())
			}
		})
	}
}

// TestStoreUseRace: requests ending while Cleanup runs let the store go
// exactly once, after the last.
func TestStoreUseRace(t *testing.T) {
	for range 200 {
		var closes, running atomic.Int32
		var early atomic.Bool
		done := make(chan struct{}, 1)
		u := &storeUse{close: func() error {
			if running.Load() != 0 {
				early.Store(true)
			}
			closes.Add(1)
			done <- struct{}{}
			return nil
		}}
		var wg sync.WaitGroup
		for range 4 {
			u.enter()
			running.Add(1)
			wg.Add(1)
			go func() { defer wg.Done(); running.Add(-1); u.leave() }()
		}
		_ = u.end()
		wg.Wait()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			t.Fatal("never let go")
		}
		if closes.Load() != 1 || early.Load() {
			t.Fatalf("let go %d times (while a request ran: %v), want once after the last", closes.Load(), early.Load())
		}
	}
}
