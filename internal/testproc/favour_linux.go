package testproc

import (
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Favour raises every thread of the process pid to nice -10 (as root;
// otherwise it leaves them as they are), for a process that stands for
// something off this machine: a Redis server on a host of its own, the
// network between them. Beside the processes under test and the CPU hogs of
// a busy machine, at an equal share of the cores, such a process answers
// tens of milliseconds late, which a test would read as the Redis or the
// network it stands for being slow. A priority is a thread's own on Linux
// (a thread started later takes its creator's): every thread running now is
// raised.
func Favour(pid int) {
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		_ = syscall.Setpriority(syscall.PRIO_PROCESS, pid, favoured)
		return
	}
	for _, task := range tasks {
		if tid, err := strconv.Atoi(task.Name()); err == nil {
			_ = syscall.Setpriority(syscall.PRIO_PROCESS, tid, favoured)
		}
	}
}

// favoured is the nice value of a favoured process.
const favoured = -10

// Stopped waits (at most bound) until every thread of the process pid is
// stopped, after a SIGSTOP: the signal is delivered as each thread next
// enters the kernel, and a thread running on another core may still copy
// a few bytes meanwhile (a partition that let one more write through). It
// reports whether they all stopped.
func Stopped(pid int, bound time.Duration) bool {
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	for deadline := time.Now().Add(bound); ; time.Sleep(time.Millisecond) {
		tasks, err := os.ReadDir(dir)
		if err != nil {
			return false
		}
		all := true
		for _, task := range tasks {
			stat, err := os.ReadFile(dir + "/" + task.Name() + "/stat")
			// The state follows the command's closing parenthesis.
			if i := strings.LastIndexByte(string(stat), ')'); err == nil && i+2 < len(stat) && stat[i+2] != 'T' && stat[i+2] != 't' {
				all = false
			}
		}
		if all {
			return true
		}
		if time.Now().After(deadline) {
			return false
		}
	}
}
