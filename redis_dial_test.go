package ratelimit

import (
	"bufio"
	"context"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestPeekingDialer: a connection that read within peekAfter is handed out
// without go-redis's peek at its socket; an idle one is peeked, so a
// connection Redis closed while idle is found closed before a command goes
// out on it, and the call succeeds on a new one.
func TestPeekingDialer(t *testing.T) {
	srv := testredis.Start(t)
	ctx := context.Background()

	conn, err := peekingDialer(time.Second)(ctx, "tcp", srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := conn.(*peekedConn)
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		t.Fatal(err)
	}
	if line, err := bufio.NewReader(c).ReadString('\n'); err != nil || !strings.HasPrefix(line, "+PONG") {
		t.Fatalf("PING: %q, %v", line, err)
	}
	peeked := 0
	peek := func(uintptr) bool { peeked++; return true }
	if err := c.raw.Read(peek); err != nil || peeked != 0 {
		t.Fatalf("a connection that just read: peeked %d times (%v), want 0", peeked, err)
	}
	c.lastRead.Store(monotonicNanos() - int64(peekAfter) - 1)
	if err := c.raw.Read(peek); err != nil || peeked != 1 {
		t.Fatalf("a connection idle for peekAfter: peeked %d times (%v), want 1", peeked, err)
	}

	// Through go-redis: Redis closes the pool's one connection.
	call := func() error {
		client := redis.NewClient(&redis.Options{Addr: srv.Addr, Dialer: peekingDialer(time.Second), PoolSize: 1, MaxRetries: -1})
		defer client.Close()
		if err := client.Ping(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		if _, err := srv.Do("CLIENT", "KILL", "TYPE", "normal"); err != nil {
			t.Fatal(err)
		}
		return client.Ping(ctx).Err()
	}
	defer func(was time.Duration) { peekAfter = was }(peekAfter)
	peekAfter = 0 // every connection is peeked: the closed one is found
	if err := call(); err != nil {
		t.Errorf("peeked: the call after Redis closed the idle connection failed: %v", err)
	}
	peekAfter = time.Hour // none is: the call goes out on the closed one
	if err := call(); err == nil {
		t.Errorf("not peeked: the call on the connection Redis closed succeeded; is the peek still skipped?")
	}
}
