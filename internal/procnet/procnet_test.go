package procnet

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
)

const tcp = `  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0 100 0 0 10 0
   1: 0100007F:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0 100 0 0 10 0
   2: 0100007F:B56E 0100007F:1F90 01 00000000:00000000 03:00000077 00000000     0        0 0 3 0
   3: 00000000:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 333 1 0 100 0 0 10 0
   4: 0100007F:0050 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0 100 0 0 10 0
   5: 0100007F:07E3 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 555 1 0 100 0 0 10 0
   6: garbage
`

const tcp6 = `  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode
   0: 00000000000000000000000001000000:1F91 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 666 1 0 100 0 0 10 0
   1: 0000000000000000FFFF00000100007F:1F92 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 777 1 0 100 0 0 10 0
`

func TestListeners(t *testing.T) {
	got := append(Listeners(strings.NewReader(tcp)), Listeners(strings.NewReader(tcp6))...)
	want := []Listener{
		{netip.MustParseAddrPort("127.0.0.1:8080"), "111"},
		{netip.MustParseAddrPort("127.0.0.1:8080"), "222"},
		{netip.MustParseAddrPort("0.0.0.0:80"), "333"},
		{netip.MustParseAddrPort("127.0.0.1:80"), "444"},
		{netip.MustParseAddrPort("127.0.0.1:2019"), "555"},
		{netip.MustParseAddrPort("[::1]:8081"), "666"},
		{netip.MustParseAddrPort("127.0.0.1:8082"), "777"}, // IPv4-mapped
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("listeners\n got %v\nwant %v", got, want)
	}
}

func TestShared(t *testing.T) {
	all := append(Listeners(strings.NewReader(tcp)), Listeners(strings.NewReader(tcp6))...)
	for _, tc := range []struct {
		name string
		mine []string
		want []string // mine->other inodes
	}{
		{"alone on its addresses", []string{"555", "666"}, nil},
		{"the same address twice", []string{"111", "555"}, []string{"111->222"}},
		{"a wildcard beside an address", []string{"444"}, []string{"444->333"}},
		{"both are mine", []string{"111", "222"}, nil},
	} {
		mine := map[string]bool{}
		for _, m := range tc.mine {
			mine[m] = true
		}
		var got []string
		for _, p := range Shared(all, mine) {
			got = append(got, p.Mine.Inode+"->"+p.Other.Inode)
		}
		if !reflect.DeepEqual(got, tc.want) {
			t.Errorf("%s: shared %v, want %v", tc.name, got, tc.want)
		}
	}
}
