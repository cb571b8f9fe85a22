package ratelimit

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/procnet"
	"go.uber.org/zap"
)

// Starting the same config twice does not fail on Linux: Caddy binds its
// listeners with SO_REUSEPORT, so the second process binds the same ports
// without an error, and the kernel splits the connections between the
// two, the admin API's included (`caddy reload`, `caddy rate-limit`), and
// their in-process buckets are two. Once the first config runs, the
// process looks, once, for another socket listening on one of its TCP
// listening addresses, and warns naming it.

var sharedListeners sync.Once

// watchSharedListeners starts the look, once per process.
func watchSharedListeners(logger *zap.Logger) {
	sharedListeners.Do(func() { go lookForSharedListeners(logger) })
}

// listenersWait bounds the wait for the first config to run.
const listenersWait = 30 * time.Second

func lookForSharedListeners(logger *zap.Logger) {
	for start := time.Now(); !configRuns(); time.Sleep(100 * time.Millisecond) {
		if time.Since(start) > listenersWait {
			return // not a running Caddy (a check, a test)
		}
	}
	mine := ownSockets()
	var all []procnet.Listener
	for _, table := range []string{"/proc/net/tcp", "/proc/net/tcp6"} {
		if f, err := os.Open(table); err == nil {
			all = append(all, procnet.Listeners(f)...)
			f.Close()
		}
	}
	var addrs []string
	var pids []int
	for _, p := range procnet.Shared(all, mine) {
		if a := p.Mine.Addr.String(); !slices.Contains(addrs, a) {
			addrs = append(addrs, a)
		}
		if pid := socketOwner(p.Other.Inode); pid > 0 && !slices.Contains(pids, pid) {
			pids = append(pids, pid)
		}
	}
	if len(addrs) == 0 {
		return
	}
	logger.Warn("another process listens on "+strings.Join(addrs, ", ")+" as well as this one: was the same config started twice? "+
		"Caddy binds with SO_REUSEPORT, so both run, and connections are split between them at random: requests, "+
		"the admin API (caddy reload, caddy rate-limit) and in-process buckets (without a redis block, each has its own). "+
		"Stop one; an old process on its way out after a restart needs nothing",
		zap.Strings("addresses", addrs), zap.Ints("other_pids", pids), zap.Int("pid", os.Getpid()))
}

// configRuns reports whether Caddy runs a config.
func configRuns() bool {
	ctx := caddy.ActiveContext()
	return ctx.GetMetricsRegistry() != nil
}

// ownSockets returns the inodes of this process's sockets.
func ownSockets() map[string]bool {
	return socketsOf("self")
}

func socketsOf(pid string) map[string]bool {
	out := map[string]bool{}
	fds, _ := os.ReadDir(filepath.Join("/proc", pid, "fd"))
	for _, fd := range fds {
		link, err := os.Readlink(filepath.Join("/proc", pid, "fd", fd.Name()))
		if inode, ok := strings.CutPrefix(link, "socket:["); err == nil && ok {
			out[strings.TrimSuffix(inode, "]")] = true
		}
	}
	return out
}

// socketOwner finds the process holding the socket of inode, among those
// this one may read (its user's): 0 when none.
func socketOwner(inode string) int {
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		pid, err := strconv.Atoi(p.Name())
		if err == nil && pid != os.Getpid() && socketsOf(p.Name())[inode] {
			return pid
		}
	}
	return 0
}
