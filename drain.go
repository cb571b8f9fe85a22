package ratelimit

// drainWaiters are the channels of those waiting for something to be done
// (a connection's calls in flight, its work after responses), closed
// together once it is. The owner's mutex guards them.
type drainWaiters []chan struct{}

// add returns a new waiter's channel.
func (w *drainWaiters) add() <-chan struct{} {
	ch := make(chan struct{})
	*w = append(*w, ch)
	return ch
}

// take returns the waiters and forgets them, for the owner to wake once
// it has let go of its mutex.
func (w *drainWaiters) take() drainWaiters {
	ws := *w
	*w = nil
	return ws
}

// wake closes every waiter's channel.
func (w drainWaiters) wake() {
	for _, ch := range w {
		close(ch)
	}
}

// closedChan is a channel already closed: nothing to wait for.
func closedChan() <-chan struct{} {
	ch := make(chan struct{})
	close(ch)
	return ch
}
