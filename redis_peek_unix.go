//go:build unix

package ratelimit

import "syscall"

// peekSocket looks at what fd holds to read, without waiting and without
// taking it, as go-redis's pool does before it hands out a connection.
func peekSocket(fd uintptr) socketState {
	var b [1]byte
	n, _, err := syscall.Recvfrom(int(fd), b[:], syscall.MSG_PEEK|syscall.MSG_DONTWAIT)
	switch {
	case n > 0:
		return socketHolds
	case n < 0 && (err == syscall.EAGAIN || err == syscall.EWOULDBLOCK):
		return socketEmpty
	}
	return socketClosed
}
