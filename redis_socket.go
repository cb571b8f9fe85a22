package ratelimit

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"os"
	"sync/atomic"
	"syscall"
	"time"
)

// The redis block's timeout measures Redis, not this process. go-redis
// puts it on the socket as deadlines; but a deadline passes whether Redis
// was late or this process was: a gateway saturated by a flood (or stopped
// by its host for a moment) wakes up to a deadline that passed while the
// reply sat on its socket, and the call fails, and its requests follow
// on_error, when the limiter matters most. So a Redis connection's socket
// judges its deadlines by what Redis did:
//
//   - a read whose deadline passed looks once more, at once: a reply that
//     reached the socket is read, and the rest of it gets the timeout again;
//   - a write whose deadline passed before the request reached the socket
//     (this process was late) gets the timeout again, from then;
//   - a reply gets the whole timeout from when its request reached the
//     socket: a call's deadline also covers its wait for a connection,
//     and a call that waited long for one (a flood, cores taken by other
//     work) would otherwise give a Redis 20 ms away what was left of it,
//     a few milliseconds, and fail although Redis answered in time.
//
// A Redis that truly stalls still fails a call within the timeout plus
// lookAgain (docs/redis.md, "Timeouts"), plus this process's own scheduling
// delay in noticing it.

// lookAgain is how long the second look at a socket whose read deadline
// passed waits for a reply: long enough to cover the instant between
// arming it and the read, far below any timeout.
const lookAgain = 5 * time.Millisecond

// redisSocket is a connection to Redis whose deadlines count Redis's time
// (see above). It sits below TLS, on the TCP connection.
type redisSocket struct {
	net.Conn
	timeout time.Duration // the redis block's
	// wrote is when the last write reached the socket, in monotonic
	// nanoseconds since socketEpoch (atomic: a subscription's health check
	// writes while its reader waits).
	wrote atomic.Int64
}

// socketEpoch is the origin of redisSocket.wrote's monotonic clock.
var socketEpoch = time.Now()

// SetReadDeadline sets t, or the write's time plus the timeout when that
// is later (see above). The zero time (no deadline) is kept.
func (s *redisSocket) SetReadDeadline(t time.Time) error {
	return s.Conn.SetReadDeadline(s.readDeadline(t))
}

// SetDeadline is SetReadDeadline's for reads, t for writes.
func (s *redisSocket) SetDeadline(t time.Time) error {
	if err := s.Conn.SetWriteDeadline(t); err != nil {
		return err
	}
	return s.SetReadDeadline(t)
}

func (s *redisSocket) readDeadline(t time.Time) time.Time {
	w := s.wrote.Load()
	if t.IsZero() || w == 0 {
		return t
	}
	if least := socketEpoch.Add(time.Duration(w) + s.timeout); t.Before(least) {
		return least
	}
	return t
}

func (s *redisSocket) Read(b []byte) (int, error) {
	n, err := s.Conn.Read(b)
	if n > 0 || !isDeadline(err) {
		return n, err
	}
	if s.Conn.SetReadDeadline(time.Now().Add(lookAgain)) != nil {
		return n, err
	}
	m, again := s.Conn.Read(b)
	if m == 0 {
		return n, err // nothing came: Redis is late
	}
	// Redis answered in time: the rest of its reply is on its way.
	_ = s.Conn.SetReadDeadline(time.Now().Add(s.timeout))
	return m, again
}

func (s *redisSocket) Write(b []byte) (int, error) {
	n, err := s.write(b)
	if n > 0 {
		s.wrote.Store(int64(time.Since(socketEpoch)))
	}
	return n, err
}

func (s *redisSocket) write(b []byte) (int, error) {
	n, err := s.Conn.Write(b)
	if n == len(b) || !isDeadline(err) {
		return n, err
	}
	// This process reached the socket late, or the socket's buffer stayed
	// full for a timeout: one more timeout, from now, and no more.
	if s.Conn.SetWriteDeadline(time.Now().Add(s.timeout)) != nil {
		return n, err
	}
	m, err := s.Conn.Write(b[n:])
	return n + m, err
}

