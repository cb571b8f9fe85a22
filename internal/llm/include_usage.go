package llm

import (
	"bytes"
	"io"
	"net/http"
	"strconv"
	"sync/atomic"
)

// Asking a streamed chat completion for its usage, and taking the answer
// back out. OpenAI's chat completions stream their usage only when the
// request sets `"stream_options": {"include_usage": true}`; then every
// chunk carries `"usage": null` and one more chunk, with no choices, the
// usage, before `data: [DONE]`. The official SDKs do not ask by default,
// so a gateway that settles such streams has only an estimate. AskUsage
// makes the request ask (on its way to the provider, as its bytes pass,
// with nothing held), and UsageFilter gives its client the stream it
// would have had without asking, byte for byte: the usage chunk removed,
// and each chunk's `"usage":null`.

// UsageAsk is what AskUsage did to a request body; it is read once the
// body has gone to the provider (its response is being written).
type UsageAsk struct {
	asked atomic.Bool // the client asked for usage itself
	added atomic.Bool // the body asks for usage because of the rewrite
}

// Strip reports whether the response must be given back without its
// usage: the request asks for it because of the rewrite, not its client.
func (u *UsageAsk) Strip() bool { return u != nil && u.added.Load() && !u.asked.Load() }

// AskUsage makes the body of a streaming chat completions request ask for
// its usage, on a request whose body ReadRequest has read (nil otherwise):
// a top-level object with `"stream": true` gets `"stream_options":
// {"include_usage": true}` (its own stream_options gets include_usage set
// to true). Only the body of a chat completions request may be given to
// it: other APIs refuse stream_options or have no such option. A body
// read whole is rewritten now, its Content-Length made exact; a longer one
// as its bytes pass, its Content-Length (when declared) grown by the most
// the rewrite adds and the body ended with that many spaces less what it
// added (white space after JSON is nothing), so it still declares its
// length.
func AskUsage(r *http.Request) *UsageAsk {
	pb, ok := r.Body.(*prefixedBody)
	if !ok || pb.err != nil {
		return nil
	}
	u := new(UsageAsk)
	if pb.whole {
		var a usageAsker
		out := a.feed(pb.prefix, make([]byte, 0, len(pb.prefix)+int(maxGrowth)))
		a.report(u)
		if a.grown != 0 || !bytes.Equal(out, pb.prefix) {
			pb.prefix = out
			setLength(r, int64(len(out)))
		}
		return u
	}
	var probe usageAsker
	probe.feed(pb.prefix, nil)
	if probe.streamSet && !probe.stream {
		return u // its prefix says it does not stream
	}
	ab := &askingBody{src: pb, u: u, pad: -1}
	if r.ContentLength > 0 {
		ab.pad = maxGrowth
		setLength(r, r.ContentLength+maxGrowth)
	}
	r.Body = ab
	return u
}

// setLength declares the request body's new length.
func setLength(r *http.Request, n int64) {
	r.ContentLength = n
	if r.Header.Get("Content-Length") != "" {
		r.Header.Set("Content-Length", strconv.FormatInt(n, 10))
	}
}

// maxGrowth is the most the rewrite adds to a body: the member it adds
// to the top-level object.
const maxGrowth = int64(len(`,"stream_options":{"include_usage":true}`))

// askingBody is a request body rewritten as it is read.
type askingBody struct {
	src  io.ReadCloser
	u    *UsageAsk
	a    usageAsker
	in   [4096]byte
	out  []byte // rewritten, not yet read
	pad  int64  // the growth declared in Content-Length; -1 none
	done bool
	err  error
}

func (b *askingBody) Read(p []byte) (int, error) {
	for len(b.out) == 0 && !b.done {
		n, err := b.src.Read(b.in[:])
		b.out = b.a.feed(b.in[:n], b.out[:0])
		b.a.report(b.u)
		if err != nil {
			b.done, b.err = true, err
			if err == io.EOF && b.pad >= 0 {
				// The growth declared: what the rewrite did not add, in spaces.
				b.out = append(b.out, bytes.Repeat([]byte{' '}, int(b.pad-b.a.grown))...)
			}
		}
	}
	if len(b.out) > 0 {
		n := copy(p, b.out)
		b.out = b.out[n:]
		return n, nil
	}
	return 0, b.err
}

func (b *askingBody) Close() error { return b.src.Close() }

