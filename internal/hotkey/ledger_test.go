package hotkey

import "testing"

// forever is a window's close far away: tokens that never lapse in a test.
const forever = 1 << 50

// ledgerOf is a ledger holding blocks of the given sizes, each ready from
// first on at one token per interval, and lapsing far later.
func ledgerOf(interval int64, blocks ...[2]int64) *Ledger {
	l := &Ledger{}
	for _, b := range blocks {
		l.Add(Block{First: b[0], Last: forever, Interval: interval, Size: b[1]}, 0)
	}
	return l
}

func TestLedgerTake(t *testing.T) {
	for _, tc := range []struct {
		name            string
		blocks          [][2]int64 // first, size
		cost, now, wait int64
		ok              bool
		at              int64
		readyAfter      int64 // at now, after the take
	}{
		{"ready now", [][2]int64{{0, 10}}, 3, 100, 0, true, 100, 7},
		{"one short: when it will be", [][2]int64{{100, 10}}, 3, 100, 0, false, 120, 1},
		{"one short, within the wait: taken, unspent until then", [][2]int64{{100, 10}}, 3, 100, 20, true, 120, 0},
		{"across two blocks", [][2]int64{{0, 2}, {0, 5}}, 4, 100, 0, true, 100, 3},
		{"a newer block ready before an older one", [][2]int64{{1000, 5}, {0, 5}}, 3, 100, 0, true, 100, 2},
		{"fewer unspent than the cost", [][2]int64{{0, 2}}, 3, 100, 1000, false, 0, 2},
		{"future tokens only", [][2]int64{{500, 5}}, 1, 100, 0, false, 500, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := ledgerOf(10, tc.blocks...)
			unspent := l.Unspent(tc.now)
			ok, at, taken := l.Take(tc.cost, tc.now, tc.wait)
			if ok != tc.ok || at != tc.at {
				t.Fatalf("Take(%d, %d, %d) = %v, %d; want %v, %d", tc.cost, tc.now, tc.wait, ok, at, tc.ok, tc.at)
			}
			if got := l.Ready(tc.now); got != tc.readyAfter {
				t.Errorf("%d ready after, want %d", got, tc.readyAfter)
			}
			if ok && (taken.Tokens() != tc.cost || l.Unspent(tc.now) != unspent-tc.cost) {
				t.Errorf("took %d, unspent %d of %d; want %d taken", taken.Tokens(), l.Unspent(tc.now), unspent, tc.cost)
			}
			if gone := l.PutBack(taken); len(gone) != 0 || l.Unspent(tc.now) != unspent {
				t.Errorf("put back: %v gone, %d unspent; want none gone, %d unspent", gone, l.Unspent(tc.now), unspent)
			}
		})
	}
}

func TestLedgerPutBackGone(t *testing.T) {
	l := ledgerOf(10, [2]int64{0, 3}, [2]int64{0, 3})
	ok, _, taken := l.Take(4, 100, 0) // the whole first block and one of the second
	if !ok {
		t.Fatal("not taken")
	}
	l.Add(Block{First: 0, Last: forever, Interval: 10, Size: 1}, 100) // drops the first, all spent
	if gone := l.PutBack(taken); Total(gone) != 3 {
		t.Errorf("%v of blocks gone, want 3 tokens (for the caller to give back)", gone)
	}
	if l.Unspent(100) != 2+1+1 {
		t.Errorf("unspent %d, want 4", l.Unspent(100))
	}
}

// TestLedgerPutBackInPlace: a take put back after other takes spent the
// tokens after it is unspent again in its own place (a hole), so its
// tokens keep their own windows: they lapse when they would have, not
// when the later ones do.
func TestLedgerPutBackInPlace(t *testing.T) {
	l := &Ledger{}
	// 10 tokens ready from 0, token j lapsing after 100 + 10·j.
	l.Add(Block{First: 0, Last: 100, Interval: 10, Size: 10, End: 1000}, 0)
	_, _, first := l.Take(2, 50, 0) // tokens 0, 1 (lapse after 100, 110)
	if _, _, second := l.Take(3, 50, 0); second.Tokens() != 3 {
		t.Fatal("second take")
	}
	if gone := l.PutBack(first); len(gone) != 0 {
		t.Fatalf("put back: %v gone, want none (a hole)", gone)
	}
	if got := l.Ready(60); got != 2+2 {
		t.Errorf("%d ready at 60, want 4 (the hole's 2 and the tail's 5 and 6)", got)
	}
	if got := l.Ready(105); got != 1+5 {
		t.Errorf("%d ready at 105, want 6: token 0 lapsed after 100, token 1 not yet", got)
	}
	if got := l.Unspent(155); got != 0+5-1 {
		t.Errorf("%d unspent at 155, want 4: the hole lapsed, and token 5 (after 150)", got)
	}
	// The hole is spent first: its tokens lapse first.
	if ok, _, taken := l.Take(1, 105, 0); !ok || taken.parts[0].start != 1 {
		t.Errorf("take at 105: %v, from %d; want token 1, the hole's", ok, taken.parts[0].start)
	}
}

