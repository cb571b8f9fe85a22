package accesslog

import (
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"
)

var dayStart = time.Date(2025, 3, 3, 0, 0, 0, 0, time.UTC)

// A generated day reads back as the entries it wrote, in the order Caddy
// writes them (by their ends), with the special traffic where it says.
func TestDayReadsBack(t *testing.T) {
	var buf bytes.Buffer
	d := Day{Start: dayStart, Requests: 20_000, Tenants: 50, Seed: 1}
	if _, err := d.WriteTo(&buf); err != nil {
		t.Fatal(err)
	}
	r := NewReader("day", bytes.NewReader(buf.Bytes()))
	var e Entry
	var n, noisy, burst, scraper int
	last := int64(0)
	for r.Next(&e) {
		n++
		if e.End < last {
			t.Fatalf("entry %d ends at %d, before the one before it (%d)", n, e.End, last)
		}
		last = e.End
		if e.Start > e.End || e.Start < dayStart.UnixMicro() {
			t.Fatalf("entry %d: start %d, end %d", n, e.Start, e.End)
		}
		switch {
		case e.ClientIP == ScraperIP:
			scraper++
		case e.Header["X-Api-Key"][0] == NoisyKey:
			noisy++
		case e.Header["X-Api-Key"][0] == BurstKey:
			burst++
			if at := time.Duration(e.Start-dayStart.UnixMicro()) * time.Microsecond; at < BurstAt || at >= BurstAt+5*time.Second {
				t.Errorf("a burst request at %s", at)
			}
		}
		if e.Header["X-Api-Key"] != nil && e.Header["Authorization"][0] != Redacted {
			t.Fatalf("Authorization %q, not redacted", e.Header["Authorization"])
		}
	}
	if r.Err() != nil {
		t.Fatal(r.Err())
	}
	st := r.Stats()
	if st.Entries != int64(n) || st.Lines != int64(n) || st.Unreadable+st.NotAccess+st.TooLong+st.NoTime != 0 {
		t.Errorf("stats %+v for %d entries", st, n)
	}
	if noisy != 3*12*3600 || burst != 300 || scraper != 20*120 {
		t.Errorf("noisy %d (want %d), burst %d (300), scraper %d (2400)", noisy, 3*12*3600, burst, scraper)
	}
	regular := n - noisy - burst - scraper
	if regular < 19_000 || regular > 21_000 {
		t.Errorf("%d regular requests, want about 20000", regular)
	}
}

// Lines of other Caddy releases and encoder settings are read; lines that
// are not entries are counted, never fatal.
func TestParseFormats(t *testing.T) {
	cases := []struct {
		name, line             string
		start, end             int64
		remoteIP, port, client string
		err                    error
	}{
		{"default", `{"level":"info","ts":1700000000.5,"logger":"http.log.access.log0","msg":"handled request","request":{"remote_ip":"192.0.2.1","remote_port":"5555","client_ip":"198.51.100.9","proto":"HTTP/1.1","method":"GET","host":"x","uri":"/a","headers":{"Authorization":["REDACTED"]}},"duration":0.25,"status":200,"resp_headers":{}}`,
			1700000000250000, 1700000000500000, "192.0.2.1", "5555", "198.51.100.9", nil},
		{"v2.4 remote_addr", `{"level":"info","ts":1600000000.000001,"logger":"http.log.access","msg":"handled request","request":{"remote_addr":"[2001:db8::1]:443","proto":"HTTP/2.0","method":"GET","host":"x","uri":"/","headers":{}},"common_log":"...","duration":0.000123,"size":0,"status":200,"resp_headers":{}}`,
			1600000000000001 - 123, 1600000000000001, "2001:db8::1", "443", "", nil},
		{"iso8601 and nano", `{"ts":"2025-03-03T09:00:00.000Z","logger":"http.log.access.log1","request":{"remote_ip":"192.0.2.1","method":"GET","uri":"/"},"duration":1500000,"status":200}`,
			time.Date(2025, 3, 3, 9, 0, 0, 0, time.UTC).UnixMicro() - 1500, time.Date(2025, 3, 3, 9, 0, 0, 0, time.UTC).UnixMicro(), "192.0.2.1", "", "", nil},
		{"string duration", `{"ts":1700000000,"logger":"http.log.access","request":{"method":"GET","uri":"/"},"duration":"2.5s","status":200}`,
			1700000000000000 - 2500000, 1700000000000000, "", "", "", nil},
		{"milliseconds", `{"ts":1700000000123.5,"logger":"http.log.access","request":{"method":"GET","uri":"/"},"status":200}`,
			1700000000123500, 1700000000123500, "", "", "", nil},
		{"absurd duration", `{"ts":1700000000,"logger":"http.log.access","request":{"method":"GET","uri":"/"},"duration":-3,"status":200}`,
			1700000000000000, 1700000000000000, "", "", "", nil},
		{"caddy's own message", `{"level":"info","ts":1700000000,"logger":"http","msg":"server running"}`, 0, 0, "", "", "", ErrNotAccess},
		{"error log", `{"level":"error","ts":1700000000,"logger":"http.log.error","msg":"x","request":{"method":"GET"}}`, 0, 0, "", "", "", ErrNotAccess},
		{"no ts", `{"logger":"http.log.access","request":{"method":"GET"}}`, 0, 0, "", "", "", ErrNoTime},
		{"ts NaN", `{"ts":"NaN","logger":"http.log.access","request":{"method":"GET"}}`, 0, 0, "", "", "", ErrNoTime},
	}
	for _, c := range cases {
		var e Entry
		err := Parse([]byte(c.line), &e)
		if err != c.err {
			t.Errorf("%s: error %v, want %v", c.name, err, c.err)
			continue
		}
		if err != nil {
			continue
		}
		if e.Start != c.start || e.End != c.end || e.RemoteIP != c.remoteIP || e.RemotePort != c.port || e.ClientIP != c.client {
			t.Errorf("%s: got start %d end %d remote %q:%q client %q", c.name, e.Start, e.End, e.RemoteIP, e.RemotePort, e.ClientIP)
		}
	}
}

