package ratelimit

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// loneConn is the connection a request the instance serves alone is
// decided on (store_lone.go): one socket that waits for Redis in a
// blocking system call (redis_wait_linux.go), on which the script's call
// is written and its reply read here, in RESP2, rather than through
// go-redis. At one connection go-redis's handling of a command (its pool,
// hooks, command and reply values) cost Caddy about what the blocking
// wait saves (docs/evidence.md); a call has nothing else to do here: one
// command, one array of integers back. Calls made together still go on
// go-redis's pool, coalesced.
type loneConn struct {
	dial               func(ctx context.Context, network, addr string) (net.Conn, error)
	addr               string
	username, password string
	db                 int
	dialTimeout        time.Duration
	timeout            time.Duration // the redis block's: each write, and each reply

	// mu is held by the one call on the connection; a call that finds it
	// held goes on the pool.
	mu  sync.Mutex
	rd  *bufio.Reader
	buf []byte // the command being written
	// answered is when a call on conn last had its reply
	// (monotonicMicros; 0: none yet), and unlooked whether ready took it
	// as sound for that without its look at the socket.
	answered int64
	unlooked bool
	// tells: the kernel tells what Redis acknowledged (unacknowledged),
	// without which every call is looked at first.
	tells bool
	// conn is the socket (nil: none); held under cmu, so that closing
	// the store ends a call waiting on it.
	cmu    sync.Mutex
	conn   net.Conn
	closed bool
	// calls counts the calls made on the connection (tests).
	calls atomic.Uint64
}

// errLoneGone stands for a lone connection that is not there: never
// made, closed, or found closed by Redis while idle.
var errLoneGone = errors.New("rate_limit: the lone connection to Redis is not open")

// loneFresh is how recently the connection must have answered for a call
// to be made on it without a look at its socket first. Redis closes a
// connection idle for its timeout, a second at least, so one that
// answered within the second is sound unless Redis was told to close it
// (CLIENT KILL, a restart); the call then finds that it was closed before
// the call reached Redis (errLoneClosed) and is made on the pool instead,
// which the kernel's counters tell (Linux 4.19 on: tells). What
// is saved is the look's system call, on every decision made one request
// at a time.
const loneFresh = 1_000_000 // µs

// errLoneClosed is a call, on a connection not looked at (loneFresh), that
// found the connection closed by Redis before the call reached it
// (closedBefore), so the script did not run.
type errLoneClosed struct{ err error }

func (e *errLoneClosed) Error() string {
	return "rate_limit: Redis had closed the lone connection: " + e.err.Error()
}
func (e *errLoneClosed) Unwrap() error { return e.err }

// loneReplyError is an error reply from Redis. go-redis's redis.Error
// interface (RedisError) makes it read as go-redis's own: the NOSCRIPT
// retry, errorKind and the breaker treat it alike.
type loneReplyError string

func (e loneReplyError) Error() string { return string(e) }
func (loneReplyError) RedisError()     {}

// open connects (dial, AUTH, SELECT) and checks the connection with a TIME,
// replacing the connection there was; the caller holds mu.
func (l *loneConn) open() error {
	l.drop()
	l.answered, l.unlooked, l.tells = 0, false, false
	ctx, cancel := context.WithTimeout(context.Background(), l.dialTimeout)
	conn, err := l.dial(ctx, "tcp", l.addr)
	cancel()
	if err != nil {
		return err
	}
	l.cmu.Lock()
	if l.closed {
		l.cmu.Unlock()
		_ = conn.Close()
		return errLoneGone
	}
	l.conn = conn
	l.cmu.Unlock()
	if l.rd == nil {
		l.rd = bufio.NewReaderSize(conn, 4096) // an error reply's line fits
	} else {
		l.rd.Reset(conn)
	}
	deadline := time.Now().Add(l.dialTimeout + l.timeout)
	// AUTH in its two-argument form ("default" without a username), which
	// a Redis whose default user has no password accepts too, as go-redis's
	// HELLO does; then TIME, which every limiter's ACL grants (the script
	// calls it), where PING may be refused: an answer proves the
	// connection, which Redis may also refuse (maxclients) after accepting
	// it.
	var hello [][]any
	if l.password != "" {
		user := l.username
		if user == "" {
			user = "default"
		}
		hello = append(hello, []any{"auth", user, l.password})
	}
	if l.db != 0 {
		hello = append(hello, []any{"select", l.db})
	}
	hello = append(hello, []any{"time"})
	for _, cmd := range hello {
		if err := l.roundTrip(conn, deadline, cmd, nil); err != nil {
			l.drop()
			return err
		}
	}
	l.answered = monotonicMicros()
	if rc := rawSocket(conn); rc != nil {
		_ = rc.Control(func(fd uintptr) { _, l.tells = unacknowledged(fd) })
	}
	return nil
}

