//go:build !unix

package ratelimit

// peekSocket cannot look at a socket here (nor can go-redis): a
// connection is taken as sound, and a call on one Redis closed fails.
func peekSocket(uintptr) socketState { return socketEmpty }
