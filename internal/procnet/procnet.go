// Package procnet reads Linux's tables of TCP sockets (/proc/net/tcp and
// /proc/net/tcp6) to find the listening addresses that another socket
// listens on too: with SO_REUSEPORT, which Caddy binds with, a second
// process started with the same config binds the same ports without an
// error, and the two split the connections between them.
package procnet

import (
	"bufio"
	"encoding/hex"
	"io"
	"net/netip"
	"strconv"
	"strings"
)

// Listener is a listening TCP socket: its address and its inode, which
// /proc/<pid>/fd links name as socket:[<inode>].
type Listener struct {
	Addr  netip.AddrPort
	Inode string
}

// stateListen is TCP_LISTEN in the tables' st column.
const stateListen = "0A"

// Listeners reads the listening sockets of a /proc/net/tcp or tcp6 table.
// Lines it cannot read are skipped.
func Listeners(table io.Reader) []Listener {
	var out []Listener
	sc := bufio.NewScanner(table)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 10 || f[3] != stateListen {
			continue
		}
		addr, ok := parseAddr(f[1])
		if !ok {
			continue
		}
		out = append(out, Listener{Addr: addr, Inode: f[9]})
	}
	return out
}

// parseAddr reads "0100007F:1F90" (IPv4) or 32 hex digits and a port
// (IPv6): the address in 32-bit words of the host's byte order (little
// endian on the machines Caddy runs on), the port in big-endian hex.
func parseAddr(s string) (netip.AddrPort, bool) {
	hexAddr, hexPort, ok := strings.Cut(s, ":")
	if !ok {
		return netip.AddrPort{}, false
	}
	port, err := strconv.ParseUint(hexPort, 16, 16)
	if err != nil {
		return netip.AddrPort{}, false
	}
	raw, err := hex.DecodeString(hexAddr)
	if err != nil || len(raw) != 4 && len(raw) != 16 {
		return netip.AddrPort{}, false
	}
	for i := 0; i < len(raw); i += 4 { // each word's bytes are reversed
		raw[i], raw[i+1], raw[i+2], raw[i+3] = raw[i+3], raw[i+2], raw[i+1], raw[i]
	}
	addr, _ := netip.AddrFromSlice(raw)
	return netip.AddrPortFrom(addr.Unmap(), uint16(port)), true
}

// Shared returns, for each listener of mine (the inodes of this process's
// sockets) whose address another listening socket also takes (the same
// port, and the same address or a wildcard on either side), the other
// socket.
func Shared(all []Listener, mine map[string]bool) (out []Pair) {
	for _, m := range all {
		if !mine[m.Inode] {
			continue
		}
		for _, o := range all {
			if mine[o.Inode] || o.Addr.Port() != m.Addr.Port() || !overlap(m.Addr.Addr(), o.Addr.Addr()) {
				continue
			}
			out = append(out, Pair{Mine: m, Other: o})
		}
	}
	return out
}

// Pair is a listener of this process and another socket listening on its
// address.
type Pair struct {
	Mine, Other Listener
}

func overlap(a, b netip.Addr) bool {
	return a == b || a.IsUnspecified() || b.IsUnspecified()
}