// The members usageAsker knows: at the top level, and in stream_options.
const (
	memberOther uint8 = iota
	memberStream
	memberMessages
	memberStreamOptions
	memberIncludeUsage
)

// usageAsker rewrites a JSON request body as its bytes pass: it follows
// the top-level object and its first stream_options object, and edits
// where asking for usage needs it (see AskUsage).
type usageAsker struct {
	depth    int
	objects  uint8 // bit d-1: the container at depth d (1 or 2) is an object
	inString bool
	escaped  bool
	isKey    bool
	key      [16]byte
	keyLen   int
	wantKey  bool
	// atValue: a member's value starts with the next token, at the depth
	// of its object; member: which member (depth 1) or, in the options,
	// which option.
	atValue bool
	member  uint8
	option  uint8
	// The first top-level stream_options: seen, being read (its object),
	// with no member yet, with include_usage.
	options, inOptions, optionsEmpty, include bool
	stream                                    bool // "stream": true
	streamSet                                 bool // "stream" has a literal value
	// swallow: a literal being replaced is skipped to its end.
	swallow bool
	done    bool // the top-level value ended
	asked   bool // the client's include_usage is true
	added   bool // an edit asks for usage
	grown   int64
}

// report tells u what the rewrite did so far.
func (a *usageAsker) report(u *UsageAsk) {
	if a.asked {
		u.asked.Store(true)
	}
	if a.added {
		u.added.Store(true)
	}
}

// feed rewrites in, appending to out.
func (a *usageAsker) feed(in, out []byte) []byte {
	for i := 0; i < len(in); i++ {
		c := in[i]
		if a.done {
			return append(out, in[i:]...)
		}
		if a.inString {
			out = append(out, c)
			switch {
			case a.escaped:
				a.escaped = false
				a.keyLen = len(a.key) + 1 // an escape: no key known
			case c == '\\':
				a.escaped = true
			case c == '"':
				a.inString = false
				if a.isKey {
					a.endKey()
				}
			default:
				if a.isKey {
					if a.keyLen < len(a.key) {
						a.key[a.keyLen] = c
					}
					a.keyLen++
				}
			}
			continue
		}
		if a.swallow {
			if c >= 'a' && c <= 'z' {
				a.grown--
				continue
			}
			a.swallow = false
		}
		switch c {
		case ' ', '\t', '\n', '\r':
			out = append(out, c)
			continue
		case ':':
			a.atValue = true
			out = append(out, c)
			continue
		}
		atValue := a.atValue
		a.atValue = false
		switch c {
		case '"':
			a.inString, a.escaped = true, false
			a.isKey = a.wantKey && a.follows()
			if a.isKey {
				a.keyLen, a.wantKey = 0, false
				if a.depth == 2 {
					a.optionsEmpty = false
				}
			}
			out = append(out, c)
		case ',':
			if a.depth <= 2 && a.objects&(1<<(a.depth-1)) != 0 {
				a.wantKey = true
			}
			out = append(out, c)
		case '{', '[':
			if atValue && a.depth == 1 && a.member == memberStreamOptions && c == '{' && !a.options {
				a.options, a.inOptions, a.optionsEmpty = true, true, true
			} else if atValue && a.depth == 1 && a.member == memberStreamOptions {
				a.options = true // not an object: left as it is
			}
			a.depth++
			if a.depth <= 2 {
				bit := uint8(1) << (a.depth - 1)
				if c == '{' {
					a.objects |= bit
				} else {
					a.objects &^= bit
				}
			}
			a.wantKey = c == '{'
			out = append(out, c)
		case '}', ']':
			switch {
			case c == '}' && a.depth == 2 && a.inOptions:
				a.inOptions = false
				if !a.include {
					add := `,"include_usage":true`
					if a.optionsEmpty {
						add = add[1:]
					}
					out = a.add(out, add)
				}
			case c == '}' && a.depth == 1 && a.objects&1 != 0:
				if !a.options && a.stream {
					out = a.add(out, `,"stream_options":{"include_usage":true}`)
				}
				a.done = true
			case a.depth == 1:
				a.done = true
			}
			if a.depth > 0 {
				a.depth--
			}
			a.wantKey = false
			out = append(out, c)
		default:
			if atValue {
				out = a.literal(c, out)
			} else {
				out = append(out, c)
			}
		}
	}
	return out
}

