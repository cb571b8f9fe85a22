//go:build linux

package ratelimit

import (
	"errors"
	"io"
	"net"
	"syscall"
	"testing"
	"time"
)

// blockingPair is a blocking socket connected to a plain one, the server's
// side, which the test drives.
func blockingPair(t *testing.T) (net.Conn, net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, err := l.Accept()
		if err != nil {
			close(accepted)
			return
		}
		accepted <- c
	}()
	raw, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c, err := blockingSocketOf(raw)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := c.(*blockingSocket); !ok {
		t.Fatalf("blockingSocketOf gave a %T, want a *blockingSocket", c)
	}
	server, ok := <-accepted
	if !ok {
		t.Fatal("no connection accepted")
	}
	t.Cleanup(func() { c.Close(); server.Close() })
	return c, server
}

// The connection carries bytes both ways, and reads EOF once the server
// closes it.
func TestBlockingSocketReadsWritesAndEOF(t *testing.T) {
	c, server := blockingPair(t)
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(server, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("server read %q, %v", buf, err)
	}
	if _, err := server.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("read %q, %v", buf, err)
	}
	server.Close()
	if n, err := c.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("read after the server closed: %d, %v; want 0, EOF", n, err)
	}
}

// A read waits for its deadline, no longer, and fails as a timeout that
// go-redis and redisSocket recognise; a deadline already passed still
// reads what came.
func TestBlockingSocketReadDeadline(t *testing.T) {
	c, server := blockingPair(t)
	buf := make([]byte, 8)
	for _, wait := range []time.Duration{50 * time.Millisecond, 0, -time.Second} {
		start := time.Now()
		_ = c.SetReadDeadline(start.Add(wait))
		_, err := c.Read(buf)
		waited := time.Since(start)
		var ne net.Error
		if !isDeadline(err) || !errors.As(err, &ne) || !ne.Timeout() {
			t.Fatalf("read with a deadline in %v and nothing sent: %v, want a timeout", wait, err)
		}
		if waited < wait || waited > wait+5*time.Second {
			t.Fatalf("read with a deadline in %v failed after %v", wait, waited)
		}
	}

	if _, err := server.Write([]byte("late")); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the reply reaches the socket
	_ = c.SetReadDeadline(time.Now().Add(-time.Millisecond))
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "late" {
		t.Fatalf("read of what came, its deadline passed: %q, %v", buf[:n], err)
	}

	// A longer deadline after a short one: the socket's shorter timeout
	// does not cut the wait.
	_ = c.SetReadDeadline(time.Now().Add(time.Millisecond))
	_, _ = c.Read(buf)
	go func() {
		time.Sleep(100 * time.Millisecond)
		_, _ = server.Write([]byte("slow"))
	}()
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "slow" {
		t.Fatalf("read of a reply 100 ms away, 10 s allowed: %q, %v", buf[:n], err)
	}

	// No deadline: the read waits for as long as the reply takes.
	_ = c.SetReadDeadline(time.Time{})
	go func() {
		time.Sleep(50 * time.Millisecond)
		_, _ = server.Write([]byte("whenever"))
	}()
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "whenever" {
		t.Fatalf("read without a deadline: %q, %v", buf[:n], err)
	}
}

// A write to a server that reads nothing fails at its deadline once the
// socket's buffers are full.
func TestBlockingSocketWriteDeadline(t *testing.T) {
	c, _ := blockingPair(t)
	big := make([]byte, 64<<20)
	start := time.Now()
	_ = c.SetWriteDeadline(start.Add(100 * time.Millisecond))
	n, err := c.Write(big)
	if !isDeadline(err) || n >= len(big) {
		t.Fatalf("write of 64 MB nobody reads: %d bytes, %v; want a timeout before the end", n, err)
	}
	if waited := time.Since(start); waited > 10*time.Second {
		t.Fatalf("write failed after %v", waited)
	}
}

// Closing the connection ends a read waiting on another goroutine (a
// subscription's, or a call's when the store shuts down), and the server
// sees the connection end.
func TestBlockingSocketCloseEndsAWaitingRead(t *testing.T) {
	c, server := blockingPair(t)
	read := make(chan error, 1)
	go func() {
		_, err := c.Read(make([]byte, 8))
		read <- err
	}()
	time.Sleep(20 * time.Millisecond) // the read waits
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-read:
		if err == nil {
			t.Fatal("the waiting read returned no error once closed")
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting read did not return within 5 s of Close")
	}
	_ = server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := server.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("server read after Close: %v, want EOF", err)
	}
	if _, err := c.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("write after Close: %v, want net.ErrClosed", err)
	}
	if err := c.Close(); !errors.Is(err, net.ErrClosed) {
		t.Fatalf("second Close: %v, want net.ErrClosed", err)
	}
}

// go-redis's health check of an idle connection (checkSyscallConn's look
// at the socket) sees a healthy one as healthy and a closed one as closed,
// without waiting.
func TestBlockingSocketHealthCheckLook(t *testing.T) {
	c, server := blockingPair(t)
	look := func() error {
		rc, err := c.(syscall.Conn).SyscallConn()
		if err != nil {
			return err
		}
		var lookErr error
		err = rc.Read(func(fd uintptr) bool {
			var b [1]byte
			n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
			switch {
			case n == 0 && err == nil:
				lookErr = io.EOF
			case err != nil && err != syscall.EAGAIN:
				lookErr = err
			}
			return true
		})
		if err != nil {
			return err
		}
		return lookErr
	}
	done := make(chan error, 1)
	go func() { done <- look() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("healthy connection: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the look at an idle socket waited")
	}
	server.Close()
	time.Sleep(20 * time.Millisecond)
	if err := look(); err != io.EOF {
		t.Fatalf("connection the server closed: %v, want EOF", err)
	}
}
