//go:build linux

package ratelimit

import (
	"encoding/binary"
	"io"
	"math"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// On Linux the lone connection (lone_conn.go, store_lone.go) waits for
// Redis in a blocking system call on the calling thread, outside Go's
// network poller. The call of a request the instance serves alone would
// otherwise park its goroutine: the scheduler then spins a thread looking
// for work, blocks it in the poller, and wakes it and hands the goroutine
// over when the reply comes. In a blocking read the kernel wakes the one
// thread that waits, and nothing else: a third less CPU for a decision
// made alone (docs/evidence.md). There is one lone connection, so at most
// one thread waits so.
//
// Deadlines become the socket's own timeouts (SO_RCVTIMEO, SO_SNDTIMEO),
// set only when they must change: each call arms the same timeout, and a
// system call a call would add what the blocking read saves.

// blockingSocket is a connected socket read and written in blocking
// system calls. It sits where a *net.TCPConn would: below redisSocket.
type blockingSocket struct {
	fd            int
	local, remote net.Addr
	network       string

	mu     sync.Mutex
	users  int  // system calls under way on fd
	closed bool // fd is shut down, and closed once users is 0

	// The deadlines, on socketEpoch's monotonic clock (noDeadline: none),
	// and the timeouts the socket has now; a reader owns rto, a writer wto.
	readDeadline, writeDeadline atomic.Int64
	rto, wto                    time.Duration
}

// blockingSocketOf takes c's socket out of the network poller: c is
// closed and its connection goes on, blocking, in the socket returned.
// Anything but a TCP or Unix connection is returned as it is.
func blockingSocketOf(c net.Conn) (net.Conn, error) {
	switch c.(type) {
	case *net.TCPConn, *net.UnixConn:
	default:
		return c, nil
	}
	rc, err := c.(syscall.Conn).SyscallConn()
	if err != nil {
		return c, nil
	}
	fd, derr := -1, error(nil)
	if err := rc.Control(func(f uintptr) {
		r, _, e := syscall.Syscall(syscall.SYS_FCNTL, f, syscall.F_DUPFD_CLOEXEC, 0)
		if e != 0 {
			derr = os.NewSyscallError("fcntl", e)
			return
		}
		fd = int(r)
	}); err != nil || derr != nil {
		_ = c.Close()
		if err == nil {
			err = derr
		}
		return nil, err
	}
	s := &blockingSocket{fd: fd, local: c.LocalAddr(), remote: c.RemoteAddr(), network: c.RemoteAddr().Network()}
	s.readDeadline.Store(noDeadline)
	s.writeDeadline.Store(noDeadline)
	_ = c.Close() // the poller lets go of the socket; fd keeps it open
	if err := syscall.SetNonblock(fd, false); err != nil {
		_ = syscall.Close(fd)
		return nil, os.NewSyscallError("fcntl", err)
	}
	return s, nil
}

// enter counts a system call about to be made on fd; false once closed.
func (s *blockingSocket) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.users++
	return true
}

// leave counts it made, closing fd when it was the last one a Close waited for.
func (s *blockingSocket) leave() {
	s.mu.Lock()
	s.users--
	if s.closed && s.users == 0 {
		_ = syscall.Close(s.fd)
	}
	s.mu.Unlock()
}

// Close shuts the connection down, which ends a read or write under way on
// another thread, and closes the socket once none is.
func (s *blockingSocket) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return s.opError("close", net.ErrClosed)
	}
	s.closed = true
	_ = syscall.Shutdown(s.fd, syscall.SHUT_RDWR)
	if s.users == 0 {
		return os.NewSyscallError("close", syscall.Close(s.fd))
	}
	return nil
}

