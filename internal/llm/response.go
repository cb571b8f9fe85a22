package llm

import (
	"errors"
	"net/http"
	"strings"
)

// Response reads the usage of a response body as it is written:
// decompressing a copy when it is compressed. Start it with the
// response's headers, Write it the body's bytes as they go to the client,
// and Finish it when the response ends.
type Response struct {
	scan   usageScanner
	coding contentCoding
	dec    *bodyDecoder
}

// Start reads how the body comes, from the response's headers.
func (b *Response) Start(hdr http.Header) {
	b.scan.sse = isEventStream(hdr.Get("Content-Type"))
	b.coding = parseCoding(hdr.Get("Content-Encoding"))
	if b.coding != codingIdentity && b.coding != codingUnknown {
		b.dec = newBodyDecoder(b.coding, &b.scan)
	}
}

func isEventStream(contentType string) bool {
	const sse = "text/event-stream"
	return len(contentType) >= len(sse) && strings.EqualFold(contentType[:len(sse)], sse)
}

func (b *Response) Write(p []byte) {
	switch {
	case b.dec != nil:
		b.dec.Write(p)
	case b.coding == codingIdentity:
		b.scan.Write(p)
	}
}

// Finish ends the body: a decoder decodes what came, and stops. It is safe
// to call more than once.
func (b *Response) Finish() {
	if b.dec != nil {
		b.dec.Close()
	}
}

// Unreadable is why the body could not be read, or nil.
func (b *Response) Unreadable() error {
	switch {
	case b.coding == codingUnknown:
		return errors.New("its Content-Encoding is not one read (gzip, deflate, br, zstd)")
	case b.dec != nil && b.dec.err != nil:
		return b.dec.err
	}
	return nil
}

// Usage is the usage the body reported so far, in the format of provider p,
// weighed by w; false when it reported none.
func (b *Response) Usage(p Provider, w Weights) (int64, bool) { return b.scan.found.usage(p, w) }

// Model is the model the body named last (what was served), or empty.
func (b *Response) Model() string { return b.scan.found.model.String() }

// CutEstimate is what the response is charged when it ended before its
// usage (see cutEstimate), for the request req, weighed by w.
func (b *Response) CutEstimate(p Provider, w Weights, req Request) int64 {
	return cutEstimate(p, w, req, &b.scan.found)
}

// Coding names the body's Content-Encoding, as far as it is read
// (identity, gzip, deflate, br, zstd or unknown).
func (b *Response) Coding() string { return b.coding.String() }
