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
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
)

// TB is the part of testing.TB that Start, Restart and FreePort use.
type TB interface {
	Helper()
	Fatalf(format string, args ...any)
	Cleanup(func())
	TempDir() string
}

// Server is one redis-server process.
type Server struct {
	Addr string // 127.0.0.1:port
	cmd  *exec.Cmd
	bin  string
	args []string
	tls  *tls.Config // for Do, when the server speaks only TLS
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
	return launch(t, nil, func(port string) []string {
		return append([]string{"--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
			"--dir", t.TempDir(), "--enable-debug-command", "local"}, extra...)
	})
}

// StartTLS runs a redis-server that accepts only TLS connections, with the
// given certificate and key (PEM files); client is how Do connects.
func StartTLS(t TB, certFile, keyFile string, client *tls.Config) *Server {
	t.Helper()
	return launch(t, client, func(port string) []string {
		return []string{"--port", "0", "--tls-port", port, "--bind", "127.0.0.1",
			"--tls-cert-file", certFile, "--tls-key-file", keyFile, "--tls-auth-clients", "no",
			"--save", "", "--appendonly", "no", "--dir", t.TempDir()}
	})
}

// launch starts redis-server on a free loopback port with the arguments
// args gives for it, and stops it when the test ends.
func launch(t TB, client *tls.Config, args func(port string) []string) *Server {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		t.Fatalf("redis-server not found (run `make test`, which installs it): %v", err)
	}
	port := strconv.Itoa(FreePort(t))
	s := &Server{Addr: net.JoinHostPort("127.0.0.1", port), bin: bin, args: args(port), tls: client}
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
	testproc.DieWithParent(s.cmd)
	if err := s.cmd.Start(); err != nil {
		t.Fatalf("starting redis-server: %v", err)
	}
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
		if time.Now().After(deadline) {
			t.Fatalf("redis-server on %s did not answer PING within 10s", s.Addr)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop kills the server; it is safe to call twice.
func (s *Server) Stop() {
	if s.cmd != nil && s.cmd.Process != nil && s.cmd.ProcessState == nil {
		_ = s.cmd.Process.Kill()
		_ = s.cmd.Wait()
	}
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
	info, _ := s.Do("INFO", "server")
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "redis_version:"); ok {
			return v
		}
	}
	return "?"
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
