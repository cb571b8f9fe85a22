package ratelimit

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"reflect"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The lone connection writes a call as RESP2 and reads what Redis answers
// a script: an array of integers or an error reply; anything else is out
// of step, and the connection is dropped rather than misread.
func TestLoneConnReadsReplies(t *testing.T) {
	for _, tc := range []struct {
		reply string
		want  []int64
		err   error // errors.Is; a loneReplyError: that text
	}{
		{"*4\r\n:1796587142603864\r\n:1\r\n:1\r\n:0\r\n", []int64{1796587142603864, 1, 1, 0}, nil},
		{"*0\r\n", nil, nil},
		{"*2\r\n:-3\r\n:-1\r\n", []int64{-3, -1}, nil},
		{"*3\r\n$2\r\n12\r\n+7\r\n:0\r\n", []int64{12, 7, 0}, nil}, // as go-redis reads them
		{"*1\r\n$2\r\n12xx", nil, errLoneProtocol},
		{"*1\r\n$-1\r\n", nil, errLoneProtocol},
		{"*1\r\n$1\r\nx\r\n", nil, errLoneProtocol},
		{"-NOSCRIPT No matching script. Please use EVAL.\r\n", nil, loneReplyError("NOSCRIPT No matching script. Please use EVAL.")},
		{"-ERR Error running script (call to f_x): @user_script:1: boom\r\n", nil, loneReplyError("ERR Error running script (call to f_x): @user_script:1: boom")},
		{"+OK\r\n", nil, errLoneProtocol},
		{"*1\r\n:1x\r\n", nil, errLoneProtocol},
		{"*-1\r\n", nil, errLoneProtocol},
		{"*99999999\r\n", nil, errLoneProtocol},
		{"*2\r\n:1\n", nil, errLoneProtocol},
		{"*2\r\n:1\r\n", nil, io.EOF},
		{"", nil, io.EOF},
		{"-" + strings.Repeat("x", 5000) + "\r\n", nil, errLoneProtocol},
	} {
		got, err := readIntegers(bufio.NewReaderSize(strings.NewReader(tc.reply), 4096), nil)
		var reply loneReplyError
		switch {
		case errors.As(tc.err, &reply):
			var asRedis redis.Error
			if err == nil || err.Error() != string(reply) || !errors.As(err, &asRedis) {
				t.Errorf("%q: %v, want the error reply %q, read as go-redis's", tc.reply, err, reply)
			}
		case !errors.Is(err, tc.err) || (tc.err == nil && !reflect.DeepEqual(got, tc.want)):
			t.Errorf("%q: %v, %v; want %v, %v", tc.reply, got, err, tc.want, tc.err)
		}
	}
}

func TestLoneConnWritesCommands(t *testing.T) {
	got, err := appendCommand(nil, []any{"evalsha", "abc", 1, "rl:p:{k}", int64(-2), []byte{0, '\r', '\n'}})
	want := "*6\r\n$7\r\nevalsha\r\n$3\r\nabc\r\n$1\r\n1\r\n$8\r\nrl:p:{k}\r\n$2\r\n-2\r\n$3\r\n\x00\r\n\r\n"
	if err != nil || string(got) != want {
		t.Fatalf("%q, %v; want %q", got, err, want)
	}
	if _, err := appendCommand(nil, []any{"get", 1.5}); err == nil {
		t.Fatal("a float argument written")
	}
}

