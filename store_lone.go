package ratelimit

import (
	"context"
	"time"

	"github.com/redis/go-redis/v9"
)

// A request the instance serves alone (no other in its rate_limit
// handlers: storeUse's serving) is decided on a client of its own, lone,
// whose sockets wait for Redis in a blocking system call
// (redis_wait_linux.go): at one connection that costs this process a
// third less than Go's network poller, which parks the goroutine, spins a
// thread looking for work and wakes it again for the reply. Under
// concurrency the poller serves the coalesced calls better, and they go on
// the pool's connections. lone is nil where sockets cannot block so, and
// in cluster mode.
//
// When a call on lone fails, whatever the error (Redis was away, full at
// maxclients, or turning new connections away: a password or an ACL
// changed since the pool's were made), the pool's connections make the
// lone calls too (loneDown), until lone answers a PING again: its pool of two would otherwise keep failing calls
// for a second after Redis is back (go-redis stops dialing a pool whose
// dials failed as often as its size, and retries once a second) while the
// main pool succeeds.

// clientFor is the client batch's call goes on, and whether it is lone.
func (c *redisStore) clientFor(batch []*pending) (redis.UniversalClient, bool) {
	if len(batch) == 1 && batch[0].alone && c.lone != nil && !c.loneDown.Load() {
		return c.lone, true
	}
	return c.client, false
}

// loneAnswered hands the lone calls to the pool's connections when a call
// on lone failed with err. Any error does: one that says nothing of
// lone's connections (a script's error reply) costs only a second of lone
// calls on the pool.
func (c *redisStore) loneAnswered(err error) {
	if err != nil && c.loneDown.CompareAndSwap(false, true) {
		go c.loneBack()
	}
}

// loneBack waits for the lone connections to answer a PING again, once a
// second, and lets them make the lone calls again (loneDown).
func (c *redisStore) loneBack() {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-c.closed:
			return
		case <-t.C:
		}
		ctx, cancel := context.WithTimeout(context.Background(), c.callTimeout)
		err := c.lone.Ping(ctx).Err()
		cancel()
		if err == nil {
			c.loneDown.Store(false)
			return
		}
	}
}