func (s *blockingSocket) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	if !s.enter() {
		return 0, s.opError("read", net.ErrClosed)
	}
	defer s.leave()
	for {
		wait, passed := leftUntil(s.readDeadline.Load())
		var n int
		var err error
		if passed {
			n, _, err = syscall.Recvfrom(s.fd, b, syscall.MSG_DONTWAIT)
		} else if err = s.arm(syscall.SO_RCVTIMEO, &s.rto, wait); err == nil {
			n, err = syscall.Read(s.fd, b)
		}
		switch {
		case err == nil && n == 0:
			return 0, io.EOF
		case err == nil:
			return n, nil
		case err == syscall.EINTR:
		case err == syscall.EAGAIN:
			if _, passed := leftUntil(s.readDeadline.Load()); passed {
				return 0, s.opError("read", os.ErrDeadlineExceeded)
			}
			// The socket's timeout was shorter than what is left: wait on.
		default:
			return 0, s.opError("read", err)
		}
	}
}

func (s *blockingSocket) Write(b []byte) (int, error) {
	if !s.enter() {
		return 0, s.opError("write", net.ErrClosed)
	}
	defer s.leave()
	done := 0
	for done < len(b) {
		wait, passed := leftUntil(s.writeDeadline.Load())
		var n int
		var err error
		if passed {
			n, err = syscall.SendmsgN(s.fd, b[done:], nil, nil, syscall.MSG_DONTWAIT|syscall.MSG_NOSIGNAL)
		} else if err = s.arm(syscall.SO_SNDTIMEO, &s.wto, wait); err == nil {
			n, err = syscall.Write(s.fd, b[done:])
		}
		if n > 0 {
			done += n
		}
		switch {
		case err == nil, err == syscall.EINTR:
		case err == syscall.EAGAIN:
			if _, passed := leftUntil(s.writeDeadline.Load()); passed {
				return done, s.opError("write", os.ErrDeadlineExceeded)
			}
		default:
			return done, s.opError("write", err)
		}
	}
	return done, nil
}

// noDeadline stands for no deadline.
const noDeadline = math.MinInt64

// leftUntil is how long is left until the deadline (noDeadline: 0) and
// whether it passed.
func leftUntil(deadline int64) (time.Duration, bool) {
	if deadline == noDeadline {
		return 0, false
	}
	left := time.Duration(deadline) - time.Since(socketEpoch)
	return left, left <= 0
}

// arm gives the socket the timeout opt for a wait of at most wait (0: no
// bound), unless the one it has, *cur, will do: one that ends at most a
// millisecond after the deadline, and not so long before it that the wait
// wakes over and over.
func (s *blockingSocket) arm(opt int, cur *time.Duration, wait time.Duration) error {
	if wait > 0 {
		wait = max(wait.Round(time.Microsecond), time.Microsecond) // 0 would be no bound
	}
	switch {
	case wait == 0 && *cur == 0:
		return nil
	case wait > 0 && *cur > 0 && *cur <= wait+time.Millisecond && 2**cur >= wait:
		return nil
	}
	tv := syscall.NsecToTimeval(int64(wait))
	if err := syscall.SetsockoptTimeval(s.fd, syscall.SOL_SOCKET, opt, &tv); err != nil {
		return os.NewSyscallError("setsockopt", err)
	}
	*cur = wait
	return nil
}

func (s *blockingSocket) opError(op string, err error) error {
	return &net.OpError{Op: op, Net: s.network, Source: s.local, Addr: s.remote, Err: err}
}

func (s *blockingSocket) LocalAddr() net.Addr  { return s.local }
func (s *blockingSocket) RemoteAddr() net.Addr { return s.remote }

func (s *blockingSocket) SetDeadline(t time.Time) error {
	_ = s.SetReadDeadline(t)
	return s.SetWriteDeadline(t)
}

func (s *blockingSocket) SetReadDeadline(t time.Time) error {
	s.readDeadline.Store(sinceEpoch(t))
	return nil
}

func (s *blockingSocket) SetWriteDeadline(t time.Time) error {
	s.writeDeadline.Store(sinceEpoch(t))
	return nil
}

// sinceEpoch is t on socketEpoch's clock (monotonic when t is), or
// noDeadline for the zero time.
func sinceEpoch(t time.Time) int64 {
	if t.IsZero() {
		return noDeadline
	}
	return max(int64(t.Sub(socketEpoch)), noDeadline+1)
}

