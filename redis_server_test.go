package ratelimit

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
)

// TestServerNamed: the module names the server it talks to as the server
// names itself (INFO server), and still does for a user whose ACL refuses
// INFO (HELLO); `caddy rate-limit check` prints it.
func TestServerNamed(t *testing.T) {
	srv := testredis.Start(t)
	want := srv.Server()
	if want.Name == "" || want.Version == "" {
		t.Fatalf("the test server says nothing of itself: %+v", want)
	}
	if _, err := srv.Do("ACL", "SETUSER", "noinfo", "on", ">pw", "~rl:*", "+@all", "-info"); err != nil {
		t.Fatal(err)
	}
	for _, user := range []string{"", "noinfo"} {
		cfg := RedisConfig{Addresses: []string{srv.Addr}}
		if user != "" {
			cfg.Username, cfg.Password = user, "pw"
		}
		h := probeHandler(t, &cfg, "")
		core, logs := observer.New(zap.InfoLevel)
		c := storeWith(t, cfg, zap.New(core))
		got, ok := c.identify([]*Policy{h.Policies[0]})
		if !ok || got.Name != want.Name || got.Version != want.Version {
			t.Errorf("user %q: the module named %+v (%v), the server says %+v", user, got, ok, want)
		}
		if !got.RedisAtLeast(6, 2) || logs.Len() != 0 {
			t.Errorf("user %q: %s reads as older than 6.2, or was logged as such: %v", user, got, logs.All())
		}
		if c.serverName() != got.String() {
			t.Errorf("serverName %q, want %q", c.serverName(), got.String())
		}
	}
	var out bytes.Buffer
	if _, _, err := runCheck(&out, checkConfig(t, checkHandlerJSON(map[string]any{"addresses": []string{srv.Addr}}, "s1")), ""); err != nil {
		t.Fatal(err)
	}
	if line := "  server: " + want.String() + "\n"; !strings.Contains(out.String(), line) {
		t.Errorf("check does not say %q:\n%s", line, out.String())
	}
}

// TestServerTooOld: a server older than the oldest Redis the module
// supports is one ERROR at start saying so, what to do and what the
// policies do meanwhile; check fails naming it. A server that runs no
// scripts is named as the one that refuses them.
func TestServerTooOld(t *testing.T) {
	addr := fakeServer(t, "# Server\r\nredis_version:6.0.20\r\nredis_mode:standalone\r\n")
	cfg := RedisConfig{Addresses: []string{addr}}
	h := probeHandler(t, &cfg, failClosed)
	core, logs := observer.New(zap.InfoLevel)
	c := storeWith(t, cfg, zap.New(core))
	c.probeStarted([]*Handler{h})
	var errs []string
	for _, e := range logs.All() {
		if e.Level == zap.ErrorLevel {
			errs = append(errs, e.Message)
		}
	}
	if len(errs) != 2 {
		t.Fatalf("want two ERROR lines (the version, no scripts), got %q", errs)
	}
	for _, s := range []string{"Redis 6.0.20 is older than Redis 6.2", "Upgrade to Redis 6.2 or later", "policies api, slots, monthly will fail_closed (answer 503)"} {
		if !strings.Contains(errs[0], s) {
			t.Errorf("the ERROR %q does not say %q", errs[0], s)
		}
	}
	if !strings.Contains(errs[1], "Redis 6.0.20 runs no scripts") {
		t.Errorf("the ERROR %q does not name the server that runs no scripts", errs[1])
	}

	var out bytes.Buffer
	problems, _, err := runCheck(&out, checkConfig(t, checkHandlerJSON(map[string]any{"addresses": []string{addr}}, "s1")), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(problems) == 0 || !strings.Contains(problems[0], "older than Redis 6.2") {
		t.Errorf("check's problems %q do not start with the server's age", problems)
	}
	for _, s := range []string{"server: Redis 6.0.20\n", "server: TOO OLD: Redis 6.0.20 is older than Redis 6.2", "NOT decided by Redis: Redis 6.0.20 runs no scripts"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("check does not say %q:\n%s", s, out.String())
		}
	}

	// Valkey with scripting taken away (a managed service's restriction).
	addr = fakeServer(t, "# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.0.1\r\n")
	out.Reset()
	if _, _, err := runCheck(&out, checkConfig(t, checkHandlerJSON(map[string]any{"addresses": []string{addr}}, "s1")), ""); err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"server: Valkey 8.0.1 (redis_version 7.2.4)\n", "NOT decided by Redis: Valkey 8.0.1 (redis_version 7.2.4) runs no scripts"} {
		if !strings.Contains(out.String(), s) {
			t.Errorf("check does not say %q:\n%s", s, out.String())
		}
	}
	if strings.Contains(out.String(), "TOO OLD") {
		t.Errorf("Valkey 8 reads as too old:\n%s", out.String())
	}
}

// fakeServer is a server that speaks RESP, answers INFO with info, PING,
// SELECT and CLIENT as Redis would, and every other command (HELLO and
// the scripts' among them) as unknown: a Redis before 6 without
// scripting, or a managed service that took them away.
func fakeServer(t *testing.T, info string) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go serveFake(c, info)
		}
	}()
	return l.Addr().String()
}

func serveFake(c net.Conn, info string) {
	defer c.Close()
	r := bufio.NewReader(c)
	for {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		args, err := readCommand(r)
		if err != nil {
			return
		}
		var reply string
		switch strings.ToUpper(args[0]) {
		case "PING":
			reply = "+PONG\r\n"
		case "SELECT", "CLIENT":
			reply = "+OK\r\n"
		case "INFO":
			reply = fmt.Sprintf("$%d\r\n%s\r\n", len(info), info)
		default:
			reply = fmt.Sprintf("-ERR unknown command `%s`, with args beginning with: \r\n", args[0])
		}
		if _, err := io.WriteString(c, reply); err != nil {
			return
		}
	}
}

// readCommand reads one RESP array of bulk strings.
func readCommand(r *bufio.Reader) ([]string, error) {
	line, err := r.ReadString('\n')
	if err != nil {
		return nil, err
	}
	n, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "*")))
	if err != nil || n < 1 {
		return nil, fmt.Errorf("not a command: %q", line)
	}
	args := make([]string, n)
	for i := range args {
		line, err := r.ReadString('\n')
		if err != nil {
			return nil, err
		}
		size, err := strconv.Atoi(strings.TrimSpace(strings.TrimPrefix(line, "$")))
		if err != nil || size < 0 {
			return nil, fmt.Errorf("not a bulk string: %q", line)
		}
		buf := make([]byte, size+2)
		if _, err := io.ReadFull(r, buf); err != nil {
			return nil, err
		}
		args[i] = string(buf[:size])
	}
	return args, nil
}
