package ratelimit

import (
	"net/http"
	"strconv"
)

// A finished request is finished everywhere. What an admitted request
// leaves for after its response (a concurrency slot to free, a charge_if
// charge given back, a settle) reaches the store before the client can see
// the end of the response: a client that sends its next request the
// instant it has the previous one's last byte, to any instance, finds that
// work done. The end a client sees is the last byte of a body of declared
// length, or the headers of a response without a body; any other response
// (chunked, HTTP/2 without a length, a settle read from a trailer) ends
// when the handler chain returns, before net/http writes the end of the
// stream. The cost is one store round trip at the end of such responses,
// and only of requests that hold a slot or are charged after their
// response: see docs/concurrency.md.

// finish does the work the request leaves after its response, at once,
// and waits for the store to take it: the charges and settles, and the
// release of its concurrency slots, in one store call. err is what the
// handler chain returned, when it has. It runs once per response, when
// the client is about to see its end.
func (aw *afterResponse) finish(err error) {
	if aw.finished {
		return
	}
	aw.finished = true
	res := aw.res
	reqs, charged := aw.charges(err)
	rels, relPolicies := res.callerSlotReleases()
	reqs = append(reqs, rels...)
	if len(reqs) == 0 {
		return
	}
	// Owed even when the client went away: nothing cancels it.
	_, err = res.decidedBy.decideAwaited(reqs)
	if err != nil {
		for _, p := range charged {
			p.after.lost[lostStoreUnreachable].Inc()
		}
	}
	res.releasesSent(rels, relPolicies, err)
}

// declaredLength is where the response ends, from its status and headers:
// the body bytes it declared (0: the headers are the whole response), or
// -1 when its end is known only once the handler chain returns.
func (w *afterResponse) declaredLength(status int, hdr http.Header) int64 {
	switch {
	case w.endAtReturn || status == http.StatusSwitchingProtocols:
		return -1 // a trailer's usage comes after the body; an upgraded connection runs on
	case w.head || !hasBody(status):
		return 0
	}
	cl := hdr.Get("Content-Length")
	if cl == "" {
		return -1
	}
	n, err := strconv.ParseInt(cl, 10, 64)
	if err != nil || n < 0 {
		return -1
	}
	return n
}
