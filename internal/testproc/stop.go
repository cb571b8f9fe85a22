package testproc

import (
	"os/exec"
	"syscall"
	"time"
)

// Stop stops cmd's process by its PID as a service manager would: SIGTERM,
// then SIGKILL when it has not exited after grace; it returns once the
// process is reaped.
func Stop(cmd *exec.Cmd, grace time.Duration) {
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan struct{})
	go func() { _ = cmd.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(grace):
		_ = cmd.Process.Kill()
		<-done
	}
}
