package integration_test

import (
	"errors"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

// TestMakeFleet runs cmd/fleet, what `make fleet` runs, with the Caddy the
// tests built, as far as its scripted run (-exit): it prints how to send
// requests to each instance, what each admitted, and together no more than
// the budget they share (burst 10 + 2/s × 5 s, one more for the last
// decisions made as the run ends); then every process it started is gone.
func TestMakeFleet(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "fleet")
	build := exec.Command("go", "build", "-o", bin, "./cmd/fleet")
	build.Dir = ".."
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/fleet: %v\n%s", err, out)
	}
	run := exec.Command(bin, "-caddy", caddyBin, "-exit")
	run.Dir = ".." // Caddyfile.fleet
	raw, err := run.CombinedOutput()
	out := string(raw)
	t.Logf("make fleet:\n%s", out)
	if err != nil {
		t.Fatalf("cmd/fleet: %v", err)
	}

	urls := regexp.MustCompile(`(?m)^  caddy-(\d)\s+(http://127\.0\.0\.1:\d+)\s+pid (\d+)`).FindAllStringSubmatch(out, -1)
	if len(urls) != 2 {
		t.Fatalf("want the two instances' URLs listed, got %v", urls)
	}
	for _, u := range urls {
		if !strings.Contains(out, "curl -i "+u[2]+"/") {
			t.Errorf("no curl command for caddy-%s at %s", u[1], u[2])
		}
	}
	row := func(name string) (sent, admitted int) {
		m := regexp.MustCompile(`(?m)^` + name + `\s+(?:http://\S+\s+)?(\d+)\s+(\d+)\s+\d+\s+\d+$`).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no row %q in the table", name)
		}
		sent, _ = strconv.Atoi(m[1])
		admitted, _ = strconv.Atoi(m[2])
		return sent, admitted
	}
	for _, name := range []string{"caddy-1", "caddy-2"} {
		if sent, admitted := row(name); sent == 0 || admitted == 0 {
			t.Errorf("%s: %d admitted of %d sent, want some of each", name, admitted, sent)
		}
	}
	if _, admitted := row("Together"); admitted > 20+1 {
		t.Errorf("the two instances admitted %d together, over the budget of 20 they share", admitted)
	}

	pids := regexp.MustCompile(`\(pid (\d+)\)`).FindAllStringSubmatch(out[strings.LastIndex(out, "Stopping"):], -1)
	if len(pids) != 3 {
		t.Fatalf("want the 3 processes it stopped named, got %v", pids)
	}
	for _, p := range pids {
		pid, _ := strconv.Atoi(p[1])
		if err := syscall.Kill(pid, 0); !errors.Is(err, syscall.ESRCH) {
			t.Errorf("process %d is still there after cmd/fleet exited: %v", pid, err)
		}
	}
}
