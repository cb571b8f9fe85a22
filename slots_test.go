package ratelimit

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// The request side of concurrency slots (slots.go): what a request takes,
// waits for, holds and frees.

// TestServeHTTPConcurrent: at most N requests of a key run at once; the
// next is denied (429, Retry-After 1, RateLimit r=0, RateLimit-Policy with
// the concurrent-requests unit) until one ends, and with `wait` takes the
// slot as soon as one is freed.
func TestServeHTTPConcurrent(t *testing.T) {
	for _, waits := range []bool{false, true} {
		t.Run(fmt.Sprintf("wait=%v", waits), func(t *testing.T) {
			c := &clock{t: 1000 * sec}
			p := &Policy{Name: "exports", Key: "{http.request.header.X-User}", Concurrent: 2}
			if waits {
				p.Wait = caddy.Duration(10 * time.Second)
			}
			h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{p}}, newMemoryStore(c.now))
			hold := make(chan struct{})
			entered := make(chan struct{}, 3)
			blocking := func(w http.ResponseWriter, r *http.Request) error {
				entered <- struct{}{}
				<-hold
				w.WriteHeader(200)
				return nil
			}
			results := make(chan exchange, 3)
			for range 2 {
				go func() { results <- serveWith([]*Handler{h}, nil, blocking, "X-User", "kim") }()
				<-entered
			}
			if waits {
				go func() { results <- serveWith([]*Handler{h}, nil, blocking, "X-User", "kim") }()
				time.Sleep(50 * time.Millisecond) // queued for a slot
				select {
				case <-entered:
					t.Fatal("a third request ran with 2 slots taken")
				default:
				}
				hold <- struct{}{} // one of the two ends: the waiting one takes its slot
				<-entered
				close(hold)
				for range 3 {
					if x := <-results; x.status != 200 {
						t.Fatalf("%d, want every request admitted in turn", x.status)
					}
				}
				return
			}
			x := serve([]*Handler{h}, nil, "X-User", "kim")
			pol := fields(t, x.header, "RateLimit-Policy")
			lim := fields(t, x.header, "RateLimit")
			if x.status != 429 || x.header.Get("Retry-After") != "1" || lim["exports"]["r"] != 0 || pol["exports"]["q"] != 2 ||
				!strings.Contains(x.header.Get("RateLimit-Policy"), `qu="concurrent-requests"`) {
				t.Fatalf("third request: %d Retry-After %q RateLimit %q RateLimit-Policy %q", x.status, x.header.Get("Retry-After"), x.header.Get("RateLimit"), x.header.Get("RateLimit-Policy"))
			}
			if x := serve([]*Handler{h}, nil, "X-User", "lou"); x.status != 200 || fields(t, x.header, "RateLimit")["exports"]["r"] != 1 {
				t.Fatalf("another key: %d %q", x.status, x.header.Get("RateLimit"))
			}
			close(hold)
			<-results
			<-results
			if x := serve([]*Handler{h}, nil, "X-User", "kim"); x.status != 200 {
				t.Fatalf("after the two ended: %d", x.status)
			}
		})
	}
}

// TestWaitQueuesOrder: the requests waiting for a key's slot try in
// arrival order: only the first is woken when a slot may be free, and the
// next, once the first leaves, is woken at once.
func TestWaitQueuesOrder(t *testing.T) {
	q := waitQueues{queues: map[string][]chan struct{}{}}
	a, b, c := q.join("k"), q.join("k"), q.join("k")
	other := q.join("other")
	woken := func(w chan struct{}) bool {
		select {
		case <-w:
			return true
		default:
			return false
		}
	}
	if !q.first("k", a) || q.first("k", b) || !q.first("other", other) {
		t.Fatal("the first to join is not first, or the queues of two keys are one")
	}
	q.wake("k")
	if !woken(a) || woken(b) || woken(c) || woken(other) {
		t.Fatal("a freed slot woke another than the first waiter of its key")
	}
	q.leave("k", a)
	if !q.first("k", b) || !woken(b) || woken(c) {
		t.Fatal("once the first left, the next was not first and woken")
	}
	q.leave("k", b)
	q.leave("k", c)
	q.leave("other", other)
	if len(q.queues) != 0 {
		t.Fatalf("queues left behind: %v", q.queues)
	}
}

