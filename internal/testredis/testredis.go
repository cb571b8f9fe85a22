// Package testredis starts real redis-server processes for tests, on free
// loopback ports, and stops them when the test ends. Start, Restart and
// FreePort take a TB, which testing.TB satisfies, so that a program that is
// not a test (cmd/demo) starts and stops its servers the same way.
package testredis

import (
	"bufio"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/redisinfo"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
)

// TB is the part of testing.TB that Start, Restart and FreePort use.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Cleanup(func())
	TempDir() string
}

// Server is one redis-server process (or the server REDIS_SERVER names:
// see ServerBinary).
type Server struct {
	Addr string // 127.0.0.1:port
	cmd  *exec.Cmd
	bin  string
	args []string
	tls  *tls.Config // for Do, when the server speaks only TLS
	// out is the end of what the process wrote, told when it does not
	// start; exited is closed once it has ended.
	out    *tailBuffer
	exited chan struct{}
}

// Start runs redis-server without persistence on a free loopback port and
// waits (at most 10 s) until it answers PING. It fails the test when
// redis-server is missing: `make test` installs it.
func Start(t TB) *Server {
	t.Helper()
	return start(t)
}

// start runs a redis-server with extra arguments.
func start(t TB, extra ...string) *Server {
	t.Helper()
	return launch(t, nil, func(port string, v binaryVersion) []string {
		args := []string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", t.TempDir()}
		if v.atLeast(7, 0) {
			// DEBUG (failure_test.go's DEBUG SLEEP) is refused by default
			// since Redis 7.0, which added this option; before, it was on.
			args = append(args, "--enable-debug-command", "local")
		}
		return append(args, extra...)
	})
}

// StartTLS runs a redis-server that accepts only TLS connections, with the
// given certificate and key (PEM files); client is how Do connects. A
// server built without TLS (make BUILD_TLS=no) skips the test, when t can
// skip, saying so.
func StartTLS(t TB, certFile, keyFile string, client *tls.Config) *Server {
	t.Helper()
	return launch(t, client, func(port string, _ binaryVersion) []string {
		return []string{"--port", "0", "--tls-port", port, "--bind", "127.0.0.1",
			"--tls-cert-file", certFile, "--tls-key-file", keyFile, "--tls-auth-clients", "no",
			"--save", "", "--appendonly", "no", "--dir", t.TempDir()}
	})
}

// launch starts the server on a free loopback port with the arguments
// args gives for it, and stops it when the test ends.
func launch(t TB, client *tls.Config, args func(port string, v binaryVersion) []string) *Server {
	t.Helper()
	bin, err := ServerBinary()
	if err != nil {
		t.Fatalf("%v", err)
	}
	port := strconv.Itoa(FreePort(t))
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", port), bin: bin, args: args(port, versionOf(bin)), tls: client}
	t.Cleanup(s.Stop)
	s.start(t)
	return s
}

// Restart starts the server again on the same port, empty, after Stop.
func (s *Server) Restart(t TB) {
	t.Helper()
	s.Stop()
	s.start(t)
}

// Pid is the process id of the running redis-server.
func (s *Server) Pid() int { return s.cmd.Process.Pid }

// Pause freezes the process (SIGSTOP): connections hang as with a dead or
// unreachable host. It returns once the process is stopped (at most 1 s).
// Resume undoes it.
func (s *Server) Pause() error  { return pause(s.cmd) }
func (s *Server) Resume() error { return s.cmd.Process.Signal(syscall.SIGCONT) }

// pause sends cmd's process SIGSTOP and waits (at most 1 s) until every
// thread of it has stopped: until then a thread running on another core
// may still answer or forward a little.
func pause(cmd *exec.Cmd) error {
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		return err
	}
	if !testproc.Stopped(cmd.Process.Pid, time.Second) {
		return fmt.Errorf("process %d not stopped 1 s after SIGSTOP", cmd.Process.Pid)
	}
	return nil
}