// The lone connection connects as the pool does: with the redis block's
// username and password (an ACL user) and in its database.
func TestLoneConnectionAuthenticatesInItsDatabase(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	srv := testredis.Start(t)
	admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { admin.Close() })
	ctx := context.Background()
	if err := admin.Do(ctx, "ACL", "SETUSER", "limiter", "on", ">pa55", "~*", "&*", "+@all").Err(); err != nil {
		t.Fatal(err)
	}
	if err := admin.Do(ctx, "ACL", "SETUSER", "default", "off").Err(); err != nil {
		t.Fatal(err)
	}
	rs := storeWith(t, RedisConfig{Addresses: []string{srv.Addr}, Username: "limiter", Password: "pa55", DB: 3,
		Timeout: caddy.Duration(testTimeout)}, zap.NewNop())
	loneUp(t, rs)
	r := []bucketRequest{{key: "rl:p:{in-db-3}", limit: limit{interval: 1_000_000, burst: 5}, op: opTake, cost: 1}}
	before := loneUsed(rs)
	if d, err := rs.decide(ctx, r); err != nil || !d.admitted || loneUsed(rs) == before {
		t.Fatalf("a request alone: %+v, %v; on the lone connection %v", d, err, loneUsed(rs) != before)
	}
	user := redis.NewClient(&redis.Options{Addr: srv.Addr, Username: "limiter", Password: "pa55", DB: 3})
	t.Cleanup(func() { user.Close() })
	if n, err := user.Exists(ctx, "rl:p:{in-db-3}").Result(); err != nil || n != 1 {
		t.Fatalf("the bucket in database 3: %d, %v", n, err)
	}
}

// A Redis that lost the script (restarted, or SCRIPT FLUSH) gets it again
// on the lone connection, and an error reply leaves the connection open.
func TestLoneConnectionLoadsTheScriptAgain(t *testing.T) {
	_, client, rs := newTestRedis(t)
	loneUp(t, rs)
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{flushed}", limit: limit{interval: 1_000_000, burst: 5}, op: opTake, cost: 1}}
	for round := range 3 {
		if err := client.ScriptFlush(ctx).Err(); err != nil {
			t.Fatal(err)
		}
		before := loneUsed(rs)
		d, err := rs.decide(ctx, r)
		if err != nil || !d.admitted || d.verdicts[0].remaining != int64(4-round) {
			t.Fatalf("round %d, after SCRIPT FLUSH: %+v, %v", round, d, err)
		}
		if got := loneUsed(rs) - before; got != 2 || rs.loneDown.Load() {
			t.Fatalf("round %d: %d calls on the lone connection (want EVALSHA then EVAL), down %v", round, got, rs.loneDown.Load())
		}
	}
}

// Closing the lone connection (as the store's Destruct does) ends a call
// waiting on it for a Redis that stopped answering, at once rather than
// at its timeout.
func TestLoneConnectionClosedWhileWaiting(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	srv := testredis.Start(t)
	rs := storeOn(t, srv.Addr, 10*time.Second)
	loneUp(t, rs)
	r := []bucketRequest{{key: "rl:p:{frozen}", limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Resume() }) // before the store's Destruct
	done := make(chan error, 1)
	go func() {
		_, err := rs.decide(context.Background(), r)
		done <- err
	}()
	for rs.lone.calls.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // in its read, most likely
	start := time.Now()
	_ = rs.lone.Close()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("decided with Redis stopped")
		}
		if waited := time.Since(start); waited > 5*time.Second {
			t.Fatalf("the call ended %v after the close", waited)
		}
	case <-time.After(8 * time.Second):
		t.Fatal("the call on the lone connection did not end when it was closed")
	}
}

// A call on the lone connection to a Redis that stopped answering fails
// after the redis block's timeout, as a call on the pool does, not after
// the longer bound of the whole call (dial timeout and three timeouts).
func TestLoneCallTimesOutAtTheTimeout(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	srv := testredis.Start(t)
	const timeout = 200 * time.Millisecond
	rs := storeOn(t, srv.Addr, timeout)
	loneUp(t, rs)
	r := []bucketRequest{{key: "rl:p:{stalled}", limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = srv.Resume() }) // before the store's Destruct
	before := loneUsed(rs)
	start := time.Now()
	_, err := rs.decide(context.Background(), r)
	took := time.Since(start)
	if err == nil || loneUsed(rs) == before {
		t.Fatalf("a request alone with Redis stopped: %v, on the lone connection %v", err, loneUsed(rs) != before)
	}
	// The call's whole bound is 1 s + 3 × 200 ms; the timeout, plus the
	// second look (lookAgain) and the kernel timer's lateness, is far below.
	if took < timeout || took > timeout+500*time.Millisecond {
		t.Fatalf("the call failed after %v, want about the timeout, %v", took, timeout)
	}
}

