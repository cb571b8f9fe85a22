package hotkey

import "testing"

// ledgerOf is a ledger holding blocks of the given sizes, each ready from
// first on at one token per interval.
func ledgerOf(interval int64, blocks ...[2]int64) *Ledger {
	l := &Ledger{}
	for _, b := range blocks {
		l.Add(Block{First: b[0], Interval: interval, Size: b[1]})
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
			unspent := l.Unspent()
			ok, at, taken := l.Take(tc.cost, tc.now, tc.wait)
			if ok != tc.ok || at != tc.at {
				t.Fatalf("Take(%d, %d, %d) = %v, %d; want %v, %d", tc.cost, tc.now, tc.wait, ok, at, tc.ok, tc.at)
			}
			if got := l.Ready(tc.now); got != tc.readyAfter {
				t.Errorf("%d ready after, want %d", got, tc.readyAfter)
			}
			if ok && (taken.Tokens() != tc.cost || l.Unspent() != unspent-tc.cost) {
				t.Errorf("took %d, unspent %d of %d; want %d taken", taken.Tokens(), l.Unspent(), unspent, tc.cost)
			}
			if gone := l.PutBack(taken); gone != 0 || l.Unspent() != unspent {
				t.Errorf("put back: %d gone, %d unspent; want 0 gone, %d unspent", gone, l.Unspent(), unspent)
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
	l.Add(Block{First: 0, Interval: 10, Size: 1}) // drops the first, all spent
	if gone := l.PutBack(taken); gone != 3 {
		t.Errorf("%d tokens of blocks gone, want 3 (for the caller to give back)", gone)
	}
	if l.Unspent() != 2+1+1 {
		t.Errorf("unspent %d, want 4", l.Unspent())
	}
}

func TestLedgerExpireAndDrop(t *testing.T) {
	l := &Ledger{}
	l.Add(Block{First: 0, Interval: 10, Size: 5, Taken: 0})
	l.Add(Block{First: 0, Interval: 10, Size: 7, Taken: 600_000})
	l.Take(2, 100, 0)
	if got := l.Expire(1_200_000, MaxAge); got != 3 || l.Blocks() != 1 || l.Unspent() != 7 {
		t.Errorf("Expire: %d returned, %d blocks, %d unspent; want 3, 1, 7", got, l.Blocks(), l.Unspent())
	}
	if got := l.Drop(); got != 7 || l.Unspent() != 0 || l.Blocks() != 0 {
		t.Errorf("Drop: %d returned, %d unspent; want 7, 0", got, l.Unspent())
	}
	for range MaxBlocks {
		if !l.Add(Block{Interval: 10, Size: 1}) {
			t.Fatal("a ledger below MaxBlocks refused a block")
		}
	}
	if l.Add(Block{Interval: 10, Size: 1}) {
		t.Error("a ledger at MaxBlocks took one more")
	}
}

func TestLedgerNext(t *testing.T) {
	l := ledgerOf(10, [2]int64{50, 2}, [2]int64{20, 3})
	if at, ok := l.Next(); !ok || at != 20 {
		t.Errorf("Next = %d, %v; want 20", at, ok)
	}
	l.Take(3, 40, 0) // 20, 30, 40 of the second
	if at, ok := l.Next(); !ok || at != 50 {
		t.Errorf("Next = %d, %v; want 50", at, ok)
	}
	l.Drop()
	if _, ok := l.Next(); ok {
		t.Error("Next with nothing unspent")
	}
}
