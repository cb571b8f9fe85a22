//go:build !linux

package testproc

import "time"

// Favour does nothing off Linux: the processes standing for other hosts
// run at the priority they were started with (see favour_linux.go).
func Favour(pid int) {}

// Stopped reports true at once off Linux, where it cannot look: a SIGSTOP
// is taken to have stopped the process.
func Stopped(pid int, bound time.Duration) bool { return true }
