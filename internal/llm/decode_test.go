package llm

import (
	"bytes"
	"compress/flate"
	"compress/zlib"
	"io"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zstd"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// watchBody feeds a compressed body to a Response as the handler would,
// in chunks, then ends it.
func watchBody(coding, contentType string, body []byte, chunk int) *Response {
	b := new(Response)
	b.Start(map[string][]string{"Content-Encoding": {coding}, "Content-Type": {contentType}})
	for i := 0; i < len(body); i += chunk {
		b.Write(body[i:min(i+chunk, len(body))])
	}
	b.Finish()
	return b
}

// raceEnabled: the tests run under the race detector (race_test.go).
var raceEnabled bool

var testCodings = []struct {
	name   string
	coding contentCoding
}{{"identity", codingIdentity}, {"gzip", codingGzip}, {"deflate", codingDeflate}, {"br", codingBrotli}, {"zstd", codingZstd}}

// TestDecodedUsage: the usage of every provider's body and stream reads
// the same compressed (gzip, deflate, br, zstd) as plain, whatever the
// chunking of the compressed bytes and the flushes of the encoder.
func TestDecodedUsage(t *testing.T) {
	for _, body := range []struct {
		name     string
		sse      bool
		text     string
		provider Provider
		usage    int64
	}{
		{"openai chat JSON", false, llmtest.OpenAIChatJSON, OpenAI, 29},
		{"openai chat SSE", true, llmtest.OpenAIChatSSE, OpenAI, 12},
		{"openai responses JSON", false, llmtest.OpenAIResponsesJSON, OpenAI, 123},
		{"openai responses SSE", true, llmtest.OpenAIResponsesSSE, OpenAI, 48},
		{"anthropic JSON", false, llmtest.AnthropicJSON, Anthropic, 18},
		{"anthropic SSE", true, llmtest.AnthropicSSE, Anthropic, 40},
	} {
		ct := "application/json"
		if body.sse {
			ct = "text/event-stream; charset=utf-8"
		}
		plain := scanAll(body.text, body.sse, len(body.text))
		for _, c := range testCodings {
			for _, flushEvery := range []int{0, 60} {
				encoded := llmtest.Encode(t, c.name, body.text, flushEvery)
				for _, chunk := range []int{len(encoded), 1, 7, 100} {
					b := watchBody(c.name, ct, encoded, chunk)
					u, ok := b.scan.found.usage(body.provider, UnitWeights)
					if !ok || u != body.usage || b.scan.found != plain.found || b.Unreadable() != nil {
						t.Errorf("%s in %s (flushed every %d, written in chunks of %d): usage %d %v, unreadable %v; found %+v, plain %+v",
							body.name, c.name, flushEvery, chunk, u, ok, b.Unreadable(), b.scan.found, plain.found)
					}
				}
			}
		}
	}
}

// TestDecodeRawDeflate: some servers send raw deflate as `deflate`; it is
// read as well as the zlib format HTTP means.
func TestDecodeRawDeflate(t *testing.T) {
	var buf bytes.Buffer
	fw, _ := flate.NewWriter(&buf, flate.DefaultCompression)
	_, _ = io.WriteString(fw, llmtest.OpenAIChatJSON)
	_ = fw.Close()
	b := watchBody("deflate", "application/json", buf.Bytes(), 5)
	if u, ok := b.scan.found.usage(OpenAI, UnitWeights); !ok || u != 29 || b.Unreadable() != nil {
		t.Fatalf("raw deflate: usage %d %v, unreadable %v", u, ok, b.Unreadable())
	}
}

// TestDecodeUnreadable: a body that cannot be read says why, and finds no
// usage: an unknown coding, corrupt data, a window larger than the 8 MiB
// read. A body cut short is not unreadable: what came is read.
func TestDecodeUnreadable(t *testing.T) {
	gz := llmtest.Encode(t, "gzip", llmtest.OpenAIChatSSE, 0)
	corrupt := bytes.Clone(gz)
	for i := 20; i < len(corrupt)-8; i += 3 {
		corrupt[i] ^= 0x5a
	}
	var bigZstd bytes.Buffer // streamed (flushed), so the frame declares its window, not its size
	zw, _ := zstd.NewWriter(&bigZstd, zstd.WithWindowSize(16<<20))
	_, _ = io.WriteString(zw, llmtest.OpenAIChatSSE)
	_ = zw.Flush()
	_, _ = io.WriteString(zw, llmtest.OpenAIChatSSE)
	_ = zw.Close()
	var bigBrotli bytes.Buffer
	bw := brotli.NewWriterOptions(&bigBrotli, brotli.WriterOptions{Quality: 5, LGWin: 24})
	_, _ = io.WriteString(bw, llmtest.OpenAIChatSSE)
	_ = bw.Close()
	var bomb bytes.Buffer // 32 MiB of zeros, in some kilobytes
	zb, _ := zstd.NewWriter(&bomb)
	_, _ = zb.Write(make([]byte, 32<<20))
	_ = zb.Close()
	for _, tc := range []struct {
		name, coding string
		body         []byte
	}{
		{"a zstd bomb", "zstd", bomb.Bytes()},
		{"an unknown coding", "compress", gz},
		{"two codings", "gzip, br", gz},
		{"corrupt gzip", "gzip", corrupt},
		{"gzip that is not gzip", "gzip", []byte(llmtest.OpenAIChatSSE)},
		{"zstd that is not zstd", "zstd", []byte(llmtest.OpenAIChatSSE)},
		{"brotli that is not brotli", "br", []byte(llmtest.OpenAIChatSSE)},
		{"deflate that is not deflate", "deflate", []byte(llmtest.OpenAIChatSSE)},
		{"a zstd window of 16 MiB", "zstd", bigZstd.Bytes()},
		{"a brotli window of 16 MiB", "br", bigBrotli.Bytes()},
	} {
		b := watchBody(tc.coding, "text/event-stream", tc.body, 64)
		if _, ok := b.scan.found.usage(OpenAI, UnitWeights); ok || b.Unreadable() == nil {
			t.Errorf("%s: usage found %v, unreadable %v: want no usage, and why", tc.name, ok, b.Unreadable())
		} else {
			t.Logf("%s: %v", tc.name, b.Unreadable())
		}
	}
	// Cut before its end: read as far as it came.
	for _, c := range testCodings[1:] {
		encoded := llmtest.Encode(t, c.name, llmtest.OpenAIChatSSE, 60)
		b := watchBody(c.name, "text/event-stream", encoded[:len(encoded)*3/4], 9)
		if _, ok := b.scan.found.usage(OpenAI, UnitWeights); ok || b.Unreadable() != nil || b.scan.found.text != int64(len("Hello there")) {
			t.Errorf("%s cut at 3/4: usage %v, unreadable %v, %d bytes of text: want no usage, readable, the text", c.name, ok, b.Unreadable(), b.scan.found.text)
		}
	}
}

// TestDecodeStreams: a stream's usage is read as its compressed events
// come, when the encoder flushes: before the body ends.
func TestDecodeStreams(t *testing.T) {
	for _, c := range testCodings[1:] {
		var buf bytes.Buffer
		var w io.Writer
		var flush func() error
		switch c.coding {
		case codingGzip:
			zw := gzip.NewWriter(&buf)
			w, flush = zw, zw.Flush
		case codingDeflate:
			zw := zlib.NewWriter(&buf)
			w, flush = zw, zw.Flush
		case codingBrotli:
			bw := brotli.NewWriter(&buf)
			w, flush = bw, bw.Flush
		case codingZstd:
			zw, _ := zstd.NewWriter(&buf)
			w, flush = zw, zw.Flush
		}
		b := new(Response)
		b.Start(map[string][]string{"Content-Encoding": {c.name}, "Content-Type": {"text/event-stream"}})
		_, _ = io.WriteString(w, llmtest.OpenAIChatSSE)
		_ = flush()
		b.Write(buf.Bytes())
		if u, ok := b.scan.found.usage(OpenAI, UnitWeights); !ok || u != 12 {
			t.Errorf("%s: usage %d %v once the events were flushed, before the end of the body", c.name, u, ok)
		}
		b.Finish()
	}
}

// TestDecodeMemory: memory per response is bounded whatever the body's
// size: 64 MiB of a stream, decoded in 4 KiB writes, allocate what one
// decoder needs (its state, and for brotli and zstd the window the stream
// declares, grown as the output reaches it), not what the body holds.
//
// Under the race detector, 8 MiB, and bounds 4 times as loose: it drops
// pooled buffers at random, which the decoders then allocate again.
func TestDecodeMemory(t *testing.T) {
	size, slack := 64<<20, uint64(1)
	if raceEnabled {
		size, slack = 8<<20, 4
	}
	event := "data: {\"choices\":[{\"delta\":{\"content\":\"" + strings.Repeat("token ", 40) + "\"}}]}\n\n"
	body := strings.Repeat(event, size/len(event)) + "data: {\"choices\":[],\"usage\":{\"total_tokens\":77}}\n\n"
	for _, c := range testCodings[1:] {
		encoded := llmtest.Encode(t, c.name, body, 16<<10)
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		b := watchBody(c.name, "text/event-stream", encoded, 4<<10)
		runtime.ReadMemStats(&after)
		allocated := after.TotalAlloc - before.TotalAlloc
		t.Logf("%s: %d MiB decoded from %d KiB in 4 KiB writes: %d KiB allocated", c.name, len(body)>>20, len(encoded)>>10, allocated>>10)
		if u, ok := b.scan.found.usage(OpenAI, UnitWeights); !ok || u != 77 {
			t.Fatalf("%s: usage %d %v", c.name, u, ok)
		}
		bound := uint64(256 << 10) // gzip and deflate: a 32 KiB window
		switch c.coding {
		case codingBrotli: // a 4 MiB window (LGWin 22), grown by doubling: 8 MiB allocated in all
			bound = 2*(4<<20) + 1<<20
		case codingZstd: // a 1 MiB window
			bound = 2*(1<<20) + 1<<20
		}
		if bound *= slack; allocated > bound {
			t.Errorf("%s: %d KiB allocated to decode a 64 MiB body, more than %d KiB: want a bounded decoder, not the body", c.name, allocated>>10, bound>>10)
		}
	}
}

// TestDecodeNoLeak: a decoder's coroutine ends with its response, ended
// early or not, finished or never started: none is left running.
func TestDecodeNoLeak(t *testing.T) {
	encoded := llmtest.Encode(t, "gzip", llmtest.OpenAIChatSSE, 60)
	base := runtime.NumGoroutine()
	for i := range 200 {
		b := new(Response)
		b.Start(map[string][]string{"Content-Encoding": {"gzip"}})
		b.Write(encoded[:i%len(encoded)])
		b.Finish()
		b.Finish() // twice: as the handler's deferred end after charge
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines after 200 decoded responses, %d before", runtime.NumGoroutine(), base)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// TestParseCoding: the Content-Encoding fields read.
func TestParseCoding(t *testing.T) {
	for v, want := range map[string]contentCoding{
		"": codingIdentity, "identity": codingIdentity, "gzip": codingGzip, "GZIP": codingGzip, "x-gzip": codingGzip, " br ": codingBrotli,
		"deflate": codingDeflate, "zstd": codingZstd, "gzip, identity": codingGzip, "compress": codingUnknown, "gzip, br": codingUnknown,
		"dcz": codingUnknown, "identity, zstd": codingZstd,
	} {
		if got := parseCoding(v); got != want {
			t.Errorf("Content-Encoding %q: %v, want %v", v, got, want)
		}
	}
}

// TestReadableAcceptEncoding: the codings a client accepts that are not
// read are dropped, q-values kept; a field of read codings is left as is.
func TestReadableAcceptEncoding(t *testing.T) {
	for _, tc := range []struct{ in, out string }{
		{"gzip, deflate", "gzip, deflate"},
		{"gzip, deflate, br, zstd", "gzip, deflate, br, zstd"},
		{"gzip;q=1.0, compress;q=0.5, *;q=0.1", "gzip;q=1.0"},
		{"dcz, dcb, br", "br"},
		{"compress", ""},
		{"*", ""},
		{"identity", "identity"},
	} {
		got, changed := ReadableAcceptEncoding(tc.in)
		if got != tc.out || changed != (tc.in != tc.out) {
			t.Errorf("Accept-Encoding %q: %q (changed %v), want %q", tc.in, got, changed, tc.out)
		}
	}
}

// TestBrotliWindowBits: the window a brotli stream declares, read from
// its first byte, for every window an encoder writes.
func TestBrotliWindowBits(t *testing.T) {
	for lgwin := 10; lgwin <= 24; lgwin++ {
		var buf bytes.Buffer
		bw := brotli.NewWriterOptions(&buf, brotli.WriterOptions{Quality: 5, LGWin: lgwin})
		_, _ = io.WriteString(bw, strings.Repeat("window ", 1000))
		_ = bw.Close()
		if got := brotliWindowBits(buf.Bytes()[0]); got != lgwin {
			t.Errorf("LGWin %d: read %d", lgwin, got)
		}
	}
}

// BenchmarkDecodedScan: what reading the usage of a gzip stream costs per
// byte, against the plain scan.
func BenchmarkDecodedScan(b *testing.B) {
	body := strings.Repeat(llmtest.OpenAIChatSSE, 50)
	for _, c := range testCodings {
		encoded := llmtest.Encode(b, c.name, body, 200)
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				watchBody(c.name, "text/event-stream", encoded, 512)
			}
		})
	}
}