// TestLedgerLapse: a token may be spent only within its window; once its
// window closes it is gone: neither spent nor given back.
func TestLedgerLapse(t *testing.T) {
	l := &Ledger{}
	l.Add(Block{First: 0, Last: 100, Interval: 10, Size: 5, End: 500, Taken: 0}, 0) // token j until 100 + 10·j
	if got := l.Ready(0); got != 1 {
		t.Errorf("%d ready at 0, want 1", got)
	}
	if got := l.Ready(100); got != 5 {
		t.Errorf("%d ready at 100, want 5", got)
	}
	if got := l.Ready(125); got != 2 {
		t.Errorf("%d ready at 125, want 2 (tokens 3 and 4)", got)
	}
	if ok, _, _ := l.Take(3, 125, 0); ok {
		t.Error("3 taken at 125 with 2 left in their windows")
	}
	if rs := l.Drop(125); Total(rs) != 2 || rs[0].Due != 500 {
		t.Errorf("Drop at 125: %v, want 2 tokens due by 500", rs)
	}
	// A take that waits gets tokens valid when it may go.
	l.Add(Block{First: 100, Last: 150, Interval: 10, Size: 5, End: 900}, 0)
	if ok, at, _ := l.Take(3, 90, 50); !ok || at != 120 {
		t.Errorf("Take(3, 90, wait 50) = %v at %d, want at 120", ok, at)
	}
	// Never, when they lapse before enough are ready.
	l.Drop(0)
	l.Add(Block{First: 0, Last: 5, Interval: 10, Size: 5, End: 900}, 0) // one token valid at any time
	if ok, at, _ := l.Take(2, 0, 1000); ok || at != 0 {
		t.Errorf("Take(2) from tokens valid one at a time = %v at %d, want never", ok, at)
	}
}

func TestLedgerExpireAndDrop(t *testing.T) {
	l := &Ledger{}
	l.Add(Block{First: 0, Last: forever, Interval: 10, Size: 5, Taken: 0, End: 1}, 0)
	l.Add(Block{First: 0, Last: forever, Interval: 10, Size: 7, Taken: 600_000, End: 2}, 0)
	l.Take(2, 100, 0)
	const now = 1_200_000
	if got := l.Expire(now, MaxAge); Total(got) != 3 || got[0].Due != 1 || l.Blocks() != 1 || l.Unspent(now) != 7 {
		t.Errorf("Expire: %v returned, %d blocks, %d unspent; want 3 due by 1, 1, 7", got, l.Blocks(), l.Unspent(now))
	}
	if got := l.Drop(now); Total(got) != 7 || got[0].Due != 2 || l.Unspent(now) != 0 || l.Blocks() != 0 {
		t.Errorf("Drop: %v returned, %d unspent; want 7 due by 2, 0", got, l.Unspent(now))
	}
	for range MaxBlocks {
		if !l.Add(Block{Last: forever, Interval: 10, Size: 1}, 0) {
			t.Fatal("a ledger below MaxBlocks refused a block")
		}
	}
	if l.Add(Block{Last: forever, Interval: 10, Size: 1}, 0) {
		t.Error("a ledger at MaxBlocks took one more")
	}
}

func TestLedgerNext(t *testing.T) {
	l := ledgerOf(10, [2]int64{50, 2}, [2]int64{20, 3})
	if at, ok := l.Next(0); !ok || at != 20 {
		t.Errorf("Next = %d, %v; want 20", at, ok)
	}
	l.Take(3, 40, 0) // 20, 30, 40 of the second
	if at, ok := l.Next(40); !ok || at != 50 {
		t.Errorf("Next = %d, %v; want 50", at, ok)
	}
	l.Drop(40)
	if _, ok := l.Next(40); ok {
		t.Error("Next with nothing unspent")
	}
}