// Files are read gzip or not, in the order of their first entries, and
// odd lines (not JSON, huge, empty, another logger's) are counted and
// skipped.
func TestReaderFiles(t *testing.T) {
	dir := t.TempDir()
	line := func(ts float64) string {
		return `{"ts":` + strings.TrimRight(strings.TrimRight(strconvF(ts), "0"), ".") + `,"logger":"http.log.access.log0","request":{"method":"GET","uri":"/","remote_ip":"192.0.2.1"},"status":200}` + "\n"
	}
	newer := line(1700000100) + "not json at all\n\n" + `{"logger":"http","msg":"x"}` + "\n" + `{"ts":1700000101,"logger":"http.log.access","request":{"method":"GET","headers":{"X":["` + strings.Repeat("a", 2<<20) + `"]}}}` + "\n" + line(1700000102)
	older := line(1700000000) + line(1700000001)
	if err := os.WriteFile(filepath.Join(dir, "access.log"), []byte(newer), 0o600); err != nil {
		t.Fatal(err)
	}
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(older))
	zw.Close()
	if err := os.WriteFile(filepath.Join(dir, "access.log.1.gz"), gz.Bytes(), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := Open([]string{filepath.Join(dir, "access.log"), filepath.Join(dir, "access.log.1.gz")})
	if err != nil {
		t.Fatal(err)
	}
	var got []int64
	var e Entry
	for r.Next(&e) {
		got = append(got, e.End/1e6)
	}
	if r.Err() != nil {
		t.Fatal(r.Err())
	}
	want := []int64{1700000000, 1700000001, 1700000100, 1700000102}
	if len(got) != len(want) {
		t.Fatalf("read %v, want %v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("read %v, want %v", got, want)
		}
	}
	st := r.Stats()
	if st.Unreadable != 1 || st.NotAccess != 1 || st.TooLong != 1 || st.Entries != 4 {
		t.Errorf("stats %+v", st)
	}
	if !strings.Contains(st.FirstProblem, "access.log line 2") {
		t.Errorf("first problem %q", st.FirstProblem)
	}
}

func strconvF(f float64) string { return strings.TrimSpace(strings.Replace(fmtF(f), " ", "", -1)) }

func BenchmarkParse(b *testing.B) {
	var buf bytes.Buffer
	Day{Start: dayStart, Length: time.Hour, Requests: 2000, Seed: 2}.WriteTo(&buf)
	lines := bytes.Split(bytes.TrimSpace(buf.Bytes()), []byte("\n"))
	b.ResetTimer()
	var e Entry
	for i := 0; i < b.N; i++ {
		if err := Parse(lines[i%len(lines)], &e); err != nil {
			b.Fatal(err)
		}
	}
}

func fmtF(f float64) string { return strconv.FormatFloat(f, 'f', 6, 64) }

// FuzzParse: no line crashes the reader, and an entry read never ends
// before it begins.
func FuzzParse(f *testing.F) {
	var buf bytes.Buffer
	Day{Start: dayStart, Length: time.Minute, Requests: 5, Seed: 3}.WriteTo(&buf)
	for _, l := range bytes.Split(buf.Bytes(), []byte("\n")) {
		f.Add(l)
	}
	f.Add([]byte(`{"ts":"2025-03-03T09:00:00Z","logger":"http.log.access","request":{"remote_addr":"[::1]:1"},"duration":"1h"}`))
	f.Fuzz(func(t *testing.T, line []byte) {
		var e Entry
		if ParseFields(line, &e, []string{"x"}) == nil && e.Start > e.End {
			t.Fatalf("start %d after end %d", e.Start, e.End)
		}
	})
}
