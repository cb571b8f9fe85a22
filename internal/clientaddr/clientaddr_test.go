package clientaddr

import (
	"strings"
	"testing"
)

// TestAddrMask: a client address is kept as its network, in one canonical
// form whatever way it was written; the address alone when the mask keeps
// all its bits; IPv4-mapped IPv6 is IPv4; anything that is not an address
// is kept as it is.
func TestAddrMask(t *testing.T) {
	def := Mask{V4: 32, V6: 64}
	for _, tc := range []struct {
		m    Mask
		kind Kind
		in   string
		want string
	}{
		{def, Host, "2001:db8:1:2::9", "2001:db8:1:2::/64"},
		{def, Host, "2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"},
		{def, Host, "2001:DB8:1:2:0:0:0:9", "2001:db8:1:2::/64"},
		{def, Host, "2001:0db8:0001:0002::9", "2001:db8:1:2::/64"},
		{def, Host, "2001:db8:1:3::9", "2001:db8:1:3::/64"},
		{def, Host, "fe80::1%eth0", "fe80::/64"},
		{def, Host, "192.0.2.7", "192.0.2.7"},
		{def, Host, "::ffff:192.0.2.7", "192.0.2.7"},
		{def, Host, "::ffff:c000:207", "192.0.2.7"},
		{def, Host, "::1", "::/64"},
		{Mask{V4: 32, V6: 128}, Host, "2001:db8:1:2::9", "2001:db8:1:2::9"},
		{Mask{V4: 32, V6: 128}, Host, "2001:DB8:1:2:0::9", "2001:db8:1:2::9"},
		{Mask{V4: 32, V6: 128}, Host, "fe80::1%eth0", "fe80::1"},
		{Mask{V4: 24, V6: 64}, Host, "192.0.2.7", "192.0.2.0/24"},
		{Mask{V4: 24, V6: 64}, Host, "::ffff:192.0.2.7", "192.0.2.0/24"},
		{Mask{V4: 1, V6: 1}, Host, "192.0.2.7", "128.0.0.0/1"},
		{Mask{V4: 1, V6: 1}, Host, "2001:db8::1", "::/1"},
		{Mask{V4: 16, V6: 48}, Host, "2001:db8:1:2::9", "2001:db8:1::/48"},
		{Mask{V4: 16, V6: 56}, Host, "2001:db8:1:2ff::9", "2001:db8:1:200::/56"},
		{Mask{}, Host, "2001:DB8::9", "2001:db8::9"}, // no mask: the address, canonical
		// Not addresses: kept.
		{def, Host, "", ""},
		{def, Host, "example.com", "example.com"},
		{def, Host, "/run/caddy.sock", "/run/caddy.sock"},
		{def, Host, "2001:db8:1:2::/64", "2001:db8:1:2::/64"}, // already masked
		{def, Host, "192.0.2.7:443", "192.0.2.7:443"},
		{def, Host, " 192.0.2.7", " 192.0.2.7"},
		{def, None, "2001:db8::9", "2001:db8::9"},
		// host:port: the host masked, the port kept.
		{def, HostPort, "[2001:db8:1:2::9]:5555", "[2001:db8:1:2::/64]:5555"},
		{def, HostPort, "192.0.2.7:5555", "192.0.2.7:5555"},
		{Mask{V4: 24, V6: 64}, HostPort, "192.0.2.7:5555", "192.0.2.0/24:5555"},
		{def, HostPort, "[::ffff:192.0.2.7]:80", "192.0.2.7:80"},
		{Mask{V4: 32, V6: 128}, HostPort, "[2001:db8::9]:80", "[2001:db8::9]:80"},
		{def, HostPort, "@", "@"},
		{def, HostPort, "192.0.2.7", "192.0.2.7"},
		{def, HostPort, "", ""},
	} {
		if got := tc.m.Masked(tc.in, tc.kind); got != tc.want {
			t.Errorf("%v, kind %d: %q masked to %q, want %q", tc.m, tc.kind, tc.in, got, tc.want)
		}
	}
}

// TestAddrMaskAllocations: masking costs at most the string it returns,
// and nothing when the address is kept as it was.
func TestAddrMaskAllocations(t *testing.T) {
	m := Mask{V4: 32, V6: 64}
	for in, want := range map[string]float64{"2001:db8:1:2::9": 1, "192.0.2.7": 0, "[2001:db8:1:2::9]:5555": 1, "example.com": 0} {
		kind := Host
		if strings.HasPrefix(in, "[") {
			kind = HostPort
		}
		if got := testing.AllocsPerRun(100, func() { _ = m.Masked(in, kind) }); got > want {
			t.Errorf("masking %q: %v allocations, want at most %v", in, got, want)
		}
	}
}

func BenchmarkAddrMask(b *testing.B) {
	m := Mask{V4: 32, V6: 64}
	for _, in := range []string{"2001:db8:1:2::9", "192.0.2.7"} {
		b.Run(in, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				_ = m.Masked(in, Host)
			}
		})
	}
}
