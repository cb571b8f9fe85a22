package ratelimit

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
	"go.uber.org/zap"
)

// A reply gets the whole timeout from when its request reached the socket,
// however little of the call's deadline was left by then (a call that
// waited long for a connection); a server that does not answer still
// fails the read within the timeout.
func TestRedisSocketReplyGetsTheTimeout(t *testing.T) {
	for _, blocking := range []bool{false, true} {
		t.Run(map[bool]string{false: "poller", true: "blocking"}[blocking], func(t *testing.T) {
			testReplyGetsTheTimeout(t, blocking)
		})
	}
}

func testReplyGetsTheTimeout(t *testing.T, blocking bool) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	go func() {
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		buf := make([]byte, 16)
		for {
			n, err := c.Read(buf)
			if err != nil {
				return
			}
			if string(buf[:n]) == "ping" {
				time.Sleep(30 * time.Millisecond) // a Redis 30 ms away
				_, _ = c.Write([]byte("pong"))
			}
		}
	}()
	dial := redisDialer(nil, time.Second, 500*time.Millisecond, blocking)
	conn, err := dial(t.Context(), "tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, ok := conn.(*redisSocket).Conn.(*net.TCPConn); ok == (blocking && blockingWaits) {
		t.Fatalf("blocking %v: the socket under redisSocket is a %T", blocking, conn.(*redisSocket).Conn)
	}

	if _, err := conn.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	// What was left of the call's deadline: 1 ms.
	if err := conn.SetReadDeadline(time.Now().Add(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	if n, err := conn.Read(buf); err != nil || string(buf[:n]) != "pong" {
		t.Fatalf("read %q, %v: want the reply that came 30 ms after the request, within the 500 ms timeout", buf[:n], err)
	}

	// Nothing asked, nothing comes: the read fails, within the timeout.
	start := time.Now()
	if err := conn.SetReadDeadline(time.Now().Add(time.Millisecond)); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Read(buf); !isDeadline(err) {
		t.Fatalf("read with no request: %v, want a deadline error", err)
	}
	if waited := time.Since(start); waited > 10*time.Second {
		t.Fatalf("read with no request failed after %v", waited)
	}
}

// A connection Redis closed while it sat idle in the pool (CLIENT KILL, an
// idle timeout) is found closed before a call uses it, and the call goes
// on a new one: the socket wrapper leaves go-redis's health check its view
// of the socket.
func TestRedisConnectionClosedWhileIdleIsRedialed(t *testing.T) {
	t.Run("tcp", func(t *testing.T) {
		srv := testredis.Start(t)
		closedWhileIdle(t, srv, storeOn(t, srv.Addr, time.Duration(testTimeout)))
	})
	// go-redis looks only at a connection that is a syscall.Conn, which a
	// crypto/tls one is not (tlsSocket).
	t.Run("tls", func(t *testing.T) {
		srv := tlsRedis(t)
		closedWhileIdle(t, srv, storeWith(t, RedisConfig{Addresses: []string{srv.Addr}, TLS: &RedisTLS{InsecureSkipVerify: true},
			Timeout: testTimeout}, zap.NewNop()))
	})
}

// closedWhileIdle: every connection of rs's Redis, the lone one and the
// pool's, closed by Redis while idle; the next decision is made all the
// same, in three rounds.
func closedWhileIdle(t *testing.T, srv *testredis.Server, rs *redisStore) {
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{idle}", limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
	for round := range 3 {
		for range 20 { // its connections answered just now
			if _, err := rs.decide(ctx, r); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(50 * time.Millisecond) // idle
		killed, err := srv.Do("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
		if err != nil || killed == "0" {
			t.Fatalf("round %d: CLIENT KILL: %s, %v", round, killed, err)
		}
		if d, err := rs.decide(ctx, r); err != nil || !d.admitted {
			t.Fatalf("round %d: the first decision after Redis closed %s idle connections: %+v, %v", round, killed, d, err)
		}
	}
}

// TestTLSConnectionsOpenedAheadAreKept: the connections go-redis opens
// ahead of use hold, under TLS 1.3, the session tickets Redis sent after
// the handshake until their first read; the look before use keeps them
// (tlsSocket), where it throws away the ones Redis closed
// (TestRedisConnectionClosedWhileIdleIsRedialed).
func TestTLSConnectionsOpenedAheadAreKept(t *testing.T) {
	srv := tlsRedis(t)
	client, err := RedisConfig{Addresses: []string{srv.Addr}, TLS: &RedisTLS{InsecureSkipVerify: true}, Timeout: testTimeout}.resolved().connect(4, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	deadline := time.Now().Add(10 * time.Second)
	for client.PoolStats().IdleConns < 2 {
		if time.Now().After(deadline) {
			t.Fatalf("go-redis did not open connections ahead of use within 10 s: %+v", *client.PoolStats())
		}
		time.Sleep(5 * time.Millisecond)
	}
	for i := range 3 {
		if err := client.Do(context.Background(), "TIME").Err(); err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
	}
	if st := client.PoolStats(); st.StaleConns != 0 || st.Hits == 0 {
		t.Fatalf("sound connections opened ahead were thrown away as closed: %+v", *st)
	}
}
