//go:build !linux

package testproc

import "os/exec"

// DieWithParent does nothing where the kernel has no parent-death signal:
// a test binary killed mid-test may leave the processes it started.
func DieWithParent(cmd *exec.Cmd) {}
