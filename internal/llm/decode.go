package llm

import (
	"errors"
	"fmt"
	"io"
	"iter"
	"strings"
	"sync"

	"github.com/andybalholm/brotli"
	"github.com/klauspost/compress/flate"
	"github.com/klauspost/compress/gzip"
	"github.com/klauspost/compress/zlib"
	"github.com/klauspost/compress/zstd"
)

// Reading the usage of a compressed response: the bytes written to the
// client are forwarded unchanged, and a copy is decompressed as it passes,
// for the scanner. The decoders (gzip, deflate, brotli, zstd) pull their
// input from a reader, while a response body is pushed, one Write at a
// time: a decoder runs as a coroutine (iter.Pull) that each Write resumes
// with its bytes and that suspends when it has used them all. So a Write
// returns once its bytes are decoded, nothing is buffered or copied but
// the decoder's own window, and nothing runs between Writes. The coroutine
// ends when the response does (Close, deferred by the handler, also when
// the handler chain panics, as reverse_proxy does on a cut stream): none
// can be left behind.

// contentCoding is a response's Content-Encoding, as far as it is read.
type contentCoding int

const (
	codingIdentity contentCoding = iota
	codingGzip
	codingDeflate
	codingBrotli
	codingZstd
	codingUnknown
)

var codingNames = [...]string{"identity", "gzip", "deflate", "br", "zstd", "unknown"}

func (c contentCoding) String() string { return codingNames[c] }

// parseCoding reads a Content-Encoding field. Several codings, one applied
// over the other, are unknown: no server of an LLM API sends them.
func parseCoding(v string) contentCoding {
	coding := codingIdentity
	for part := range strings.SplitSeq(v, ",") {
		var c contentCoding
		switch strings.ToLower(strings.TrimSpace(part)) {
		case "", "identity":
			continue
		case "gzip", "x-gzip":
			c = codingGzip
		case "deflate":
			c = codingDeflate
		case "br":
			c = codingBrotli
		case "zstd":
			c = codingZstd
		default:
			return codingUnknown
		}
		if coding != codingIdentity {
			return codingUnknown
		}
		coding = c
	}
	return coding
}

// readableCoding reports whether a coding of an Accept-Encoding field is
// one the decoders read.
func readableCoding(coding string) bool {
	switch strings.ToLower(strings.TrimSpace(coding)) {
	case "gzip", "x-gzip", "deflate", "br", "zstd", "identity":
		return true
	}
	return false
}

// ReadableAcceptEncoding is an Accept-Encoding field without the codings
// the decoders cannot read (and without `*`, which would let the upstream
// pick one), so that an upstream honouring it answers in a coding whose
// usage can be read. ok is false when the field needs no change.
func ReadableAcceptEncoding(v string) (filtered string, ok bool) {
	var keep []string
	changed := false
	for part := range strings.SplitSeq(v, ",") {
		coding, _, _ := strings.Cut(part, ";")
		if strings.TrimSpace(coding) == "" {
			continue
		}
		if !readableCoding(coding) {
			changed = true
			continue
		}
		keep = append(keep, strings.TrimSpace(part))
	}
	if !changed {
		return v, false
	}
	return strings.Join(keep, ", "), true
}

// maxDecodeWindow bounds the history one decoder keeps: the window of
// brotli and zstd (gzip and deflate have 32 KiB). 8 MiB is the most
// RFC 9659 lets a zstd encoder use for HTTP, and brotli's default window
// is 4 MiB. A body that declares a larger window is not read.
const maxDecodeWindow = 8 << 20

// maxDecodeRatio bounds the work one body costs: past its first MiB, a
// body that decodes to more than this many times its size (a compression
// bomb; model output compresses some tens of times) is not read further.
const maxDecodeRatio = 4096

var (
	errWindowTooLarge = fmt.Errorf("its window is larger than the %d MiB read", maxDecodeWindow>>20)
	errDecodeRatio    = fmt.Errorf("it decodes to more than %d times its size", maxDecodeRatio)
	errDecodeStopped  = errors.New("decoding stopped")
)

// byteSink takes decoded bytes.
type byteSink interface{ Write(b []byte) }

// bodyDecoder decompresses a copy of a response body as it is written.
type bodyDecoder struct {
	coding contentCoding
	sink   byteSink

	in       []byte // the bytes of the Write being decoded
	consumed int64  // the body's bytes given to the decoder
	decoded  int64  // the bytes it decoded
	eof      bool   // the body ended: the decoder reads what it has
	done     bool   // the decoder finished, or failed
	stopping bool
	next     func() (struct{}, bool)
	stop     func()
	yield    func(struct{}) bool

	// err is why the body could not be read: corrupt data, a window too
	// large. A body cut short (the client gone, the upstream cut) is not
	// an error: what came was decoded.
	err error
	out [4 << 10]byte
}

func newBodyDecoder(coding contentCoding, sink byteSink) *bodyDecoder {
	return &bodyDecoder{coding: coding, sink: sink}
}

// Write decodes b: it returns once the decoder has used all of b (or
// failed). The decoder starts with the first bytes.
func (d *bodyDecoder) Write(b []byte) {
	if d.done || len(b) == 0 {
		return
	}
	d.in = b
	if d.next == nil {
		d.next, d.stop = iter.Pull(d.run)
	}
	if _, ok := d.next(); !ok {
		d.done = true
	}
	d.in = nil
}

// Close ends the body: the decoder decodes what it holds still, then
// stops. It is safe to call more than once, and before any Write.
func (d *bodyDecoder) Close() {
	if d.next == nil {
		return
	}
	if !d.done {
		d.eof = true
		d.next()
		d.done = true
	}
	d.stopping = true
	d.stop()
}

