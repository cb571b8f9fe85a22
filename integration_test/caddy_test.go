// Package integration_test runs the real Caddy binary, built with the
// module, against real redis-server processes.
package integration_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testcaddy"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// caddyBin is the Caddy binary with the module, built once for all tests.
var caddyBin string

func TestMain(m *testing.M) {
	testredis.RunProxyIfAsked() // this process may be a test's Redis proxy
	dir, err := os.MkdirTemp("", "rate-limit-it-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	caddyBin = filepath.Join(dir, "caddy")
	if err := testcaddy.Build(caddyBin); err != nil {
		fmt.Fprintln(os.Stderr, "building caddy:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// instance is one running Caddy process: URL, Admin (the admin API's URL)
// and Log (the file holding its stdout and stderr) come from
// testcaddy.Instance, which internal/testcaddy shares with cmd/demo.
type instance struct {
	*testcaddy.Instance
}

// caddyConfig is a JSON config with one server whose one route runs the
// handlers.
func caddyConfig(port, adminPort int, tune func(map[string]any), handlers []map[string]any) []byte {
	return testcaddy.Config(port, adminPort, tune, handlers)
}

// reload replaces the running config through the admin API, as
// `caddy reload` does.
func (in *instance) reload(t *testing.T, handlers ...map[string]any) {
	t.Helper()
	if err := in.Reload(handlers...); err != nil {
		t.Fatal(err)
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
	return startCaddyEnv(t, nil, tune, handlers...)
}

// startCaddyEnv is startCaddyTuned with variables added to Caddy's
// environment ("NAME=value").
func startCaddyEnv(t *testing.T, env []string, tune func(cfg map[string]any), handlers ...map[string]any) *instance {
	t.Helper()
	in := &instance{testcaddy.StartEnv(t, caddyBin, env, tune, handlers...)}
	// Runs before the stop that Start registered: a failed test shows the
	// log of every Caddy it ran.
	t.Cleanup(func() {
		in.Stop()
		if t.Failed() {
			out, _ := os.ReadFile(in.Log)
			t.Logf("caddy log (%s):\n%s", in.URL, out)
		}
	})
	return in
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
