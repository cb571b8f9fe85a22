package integration_test

import (
	"bufio"
	"encoding/json"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Loud at start: a Redis the limiter cannot use is one ERROR per cause
// when Caddy starts, which starts anyway (unless require_redis); `caddy
// rate-limit check` fails on it; the log stays JSON whatever Redis does;
// the same config started twice is warned about.

// TestRedisUnusableAtStart: a wrong password, an ACL without the
// script's commands, an address nothing listens on: Caddy starts and
// serves (fail_open), its log has one ERROR naming the cause, the fix and
// what the policy does until then, and `caddy rate-limit check` of the
// config exits non-zero naming the policy.
func TestRedisUnusableAtStart(t *testing.T) {
	srv := testredis.Start(t)
	do(t, srv, "ACL", "SETUSER", "limiter", "on", ">right", "~rl:*", "~rate_limit:{fleet}*", "+@all")
	do(t, srv, "ACL", "SETUSER", "noscripts", "on", ">right", "~rl:*", "~rate_limit:{fleet}*", "+@all", "-evalsha", "-eval")
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	for _, tc := range []struct {
		name  string
		redis map[string]any
		error string // the start of the ERROR's message
	}{
		{"wrong password", map[string]any{"addresses": []string{srv.Addr}, "username": "limiter", "password": "wrong"},
			"Redis cannot decide for policy per_user: Redis refuses the username or password: check the redis username and password"},
		{"ACL without scripts", map[string]any{"addresses": []string{srv.Addr}, "username": "noscripts", "password": "right"},
			"Redis cannot decide for policy per_user: the Redis user's ACL refuses the limiter's commands or keys: grant the Redis user the commands and keys the limiter uses: ACL SETUSER"},
		{"nothing listens", map[string]any{"addresses": []string{closed}},
			"Redis cannot decide for policy per_user: Redis cannot be reached: check the redis address"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := limiter("", nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"})
			h["redis"] = tc.redis
			in := startCaddy(t, h, echo())
			isError := func(e map[string]any) bool {
				msg, _ := e["msg"].(string)
				return e["level"] == "error" && strings.HasPrefix(msg, tc.error)
			}
			e := waitForLog(t, in, 10*time.Second, "the ERROR at start", isError)
			t.Logf("ERROR at start: %s", e["msg"])
			if msg := e["msg"].(string); !strings.HasSuffix(msg, "policy per_user will fail_open (admit every request) until Redis answers") {
				t.Errorf("the ERROR does not say what the policy does meanwhile: %s", msg)
			}
			for i := range 10 {
				if r := get(t, in.URL, "X-User", "u"+strconv.Itoa(i%3)); r.status != 200 || !strings.HasPrefix(string(r.body), "fail_open") {
					t.Fatalf("request %d: %d %q, want 200 fail_open", i, r.status, r.body)
				}
			}
			if n := countLog(t, in, func(e map[string]any) bool { return e["level"] == "error" }); n != 1 {
				raw, _ := os.ReadFile(in.Log)
				t.Errorf("%d ERROR lines after 10 requests, want the one at start:\n%s", n, raw)
			}

			out, ok := check(t, writeConfig(t, h, echo()))
			t.Logf("caddy rate-limit check:\n%s", out)
			if ok || !strings.Contains(out, "policy per_user: NOT decided by Redis") || !strings.Contains(out, "policy per_user would not be decided by Redis") {
				t.Errorf("caddy rate-limit check exited 0: %v, want non-zero naming per_user:\n%s", ok, out)
			}
		})
	}
}

// TestRedisComesBack: Caddy started while Redis was down logs the ERROR,
// then, once Redis answers, one INFO line that Redis decides.
func TestRedisComesBack(t *testing.T) {
	srv := testredis.Start(t)
	srv.Stop()
	in := startCaddyTuned(t, logLevel("INFO"), limiter(srv.Addr, nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"}), echo())
	waitForLog(t, in, 10*time.Second, "the ERROR at start", func(e map[string]any) bool {
		msg, _ := e["msg"].(string)
		return e["level"] == "error" && strings.HasPrefix(msg, "Redis cannot decide for policy per_user: Redis cannot be reached")
	})
	srv.Restart(t)
	back := time.Now()
	// The fleet's next refresh (every 5 s) finds Redis answering; a call
	// on a connection Redis's stop broke may fail once more.
	waitForLog(t, in, 15*time.Second, "Redis deciding again", func(e map[string]any) bool {
		return e["level"] == "info" && e["msg"] == "Redis decides for policy per_user"
	})
	// It names the server, as the server names itself.
	server := srv.Server().String()
	waitForLog(t, in, time.Second, "the server named "+server, func(e map[string]any) bool {
		return e["msg"] == "Redis decides for policy per_user" && e["server"] == server
	})
	t.Logf("logged that Redis decides %.1f s after it came back", time.Since(back).Seconds())
}

// ranCaddy is a `caddy run` process: done is closed once it exited.
type ranCaddy struct {
	cmd  *exec.Cmd
	log  string
	done chan struct{}
}

// runCaddy runs `caddy run --config <file>` with its own home, logging to
// a file; the process is stopped (by its PID) when the test ends.
func runCaddy(t *testing.T, configFile string) *ranCaddy {
	t.Helper()
	dir := t.TempDir()
	r := &ranCaddy{log: filepath.Join(dir, "caddy.log"), done: make(chan struct{})}
	log, err := os.Create(r.log)
	if err != nil {
		t.Fatal(err)
	}
	r.cmd = exec.Command(caddyBin, "run", "--config", configFile)
	r.cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+filepath.Join(dir, "data"), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "HOME="+dir)
	r.cmd.Stdout, r.cmd.Stderr = log, log
	testproc.DieWithParent(r.cmd)
	if err := r.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { _ = r.cmd.Wait(); log.Close(); close(r.done) }()
	t.Cleanup(func() {
		_ = r.cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-r.done:
		case <-time.After(5 * time.Second):
			_ = r.cmd.Process.Kill()
			<-r.done
		}
	})
	return r
}

// TestRequireRedis: with require_redis, Caddy does not start while Redis
// cannot decide, and says why.
func TestRequireRedis(t *testing.T) {
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	h := limiter(closed, map[string]any{"require_redis": true}, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"})
	r := runCaddy(t, writeConfig(t, h, echo()))
	select {
	case <-r.done:
	case <-time.After(20 * time.Second):
		raw, _ := os.ReadFile(r.log)
		t.Fatalf("caddy did not exit within 20 s:\n%s", raw)
	}
	raw, _ := os.ReadFile(r.log)
	if r.cmd.ProcessState.Success() {
		t.Fatalf("caddy exited 0:\n%s", raw)
	}
	if !strings.Contains(string(raw), "require_redis: Redis cannot decide for policy per_user: Redis cannot be reached: check the redis address") {
		t.Errorf("caddy's error does not say why:\n%s", raw)
	}
}

// TestLogsStayJSON: with Redis killed under load, every line Caddy writes
// is JSON, go-redis's own included (at DEBUG here, to see them).
func TestLogsStayJSON(t *testing.T) {
	srv := testredis.Start(t)
	in := startCaddyTuned(t, debugLogs, redisLimiter(srv.Addr, "100ms", nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "1000/1s"}), echo())
	var sent atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := newClient()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				resp, err := client.Get(in.URL + "/?u=" + strconv.Itoa(w*100000+i))
				if err == nil {
					resp.Body.Close()
					sent.Add(1)
				}
			}
		}()
	}
	time.Sleep(time.Second)
	srv.Stop() // SIGKILL, under load
	time.Sleep(3 * time.Second)
	close(stop)
	wg.Wait()
	in.Stop()

	f, err := os.Open(in.Log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	lines, goRedis := 0, 0
	for sc.Scan() {
		line := sc.Bytes()
		if len(strings.TrimSpace(string(line))) == 0 {
			continue
		}
		lines++
		var e map[string]any
		if err := json.Unmarshal(line, &e); err != nil {
			t.Errorf("a line of Caddy's log is not JSON: %s", line)
			continue
		}
		if e["logger"] == "http.handlers.rate_limit.go-redis" {
			goRedis++
		}
	}
	t.Logf("%d requests, %d log lines, all JSON; %d from go-redis", sent.Load(), lines, goRedis)
	if goRedis == 0 {
		t.Errorf("no line from go-redis: did it log nothing when Redis was killed?")
	}
}

