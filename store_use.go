package ratelimit

import (
	"sync"
	"sync/atomic"
)

// storeUse is a handler's use of its store, which lasts until the handler
// is cleaned up and its last request has ended. On a reload Caddy cleans
// the old config up without waiting for the requests still running on it
// (a stream, an upload, an export): they still renew their slots' leases,
// free them and settle after their responses, on the store they were
// decided by. When Caddy stops, it cleans up after its requests ended, and
// the store is let go at once.
type storeUse struct {
	serving atomic.Int64
	cleaned atomic.Bool
	once    sync.Once
	close   func() error // lets the store go (see openStore)
	err     error
}

// serving counts the requests every rate_limit handler of this process
// is serving. One alone is an instance at low load, whose Redis call has
// nothing to share a round trip with and waits in a blocking system call
// (store_lone.go).
var serving atomic.Int64

// enter and leave bracket each request the handler serves.
func (u *storeUse) enter() {
	u.serving.Add(1)
	serving.Add(1)
}

func (u *storeUse) leave() {
	serving.Add(-1)
	if u.serving.Add(-1) == 0 && u.cleaned.Load() {
		// Not in the request: closing a connection waits for the work after
		// the last responses.
		go u.letGo()
	}
}

// end is the handler's Cleanup: the store is let go now, or when the last
// request running ends.
func (u *storeUse) end() error {
	u.cleaned.Store(true)
	if u.serving.Load() == 0 {
		return u.letGo()
	}
	return nil
}

func (u *storeUse) letGo() error {
	u.once.Do(func() { u.err = u.close() })
	return u.err
}
