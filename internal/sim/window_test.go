package sim

import (
	"math/rand/v2"
	"testing"
)

func TestLoopOrder(t *testing.T) {
	var l Loop
	var got []int
	l.At(20, func() { got = append(got, 3) })
	l.At(10, func() {
		got = append(got, 1)
		l.After(0, func() { got = append(got, 2) }) // now, after those already at 10
	})
	l.At(10, func() { got = append(got, 11) })
	l.Run(15)
	if len(got) != 3 || got[0] != 1 || got[1] != 11 || got[2] != 2 || l.Now() != 15 || l.Pending() != 1 {
		t.Fatalf("ran %v to %d, %d pending", got, l.Now(), l.Pending())
	}
	l.Run(100)
	if len(got) != 4 || got[3] != 3 {
		t.Fatalf("ran %v", got)
	}
}

func TestWindow(t *testing.T) {
	type adm struct{ tokens, at int64 }
	for _, tc := range []struct {
		name  string
		run   func(w *Window) *Over
		over  bool
		check func(t *testing.T, o *Over)
	}{
		{"a burst at once", func(w *Window) *Over { return admitAll(w, 10, 0, 0) }, false, nil},
		{"one more than the burst at once", func(w *Window) *Over { return admitAll(w, 11, 0, 0) }, true, func(t *testing.T, o *Over) {
			if o.Tokens != 11 || o.Admissions != 11 || o.Bound != 10 {
				t.Errorf("%v", o)
			}
		}},
		{"the burst, then one a token's interval later", func(w *Window) *Over {
			if o := admitAll(w, 10, 0, 0); o != nil {
				return o
			}
			_, o := w.Admit(1, 100)
			return o
		}, false, nil},
		{"the burst, then one too early", func(w *Window) *Over {
			admitAll(w, 10, 0, 0)
			_, o := w.Admit(1, 99)
			return o
		}, true, nil},
		// Over any interval, not since the start: a quiet start refills
		// nothing beyond the burst.
		{"quiet, then twice the burst within one interval", func(w *Window) *Over {
			admitAll(w, 10, 5_000, 0)
			_, o := w.Admit(10, 5_050)
			return o
		}, true, func(t *testing.T, o *Over) {
			if o.From != 5_000 || o.To != 5_050 || o.Tokens != 20 || o.Bound != 10.5 {
				t.Errorf("%v", o)
			}
		}},
		{"a refund lets the tokens go again", func(w *Window) *Over {
			id, _ := w.Admit(10, 0)
			w.Refund(id, 4)
			_, o := w.Admit(4, 1)
			return o
		}, false, nil},
		{"a reset adds a burst", func(w *Window) *Over {
			admitAll(w, 10, 0, 0)
			w.Add(10, 1)
			_, o := w.Admit(10, 2)
			return o
		}, false, nil},
		{"a faster rate in force beside the old", func(w *Window) *Over {
			admitAll(w, 10, 0, 0)
			w.Limit(50, 10, 0, 1_000) // twice the rate
			_, o := w.Admit(10, 500)
			return o
		}, false, nil},
		{"the faster rate gone again", func(w *Window) *Over {
			admitAll(w, 10, 0, 0)
			w.Limit(50, 10, 0, 0)
			w.Limit(100, 10, 100, 200) // back to 100 µs a token from 100 on; 50 µs until 200
			// 0..200 at 50 µs: 4 tokens; 200..1000 at 100 µs: 8.
			if _, o := w.Admit(12, 1_000); o != nil {
				return o
			}
			_, o := w.Admit(1, 1_000)
			return o
		}, true, nil},
		{"the old rate until the bucket is written under the new", func(w *Window) *Over {
			admitAll(w, 10, 0, 0)
			w.Limit(1_000, 10, 0, 0) // ten times slower, from 0
			w.EndOld(5_000)          // written under it then: 50 tokens refilled by then
			if _, o := w.Admit(50, 5_000); o != nil {
				return o
			}
			_, o := w.Admit(1, 5_500) // half a token since
			return o
		}, true, nil},
		{"a raised burst is the bound", func(w *Window) *Over {
			w.Limit(100, 20, 0, 0)
			return admitAll(w, 20, 0, 0)
		}, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w := NewWindow(100, 10, 0)
			o := tc.run(w)
			if (o != nil) != tc.over {
				t.Fatalf("over: %v, want %v", o, tc.over)
			}
			if tc.check != nil && o != nil {
				tc.check(t, o)
			}
		})
	}
}

// admitAll admits n tokens one at a time, spaced apart from at.
func admitAll(w *Window, n, at, apart int64) *Over {
	for i := range n {
		if _, o := w.Admit(1, at+i*apart); o != nil {
			return o
		}
	}
	return nil
}

// TestWindowMatchesBruteForce: the checker agrees with trying every
// interval, for random admissions, refunds, additions and limits.
func TestWindowMatchesBruteForce(t *testing.T) {
	for seed := range 200 {
		rng := rand.New(rand.NewPCG(uint64(seed), 45))
		w := NewWindow(100, 5, 0)
		type rec struct {
			at, tokens int64
			f          float64 // F at its admission
			bonus      int64   // what intervals starting with it may admit more
		}
		type bonus struct{ tokens, from, until int64 }
		var bonuses []bonus
		var adms []rec
		now := int64(0)
		for step := range 300 {
			now += rng.Int64N(120)
			switch rng.IntN(10) {
			case 0:
				if len(adms) > 0 {
					id := rng.IntN(len(adms))
					r := min(adms[id].tokens, 1+rng.Int64N(3))
					w.Refund(id, r)
					adms[id].tokens -= r
				}
				continue
			case 1:
				w.Add(1+rng.Int64N(3), now)
				continue
			case 2:
				b := bonus{1 + rng.Int64N(3), now, now + rng.Int64N(500)}
				w.Bonus(b.tokens, b.from, b.until)
				bonuses = append(bonuses, b)
				continue
			}
			tokens := 1 + rng.Int64N(3)
			id, o := w.Admit(tokens, now)
			var extra int64
			for _, b := range bonuses {
				if b.from <= now && now <= b.until {
					extra += b.tokens
				}
			}
			adms = append(adms, rec{now, tokens, w.f, extra})
			if id != len(adms)-1 {
				t.Fatal("ids")
			}
			// Brute force: every interval ending here.
			var in int64
			want := false
			for i := len(adms) - 1; i >= 0; i-- {
				in += adms[i].tokens
				if float64(in) > float64(w.Burst()+adms[i].bonus)+adms[len(adms)-1].f-adms[i].f+epsilon {
					want = true
				}
			}
			if (o != nil) != want {
				t.Fatalf("seed %d step %d: checker says %v, brute force %v", seed, step, o, want)
			}
			if o != nil { // start over from here, as the simulation stops
				w = NewWindow(100, 5, now)
				adms, bonuses = nil, nil
			}
		}
	}
}
