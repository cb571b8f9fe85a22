package ratelimit

import (
	"bufio"
	"context"
	"fmt"
	"net"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
	"github.com/redis/go-redis/v9"
)

// Every key a script touches is declared in its call's KEYS: Dragonfly, in
// its default strict mode, refuses a script that touches any other (and
// its escape hatch locks the whole store for the script), and a Redis
// Cluster can only promise a call the slots of the keys it declares.
// TestScriptsDeclareEveryKey watches what Redis runs (MONITOR) across a
// workload of every kind of policy and every use of a script, and compares
// the keys of each command a script ran with the KEYS of its call.

// scriptCall is one EVAL or EVALSHA that MONITOR saw, with the commands
// its script ran (MONITOR shows a script's commands, as client "lua",
// right after the call that runs them, on Redis 6.2 and 7 and Valkey 8).
type scriptCall struct {
	args     []string   // EVALSHA <sha> <numkeys> <keys...> <args...>
	keys     []string   // its KEYS
	commands [][]string // what its script ran
}

// monitor is a MONITOR connection to a server, read until stopped.
type monitor struct {
	conn  net.Conn
	mu    sync.Mutex
	lines []string
	done  chan error
}

// monitorEnd is the command that marks the end of what a test watches.
const monitorEnd = "rate_limit monitor end"

