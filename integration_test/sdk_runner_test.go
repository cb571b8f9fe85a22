package integration_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// Running the official SDKs: integration_test/sdk/driver.mjs under Node,
// with the packages of integration_test/sdk/package-lock.json, installed
// once (npm ci) when missing. `make test` installs Node from Debian's
// packages when it is missing, as it installs redis-server.

var sdkDeps struct {
	once sync.Once
	err  error
}

// sdkDir is the Node project of the SDK tests.
func sdkDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs("sdk")
	if err != nil {
		t.Fatal(err)
	}
	sdkDeps.once.Do(func() {
		for _, tool := range []string{"node", "npm"} {
			if _, err := exec.LookPath(tool); err != nil {
				sdkDeps.err = errors.New(tool + " is missing: install Node (make test does: apt-get install nodejs npm)")
				return
			}
		}
		if installed(dir, "openai", "6.49.0") && installed(dir, "@anthropic-ai/sdk", "1.16.0") {
			return
		}
		cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund", "--loglevel=error")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			sdkDeps.err = errors.New("npm ci in integration_test/sdk: " + err.Error() + ": " + string(out))
		}
	})
	if sdkDeps.err != nil {
		t.Fatal(sdkDeps.err)
	}
	return dir
}

// installed reports whether node_modules holds the package at the version.
func installed(dir, pkg, version string) bool {
	raw, err := os.ReadFile(filepath.Join(dir, "node_modules", pkg, "package.json"))
	if err != nil {
		return false
	}
	var p struct{ Version string }
	return json.Unmarshal(raw, &p) == nil && p.Version == version
}

// sdkCall is one application call of a driver run, as it went.
type sdkCall struct {
	ID      string         `json:"id"`
	APIKey  string         `json:"apiKey"`
	Kind    string         `json:"kind"`
	Params  map[string]any `json:"params"`
	Headers map[string]any `json:"headers,omitempty"`
	// AbortAfterText cuts the stream once that much text has come.
	AbortAfterText int `json:"abortAfterText,omitempty"`
	// BaseURL is the call's gateway, when not the plan's.
	BaseURL string `json:"baseURL,omitempty"`

	requests []sdkHTTP
	done     *sdkEvent
}

// sdkHTTP is one HTTP request the SDK made for a call, and its answer.
type sdkHTTP struct {
	sent, answered float64 // ms
	answer         sdkEvent
}

// sdkEvent is a line of the driver's output.
type sdkEvent struct {
	T            float64 `json:"t"`
	Event        string  `json:"event"`
	Call         string  `json:"call"`
	Status       int     `json:"status"`
	RetryAfter   string  `json:"retryAfter"`
	RetryAfterMs string  `json:"retryAfterMs"`
	ShouldRetry  string  `json:"shouldRetry"`
	ContentType  string  `json:"contentType"`
	RateLimit    string  `json:"ratelimit"`
	OK           bool    `json:"ok"`
	Text         int     `json:"text"`
	Ms           float64 `json:"ms"`
	Name         string  `json:"name"`
	Message      string  `json:"message"`
	Type         string  `json:"type"`
	Code         string  `json:"code"`
	// Usage is what the application was given of the usage: the last the
	// stream carried (null when none), or the response's.
	Usage json.RawMessage `json:"usage"`
}

// sdkPlan is what one driver run does.
type sdkPlan struct {
	SDK         string     `json:"sdk"`
	BaseURL     string     `json:"baseURL"`
	MaxRetries  *int       `json:"maxRetries,omitempty"`
	Concurrency int        `json:"concurrency"`
	Calls       []*sdkCall `json:"calls"`
}

// sdkRun is what a driver run did: its calls, and how long it ran.
type sdkRun struct {
	calls   map[string]*sdkCall
	ended   float64 // ms: when the driver ended or was stopped
	stopped bool    // stopped at the deadline with calls pending
}

// runSDK runs the plan with the official SDK, for at most deadline: a call
// still pending then (asleep in the SDK's retry) has no done.
func runSDK(t *testing.T, plan sdkPlan, deadline time.Duration) sdkRun {
	t.Helper()
	dir := sdkDir(t)
	raw, _ := json.Marshal(plan)
	file := filepath.Join(t.TempDir(), "plan.json")
	if err := os.WriteFile(file, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	cmd := exec.CommandContext(ctx, "node", "driver.mjs", file)
	cmd.Dir = dir
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	run := sdkRun{calls: map[string]*sdkCall{}}
	for _, c := range plan.Calls {
		run.calls[c.ID] = c
	}
	sent := map[string]float64{}
	lines := bufio.NewScanner(stdout)
	lines.Buffer(make([]byte, 1<<20), 1<<20)
	for lines.Scan() {
		var e sdkEvent
		if err := json.Unmarshal(lines.Bytes(), &e); err != nil {
			t.Fatalf("driver: %q: %v", lines.Text(), err)
		}
		run.ended = e.T
		c := run.calls[e.Call]
		switch e.Event {
		case "request":
			sent[e.Call] = e.T
		case "response":
			c.requests = append(c.requests, sdkHTTP{sent: sent[e.Call], answered: e.T, answer: e})
		case "done":
			c.done = &e
		}
	}
	err = cmd.Wait() // killed at the deadline by its context
	if ctx.Err() != nil {
		run.stopped = true
		run.ended = float64(deadline.Milliseconds())
	} else if err != nil {
		t.Fatalf("driver: %v: %s", err, stderr.String())
	}
	return run
}

// httpRequests is the HTTP requests the SDK made for the call.
func (c *sdkCall) httpRequests() int { return len(c.requests) }

// longestSleep is the longest the SDK waited between an answer and its
// next request for the call: for a call still pending when the run ended,
// at least from its last answer to then.
func (c *sdkCall) longestSleep(run sdkRun) time.Duration {
	longest := 0.0
	for i := 1; i < len(c.requests); i++ {
		longest = max(longest, c.requests[i].sent-c.requests[i-1].answered)
	}
	if c.done == nil && len(c.requests) > 0 {
		longest = max(longest, run.ended-c.requests[len(c.requests)-1].answered)
	}
	return time.Duration(longest * float64(time.Millisecond))
}

// surfaced says what the application was told, for logs.
func (c *sdkCall) surfaced() string {
	switch {
	case c.done == nil:
		return "nothing: still pending"
	case c.done.OK:
		return "ok"
	}
	return strings.TrimSpace(c.done.Name + " " + c.done.Message)
}

func intp(n int) *int { return &n }
