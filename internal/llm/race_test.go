//go:build race

package llm

// The race detector changes what tests that count allocations measure
// (sync.Pool drops what it is given, at random) and slows them tenfold.
func init() { raceEnabled = true }
