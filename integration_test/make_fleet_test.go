package integration_test

import (
	"errors"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
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

// TestMakeFleetStopsByPid: a fleet left running stops every process it
// started when the user kills the command they started, `make fleet` or
// `go run ./cmd/fleet` (make forwards SIGTERM to go run, which dies of it
// without passing it on: the fleet program follows its parent), and the pid
// it tells them to kill is that go run's.
func TestMakeFleetStopsByPid(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"make", []string{"make", "fleet", "FLEET_FLAGS=-caddy " + caddyBin + " -load=false"}},
		{"go run", []string{"go", "run", "./cmd/fleet", "-caddy", caddyBin, "-load=false"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(tc.args[0], tc.args[1:]...)
			cmd.Dir = ".." // the repository's root, as a user runs it
			var out lockedBuffer
			cmd.Stdout, cmd.Stderr = &out, &out
			cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // for the cleanup below only
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }) // whatever is left, if the test failed
			deadline := time.Now().Add(3 * time.Minute)                               // go run builds cmd/fleet first
			for !strings.Contains(out.String(), "The fleet keeps running") {
				if time.Now().After(deadline) {
					t.Fatalf("the fleet did not come up:\n%s", out.String())
				}
				time.Sleep(100 * time.Millisecond)
			}
			text := out.String()
			var pids []int
			for _, m := range regexp.MustCompile(`(?m)^  (?:redis-server|Redis|Valkey|Dragonfly|KeyDB|caddy-\d)\s.*\bpid (\d+)`).FindAllStringSubmatch(text, -1) {
				pid, _ := strconv.Atoi(m[1])
				pids = append(pids, pid)
			}
			told := regexp.MustCompile(`kill (\d+)\s+\(go run\); .* this program's \((\d+)\)`).FindStringSubmatch(text)
			if len(pids) != 3 || told == nil {
				t.Fatalf("want the pids of redis-server, caddy-1, caddy-2, and the pid to kill, in:\n%s", text)
			}
			goRun, _ := strconv.Atoi(told[1])
			fleet, _ := strconv.Atoi(told[2])
			if tc.name == "go run" && goRun != cmd.Process.Pid {
				t.Errorf("it says kill %d, the go run the user started is %d", goRun, cmd.Process.Pid)
			}
			pids = append(pids, fleet, goRun)

			if err := syscall.Kill(cmd.Process.Pid, syscall.SIGTERM); err != nil { // kill <pid>
				t.Fatal(err)
			}
			_ = cmd.Wait()
			deadline = time.Now().Add(15 * time.Second)
			for _, pid := range pids {
				for syscall.Kill(pid, 0) == nil {
					if time.Now().After(deadline) {
						t.Fatalf("process %d still runs after kill %d (%s):\n%s", pid, cmd.Process.Pid, tc.name, out.String())
					}
					time.Sleep(50 * time.Millisecond)
				}
			}
			t.Logf("kill %d (%s): redis-server, both Caddy instances, the fleet program and go run gone:\n%s", cmd.Process.Pid, tc.name, out.String()[strings.LastIndex(out.String(), "\nfleet:"):])
		})
	}
}

// lockedBuffer is an io.Writer for a process's output, read while it runs.
type lockedBuffer struct {
	mu sync.Mutex
	b  strings.Builder
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