// follows reports whether a key at the current depth is one the rewrite
// follows: the top-level object's, or its first stream_options'.
func (a *usageAsker) follows() bool {
	return a.depth == 1 && a.objects&1 != 0 || a.depth == 2 && a.inOptions
}

// endKey records the key just read.
func (a *usageAsker) endKey() {
	k := memberOther
	if a.keyLen <= len(a.key) {
		switch string(a.key[:a.keyLen]) {
		case "stream":
			k = memberStream
		case "messages":
			k = memberMessages
		case "stream_options":
			k = memberStreamOptions
		case "include_usage":
			k = memberIncludeUsage
		}
	}
	if a.depth == 1 {
		a.member = k
		if k == memberStreamOptions && a.options {
			a.member = memberOther // a second one is left as it is
		}
	} else {
		a.option = k
	}
}

// literal handles the first byte of a value that is a literal or a
// number: `"stream": true`, the client's include_usage (made true), a
// stream_options of null (made an object asking for usage).
func (a *usageAsker) literal(c byte, out []byte) []byte {
	switch {
	case a.depth == 1 && a.member == memberStream:
		a.stream, a.streamSet = c == 't', true
	case a.depth == 1 && a.member == memberStreamOptions:
		a.options = true
		if c == 'n' && a.stream {
			a.swallow, a.grown = true, a.grown-1
			return a.add(out, `{"include_usage":true}`)
		}
	case a.depth == 2 && a.inOptions && a.option == memberIncludeUsage:
		a.include = true
		if c == 't' {
			a.asked = true
			break
		}
		a.swallow, a.grown = true, a.grown-1
		return a.add(out, "true")
	}
	return append(out, c)
}

// add appends what an edit adds.
func (a *usageAsker) add(out []byte, s string) []byte {
	a.added = true
	a.grown += int64(len(s))
	return append(out, s...)
}

// UsageFilter writes a chat completions stream on to its client without
// what asking for usage added to it (see AskUsage): the last chunk, whose
// choices are empty and which carries the usage, and the `"usage":null`
// of every other chunk. It holds the bytes of one event at a time (up to
// maxEvent; a longer one is passed on as it is) until the event's end, a
// blank line, and passes everything else on untouched.
type UsageFilter struct {
	w       io.Writer
	event   []byte
	lineLen int  // bytes of the current line so far, line ends aside
	passing bool // the event is too long to hold: passed on to its end
	out     []byte
	// Removed counts the usage chunks removed.
	Removed int
}

// maxEvent is the longest event UsageFilter holds: a usage chunk is some
// hundreds of bytes.
const maxEvent = 64 << 10

// NewUsageFilter filters a stream written to w.
func NewUsageFilter(w io.Writer) *UsageFilter { return &UsageFilter{w: w} }

func (f *UsageFilter) Write(p []byte) (int, error) {
	f.out = f.out[:0]
	start := 0 // of the bytes of p not yet held or passed
	for i, c := range p {
		if c == '\n' {
			blank := f.lineLen == 0
			f.lineLen = 0
			if !blank {
				continue
			}
			// The event ends here.
			if f.passing || len(f.event)+i+1-start > maxEvent {
				f.out = append(append(f.out, f.event...), p[start:i+1]...)
				f.event, f.passing = f.event[:0], false
			} else {
				f.event = append(f.event, p[start:i+1]...)
				f.out = f.filtered(f.event, f.out)
				f.event = f.event[:0]
			}
			start = i + 1
			continue
		}
		if c != '\r' {
			f.lineLen++
		}
	}
	switch {
	case f.passing:
		f.out = append(f.out, p[start:]...)
	case len(f.event)+len(p)-start > maxEvent:
		f.out = append(append(f.out, f.event...), p[start:]...)
		f.event, f.passing = f.event[:0], true
	default:
		f.event = append(f.event, p[start:]...)
	}
	if len(f.out) == 0 {
		return len(p), nil
	}
	if _, err := f.w.Write(f.out); err != nil {
		return 0, err
	}
	return len(p), nil
}

// Close passes on what is held: the part of an event a cut stream ended
// in.
func (f *UsageFilter) Close() error {
	if len(f.event) == 0 {
		return nil
	}
	_, err := f.w.Write(f.event)
	f.event = f.event[:0]
	return err
}

