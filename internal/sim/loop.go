// Package sim holds the pure parts of the module's deterministic
// simulation (sim_test.go in the root package): a virtual clock whose
// events run in one goroutine in a seeded order (Loop), the every-interval
// budget check of one bucket (Window), and the bucket one sequential
// client expects (Ideal). It never imports the module's root.
package sim

import "container/heap"

// Loop is a virtual clock and the events scheduled on it, run in the order
// of their time, then of their scheduling: the same seed, the same run.
type Loop struct {
	now    int64 // µs
	seq    uint64
	events eventHeap
}

type event struct {
	at  int64
	seq uint64
	run func()
}

type eventHeap []event

func (h eventHeap) Len() int { return len(h) }
func (h eventHeap) Less(i, j int) bool {
	return h[i].at < h[j].at || h[i].at == h[j].at && h[i].seq < h[j].seq
}
func (h eventHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *eventHeap) Push(x any)   { *h = append(*h, x.(event)) }
func (h *eventHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}

// Now is the virtual time, in µs.
func (l *Loop) Now() int64 { return l.now }

// At schedules run at the virtual µs at (now, when at is in the past).
func (l *Loop) At(at int64, run func()) {
	l.seq++
	heap.Push(&l.events, event{at: max(at, l.now), seq: l.seq, run: run})
}

// After schedules run d µs from now.
func (l *Loop) After(d int64, run func()) { l.At(l.now+d, run) }

// Run runs the events in order until none is left or the next is after
// end; the clock ends at end.
func (l *Loop) Run(end int64) {
	for len(l.events) > 0 && l.events[0].at <= end {
		e := heap.Pop(&l.events).(event)
		l.now = e.at
		e.run()
	}
	l.now = max(l.now, end)
}

// Pending is the number of events scheduled.
func (l *Loop) Pending() int { return len(l.events) }