// FuzzBodyDecoder: whatever bytes an upstream sends under a coding, the
// decoder never panics, ends with the response (Close), and finds no
// negative usage; and whatever body is compressed, in whatever chunks it
// is written, it reads what the plain body says.
func FuzzBodyDecoder(f *testing.F) {
	f.Add([]byte(llmtest.OpenAIChatSSE), uint8(1), uint8(7), true)
	f.Add([]byte(llmtest.AnthropicJSON), uint8(3), uint8(1), false)
	f.Add([]byte("\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"), uint8(1), uint8(2), false)
	f.Add([]byte("\x28\xb5\x2f\xfd\x00\x58"), uint8(4), uint8(3), true)
	f.Add([]byte{0x8b, 0x02, 0x80}, uint8(3), uint8(1), false)
	f.Fuzz(func(t *testing.T, data []byte, coding, chunk uint8, sse bool) {
		c := testCodings[1+int(coding)%4]
		n := 1 + int(chunk)%64
		ct := "application/json"
		if sse {
			ct = "text/event-stream"
		}
		// The bytes as they came, under the coding.
		b := watchBody(c.name, ct, data, n)
		if u, ok := b.scan.found.usage(OpenAI, UnitWeights); ok && u < 0 {
			t.Fatalf("usage %d", u)
		}
		// The bytes as a body, compressed.
		plain := scanAll(string(data), sse, len(data)+1)
		if b := watchBody(c.name, ct, llmtest.Encode(t, c.name, string(data), 0), n); b.Unreadable() != nil || b.scan.found != plain.found {
			t.Fatalf("%s in chunks of %d: unreadable %v, found %+v, plain %+v", c.name, n, b.Unreadable(), b.scan.found, plain.found)
		}
	})
}
