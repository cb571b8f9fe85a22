package testredis

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
)

// Proxy is a TCP proxy on a free loopback port that delays every byte by a
// fixed time in each direction: a Redis that answers correctly but far away
// (a 20 ms round trip is oneWay = 10 ms). Order and throughput are kept:
// bytes are delayed, not rate-limited.
//
// It runs in a process of its own (the test binary, started again; see
// RunProxyIfAsked). In the test's own process its goroutines queue behind
// the load generator's: under a 1,024-connection flood, chunks were
// forwarded up to 64 ms late each way, a Redis far slower than the one the
// test means. A process of its own is scheduled by the kernel beside the
// others, as a network would be.
type Proxy struct {
	Addr string

	cmd   *exec.Cmd
	stdin io.WriteCloser
	once  sync.Once
}

// proxyEnv asks a test binary started by StartProxy to be the proxy:
// "<target>,<one-way delay>".
const proxyEnv = "TESTREDIS_PROXY"

// StartProxy starts a Proxy to target and stops it, by its PID, when the
// test ends. The test binary's TestMain must call RunProxyIfAsked first.
func StartProxy(t TB, target string, oneWay time.Duration) *Proxy {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), proxyEnv+"="+target+","+oneWay.String())
	cmd.Stderr = os.Stderr
	testproc.DieWithParent(cmd)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("proxy: %v", err)
	}
	p := &Proxy{cmd: cmd, stdin: stdin}
	t.Cleanup(p.Close)
	addr := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(stdout).ReadString('\n')
		addr <- strings.TrimSpace(line)
	}()
	select {
	case p.Addr = <-addr:
	case <-time.After(10 * time.Second):
	}
	if p.Addr == "" {
		p.Close()
		t.Fatalf("proxy: the proxy process did not report its address (did TestMain call RunProxyIfAsked?)")
	}
	// The proxy stands for the network, which takes no CPU from Caddy: at
	// a higher priority than the processes under test, every thread of it
	// (testproc.Favour), so that a Caddy that keeps both cores busy does
	// not also stall the link by tens of milliseconds, which the test would
	// read as a slow Redis.
	testproc.Favour(cmd.Process.Pid)
	return p
}

// Close stops the proxy process, cutting every proxied connection.
func (p *Proxy) Close() {
	p.once.Do(func() {
		_ = p.stdin.Close()
		_ = p.cmd.Process.Kill()
		_ = p.cmd.Wait()
	})
}

// Pause freezes the proxy process (SIGSTOP): the bytes sent through it
// wait in the kernel's buffers, as over a partitioned network, while the
// connections stay open. It returns once the process is stopped (at most
// 1 s): a write the test makes after it is not forwarded. Resume undoes it.
func (p *Proxy) Pause() error  { return pause(p.cmd) }
func (p *Proxy) Resume() error { return p.cmd.Process.Signal(syscall.SIGCONT) }

// RunProxyIfAsked is to be called first in TestMain: in a process started
// by StartProxy it runs the proxy, prints its address and exits when its
// parent closes stdin or goes away; otherwise it returns at once.
func RunProxyIfAsked() {
	spec := os.Getenv(proxyEnv)
	if spec == "" {
		return
	}
	target, delay, _ := strings.Cut(spec, ",")
	oneWay, err := time.ParseDuration(delay)
	if err != nil {
		fmt.Fprintln(os.Stderr, "proxy:", err)
		os.Exit(2)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		fmt.Fprintln(os.Stderr, "proxy:", err)
		os.Exit(2)
	}
	p := &proxy{target: target, oneWay: oneWay, l: l}
	go p.accept()
	fmt.Println(l.Addr().String())
	_, _ = io.Copy(io.Discard, os.Stdin)
	os.Exit(0)
}

// proxy is the proxy process's state.
type proxy struct {
	target string
	oneWay time.Duration
	l      net.Listener
}

func (p *proxy) accept() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		go p.serve(c)
	}
}

func (p *proxy) serve(client net.Conn) {
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		client.Close()
		return
	}
	go p.pump(server, client)
	p.pump(client, server)
}

// chunk is what one read got, and when.
type chunk struct {
	at   time.Time
	data []byte
}

// pump copies src to dst, each chunk oneWay after it was read.
func (p *proxy) pump(src, dst net.Conn) {
	defer src.Close()
	defer dst.Close()
	chunks := make(chan chunk, 4096)
	go func() {
		defer close(chunks)
		for {
			buf := make([]byte, 32<<10)
			n, err := src.Read(buf)
			if n > 0 {
				chunks <- chunk{time.Now(), buf[:n]}
			}
			if err != nil {
				return
			}
		}
	}()
	for c := range chunks {
		time.Sleep(time.Until(c.at.Add(p.oneWay)))
		if _, err := dst.Write(c.data); err != nil {
			// Drain, so the reader can finish.
			for range chunks {
			}
			return
		}
	}
	if tcp, ok := dst.(*net.TCPConn); ok {
		_ = tcp.CloseWrite()
	} else {
		_, _ = io.Copy(io.Discard, src)
	}
}