// SyscallConn lets go-redis check an idle connection's health as it does
// a plain TCP one's.
func (s *redisSocket) SyscallConn() (syscall.RawConn, error) {
	if sc, ok := s.Conn.(syscall.Conn); ok {
		return sc.SyscallConn()
	}
	return nil, errors.ErrUnsupported
}

func isDeadline(err error) bool { return errors.Is(err, os.ErrDeadlineExceeded) }

// redisDialer connects to Redis as go-redis's own dialer does (TCP
// keep-alives, TLS when configured), through a redisSocket; blocking: its
// socket waits for Redis in blocking system calls (redis_wait_linux.go).
func redisDialer(tlsConfig *tls.Config, dialTimeout, timeout time.Duration, blocking bool) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		d := &net.Dialer{Timeout: dialTimeout, KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 30 * time.Second, Interval: 5 * time.Second, Count: 3}}
		raw, err := d.DialContext(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		if blocking {
			if raw, err = blockingSocketOf(raw); err != nil {
				return nil, err
			}
		}
		conn := net.Conn(&redisSocket{Conn: raw, timeout: timeout})
		if tlsConfig == nil {
			return conn, nil
		}
		cfg := tlsConfig
		if cfg.ServerName == "" {
			cfg = cfg.Clone()
			cfg.ServerName, _, _ = net.SplitHostPort(addr)
		}
		hctx, cancel := context.WithTimeout(ctx, dialTimeout)
		defer cancel()
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(hctx); err != nil {
			_ = raw.Close()
			return nil, err
		}
		return tlsSocket{tc}, nil
	}
}

// tlsSocket is a TLS connection to Redis whose health go-redis's pool can
// check before it hands the connection out after it sat idle. go-redis
// looks only at a connection that is a syscall.Conn, which crypto/tls's is
// not: without this, a connection Redis closed while idle (its timeout
// setting, a restart) failed the next call made on it.
type tlsSocket struct{ *tls.Conn }

// SyscallConn is the TCP socket's below TLS, for the look only (idleLook).
func (s tlsSocket) SyscallConn() (syscall.RawConn, error) {
	sc, ok := s.NetConn().(syscall.Conn)
	if !ok {
		return nil, errors.ErrUnsupported
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, err
	}
	return idleLook{rc}, nil
}

// idleLook is the socket go-redis's health check reads through. Where the
// check would peek at the socket itself and, finding bytes there, read
// them through TLS (which can wait forever for a record that does not
// come, go-redis's own comment says), Read takes its own look and answers
// a socket that is not sound with an error, which go-redis takes as
// unhealthy: it closes the connection and makes another one. Bytes on a
// connection Redis has not closed are TLS's own records, left for the
// connection's first read: the session tickets a TLS 1.3 server sends
// after the handshake sit there on the connections go-redis opens ahead
// of use (MinIdleConns), which are sound.
type idleLook struct{ syscall.RawConn }

// errIdleUnsound: Redis closed the connection while it sat idle.
var errIdleUnsound = errors.New("rate_limit: Redis closed the idle connection")

func (r idleLook) Read(func(fd uintptr) bool) error {
	if !idleSound(r.RawConn, true) {
		return errIdleUnsound
	}
	return nil
}

// idleSound takes a look at an idle connection's socket that does not
// wait: sound when it holds nothing to read (not closed by Redis, no
// reply nobody asked for), or when it cannot be looked at. With
// tlsRecords, bytes on a connection Redis has not closed are sound too:
// TLS's own records, left for its first read (idleLook).
func idleSound(rc syscall.RawConn, tlsRecords bool) bool {
	sound := true
	err := rc.Read(func(fd uintptr) bool {
		switch peekSocket(fd) {
		case socketHolds:
			sound = tlsRecords && !closedByPeer(fd)
		case socketClosed:
			sound = false
		}
		return true
	})
	return err == nil && sound
}

// What a look at a socket that does not wait finds (peekSocket).
type socketState int

const (
	socketEmpty  socketState = iota // nothing to read, or no look possible here
	socketHolds                     // bytes to read
	socketClosed                    // closed by the other end, or failed
)
