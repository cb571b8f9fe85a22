// Package testcaddy builds the Caddy binary with the module and runs it as
// separate processes on free loopback ports, each with its own admin port
// and XDG directories, for the integration tests and for cmd/demo.
package testcaddy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testproc"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// Package is the import path of the Caddy command with the module.
const Package = "github.com/ratelimit-caddy/caddy-ratelimit/cmd/caddy"

// Build builds the Caddy command with the module into out. It must run
// inside the module (any directory of it), as the tests and `go run
// ./cmd/demo` do. The go command's output goes to stderr.
func Build(out string) error { return BuildTags(out, "") }

// BuildTags is Build with build tags (comma-separated; "" for none).
func BuildTags(out, tags string) error {
	args := []string{"build", "-o", out}
	if tags != "" {
		args = append(args, "-tags", tags)
	}
	build := exec.Command("go", append(args, Package)...)
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	return build.Run()
}

// Instance is one running Caddy process.
type Instance struct {
	URL   string // http://127.0.0.1:port
	Admin string // http://127.0.0.1:port of the admin API
	Log   string // the file holding Caddy's stdout and stderr

	Port, AdminPort int
	// Tune adjusts the whole config before it is loaded, and on reloads.
	Tune func(cfg map[string]any)

	cmd      *exec.Cmd
	logFile  *os.File
	stopOnce sync.Once
}

// Pid is the process id of the running Caddy.
func (in *Instance) Pid() int { return in.cmd.Process.Pid }

// Config is a JSON config with one server, listening on 127.0.0.1:port
// without automatic HTTPS, whose one route runs the handlers; the admin API
// is on 127.0.0.1:adminPort and logs are at WARN. tune, when not nil,
// adjusts the config before it is encoded.
func Config(port, adminPort int, tune func(map[string]any), handlers []map[string]any) []byte {
	cfg := map[string]any{
		"admin":   map[string]any{"listen": "127.0.0.1:" + strconv.Itoa(adminPort), "config": map[string]any{"persist": false}},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{"level": "WARN"}}},
		"apps": map[string]any{"http": map[string]any{"servers": map[string]any{"test": map[string]any{
			"listen":          []string{"127.0.0.1:" + strconv.Itoa(port)},
			"automatic_https": map[string]any{"disable": true},
			"routes":          []any{map[string]any{"handle": handlers}},
		}}}},
	}
	if tune != nil {
		tune(cfg)
	}
	raw, _ := json.Marshal(cfg)
	return raw
}

// Start runs the Caddy binary bin with Config(…, tune, handlers), in a
// fresh directory of t.TempDir() that is its HOME and holds its XDG data
// and config directories (Caddy's identity and storage), and waits (at
// most 20 s) until it listens. The process is stopped by t.Cleanup.
func Start(t testredis.TB, bin string, tune func(cfg map[string]any), handlers ...map[string]any) *Instance {
	t.Helper()
	return StartEnv(t, bin, nil, tune, handlers...)
}

// StartEnv is Start with variables added to Caddy's environment
// ("NAME=value", as OTEL_* for its tracing).
func StartEnv(t testredis.TB, bin string, env []string, tune func(cfg map[string]any), handlers ...map[string]any) *Instance {
	t.Helper()
	port, adminPort := testredis.FreePort(t), testredis.FreePort(t)
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "caddy.json")
	if err := os.WriteFile(cfgPath, Config(port, adminPort, tune, handlers), 0o600); err != nil {
		t.Fatalf("writing the config: %v", err)
	}
	in := launch(t, bin, dir, []string{"run", "--config", cfgPath}, env, port, adminPort)
	in.Tune = tune
	return in
}

// StartFile runs the Caddy binary bin with the config file at path, read
// by adapter ("caddyfile", or "" for JSON), in a fresh directory as Start
// does, with env added to its environment; the config (through env, as
// {$SITE_ADDRESS}) must put the site on 127.0.0.1:port and the admin API
// on 127.0.0.1:adminPort. It waits until Caddy listens; the process is
// stopped by t.Cleanup.
func StartFile(t testredis.TB, bin, path, adapter string, port, adminPort int, env []string) *Instance {
	t.Helper()
	args := []string{"run", "--config", path}
	if adapter != "" {
		args = append(args, "--adapter", adapter)
	}
	return launch(t, bin, t.TempDir(), args, env, port, adminPort)
}

// launch starts bin with args in dir (its HOME, holding its XDG data and
// config directories), logging to dir/caddy.log, and waits (at most 20 s)
// until it listens on port.
func launch(t testredis.TB, bin, dir string, args, env []string, port, adminPort int) *Instance {
	t.Helper()
	logFile, err := os.Create(filepath.Join(dir, "caddy.log"))
	if err != nil {
		t.Fatalf("creating the log: %v", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+filepath.Join(dir, "data"), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "HOME="+dir)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	testproc.DieWithParent(cmd)
	if err := cmd.Start(); err != nil {
		logFile.Close()
		t.Fatalf("starting caddy: %v", err)
	}
	in := &Instance{
		URL:   fmt.Sprintf("http://127.0.0.1:%d", port),
		Admin: fmt.Sprintf("http://127.0.0.1:%d", adminPort),
		Log:   logFile.Name(),
		Port:  port, AdminPort: adminPort,
		cmd: cmd, logFile: logFile,
	}
	t.Cleanup(in.Stop)
	deadline := time.Now().Add(20 * time.Second)
	for {
		c, err := net.DialTimeout("tcp", "127.0.0.1:"+strconv.Itoa(port), time.Second)
		if err == nil {
			c.Close()
			return in
		}
		if time.Now().After(deadline) {
			out, _ := os.ReadFile(logFile.Name())
			t.Fatalf("caddy did not listen on %d within 20s:\n%s", port, out)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// Stop stops the process as `caddy stop` would (SIGTERM, then SIGKILL
// after 5 s) and closes its log. It is safe to call more than once.
func (in *Instance) Stop() {
	in.stopOnce.Do(func() {
		testproc.Stop(in.cmd, 5*time.Second)
		in.logFile.Close()
	})
}

// Reload replaces the running config through the admin API, as `caddy
// reload` does.
func (in *Instance) Reload(handlers ...map[string]any) error {
	resp, err := http.Post(in.Admin+"/load", "application/json", bytes.NewReader(Config(in.Port, in.AdminPort, in.Tune, handlers)))
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("reload: %d %s", resp.StatusCode, body)
	}
	return nil
}
