package testredis

import (
	"io"
	"net"
	"sync"
	"time"
)

// Proxy is a TCP proxy on a free loopback port that delays every byte by a
// fixed time in each direction: a Redis that answers correctly but far away
// (a 20 ms round trip is oneWay = 10 ms). Order and throughput are kept:
// bytes are delayed, not rate-limited.
type Proxy struct {
	Addr string

	target string
	oneWay time.Duration
	l      net.Listener
	mu     sync.Mutex
	conns  []net.Conn
	closed bool
}

// StartProxy starts a Proxy to target and stops it when the test ends.
func StartProxy(t TB, target string, oneWay time.Duration) *Proxy {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatalf("proxy: %v", err)
	}
	p := &Proxy{Addr: l.Addr().String(), target: target, oneWay: oneWay, l: l}
	t.Cleanup(p.Close)
	go p.accept()
	return p
}

func (p *Proxy) accept() {
	for {
		c, err := p.l.Accept()
		if err != nil {
			return
		}
		go p.serve(c)
	}
}

func (p *Proxy) serve(client net.Conn) {
	server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
	if err != nil {
		client.Close()
		return
	}
	if !p.track(client, server) {
		return
	}
	go p.pump(server, client)
	p.pump(client, server)
}

// track remembers a pair of connections for Close; false when closed.
func (p *Proxy) track(cs ...net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		for _, c := range cs {
			c.Close()
		}
		return false
	}
	p.conns = append(p.conns, cs...)
	return true
}

// chunk is what one read got, and when.
type chunk struct {
	at   time.Time
	data []byte
}

// pump copies src to dst, each chunk oneWay after it was read.
func (p *Proxy) pump(src, dst net.Conn) {
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

// Close stops accepting and cuts every proxied connection.
func (p *Proxy) Close() {
	p.mu.Lock()
	p.closed = true
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	p.l.Close()
	for _, c := range conns {
		c.Close()
	}
}
