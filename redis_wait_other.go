//go:build !linux

package ratelimit

import "net"

// blockingSocketOf leaves c in Go's network poller: the blocking socket
// of redis_wait_linux.go is Linux's.
func blockingSocketOf(c net.Conn) (net.Conn, error) { return c, nil }

// blockingWaits: sockets to Redis can wait in blocking system calls here.
const blockingWaits = false

// closedByPeer cannot tell here whether Redis closed the connection: it
// is taken as closed, and another one made.
func closedByPeer(uintptr) bool { return true }

// unacknowledged cannot tell here what the other end took in.
func unacknowledged(uintptr) (unacked, known bool) { return false, false }