// The lone connection opens with the ACL docs/redis.md gives the limiter
// (no PING, no HELLO), and with a password configured for a Redis whose
// default user has none, as go-redis's connections do.
func TestLoneConnectionOpensWhereThePoolDoes(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	docs, err := os.ReadFile("docs/redis.md")
	if err != nil {
		t.Fatal(err)
	}
	acl := regexp.MustCompile(`ACL SETUSER <user> on ><password> ([^\n]+)`).FindSubmatch(docs)
	if acl == nil {
		t.Fatal("no ACL SETUSER line in docs/redis.md")
	}
	for _, tc := range []struct {
		name, username, password string
		setup                    [][]any
	}{
		{"the documented ACL", "limiter", "pa55", [][]any{append([]any{"ACL", "SETUSER", "limiter", "on", ">pa55"}, stringsAsAny(strings.Fields(string(acl[1])))...)}},
		{"a password Redis does not ask for", "", "unasked", nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := testredis.Start(t)
			admin := redis.NewClient(&redis.Options{Addr: srv.Addr})
			t.Cleanup(func() { admin.Close() })
			for _, cmd := range tc.setup {
				if err := admin.Do(context.Background(), cmd...).Err(); err != nil {
					t.Fatal(err)
				}
			}
			rs := storeWith(t, RedisConfig{Addresses: []string{srv.Addr}, Username: tc.username, Password: tc.password,
				Timeout: caddy.Duration(testTimeout)}, zap.NewNop())
			loneUp(t, rs)
			r := []bucketRequest{{key: "rl:p:{acl}", limit: limit{interval: 1_000_000, burst: 5}, op: opTake, cost: 1}}
			before := loneUsed(rs)
			if d, err := rs.decide(context.Background(), r); err != nil || !d.admitted || loneUsed(rs) == before {
				t.Fatalf("a request alone: %+v, %v; on the lone connection %v", d, err, loneUsed(rs) != before)
			}
		})
	}
}

func stringsAsAny(s []string) []any {
	a := make([]any, len(s))
	for i, v := range s {
		a[i] = v
	}
	return a
}

// Redis's error reply to a lone call (here out of memory) leaves the
// lone connection as it was: no new connection per request.
func TestLoneErrorReplyKeepsTheConnection(t *testing.T) {
	_, client, rs := newTestRedis(t)
	loneUp(t, rs)
	ctx := context.Background()
	r := []bucketRequest{{key: "rl:p:{oom}", limit: limit{interval: 1_000_000, burst: 5}, op: opTake, cost: 1}}
	if _, err := rs.decide(ctx, r); err != nil { // the script loaded
		t.Fatal(err)
	}
	connections := func() int64 {
		info, err := client.Info(ctx, "stats").Result()
		if err != nil {
			t.Fatal(err)
		}
		m := regexp.MustCompile(`total_connections_received:(\d+)`).FindStringSubmatch(info)
		n, _ := strconv.ParseInt(m[1], 10, 64)
		return n
	}
	if err := client.ConfigSet(ctx, "maxmemory-policy", "noeviction").Err(); err != nil {
		t.Fatal(err)
	}
	if err := client.ConfigSet(ctx, "maxmemory", "1").Err(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.ConfigSet(ctx, "maxmemory", "0") })
	before, calls := connections(), loneUsed(rs)
	r[0].key = "rl:p:{oom-new}" // a write Redis refuses
	for i := range 20 {
		if _, err := rs.decide(ctx, r); err == nil || !strings.Contains(err.Error(), "OOM") {
			t.Fatalf("call %d with Redis out of memory: %v, want its OOM reply", i, err)
		}
	}
	if got := connections() - before; got != 0 || loneUsed(rs)-calls != 20 || rs.loneDown.Load() {
		t.Fatalf("20 OOM replies alone: %d new connections, %d lone calls, down %v; want 0, 20, false", got, loneUsed(rs)-calls, rs.loneDown.Load())
	}
}

