//go:build !linux

package testproc

// Favour does nothing off Linux: the processes standing for other hosts
// run at the priority they were started with (see favour_linux.go).
func Favour(pid int) {}
