// Package testproc holds what the test harnesses do alike to the processes
// they start.
package testproc

import (
	"os/exec"
	"syscall"
)

// DieWithParent has the kernel kill cmd's process when the test binary that
// started it dies (go test's -timeout panic, a kill): a test stops what it
// starts by its PID, but a binary killed mid-test runs no cleanup, and an
// orphaned Caddy or redis-server would hold its ports and cores for the
// runs that follow.
func DieWithParent(cmd *exec.Cmd) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Pdeathsig = syscall.SIGKILL
}