// TestCallerSlotReleases: at the response's end a request frees the slots
// of its callers' budgets (a concurrent policy's), and keeps a shed
// policy's, which protects the service until its handler chain returns;
// giving back frees those too. In process, every release is made at once,
// so the slots are free again.
func TestCallerSlotReleases(t *testing.T) {
	c := &clock{t: 1000 * sec}
	st := newMemoryStore(c.now)
	h := testHandler(t, &Handler{Jitter: jitterOff(), Policies: []*Policy{
		{Name: "exports", Key: "global", Concurrent: 1},
		{Name: "slots_" + t.Name(), Key: "global", Shed: &Shed{Concurrent: 1}},
	}}, st)
	caller, shed := h.Policies[0], h.Policies[1]
	reqs := []bucketRequest{
		{key: "rl:exports:{a}", op: opAcquire, limit: limit{interval: 30_000_000, burst: 1}, lease: "a"},
		{key: "rl:shed:{a}", op: opAcquire, limit: limit{interval: 30_000_000, burst: 1}, lease: "b"},
	}
	res := &admission{parts: []part{{policy: caller, rq: reqs[0]}, {policy: shed, rq: reqs[1]}}}
	d, err := st.decide(context.Background(), reqs)
	if err != nil || !d.admitted {
		t.Fatalf("taking both slots: %+v %v", d, err)
	}
	res.decided(st, d, allParts(2), reqs)
	res.takeSlots()
	if len(res.leases) != 2 || !res.holdsClientSlots() {
		t.Fatalf("leases %d, holding a caller's slot %v: want both slots held", len(res.leases), res.holdsClientSlots())
	}
	rels, policies := res.callerSlotReleases()
	if len(rels) != 1 || rels[0].key != reqs[0].key || rels[0].op != opRelease || policies[0] != caller {
		t.Fatalf("released at the response's end: %+v, want the concurrent policy's slot alone", rels)
	}
	if len(res.leases) != 1 || res.leases[0].policy != shed || res.holdsClientSlots() {
		t.Fatalf("kept %+v, want the shed policy's slot alone", res.leases)
	}
	leasesOf(res.decidedBy).sendReleases(rels, policies)
	res.freeSlots()
	if len(res.leases) != 0 {
		t.Fatalf("after giving back, %d slots still held", len(res.leases))
	}
	again := []bucketRequest{reqs[0], reqs[1]}
	again[0].lease, again[1].lease = "c", "d"
	if d, err := st.decide(context.Background(), again); err != nil || !d.admitted {
		t.Fatalf("both slots taken again after their releases: %+v %v, want them free", d, err)
	}
}

// TestLeaseBookReleaseDuringRestore: a release of a lease whose restore is
// in flight is not sent before the restore lands (which would take the slot
// back after it was freed): the book marks it, and frees it once the
// restore is back.
func TestLeaseBookReleaseDuringRestore(t *testing.T) {
	var sent [][]bucketRequest
	b := &leaseBook{decideAfter: func(reqs []bucketRequest, then func(decision, error)) {
		sent = append(sent, reqs)
		then(decision{admitted: true}, nil)
	}, closed: make(chan struct{})}
	l := lease{rq: bucketRequest{key: "rl:c:{a}", op: opAcquire, lease: "x", limit: limit{interval: 30_000_000, burst: 1}}}
	b.mu.Lock()
	b.leases, b.pending, b.tick, b.running = map[string]*bookedLease{}, map[string]*pendingRelease{}, renewEvery, true // no renewer
	b.leases["x"] = &bookedLease{rq: l.rq, restoring: true}
	b.mu.Unlock()
	if rels, _ := b.releasing([]lease{l}); len(rels) != 0 {
		t.Fatalf("released during a restore: %+v", rels)
	}
	b.mu.Lock()
	held := b.leases["x"]
	b.mu.Unlock()
	if held == nil || !held.released {
		t.Fatal("the release was forgotten, not kept for after the restore")
	}
	if rels, _ := b.releasing([]lease{{rq: bucketRequest{key: "rl:c:{b}", lease: "y"}}}); len(rels) != 1 || rels[0].op != opRelease {
		t.Fatalf("a lease with no restore in flight: %+v, want its release", rels)
	}
}
