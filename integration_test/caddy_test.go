// Package integration_test runs the real Caddy binary, built with the
// module, against real redis-server processes.
package integration_test

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
	"syscall"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// caddyBin is the Caddy binary with the module, built once for all tests.
var caddyBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "rate-limit-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	caddyBin = filepath.Join(dir, "caddy")
	build := exec.Command("go", "build", "-o", caddyBin, "../cmd/caddy")
	build.Stdout, build.Stderr = os.Stdout, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building caddy:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// instance is one running Caddy process.
type instance struct {
	URL   string // http://127.0.0.1:port
	Admin string // http://127.0.0.1:port of the admin API
	Log   string // the file holding Caddy's stdout and stderr
	cmd   *exec.Cmd

	port, adminPort int
	tune            func(cfg map[string]any)
}

// caddyConfig is a JSON config with one server whose one route runs the
// handlers.
func caddyConfig(port, adminPort int, tune func(map[string]any), handlers []map[string]any) []byte {
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

// reload replaces the running config through the admin API, as
// `caddy reload` does.
func (in *instance) reload(t *testing.T, handlers ...map[string]any) {
	t.Helper()
	resp, err := http.Post(in.Admin+"/load", "application/json", bytes.NewReader(caddyConfig(in.port, in.adminPort, in.tune, handlers)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		body, _ := io.ReadAll(resp.Body)
		t.Fatalf("reload: %d %s", resp.StatusCode, body)
	}
}

// startCaddy runs the binary with a JSON config whose handlers are given;
// each instance has its own ports and XDG directories (Caddy's identity and
// storage). The process is stopped when the test ends.
func startCaddy(t *testing.T, handlers ...map[string]any) *instance {
	t.Helper()
	return startCaddyTuned(t, nil, handlers...)
}

// startCaddyTuned is startCaddy with a function that adjusts the whole
// config (logging, server options) before it is loaded, and on reloads.
func startCaddyTuned(t *testing.T, tune func(cfg map[string]any), handlers ...map[string]any) *instance {
	t.Helper()
	port, adminPort := testredis.FreePort(t), testredis.FreePort(t)
	dir := t.TempDir()
	raw := caddyConfig(port, adminPort, tune, handlers)
	cfgPath := filepath.Join(dir, "caddy.json")
	if err := os.WriteFile(cfgPath, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	logFile, err := os.Create(filepath.Join(dir, "caddy.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(caddyBin, "run", "--config", cfgPath)
	cmd.Env = append(os.Environ(), "XDG_DATA_HOME="+filepath.Join(dir, "data"), "XDG_CONFIG_HOME="+filepath.Join(dir, "config"), "HOME="+dir)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	in := &instance{URL: fmt.Sprintf("http://127.0.0.1:%d", port), Admin: fmt.Sprintf("http://127.0.0.1:%d", adminPort), cmd: cmd, port: port, adminPort: adminPort, tune: tune, Log: logFile.Name()}
	t.Cleanup(func() {
		_ = cmd.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		logFile.Close()
		if t.Failed() {
			out, _ := os.ReadFile(logFile.Name())
			t.Logf("caddy log (%s):\n%s", in.URL, out)
		}
	})
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

// respond is a terminal handler answering 200 "ok".
func respond() map[string]any {
	return map[string]any{"handler": "static_response", "status_code": 200, "body": "ok"}
}

func newClient() *http.Client {
	return &http.Client{
		Timeout:   5 * time.Second,
		Transport: &http.Transport{MaxIdleConnsPerHost: 64, DisableCompression: true},
	}
}