func watchMonitor(t *testing.T, srv *testredis.Server) *monitor {
	t.Helper()
	conn, err := net.Dial("tcp", srv.Addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	if _, err := conn.Write([]byte("*1\r\n$7\r\nMONITOR\r\n")); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReaderSize(conn, 1<<20)
	if line, err := r.ReadString('\n'); err != nil || line != "+OK\r\n" {
		t.Fatalf("MONITOR: %q %v", line, err)
	}
	m := &monitor{conn: conn, done: make(chan error, 1)}
	go func() {
		for {
			line, err := r.ReadString('\n')
			if err != nil {
				m.done <- err
				return
			}
			line = strings.TrimSuffix(strings.TrimPrefix(line, "+"), "\r\n")
			m.mu.Lock()
			m.lines = append(m.lines, line)
			m.mu.Unlock()
			if strings.Contains(line, `"`+monitorEnd+`"`) {
				m.done <- nil
				return
			}
		}
	}()
	return m
}

// stop marks the end (ECHO), waits (at most 10 s) until MONITOR showed it,
// and returns the script calls seen.
func (m *monitor) stop(t *testing.T, srv *testredis.Server) []scriptCall {
	t.Helper()
	if _, err := srv.Do("ECHO", monitorEnd); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-m.done:
		if err != nil {
			t.Fatalf("reading MONITOR: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("MONITOR did not show the end within 10 s")
	}
	m.conn.Close()
	m.mu.Lock()
	defer m.mu.Unlock()
	var calls []scriptCall
	for _, line := range m.lines {
		client, args, err := parseMonitorLine(line)
		if err != nil {
			t.Fatalf("%v: %q", err, line)
		}
		if client == "lua" {
			if len(calls) == 0 {
				t.Fatalf("a script's command before any script call: %q", line)
			}
			c := &calls[len(calls)-1]
			c.commands = append(c.commands, args)
			continue
		}
		switch strings.ToUpper(args[0]) {
		case "EVAL", "EVALSHA", "EVAL_RO", "EVALSHA_RO", "FCALL", "FCALL_RO":
			n, err := strconv.Atoi(args[2])
			if err != nil || 3+n > len(args) {
				t.Fatalf("a script call without its number of keys: %q", line)
			}
			calls = append(calls, scriptCall{args: args, keys: args[3 : 3+n]})
		}
	}
	return calls
}

// monitorLine is "<time> [<db> <client>] "<arg>" "<arg>" ...".
var monitorLine = regexp.MustCompile(`^\d+\.\d+ \[\d+ ([^\]]+)\] (.*)$`)

// parseMonitorLine returns the client of a MONITOR line ("lua" inside a
// script) and the command's arguments, unquoted.
func parseMonitorLine(line string) (string, []string, error) {
	m := monitorLine.FindStringSubmatch(line)
	if m == nil {
		return "", nil, fmt.Errorf("not a MONITOR line")
	}
	var args []string
	s := m[2]
	for len(s) > 0 {
		if s[0] == ' ' {
			s = s[1:]
			continue
		}
		if s[0] != '"' {
			return "", nil, fmt.Errorf("an argument not quoted")
		}
		var b strings.Builder
		i := 1
		for ; i < len(s) && s[i] != '"'; i++ {
			if s[i] != '\\' || i+1 >= len(s) {
				b.WriteByte(s[i])
				continue
			}
			i++
			switch s[i] {
			case 'n':
				b.WriteByte('\n')
			case 'r':
				b.WriteByte('\r')
			case 't':
				b.WriteByte('\t')
			case 'a':
				b.WriteByte('\a')
			case 'b':
				b.WriteByte('\b')
			case 'x':
				if i+2 >= len(s) {
					return "", nil, fmt.Errorf("a short \\x escape")
				}
				v, err := strconv.ParseUint(s[i+1:i+3], 16, 8)
				if err != nil {
					return "", nil, err
				}
				b.WriteByte(byte(v))
				i += 2
			default: // \\ and \"
				b.WriteByte(s[i])
			}
		}
		if i >= len(s) {
			return "", nil, fmt.Errorf("an argument not closed")
		}
		args = append(args, b.String())
		s = s[i+1:]
	}
	if len(args) == 0 {
		return "", nil, fmt.Errorf("no command")
	}
	return m[1], args, nil
}

// undeclaredKey is a command a script ran on a key its call did not
// declare.
type undeclaredKey struct {
	call    scriptCall
	command []string
	key     string
}

// keysOf is the keys of a command, as the server says (COMMAND GETKEYS):
// none for a command without any (TIME, PUBLISH).
func keysOf(ctx context.Context, client *redis.Client, cache map[string][]string, command []string) ([]string, error) {
	id := strings.Join(command, "\x00")
	if keys, ok := cache[id]; ok {
		return keys, nil
	}
	args := make([]any, len(command))
	for i, a := range command {
		args[i] = a
	}
	keys, err := client.CommandGetKeys(ctx, args...).Result()
	if err != nil {
		msg := strings.ToLower(err.Error())
		if !strings.Contains(msg, "no key arguments") && !strings.Contains(msg, "invalid arguments") && !strings.Contains(msg, "wrong number of arguments") {
			return nil, fmt.Errorf("COMMAND GETKEYS %q: %v", command, err)
		}
		keys = nil
	}
	cache[id] = keys
	return keys, nil
}

// undeclared is every command of calls that touched a key its call did
// not declare.
func undeclared(t *testing.T, client *redis.Client, calls []scriptCall) []undeclaredKey {
	t.Helper()
	ctx := context.Background()
	cache := map[string][]string{}
	var out []undeclaredKey
	for _, c := range calls {
		declared := map[string]bool{}
		for _, k := range c.keys {
			declared[k] = true
		}
		for _, cmd := range c.commands {
			keys, err := keysOf(ctx, client, cache, cmd)
			if err != nil {
				t.Fatal(err)
			}
			for _, k := range keys {
				if !declared[k] {
					out = append(out, undeclaredKey{call: c, command: cmd, key: k})
				}
			}
		}
	}
	return out
}

// keyShape is a key with its hash tag's content (a hashed identity) and
// digits left out: what kind of key it is.
var keyShape = regexp.MustCompile(`\{[^}]*\}|[0-9]+`)

func shapeOf(command []string, key string) string {
	return strings.ToUpper(command[0]) + " " + keyShape.ReplaceAllStringFunc(key, func(s string) string {
		if s[0] == '{' {
			return "{…}"
		}
		return "N"
	})
}

// TestMonitorFindsUndeclaredKeys: the watch itself, on a script of its
// own, sees a key its call did not declare, and none where it did: the
// test below can fail.
func TestMonitorFindsUndeclaredKeys(t *testing.T) {
	srv := testredis.Start(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })
	ctx := context.Background()
	m := watchMonitor(t, srv)
	// Binary arguments, quotes and escapes as MONITOR prints them.
	if err := client.Eval(ctx, `redis.call('SET', KEYS[1], ARGV[1]); redis.call('TIME'); return redis.call('GET', KEYS[1] .. ':override')`,
		[]string{"rl:p:{a\"b\\}"}, "\x00\x01\xff \"\n").Err(); err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	if err := client.Eval(ctx, `return redis.call('GET', KEYS[2])`, []string{"rl:p:{a}", "rl:p:{a}:usage"}).Err(); err != nil && err != redis.Nil {
		t.Fatal(err)
	}
	calls := m.stop(t, srv)
	if len(calls) != 2 || len(calls[0].commands) != 3 || calls[0].commands[0][2] != "\x00\x01\xff \"\n" {
		t.Fatalf("MONITOR read as %q", calls)
	}
	got := undeclared(t, client, calls)
	if len(got) != 1 || got[0].key != "rl:p:{a\"b\\}:override" {
		t.Fatalf("undeclared keys found: %+v, want the one override", got)
	}
}

// TestScriptsDeclareEveryKey: across a workload of every kind of policy
// (rates, waits, concurrency slots, quotas, money budgets, settles that learn usage,
// overrides of each kind, hot keys' blocks), the admin API's operations,
// the leases' renewals and restores, and the fleet's records, every key a
// script touched was declared in its call's KEYS.
func TestScriptsDeclareEveryKey(t *testing.T) {
	srv := testredis.Start(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr})
	t.Cleanup(func() { client.Close() })
	ctx := context.Background()
	m := watchMonitor(t, srv)
	user := "{http.request.header.X-User}"
	settle := &Settle{From: settleHeader, Field: "X-Used"}
	usdSettle := &Settle{From: settleHeader, Field: "X-Used-USD"}
	h := testHandler(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Jitter: jitterOff(), Policies: []*Policy{
		{Name: "kd_rate", Key: user, Rate: "100/1m"},
		{Name: "kd_wait", Key: user, Rate: "100/1s", Burst: 1, Wait: caddy.Duration(100 * time.Millisecond)},
		{Name: "kd_slots", Key: user, Concurrent: 3},
		{Name: "kd_quota", Key: user, Quota: "1000/day"},
		{Name: "kd_tokens", Key: user, Rate: "100000/1s", Burst: 50000, Cost: "{http.request.header.X-Cost}", Settle: settle},
		{Name: "kd_spend", Key: user, Quota: "10000000/month", Cost: "{http.request.header.X-Cost}", Settle: settle},
		// Money budgets (unit usd): the same buckets in micro-dollars,
		// settled from a cost header in dollars, learning, overridden.
		{Name: "kd_usd", Key: user, Unit: "usd", Rate: "1/1s", Burst: 5, Cost: "0.01", Settle: usdSettle},
		{Name: "kd_usd_month", Key: user, Unit: "usd", Quota: "50/month", Cost: "0.01", Settle: usdSettle},
	}}, nil)
	hot := testHandler(t, &Handler{Redis: &RedisConfig{Addresses: []string{srv.Addr}}, Jitter: jitterOff(), Policies: []*Policy{
		{Name: "kd_hot", Key: user, Rate: "100000/1s", Burst: 10000},
	}}, nil)
	rs := h.store.(*redisStore)

	// send sends n requests of user at once (the coalescer merges them
	// into calls of many requests), the upstream using used (tokens, and
	// used/10,000 dollars).
	send := func(user string, n int, used string) {
		tokens, _ := strconv.ParseFloat(used, 64)
		usd := strconv.FormatFloat(tokens/10_000, 'f', -1, 64)
		var wg sync.WaitGroup
		for range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				serveWith([]*Handler{h}, nil, upstreamAnswering(200, "X-Used", used, "X-Used-USD", usd), "X-User", user, "X-Cost", "100")
			}()
		}
		wg.Wait()
	}
	send("alice", 8, "80")
	send("bob", 8, "4000") // learns: more than it reserved
	send("bob", 4, "100")  // reserves what it learned

	// Overrides of each kind, one for a while (a script of its own), then
	// requests decided under them.
	for _, body := range []string{
		`{"policy":"kd_rate","identity":"alice","rate":"1000/1m","for":"1h"}`,
		`{"policy":"kd_rate","identity":"bob","rate":"1000/1m"}`,
		`{"policy":"kd_slots","identity":"alice","concurrent":5}`,
		`{"policy":"kd_quota","identity":"alice","quota":"5000/day"}`,
		`{"policy":"kd_tokens","identity":"bob","rate":"200000/1s","burst":60000}`,
		`{"policy":"kd_spend","identity":"bob","quota":"20000000/month"}`,
		`{"policy":"kd_usd","identity":"bob","rate":"1/1s","burst":10}`,
		`{"policy":"kd_usd_month","identity":"bob","quota":"100/month"}`,
	} {
		if status, answer := adminDo(t, "POST", "/rate_limit/override", body); status != 200 {
			t.Fatalf("override %s: %d %s", body, status, answer)
		}
	}
	send("alice", 6, "50")
	send("bob", 6, "9000")

	// The admin API's reads and writes.
	for _, call := range [][3]string{
		{"POST", "/rate_limit/inspect", `{"policy":"kd_rate","identity":"alice"}`},
		{"POST", "/rate_limit/inspect", `{"policy":"kd_slots","identity":"alice"}`},
		{"POST", "/rate_limit/inspect", `{"policy":"kd_quota","identity":"alice"}`},
		{"POST", "/rate_limit/inspect", `{"policy":"kd_tokens","identity":"bob"}`},
		{"POST", "/rate_limit/grant", `{"policy":"kd_quota","identity":"alice","tokens":2}`},
		{"POST", "/rate_limit/grant", `{"policy":"kd_tokens","identity":"bob","tokens":100}`},
		{"POST", "/rate_limit/reset", `{"policy":"kd_tokens","identity":"bob"}`},
		{"POST", "/rate_limit/reset", `{"policy":"kd_spend","identity":"bob"}`},
		{"POST", "/rate_limit/reset", `{"policy":"kd_slots","identity":"alice"}`},
		{"POST", "/rate_limit/inspect", `{"policy":"kd_usd","identity":"bob"}`},
		{"POST", "/rate_limit/grant", `{"policy":"kd_usd","identity":"bob","amount":"0.5"}`},
		{"POST", "/rate_limit/grant", `{"policy":"kd_usd_month","identity":"bob","amount":"0.5"}`},
		{"POST", "/rate_limit/reset", `{"policy":"kd_usd","identity":"bob"}`},
		{"DELETE", "/rate_limit/override", `{"policy":"kd_rate","identity":"bob"}`},
		// A dry run reads (no script) and a limits file writes in
		// pipelines; a script either ran would be checked below.
		{"POST", "/rate_limit/dry_run", `{"url":"http://example.com/","headers":{"X-User":["bob"],"X-Cost":["100"]}}`},
		{"POST", "/rate_limit/apply", `{"source":"kd","overrides":[{"line":1,"policy":"kd_rate","identity":"dave","rate":"500/1m"},{"line":2,"policy":"kd_tokens","identity":"dave","rate":"1000/1s","burst":900}]}`},
	} {
		if status, answer := adminDo(t, call[0], call[1], call[2]); status != 200 {
			t.Fatalf("%s %s: %d %s", call[0], call[1], status, answer)
		}
	}

	// A lease's life beyond acquire and release: renewed while its request
	// runs, restored after Redis lost it, and the stale ones freed.
	slots := h.Policies[2]
	key := slots.storageKey(h.hasher, "alice")
	lease := func(op bucketOp, member string) bucketRequest {
		rq := bucketRequest{key: key, limit: slots.limit, op: op, cost: 1, lease: member, events: "rl:events"}
		slots.markOverridable(&rq, true)
		return rq
	}
	for _, rq := range []bucketRequest{lease(opAcquire, "l1"), lease(opRenew, "l1"), lease(opRestore, "l2"), lease(opCount, ""), lease(opRelease, "l1")} {
		if _, err := rs.decide(ctx, []bucketRequest{rq}); err != nil {
			t.Fatalf("op %d: %v", rq.op, err)
		}
	}
	free := lease(opFree, "")
	free.delta = 0
	if _, err := rs.decide(ctx, []bucketRequest{free}); err != nil {
		t.Fatalf("free: %v", err)
	}

	// A hot key: blocks of its tokens, taken in calls of their own.
	// The key is hot above 200 decisions a second; a slow machine takes
	// longer to get there (at most 10 s).
	blocks := testutilValue(hotBlocksTaken.WithLabelValues("kd_hot"))
	for deadline := time.Now().Add(10 * time.Second); testutilValue(hotBlocksTaken.WithLabelValues("kd_hot")) == blocks; {
		if time.Now().After(deadline) {
			t.Fatal("no hot key's block was taken within 10 s: the workload misses them")
		}
		for range 100 {
			serve([]*Handler{hot}, nil, "X-User", "carol")
		}
	}
	for range 500 { // decided from blocks, and blocks fetched ahead
		serve([]*Handler{hot}, nil, "X-User", "carol")
	}

	// The fleet's records: written, read, left.
	if _, _, err := fleetCall(ctx, rs.client, "kd-instance", "d1", []byte(`{"id":"kd-instance"}`), true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := rs.fleet.liveRecords(ctx); err != nil {
		t.Fatal(err)
	}
	if _, _, err := fleetCall(ctx, rs.client, "kd-instance", "", nil, false); err != nil {
		t.Fatal(err)
	}

	calls := m.stop(t, srv)
	// The workload reached what it is meant to: scripts that read and
	// write overrides, learned usage, quotas, slots and the fleet's
	// records. (A key is touched by a command inside a script call.)
	seen := map[string]bool{}
	commands := 0
	for _, c := range calls {
		commands += len(c.commands)
		for _, cmd := range c.commands {
			if len(cmd) > 1 {
				seen[shapeOf(cmd, cmd[1])] = true
			}
		}
	}
	for _, want := range []string{"GET rl:kd_rate:{…}:override", "GET rl:kd_tokens:{…}:usage", "SET rl:kd_tokens:{…}:usage",
		"GET rl:kd_quota:{…}", "ZADD rl:kd_slots:{…}", "SET rl:kd_rate:{…}:override", "HSET rate_limit:{…}", "HSET rate_limit:{…}:records",
		"GET rl:kd_usd:{…}:usage", "SET rl:kd_usd:{…}:usage", "GET rl:kd_usd:{…}:override", "GET rl:kd_usd_month:{…}:override"} {
		if !seen[want] {
			var all []string
			for s := range seen {
				all = append(all, s)
			}
			sort.Strings(all)
			t.Errorf("no script ran %q: the workload misses it; scripts ran:\n%s", want, strings.Join(all, "\n"))
		}
	}
	bad := undeclared(t, client, calls)
	if len(bad) == 0 {
		t.Logf("%d script calls ran %d commands, every key declared", len(calls), commands)
		return
	}
	shapes := map[string]int{}
	inCalls := map[string]bool{}
	for _, b := range bad {
		shapes[shapeOf(b.command, b.key)]++
		inCalls[strings.Join(b.call.args, "\x00")] = true
	}
	var lines []string
	for s, c := range shapes {
		lines = append(lines, fmt.Sprintf("  %s (%d times)", s, c))
	}
	sort.Strings(lines)
	t.Errorf("of %d commands run inside %d script calls, %d touched keys their call did not declare in KEYS (in %d calls):\n%s",
		commands, len(calls), len(bad), len(inCalls), strings.Join(lines, "\n"))
}
