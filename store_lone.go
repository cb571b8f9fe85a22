package ratelimit

import (
	"time"
)

// A request the instance serves alone (no other in its rate_limit
// handlers: storeUse's serving) is decided on a connection of its own,
// lone (lone_conn.go), which waits for Redis in a blocking system call
// (redis_wait_linux.go) and speaks to Redis without go-redis: at one
// connection Go's network poller parks the goroutine, spins a thread
// looking for work and wakes it again for the reply, and go-redis's
// handling of a command costs about as much again. Under concurrency the
// poller serves the coalesced calls better, and they go on the pool's
// connections. lone is nil where sockets cannot block so, in cluster mode
// and with Sentinel.
//
// The pool's connections make the lone calls while lone is down
// (loneDown): from the start until it first answers, and after a call on
// it failed, whatever the error (Redis was away, full at maxclients, or
// turning new connections away: a password or an ACL changed since the
// pool's were made), until it answers a PING again, tried at once and
// then once a second. A call that finds lone busy (another coalescer's
// call alone) goes on the pool too.

// loneFor is the lone connection, held for batch's call, or nil when the
// call goes on the pool.
func (c *redisStore) loneFor(batch []*pending) *loneConn {
	if len(batch) != 1 || !batch[0].alone || c.lone == nil || c.loneDown.Load() || !c.lone.mu.TryLock() {
		return nil
	}
	if !c.lone.ready() { // Redis closed it while it sat idle
		c.lone.mu.Unlock()
		c.loneAnswered(errLoneGone)
		return nil
	}
	return c.lone
}

// loneAnswered hands the lone calls to the pool's connections when a call
// on lone failed with err. Any error does: one that says nothing of
// lone's connection (a script's error reply) costs only a second of lone
// calls on the pool.
func (c *redisStore) loneAnswered(err error) {
	if err != nil && c.loneDown.CompareAndSwap(false, true) {
		go c.loneBack()
	}
}

// loneBack opens the lone connection again (connected, and answering a
// PING), at once and then once a second until it is, and lets it make
// the lone calls again (loneDown).
func (c *redisStore) loneBack() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		c.lone.mu.Lock()
		err := c.lone.open()
		c.lone.mu.Unlock()
		if err == nil {
			c.loneDown.Store(false)
			return
		}
		select {
		case <-c.closed:
			return
		case <-t.C:
		}
	}
}
