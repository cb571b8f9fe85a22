// Package clientaddr keeps a client address in a key as its network: whoever
// holds one IPv6 address holds the /64 around it (2^64 addresses, what one
// subscriber line or one cloud VM is given), so a key of {client_ip} that
// kept whole IPv6 addresses would give one client 2^64 buckets. Cloudflare
// counts an IPv6 client by its /64 for the same reason. IPv4 addresses are
// scarce and kept whole by default.
package clientaddr

import (
	"fmt"
	"net/netip"
	"strconv"
)

// The prefix lengths kept when a policy and its handler set none.
const (
	defaultIPv4Prefix = 32
	defaultIPv6Prefix = 64
)

// Mask is how many leading bits of a client address a policy's key keeps,
// per family (0 or all: the whole address).
type Mask struct{ V4, V6 int }

// Kind says whether a placeholder is a client address, and its form.
type Kind uint8

const (
	None     Kind = iota // not a client address
	Host                 // an IP address: {client_ip}, {remote_host}
	HostPort             // host:port: {http.request.remote}
)

// Placeholder classifies a placeholder name. The Caddyfile's
// shorthands ({client_ip}, {remote_host}, {remote}) are read as the
// placeholders they stand for, in JSON too, where Caddy would leave them
// empty.
func Placeholder(name string) (canonical string, kind Kind) {
	switch name {
	case "http.vars.client_ip", "client_ip":
		return "http.vars.client_ip", Host
	case "http.request.remote.host", "remote_host":
		return "http.request.remote.host", Host
	case "http.request.remote", "remote":
		return "http.request.remote", HostPort
	}
	return name, None
}

// Masked is s as a key holds it: the address's network in canonical form
// ("2001:db8:1:2::/64", "192.0.2.0/24"), or the address alone when the
// mask keeps all its bits ("192.0.2.7", "2001:db8::9"); an IPv4-mapped IPv6
// address is IPv4, and a zone is dropped. A value that is not an address
// (a Unix socket, the empty string) is kept as it is. It allocates only
// the string it returns, and nothing when s is already that string.
func (m Mask) Masked(s string, kind Kind) string {
	var buf [64]byte
	b, ok := m.AppendMasked(buf[:0], s, kind)
	if !ok || string(b) == s {
		return s
	}
	return string(b)
}

// AppendMasked appends s masked to dst; ok is false when s is not an
// address of the kind (it is then appended as it is).
func (m Mask) AppendMasked(dst []byte, s string, kind Kind) (_ []byte, ok bool) {
	if !addrLike(s) {
		return append(dst, s...), false
	}
	switch kind {
	case Host:
		a, err := netip.ParseAddr(s)
		if err != nil {
			return append(dst, s...), false
		}
		return m.appendAddr(dst, a), true
	case HostPort:
		// The port is kept: a key of host:port is one bucket per
		// connection whatever the mask, as its author chose.
		ap, err := netip.ParseAddrPort(s)
		if err != nil {
			return append(dst, s...), false
		}
		a := ap.Addr().Unmap()
		if a.Is6() {
			dst = append(m.appendAddr(append(dst, '['), a), ']')
		} else {
			dst = m.appendAddr(dst, a)
		}
		return strconv.AppendUint(append(dst, ':'), uint64(ap.Port()), 10), true
	}
	return append(dst, s...), false
}

func (m Mask) appendAddr(dst []byte, a netip.Addr) []byte {
	a = a.Unmap().WithZone("")
	bits, all := m.V6, 128
	if a.Is4() {
		bits, all = m.V4, 32
	}
	if bits <= 0 || bits >= all {
		return a.AppendTo(dst)
	}
	p, _ := a.Prefix(bits) // cannot fail: 0 < bits < all
	return p.AppendTo(dst)
}

// addrLike reports whether s may be an address (or address and port): up
// to a zone, only what addresses are written with. It spares the parsers'
// errors, which allocate, for the values that are plainly not addresses.
func addrLike(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c >= '0' && c <= '9', c >= 'a' && c <= 'f', c >= 'A' && c <= 'F', c == ':', c == '.', c == '[', c == ']':
		case c == '%':
			return true
		default:
			return false
		}
	}
	return true
}

// Valid reports whether s is an address of the kind.
func Valid(s string, kind Kind) bool {
	var err error
	switch kind {
	case Host:
		_, err = netip.ParseAddr(s)
	case HostPort:
		_, err = netip.ParseAddrPort(s)
	default:
		return false
	}
	return err == nil
}

// String describes the mask, for messages.
func (m Mask) String() string {
	return fmt.Sprintf("IPv4 /%d, IPv6 /%d", m.V4, m.V6)
}

// MaskOf is the mask of a policy's and its handler's settings (0: unset).
func MaskOf(policyV4, policyV6, handlerV4, handlerV6 int) Mask {
	pick := func(p, h, def int) int {
		if p != 0 {
			return p
		}
		if h != 0 {
			return h
		}
		return def
	}
	return Mask{V4: pick(policyV4, handlerV4, defaultIPv4Prefix), V6: pick(policyV6, handlerV6, defaultIPv6Prefix)}
}