// Under TLS, a lone connection Redis closed while it sat idle is found
// closed before a call is written on it (its TCP socket holds Redis's
// close_notify or end), and the call goes on the pool instead of failing.
func TestLoneConnectionClosedWhileIdleUnderTLS(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	srv := tlsRedis(t)
	rs := storeWith(t, RedisConfig{Addresses: []string{srv.Addr}, TLS: &RedisTLS{InsecureSkipVerify: true},
		Timeout: caddy.Duration(testTimeout)}, zap.NewNop())
	loneUp(t, rs)
	r := []bucketRequest{{key: "rl:p:{tls-idle}", limit: limit{interval: 1000, burst: 1_000_000}, op: opTake, cost: 1}}
	for round := range 3 {
		before := loneUsed(rs)
		if _, err := rs.decide(context.Background(), r); err != nil || loneUsed(rs) == before {
			t.Fatalf("round %d, a request alone: %v, on the lone connection %v", round, err, loneUsed(rs) != before)
		}
		rs.lone.cmu.Lock()
		local := rs.lone.conn.LocalAddr().String()
		rs.lone.cmu.Unlock()
		if _, err := srv.Do("CLIENT", "KILL", "ADDR", local); err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // idle; Redis's close reaches the socket
		if d, err := rs.decide(context.Background(), r); err != nil || !d.admitted {
			t.Fatalf("round %d, the first request alone after Redis closed the idle lone connection: %+v, %v", round, d, err)
		}
		loneUp(t, rs)
	}
}

// A call on a lone connection taken without a look (it answered just
// now) is made again on the pool only when Redis had closed the
// connection before the call reached it: then Redis's kernel never
// acknowledged the call. A Redis that read the call and closed the
// connection without answering (a CLIENT KILL between running the script
// and answering) may have run it: that call fails, as a call whose
// connection broke always did, and is not made twice.
func TestLoneCallIsMadeAgainOnlyWhenRedisNeverReadIt(t *testing.T) {
	if !blockingWaits {
		t.Skip("the lone connection is made only where sockets to Redis wait in blocking calls (Linux)")
	}
	for _, tc := range []struct {
		name      string
		readFirst bool // the server reads the call whole before it closes
		again     bool
	}{{"closed before the call", false, true}, {"closed after reading the call", true, false}} {
		t.Run(tc.name, func(t *testing.T) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { ln.Close() })
			closed := make(chan struct{})
			go func() {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				defer close(closed)
				rd := bufio.NewReader(c)
				if _, err := readCommand(rd); err != nil { // TIME
					c.Close()
					return
				}
				_, _ = io.WriteString(c, "*2\r\n$10\r\n1700000000\r\n$1\r\n0\r\n")
				if tc.readFirst {
					_, _ = readCommand(rd)
				}
				c.Close()
			}()
			l, err := RedisConfig{Addresses: []string{ln.Addr().String()}, Timeout: caddy.Duration(2 * time.Second)}.resolved().newLone()
			if err != nil || l == nil {
				t.Fatal(l, err)
			}
			t.Cleanup(func() { l.Close() })
			l.mu.Lock()
			defer l.mu.Unlock()
			if err := l.open(); err != nil {
				t.Fatal(err)
			}
			if !tc.readFirst {
				<-closed // the server's socket is gone: what it is sent now is refused
			}
			if !l.ready() || !l.unlooked {
				t.Fatalf("a connection that answered just now: ready %v, taken without a look %v", l.ready(), l.unlooked)
			}
			_, err = l.call(time.Now().Add(2*time.Second), []any{"evalsha", "0123456789012345678901234567890123456789", 1, "rl:p:{k}", 2, []byte("x")}, nil)
			var again *errLoneClosed
			if err == nil || errors.As(err, &again) != tc.again {
				t.Fatalf("the call: %v; made again on the pool %v, want %v", err, errors.As(err, &again), tc.again)
			}
		})
	}
}
