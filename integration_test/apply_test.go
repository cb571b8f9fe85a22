package integration_test

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/limitsfile"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// applyCLI runs `caddy rate-limit apply` against an instance and returns
// what it printed and its exit status.
func applyCLI(t *testing.T, in *instance, args ...string) (string, int) {
	t.Helper()
	cmd := exec.Command(caddyBin, append(append([]string{"rate-limit", "apply"}, args...), "--address", strings.TrimPrefix(in.Admin, "http://"))...)
	out, err := cmd.CombinedOutput()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("caddy rate-limit apply: %v\n%s", err, out)
	}
	return string(out), code
}

// customers is a limits file's overrides of n identities of per_user:
// each its own rate, and a note.
func customers(n int) []limitsfile.Entry {
	out := make([]limitsfile.Entry, n)
	for i := range out {
		out[i] = limitsfile.Entry{Policy: "per_user", Identity: fmt.Sprintf("cust-%05d", i), Rate: fmt.Sprintf("%d/1h", 100+i%50), Note: fmt.Sprintf("contract %d", i)}
	}
	return out
}

// TestApplyLimitsFile: 10,000 overrides in one limits file, applied with
// `caddy rate-limit apply` through one of two instances: the next request
// of any of them, on the other instance, is decided under its override,
// and a drained customer's bucket keeps its state. The same file again
// changes nothing. A file with 3 wrong lines, 5 changed limits and 2
// customers dropped applies the rest and exits non-zero; a hand-made
// override survives it all; --dry-run changes nothing.
func TestApplyLimitsFile(t *testing.T) {
	srv := testredis.Start(t)
	perUser := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "5/1h"}
	a := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, perUser), echo())
	b := startCaddy(t, limiter(srv.Addr, map[string]any{"jitter": 0}, perUser), echo())
	dir := t.TempDir()
	write := func(name string, data []byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}

	// A customer drained before the file, and a hand-made override.
	for range 5 {
		get(t, b.URL, "X-User", "cust-00007")
	}
	if r := get(t, b.URL, "X-User", "cust-00007"); r.status != 429 {
		t.Fatalf("6th of 5: %d", r.status)
	}
	rateLimitCLI(t, a, "override", "per_user", "hand", "rate", "77/1h", "note", "by hand")

	entries := customers(10_000)
	file := write("limits.yaml", limitsfile.Marshal("billing", entries))
	dry, code := applyCLI(t, a, file, "--dry-run")
	if code != 0 || !strings.Contains(dry, "10000 added, 0 changed, 0 removed, 0 unchanged") {
		t.Fatalf("--dry-run: exit %d\n%s", code, dry)
	}
	if r := get(t, b.URL, "X-User", "cust-00007"); r.status != 429 {
		t.Fatalf("after a dry run: %d, want still denied", r.status)
	}

	began := time.Now()
	out, code := applyCLI(t, a, file)
	took := time.Since(began)
	if code != 0 || !strings.Contains(out, "10000 added, 0 changed, 0 removed, 0 unchanged") {
		t.Fatalf("apply: exit %d\n%s", code, out)
	}
	// On the other instance, the next request of each sampled customer is
	// decided under its override; cust-00007 owed 5 (and was denied once,
	// uncharged): 107 - 5 - 1 left after this one.
	for _, i := range []int{0, 7, 4999, 9999} {
		r := get(t, b.URL, "X-User", fmt.Sprintf("cust-%05d", i))
		want := int64(100 + i%50)
		if r.status != 200 || policyQ(t, r) != want {
			t.Fatalf("cust-%05d on the other instance: %d q=%d, want 200 q=%d", i, r.status, policyQ(t, r), want)
		}
		if i == 7 && remainingOf(t, r.header)["per_user"] != want-6 {
			t.Fatalf("cust-00007's bucket did not keep its state: r=%d, want %d", remainingOf(t, r.header)["per_user"], want-6)
		}
	}
	began = time.Now()
	again, code := applyCLI(t, b, file)
	tookAgain := time.Since(began)
	if code != 0 || !strings.Contains(again, "0 added, 0 changed, 0 removed, 10000 unchanged") {
		t.Fatalf("the same file again: exit %d\n%s", code, again)
	}

	// 5 limits changed, 2 customers dropped, 3 wrong lines.
	next := append([]limitsfile.Entry(nil), entries[2:]...) // cust-00000 and cust-00001 dropped
	for i := range 5 {
		next[i].Rate = "1000/1h"
	}
	next = append(next,
		limitsfile.Entry{Policy: "per_usr", Identity: "x", Rate: "1/1s"},
		limitsfile.Entry{Policy: "per_user", Identity: "y", Concurrent: 3},
		limitsfile.Entry{Policy: "per_user", Identity: "z", Rate: "1/1s", Burst: 9_000_000_000_000_000})
	file2 := write("limits2.yaml", limitsfile.Marshal("billing", next))
	out2, code := applyCLI(t, a, file2)
	t.Logf("caddy rate-limit apply limits2.yaml (exit %d), its diff's summary and refusals:\n%s", code, tail(out2, 6))
	if code == 0 || !strings.Contains(out2, "0 added, 5 changed, 2 removed, 9993 unchanged") || strings.Count(out2, ": refused: ") != 3 ||
		!strings.Contains(out2, "limits2.yaml:10003: refused:") {
		t.Fatalf("a file with 3 wrong lines: exit %d\n%s", code, out2)
	}
	if r := get(t, b.URL, "X-User", "cust-00002"); policyQ(t, r) != 1000 {
		t.Errorf("a changed limit: q=%d, want 1000", policyQ(t, r))
	}
	if r := get(t, b.URL, "X-User", "cust-00000"); policyQ(t, r) != 5 {
		t.Errorf("a dropped customer: q=%d, want the policy's 5", policyQ(t, r))
	}
	if r := get(t, a.URL, "X-User", "hand"); policyQ(t, r) != 77 {
		t.Errorf("the hand-made override: q=%d, want 77", policyQ(t, r))
	}
	t.Logf("10,000 overrides applied through one of two instances in %v (the call returns once both confirmed every change); the same file again, a no-op, in %v",
		took.Round(time.Millisecond), tookAgain.Round(time.Millisecond))
}

// tail is the last n lines of s.
func tail(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}
