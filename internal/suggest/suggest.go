// Package suggest finds the word a misspelt one was probably meant to be,
// for errors that say what to do ("burts: did you mean burst?").
package suggest

import "strings"

// Nearest returns the candidate nearest to word, ignoring case, when it is
// near enough to be a likely slip: at most one edit away for words of up to
// four letters, two for longer ones (an edit: a letter added, dropped or
// changed, or two neighbours swapped, so "burts" is one edit from
// "burst"). Of equally near candidates the first wins. It returns "" when
// none is near enough, or when word is a candidate.
func Nearest(word string, candidates []string) string {
	w := strings.ToLower(word)
	best, bestDist := "", 0
	for _, c := range candidates {
		lc := strings.ToLower(c)
		if lc == w {
			return ""
		}
		limit := 2
		if min(len(w), len(lc)) <= 4 {
			limit = 1
		}
		if d := Distance(w, lc); d <= limit && (best == "" || d < bestDist) {
			best, bestDist = c, d
		}
	}
	return best
}

// Distance is the optimal string alignment distance between a and b, byte
// by byte: the fewest insertions, deletions, substitutions and swaps of
// adjacent bytes that turn a into b, no substring edited twice.
func Distance(a, b string) int {
	// Three rows of the dynamic programme: two back, one back, this one.
	prev2 := make([]int, len(b)+1)
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				cur[j] = min(cur[j], prev2[j-2]+1)
			}
		}
		prev2, prev, cur = prev, cur, prev2
	}
	return prev[len(b)]
}
