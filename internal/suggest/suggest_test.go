package suggest

import "testing"

func TestDistance(t *testing.T) {
	for _, tc := range []struct {
		a, b string
		want int
	}{
		{"", "", 0},
		{"burst", "burst", 0},
		{"burts", "burst", 1}, // a swap
		{"brust", "burst", 1},
		{"bust", "burst", 1},   // a letter dropped
		{"bursts", "burst", 1}, // one added
		{"burxt", "burst", 1},  // one changed
		{"rate", "", 4},
		{"", "key", 3},
		{"timout", "timeout", 1},
		{"kye", "key", 1},
		{"ca", "abc", 3}, // OSA: no edit of a swapped pair
		{"concurent", "concurrent", 1},
		{"policy", "plan", 4},
	} {
		if got := Distance(tc.a, tc.b); got != tc.want {
			t.Errorf("Distance(%q, %q) = %d, want %d", tc.a, tc.b, got, tc.want)
		}
		if got := Distance(tc.b, tc.a); got != tc.want {
			t.Errorf("Distance(%q, %q) = %d, want %d (symmetric)", tc.b, tc.a, got, tc.want)
		}
	}
}

func TestNearest(t *testing.T) {
	policy := []string{"match", "key", "rate", "burst", "cost", "on_error", "shadow", "wait", "charge_if", "settle", "concurrent", "lease", "quota", "timezone", "durable", "plan", "shed", "priority"}
	for _, tc := range []struct {
		word string
		want string
	}{
		{"burts", "burst"},
		{"brust", "burst"},
		{"Burst", ""}, // a candidate, in another case: nothing to suggest
		{"BURTS", "burst"},
		{"kye", "key"},
		{"keys", "key"},
		{"rates", "rate"},
		{"concurent", "concurrent"},
		{"timzone", "timezone"},
		{"on-error", "on_error"},
		{"onerror", "on_error"},
		{"charge-if", "charge_if"},
		{"qouta", "quota"},
		{"priorty", "priority"},
		{"bogus", ""},
		{"zone", ""}, // a four-letter word: one edit at most, and zone is two from cost and lease
		{"x", ""},
		{"", ""},
		{"ratelimit", ""},
		{"limit", ""},
	} {
		got := Nearest(tc.word, policy)
		if got != tc.want {
			t.Errorf("Nearest(%q) = %q, want %q", tc.word, got, tc.want)
		}
	}
}