// ready reports whether the connection is open and Redis has not closed
// it while it sat idle: a look at the socket that does not wait, as
// go-redis's pool takes before handing a connection out, unless it
// answered within loneFresh (unlooked). Under TLS the
// look is at the TCP socket below, which holds nothing while the
// connection is idle unless Redis closed it (its close_notify) or sent
// something unasked: either way it is not used. A closed one is dropped.
// The caller holds mu.
func (l *loneConn) ready() bool {
	l.cmu.Lock()
	conn := l.conn
	l.cmu.Unlock()
	if conn == nil {
		return false
	}
	if l.rd.Buffered() > 0 {
		l.drop() // a reply nobody asked for: the connection is out of step
		return false
	}
	if l.tells && l.answered != 0 && monotonicMicros()-l.answered < loneFresh {
		l.unlooked = true
		return true
	}
	l.unlooked = false
	rc := rawSocket(conn)
	if rc == nil {
		return true
	}
	if !idleSound(rc, false) { // the handshake's records were read with its replies
		l.drop()
		return false
	}
	return true
}

// call runs args (a script's EVALSHA or EVAL) and reads its reply, an
// array of integers, by deadline, into out. A connection that failed in
// any way but an error reply is dropped: what it holds next is unknown.
// The caller holds mu, and checked ready.
func (l *loneConn) call(deadline time.Time, args []any, out []int64) ([]int64, error) {
	l.calls.Add(1)
	l.cmu.Lock()
	conn := l.conn
	l.cmu.Unlock()
	if conn == nil {
		return nil, errLoneGone
	}
	out = out[:0]
	if err := l.roundTrip(conn, deadline, args, &out); err != nil {
		if _, reply := err.(loneReplyError); !reply {
			l.drop()
		}
		return nil, err
	}
	l.answered = monotonicMicros()
	return out, nil
}

// roundTrip writes one command and reads its reply: an array of integers
// into *out, or (out nil) anything but an error. The write, then the
// reply, each get the timeout, within deadline, as go-redis gives its
// commands (and the socket gives the reply the whole timeout from when the
// command reached it: redis_socket.go).
func (l *loneConn) roundTrip(conn net.Conn, deadline time.Time, args []any, out *[]int64) error {
	b, err := appendCommand(l.buf[:0], args)
	if err != nil {
		return err
	}
	l.buf = b
	within := func() time.Time {
		if t := time.Now().Add(l.timeout); l.timeout > 0 && t.Before(deadline) {
			return t
		}
		return deadline
	}
	if err := conn.SetWriteDeadline(within()); err != nil {
		return err
	}
	if _, err := conn.Write(b); err != nil {
		return l.closedBefore(err, nil) // not written whole: not run
	}
	if err := conn.SetReadDeadline(within()); err != nil {
		return err
	}
	if _, err := l.rd.Peek(1); err != nil { // nothing of the reply came
		return l.closedBefore(err, conn)
	}
	if out == nil {
		return skipReply(l.rd)
	}
	*out, err = readIntegers(l.rd, (*out)[:0])
	return err
}

// closedBefore is err, a call's write or the wait for its reply's first
// byte, as errLoneClosed when it says Redis had closed a connection the
// call took without a look (a reset, or the end of it) before the call
// reached it: what the look would have found. Redis runs no command it
// has not read whole, and reads none once it closed the connection. A
// write that failed was not made whole. After a whole write (conn), the
// call reached Redis unless Redis's kernel never acknowledged it
// (unacknowledged): one Redis closed after reading it, whose script may
// have run (a CLIENT KILL between running it and answering), stays a
// failure, never charged twice.
func (l *loneConn) closedBefore(err error, conn net.Conn) error {
	if !l.unlooked || !(errors.Is(err, io.EOF) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)) {
		return err
	}
	if conn != nil {
		rc, unacked := rawSocket(conn), false
		if rc == nil || rc.Control(func(fd uintptr) { unacked, _ = unacknowledged(fd) }) != nil || !unacked {
			return err
		}
	}
	return &errLoneClosed{err}
}