// Read and ReadByte are the decoder's input: the bytes of the current
// Write, then, suspended, those of the next.
func (d *bodyDecoder) Read(p []byte) (int, error) {
	if err := d.wait(); err != nil {
		return 0, err
	}
	n := copy(p, d.in)
	d.in = d.in[n:]
	d.consumed += int64(n)
	return n, nil
}

func (d *bodyDecoder) ReadByte() (byte, error) {
	if err := d.wait(); err != nil {
		return 0, err
	}
	c := d.in[0]
	d.in = d.in[1:]
	d.consumed++
	return c, nil
}

// wait suspends the decoder until there are bytes to read, or the end.
func (d *bodyDecoder) wait() error {
	for len(d.in) == 0 {
		if d.eof {
			return io.EOF
		}
		if !d.yield(struct{}{}) {
			return errDecodeStopped
		}
	}
	return nil
}

// run is the coroutine: it decodes until the body ends or cannot be read.
func (d *bodyDecoder) run(yield func(struct{}) bool) {
	d.yield = yield
	panicked := true
	defer func() {
		if panicked { // a decoder's bug must not take the request down
			d.err = fmt.Errorf("the decoder failed: %v", recover())
		}
	}()
	err := d.decode()
	panicked = false
	switch {
	case err == io.EOF, d.stopping:
	case d.eof && errors.Is(err, io.ErrUnexpectedEOF):
		// The body was cut: what came was decoded.
	default:
		d.err = err
	}
}

// decode feeds the sink what the decoder reads, to the end of the body or
// an error. A decoder that panics is dropped, not closed (or pooled).
func (d *bodyDecoder) decode() error {
	r, closeReader, err := d.open()
	if err != nil {
		return err
	}
	for {
		n, err := r.Read(d.out[:])
		if n > 0 {
			d.sink.Write(d.out[:n])
		}
		if d.decoded += int64(n); d.decoded > 1<<20 && d.decoded/maxDecodeRatio > d.consumed {
			err = errDecodeRatio
		}
		if err != nil {
			closeReader() // not deferred: a decoder that panicked is not put back
			return err
		}
	}
}

// open makes the decoder of the coding, reading the stream's header where
// the coding needs it to be chosen or bounded.
func (d *bodyDecoder) open() (io.Reader, func(), error) {
	none := func() {}
	switch d.coding {
	case codingGzip:
		zr, err := gzip.NewReader(d)
		if err != nil {
			return nil, none, err
		}
		return zr, func() { _ = zr.Close() }, nil
	case codingDeflate:
		// HTTP's deflate is the zlib format; some servers send raw deflate.
		h, err := d.peek(2)
		if err != nil {
			return nil, none, err
		}
		if h[0]&0x0f == 8 && h[0]>>4 <= 7 && (uint16(h[0])<<8|uint16(h[1]))%31 == 0 {
			zr, err := zlib.NewReader(d)
			if err != nil {
				return nil, none, err
			}
			return zr, func() { _ = zr.Close() }, nil
		}
		fr := flate.NewReader(d)
		return fr, func() { _ = fr.Close() }, nil
	case codingBrotli:
		h, err := d.peek(1)
		if err != nil {
			return nil, none, err
		}
		if brotliWindowBits(h[0]) < 0 || 1<<brotliWindowBits(h[0]) > maxDecodeWindow {
			return nil, none, errWindowTooLarge
		}
		return brotli.NewReader(d), none, nil
	case codingZstd:
		zr, err := zstdDecoder(d)
		if err != nil {
			return nil, none, err
		}
		return zr, func() {
			_ = zr.Reset(nil) // lets go of the body
			zstdDecoders.Put(zr)
		}, nil
	}
	return nil, none, fmt.Errorf("the content coding is not read")
}

// zstdDecoders keeps zstd decoders between responses: one allocates its
// buffers (2 MiB for a 1 MiB window), which Reset keeps.
var zstdDecoders sync.Pool

// zstdDecoder is a decoder, from the pool or new, reading r: in the
// calling goroutine (concurrency 1), its window at most maxDecodeWindow.
func zstdDecoder(r io.Reader) (*zstd.Decoder, error) {
	if zr, ok := zstdDecoders.Get().(*zstd.Decoder); ok {
		if err := zr.Reset(r); err == nil {
			return zr, nil
		}
		zr.Close()
	}
	return zstd.NewReader(r, zstd.WithDecoderConcurrency(1), zstd.WithDecoderLowmem(true),
		zstd.WithDecoderMaxWindow(maxDecodeWindow), zstd.WithDecoderMaxMemory(maxDecodeWindow))
}

// peek reads the stream's first n bytes and puts them back before the
// rest.
func (d *bodyDecoder) peek(n int) ([]byte, error) {
	h := make([]byte, n, n+len(d.in))
	if _, err := io.ReadFull(d, h); err != nil {
		if err == io.EOF {
			err = io.ErrUnexpectedEOF
		}
		return nil, err
	}
	d.in = append(h, d.in...)
	return h, nil
}

// brotliWindowBits reads the window size a brotli stream declares in its
// first bits (RFC 7932, 9.1): WBITS, or -1 for the large-window extension,
// which HTTP does not use.
func brotliWindowBits(b byte) int {
	if b&1 == 0 {
		return 16
	}
	if n := int(b>>1) & 7; n != 0 {
		return 17 + n
	}
	switch m := int(b>>4) & 7; m {
	case 0:
		return 17
	case 1:
		return -1
	default:
		return 8 + m
	}
}
