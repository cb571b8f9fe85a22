package ratelimit

import (
	"errors"
	"time"

	"go.uber.org/zap"
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
// it failed other than by Redis's error reply (Redis was away, or closed
// the connection), until it opens again, tried at once and then once a
// second; Redis may refuse the new one (full at maxclients, or a password
// or an ACL changed since the pool's were made) while the pool's go on.
// A call that finds lone busy (another coalescer's call alone), or its
// connection closed by Redis while idle, goes on the pool too: found
// closed by the look before the call, or, when the connection answered
// too recently to be looked at (loneFresh), by the call itself before any
// reply (errLoneClosed, eval).

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
// on lone failed with err, unless err is Redis's error reply (out of
// memory, a read-only replica, a script's error): the connection is sound,
// and the pool would get the same reply.
func (c *redisStore) loneAnswered(err error) {
	if err == nil {
		return
	}
	if _, reply := err.(loneReplyError); !reply && c.loneDown.CompareAndSwap(false, true) {
		go c.loneBack()
	}
}

// loneBack opens the lone connection again (connected, and answering),
// at once and then once a second until it is, and lets it make the lone
// calls again (loneDown). When Redis answers but refuses it (a password,
// an ACL, maxclients), that is logged once: the pool's connections,
// opened before, may go on working meanwhile, and nothing else would say
// why requests served alone cost more.
func (c *redisStore) loneBack() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	logged := false
	for {
		c.lone.mu.Lock()
		err := c.lone.open()
		c.lone.mu.Unlock()
		if err == nil {
			c.loneDown.Store(false)
			return
		}
		var reply loneReplyError
		if !logged && errors.As(err, &reply) {
			logged = true
			c.logger.Warn("Redis refused the connection for requests served alone; they go on the pool's connections, and it is tried again once a second",
				zap.String("redis", c.name), zap.Error(err))
		}
		select {
		case <-c.closed:
			return
		case <-t.C:
		}
	}
}