// rawSocket is conn's TCP socket, below TLS, or nil when it cannot be
// looked at.
func rawSocket(conn net.Conn) syscall.RawConn {
	if tc, ok := conn.(tlsSocket); ok {
		conn = tc.NetConn()
	}
	sc, ok := conn.(syscall.Conn)
	if !ok {
		return nil
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// drop closes the connection, if there is one.
func (l *loneConn) drop() {
	l.cmu.Lock()
	conn := l.conn
	l.conn = nil
	l.cmu.Unlock()
	if conn != nil {
		_ = conn.Close()
	}
}

// Close closes the connection for good; a call waiting on it ends.
func (l *loneConn) Close() error {
	l.cmu.Lock()
	l.closed = true
	l.cmu.Unlock()
	l.drop()
	return nil
}

// appendCommand appends args as a RESP array of bulk strings. The call's
// arguments are strings, byte strings and integers (wire.go, encodeCall).
func appendCommand(b []byte, args []any) ([]byte, error) {
	b = append(b, '*')
	b = strconv.AppendInt(b, int64(len(args)), 10)
	b = append(b, '\r', '\n')
	var digits [20]byte
	for _, a := range args {
		switch v := a.(type) {
		case string:
			b = appendBulk(b, v)
		case []byte:
			b = appendBulk(b, v)
		case int:
			b = appendBulk(b, strconv.AppendInt(digits[:0], int64(v), 10))
		case int64:
			b = appendBulk(b, strconv.AppendInt(digits[:0], v, 10))
		default:
			return b, fmt.Errorf("rate_limit: a Redis argument of type %T", a)
		}
	}
	return b, nil
}

func appendBulk[S string | []byte](b []byte, s S) []byte {
	b = append(b, '$')
	b = strconv.AppendInt(b, int64(len(s)), 10)
	b = append(b, '\r', '\n')
	b = append(b, s...)
	return append(b, '\r', '\n')
}

// errLoneProtocol is a reply this connection cannot read as one.
var errLoneProtocol = errors.New("rate_limit: Redis's reply on the lone connection is not RESP2 of the kind expected")

// readIntegers reads one reply: an array of integers (appended to out),
// or an error reply (a loneReplyError).
func readIntegers(rd *bufio.Reader, out []int64) ([]int64, error) {
	kind, line, err := readLine(rd)
	if err != nil {
		return nil, err
	}
	switch kind {
	case '-':
		return nil, loneReplyError(line)
	case '*':
	default:
		return nil, errLoneProtocol
	}
	n, err := respLen(line, 1<<16)
	if err != nil {
		return nil, err
	}
	for range n {
		kind, line, err := readLine(rd)
		if err != nil {
			return nil, err
		}
		switch kind {
		case ':', '+': // an integer; a status that is one, as go-redis reads it
		case '$': // a bulk string that is one, as go-redis reads it
			if line, err = readBulk(rd, line); err != nil {
				return nil, err
			}
		default:
			return nil, errLoneProtocol
		}
		v, err := strconv.ParseInt(string(line), 10, 64)
		if err != nil {
			return nil, errLoneProtocol
		}
		out = append(out, v)
	}
	return out, nil
}

// readBulk reads the body of a bulk string of the length given (a short
// one: a number's digits).
func readBulk(rd *bufio.Reader, length []byte) ([]byte, error) {
	n, err := respLen(length, 64)
	if err != nil {
		return nil, err
	}
	var b [66]byte
	if _, err := io.ReadFull(rd, b[:n+2]); err != nil {
		return nil, err
	}
	if b[n] != '\r' || b[n+1] != '\n' {
		return nil, errLoneProtocol
	}
	return b[:n], nil
}

// skipReply reads a reply to AUTH, SELECT or TIME: a simple string, or an
// array of bulk strings; or an error reply.
func skipReply(rd *bufio.Reader) error {
	kind, line, err := readLine(rd)
	switch {
	case err != nil:
		return err
	case kind == '-':
		return loneReplyError(line)
	case kind == '+':
		return nil
	case kind != '*':
		return errLoneProtocol
	}
	n, err := respLen(line, 16)
	if err != nil {
		return err
	}
	for range n {
		kind, line, err := readLine(rd)
		if err != nil {
			return err
		}
		if kind != '$' {
			return errLoneProtocol
		}
		if _, err := readBulk(rd, line); err != nil {
			return err
		}
	}
	return nil
}

// respLen reads an array's or a bulk string's length, from 0 to most.
func respLen(line []byte, most int) (int, error) {
	n, err := strconv.Atoi(string(line))
	if err != nil || n < 0 || n > most {
		return 0, errLoneProtocol
	}
	return n, nil
}

// readLine reads one RESP line: its type byte and the rest, without CRLF.
func readLine(rd *bufio.Reader) (byte, []byte, error) {
	line, err := rd.ReadSlice('\n')
	if err != nil {
		if errors.Is(err, bufio.ErrBufferFull) {
			return 0, nil, errLoneProtocol
		}
		return 0, nil, err
	}
	if len(line) < 3 || line[len(line)-2] != '\r' {
		return 0, nil, errLoneProtocol
	}
	return line[0], line[1 : len(line)-2], nil
}