// SyscallConn gives go-redis's health check of an idle connection (a
// look at the socket that does not wait) the socket.
func (s *blockingSocket) SyscallConn() (syscall.RawConn, error) { return rawBlocking{s}, nil }

type rawBlocking struct{ s *blockingSocket }

func (r rawBlocking) Control(f func(fd uintptr)) error {
	if !r.s.enter() {
		return r.s.opError("raw-control", net.ErrClosed)
	}
	defer r.s.leave()
	f(uintptr(r.s.fd))
	return nil
}

func (r rawBlocking) Read(f func(fd uintptr) bool) error { return r.wait("raw-read", pollIn, f) }

func (r rawBlocking) Write(f func(fd uintptr) bool) error {
	return r.wait("raw-write", pollOut, f)
}

// wait calls f until it is done, waiting for the socket to be ready for
// events between calls.
func (r rawBlocking) wait(op string, events int16, f func(fd uintptr) bool) error {
	if !r.s.enter() {
		return r.s.opError(op, net.ErrClosed)
	}
	defer r.s.leave()
	for !f(uintptr(r.s.fd)) {
		pfd := struct {
			fd              int32
			events, revents int16
		}{fd: int32(r.s.fd), events: events}
		_, _, e := syscall.Syscall6(syscall.SYS_PPOLL, uintptr(unsafe.Pointer(&pfd)), 1, 0, 0, 0, 0)
		if e != 0 && e != syscall.EINTR {
			return r.s.opError(op, os.NewSyscallError("ppoll", e))
		}
	}
	return nil
}

// ppoll's events: readable, writable.
const pollIn, pollOut = 0x1, 0x4

// blockingWaits: sockets to Redis can wait in blocking system calls here.
const blockingWaits = true

// closedByPeer says whether the TCP connection on fd is no longer open
// both ways (Redis closed it: its FIN came), from TCP_INFO's state, its
// first byte; true when that cannot be read.
func closedByPeer(fd uintptr) bool {
	var info [1]byte
	return tcpInfo(fd, info[:]) < len(info) || info[0] != tcpEstablished
}

// unacknowledged says whether some of the bytes sent on the TCP
// connection on fd were never acknowledged by the other end: from
// TCP_INFO's counters, the bytes sent, less those sent again, beyond the
// bytes acknowledged. Once the connection has ended, that is what it sent
// after the other end's kernel stopped taking it in; a FIN acknowledges
// everything taken in before it. known is false where the counters
// cannot be read (kernels before 4.19).
func unacknowledged(fd uintptr) (unacked, known bool) {
	var info [tcpInfoLen]byte
	if tcpInfo(fd, info[:]) < len(info) {
		return false, false
	}
	u64 := func(off int) uint64 { return binary.NativeEndian.Uint64(info[off:]) }
	acked, sent, resent := u64(120), u64(200), u64(208) // tcpi_bytes_acked, _sent, _retrans
	return sent-resent > acked, true
}

// tcpInfo reads the TCP connection on fd's struct tcp_info, as much of
// it as info holds and the kernel has, into info; it returns how many
// bytes it read, 0 when it could not.
func tcpInfo(fd uintptr, info []byte) int {
	n := uint32(len(info))
	_, _, e := syscall.Syscall6(syscall.SYS_GETSOCKOPT, fd, syscall.IPPROTO_TCP, syscall.TCP_INFO,
		uintptr(unsafe.Pointer(&info[0])), uintptr(unsafe.Pointer(&n)), 0)
	if e != 0 {
		return 0
	}
	return int(n)
}

// tcpInfoLen is struct tcp_info's length up to tcpi_bytes_retrans
// (include/uapi/linux/tcp.h).
const tcpInfoLen = 216

// tcpEstablished is TCP_ESTABLISHED, the state of a connection open both
// ways (include/net/tcp_states.h).
const tcpEstablished = 1
