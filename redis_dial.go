package ratelimit

import (
	"context"
	"net"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// Dialing Redis. Each time go-redis's pool hands out a connection it peeks
// at the socket (recvfrom with MSG_PEEK: a syscall and three allocations),
// to find a connection Redis closed, or one holding a reply nobody asked
// for, before a command is written on it. On the hot path that is one
// syscall in four of a script call, the whole of a decision's cost at one
// request at a time. A connection that read a reply within peekAfter has
// just been found live, so it is handed out without the peek, as go-redis
// itself skips its push-notification peek for 5 s after a check; an idle
// one is peeked as before. Redis closing a connection in that second costs
// what it costs between a peek and the write anyway: that call fails.

// peekAfter is how long since a connection last read before the pool peeks
// at it again.
var peekAfter = time.Second

// peekingDialer is dial (a plain TCP dialer) with its connections peeked
// at only once idle. A TLS connection is never peeked by go-redis (it does
// not expose its socket), so TLS keeps go-redis's own dialer.
func peekingDialer(dialTimeout time.Duration) func(ctx context.Context, network, addr string) (net.Conn, error) {
	dial := redis.NewDialer(&redis.Options{DialTimeout: dialTimeout})
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		sc, ok := conn.(syscall.Conn)
		if !ok {
			return conn, nil
		}
		raw, err := sc.SyscallConn()
		if err != nil {
			return conn, nil
		}
		c := &peekedConn{Conn: conn}
		c.raw = recentRaw{RawConn: raw, conn: c}
		c.lastRead.Store(monotonicNanos())
		return c, nil
	}
}

// peekedConn is a connection to Redis that remembers when it last read.
type peekedConn struct {
	net.Conn
	raw      recentRaw
	lastRead atomic.Int64 // monotonicNanos
}

func (c *peekedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	if n > 0 {
		c.lastRead.Store(monotonicNanos())
	}
	return n, err
}

// SyscallConn is what go-redis peeks through.
func (c *peekedConn) SyscallConn() (syscall.RawConn, error) { return &c.raw, nil }

// recentRaw is the socket of a peekedConn, which skips the reads go-redis
// makes to peek while the connection read recently.
type recentRaw struct {
	syscall.RawConn
	conn *peekedConn
}

func (r *recentRaw) Read(f func(fd uintptr) bool) error {
	if monotonicNanos()-r.conn.lastRead.Load() < int64(peekAfter) {
		return nil // f not called: nothing found, the connection is taken
	}
	return r.RawConn.Read(f)
}

// monotonicNanos is a monotonic clock in ns.
func monotonicNanos() int64 { return int64(time.Since(epoch)) }