func (s *Server) start(t TB) {
	t.Helper()
	s.cmd = exec.Command(s.bin, s.args...)
	s.out = &tailBuffer{}
	s.cmd.Stdout, s.cmd.Stderr = s.out, s.out
	// A child the server forked (a replica's sync) may hold the output open
	// after the server ended: Wait waits for it at most this long.
	s.cmd.WaitDelay = time.Second
	testproc.DieWithParent(s.cmd)
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("starting %s: %v", s.bin, err)
	}
	exited := make(chan struct{})
	s.exited = exited
	go func() {
		_ = s.cmd.Wait()
		close(exited)
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := s.Do("PING"); err == nil {
			// In a test, the server stands for a Redis on a host of its
			// own: above the Caddy under test and a busy machine's other
			// work (testproc.Favour), as if on cores of its own. make
			// bench, the demo and make fleet run it as it is: what they
			// measure shares the cores as a deployment on one host does.
			if testing.Testing() {
				testproc.Favour(s.cmd.Process.Pid)
			}
			return
		}
		select {
		case <-exited:
			out := s.out.String()
			if s.tls != nil && strings.Contains(strings.ToLower(out), "tls") {
				if sk, ok := t.(interface{ Skipf(string, ...any) }); ok {
					sk.Skipf("%s cannot serve TLS (built without it? make BUILD_TLS=yes): it exited saying:\n%s", s.bin, out)
				}
			}
			t.Fatalf("%s %s exited at start (%v):\n%s", s.bin, strings.Join(s.args, " "), s.cmd.ProcessState, out)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s on %s did not answer PING within 10s; it wrote:\n%s", s.bin, s.Addr, s.out.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server; it is safe to call twice.
func (s *Server) Stop() {
	if s.exited == nil {
		return
	}
	select {
	case <-s.exited:
	default:
		_ = s.cmd.Process.Kill()
		<-s.exited
	}
}

// tailBuffer keeps the last 8 KiB written to it: a server's log, to say
// why it did not start.
type tailBuffer struct {
	mu  sync.Mutex
	buf []byte
}

func (b *tailBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.buf = append(b.buf, p...)
	if over := len(b.buf) - 8<<10; over > 0 {
		b.buf = append(b.buf[:0], b.buf[over:]...)
	}
	return len(p), nil
}

func (b *tailBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return string(b.buf)
}

// Do sends one command over a fresh connection and returns a simple,
// integer or bulk-string reply (PING, FLUSHALL, DBSIZE, INFO, CLIENT LIST).
func (s *Server) Do(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	var d net.Dialer
	var c net.Conn
	var err error
	if s.tls != nil {
		c, err = (&tls.Dialer{NetDialer: &d, Config: s.tls}).DialContext(ctx, "tcp", s.Addr)
	} else {
		c, err = d.DialContext(ctx, "tcp", s.Addr)
	}
	if err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(2 * time.Second))
	req := fmt.Sprintf("*%d\r\n", len(args))
	for _, a := range args {
		req += fmt.Sprintf("$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(req)); err != nil {
		return "", err
	}
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	if len(line) < 3 {
		return "", fmt.Errorf("redis: short reply %q", line)
	}
	switch line[0] {
	case '-':
		return "", fmt.Errorf("redis: %s", line[1:len(line)-2])
	case '$':
		n, err := strconv.Atoi(line[1 : len(line)-2])
		if err != nil || n < 0 {
			return "", err
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(br, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
	return line[1 : len(line)-2], nil
}

// Version is the server's redis_version, from INFO ("?" when it does not
// say).
func (s *Server) Version() string {
	if v := s.Server().Redis; v != "" {
		return v
	}
	return "?"
}

// Server is who the server says it is in INFO server: "Redis 7.0.15",
// "Valkey 8.0.1 (redis_version 7.2.4)".
func (s *Server) Server() redisinfo.Server {
	info, _ := s.Do("INFO", "server")
	return redisinfo.Parse(info)
}

// FreePort returns a loopback TCP port that was free a moment ago.
func FreePort(t TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("finding a free port: %v", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}