// TestSameConfigTwice: a second Caddy started with the same config binds
// the same ports (SO_REUSEPORT) without an error; it warns that another
// process listens on its addresses, naming them and that process.
func TestSameConfigTwice(t *testing.T) {
	configFile := writeConfig(t, limiter("", nil, map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"}), echo())
	first := runCaddy(t, configFile)
	raw, _ := os.ReadFile(configFile)
	var cfg struct {
		Admin struct {
			Listen string `json:"listen"`
		} `json:"admin"`
	}
	_ = json.Unmarshal(raw, &cfg)
	waitListening(t, cfg.Admin.Listen)
	secondLog := runCaddy(t, configFile).log
	deadline := time.Now().Add(10 * time.Second)
	for {
		log, _ := os.ReadFile(secondLog)
		if i := strings.Index(string(log), "another process listens on"); i >= 0 {
			line := string(log)[strings.LastIndex(string(log[:i]), "\n")+1:]
			line = line[:strings.Index(line, "\n")]
			t.Logf("the second instance: %s", line)
			if !strings.Contains(line, cfg.Admin.Listen) || !strings.Contains(line, `"other_pids":[`+strconv.Itoa(first.cmd.Process.Pid)+`]`) {
				t.Errorf("the warning does not name the admin address %s and the first process %d: %s", cfg.Admin.Listen, first.cmd.Process.Pid, line)
			}
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the second instance did not warn within 10 s:\n%s", log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitListening waits, at most 20 s, until addr accepts connections.
func waitListening(t *testing.T, addr string) {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if c, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
			c.Close()
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("nothing listens on %s after 20 s", addr)
		}
	}
}