// filtered appends the event as its client would have had it: nothing for
// the usage chunk, a chunk without its `"usage":null`, any other event as
// it is.
func (f *UsageFilter) filtered(event, out []byte) []byte {
	payload, ok := oneDataLine(event)
	if !ok {
		return append(out, event...)
	}
	members, ok := topMembers(payload)
	if !ok {
		return append(out, event...)
	}
	usage, choices := -1, -1
	for i, m := range members {
		switch string(payload[m.key:m.value]) {
		case `"usage"`:
			usage = i
		case `"choices"`:
			choices = i
		}
	}
	if usage < 0 {
		return append(out, event...)
	}
	u := members[usage]
	value := payload[u.valueStart:u.end]
	switch {
	case choices >= 0 && string(bytes.TrimSpace(payload[members[choices].valueStart:members[choices].end])) == "[]" && value[0] == '{':
		f.Removed++
		return out // the usage chunk
	case string(value) != "null":
		return append(out, event...)
	}
	// The member and one comma beside it.
	from, to := u.key, u.end
	switch {
	case usage > 0:
		from = members[usage-1].end
	case len(members) > 1:
		to = members[1].key
	}
	at := cap(event) - cap(payload) // where the payload is in the event
	out = append(out, event[:at+from]...)
	return append(out, event[at+to:]...)
}

// oneDataLine is the payload of an event made of one `data:` line (and
// its end), as OpenAI's chunks are.
func oneDataLine(event []byte) ([]byte, bool) {
	line, rest, _ := bytes.Cut(event, []byte("\n"))
	if len(bytes.Trim(rest, "\r\n")) != 0 {
		return nil, false
	}
	payload, ok := bytes.CutPrefix(bytes.TrimRight(line, "\r"), []byte("data:"))
	if !ok {
		return nil, false
	}
	return bytes.TrimPrefix(payload, []byte(" ")), true
}

// member is one member of a JSON object: its key (quotes included) from
// key to value, its value from valueStart to end.
type member struct{ key, value, valueStart, end int }

// topMembers lists the members of the JSON object b; false when b is not
// one.
func topMembers(b []byte) ([]member, bool) {
	i := skipSpace(b, 0)
	if i >= len(b) || b[i] != '{' {
		return nil, false
	}
	var ms []member
	i = skipSpace(b, i+1)
	if i < len(b) && b[i] == '}' {
		return ms, skipSpace(b, i+1) == len(b)
	}
	for {
		if i >= len(b) || b[i] != '"' {
			return nil, false
		}
		var m member
		m.key = i
		if i = skipString(b, i); i < 0 {
			return nil, false
		}
		m.value = i
		if i = skipSpace(b, i); i >= len(b) || b[i] != ':' {
			return nil, false
		}
		m.valueStart = skipSpace(b, i+1)
		if m.end = skipValue(b, m.valueStart); m.end < 0 {
			return nil, false
		}
		ms = append(ms, m)
		i = skipSpace(b, m.end)
		switch {
		case i < len(b) && b[i] == ',':
			i = skipSpace(b, i+1)
		case i < len(b) && b[i] == '}':
			return ms, skipSpace(b, i+1) == len(b)
		default:
			return nil, false
		}
	}
}

func skipSpace(b []byte, i int) int {
	for i < len(b) && (b[i] == ' ' || b[i] == '\t' || b[i] == '\n' || b[i] == '\r') {
		i++
	}
	return i
}

// skipString is the index after the string starting at b[i]; -1 when it
// does not end.
func skipString(b []byte, i int) int {
	for i++; i < len(b); i++ {
		switch b[i] {
		case '\\':
			i++
		case '"':
			return i + 1
		}
	}
	return -1
}

// skipValue is the index after the value starting at b[i]; -1 when there
// is none.
func skipValue(b []byte, i int) int {
	if i >= len(b) {
		return -1
	}
	switch b[i] {
	case '"':
		return skipString(b, i)
	case '{', '[':
		depth := 0
		for ; i < len(b); i++ {
			switch b[i] {
			case '"':
				if i = skipString(b, i); i < 0 {
					return -1
				}
				i--
			case '{', '[':
				depth++
			case '}', ']':
				if depth--; depth == 0 {
					return i + 1
				}
			}
		}
		return -1
	}
	j := i
	for j < len(b) && b[j] != ',' && b[j] != '}' && b[j] != ']' && b[j] != ' ' && b[j] != '\t' && b[j] != '\n' && b[j] != '\r' {
		j++
	}
	if j == i {
		return -1
	}
	return j
}
