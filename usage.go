package ratelimit

// usageScanner finds `usage.total_tokens` in an OpenAI-compatible
// response as its bytes stream past: in a JSON body, or in the `data:`
// events of a server-sent-events stream (the last one found wins: the final
// event carries the usage). It keeps a few bytes of state whatever the
// body's size, and never holds the body. It reads JSON tokens, not text:
// `total_tokens` counts only as a key of the `usage` object that is a
// member of the top-level object, so text the model writes (inside JSON
// strings) cannot pass for usage.
type usageScanner struct {
	sse   bool // the body is text/event-stream
	found bool
	total int64

	// SSE framing.
	midLine   bool // past the start of the line
	dataMatch int  // bytes of "data:" matched at the line's start; -1 no match
	inData    bool // in a data line's value

	json jsonUsage
}

func (s *usageScanner) Write(b []byte) {
	if !s.sse {
		s.json.feed(b, s)
		return
	}
	const data = "data:"
	for i := 0; i < len(b); i++ {
		c := b[i]
		if c == '\n' || c == '\r' {
			s.midLine, s.dataMatch, s.inData = false, 0, false
			continue
		}
		if s.inData {
			// The rest of this line, up to its end, is one event's JSON.
			j := i
			for j < len(b) && b[j] != '\n' && b[j] != '\r' {
				j++
			}
			s.json.feed(b[i:j], s)
			i = j - 1
			continue
		}
		if !s.midLine {
			s.midLine, s.dataMatch = true, 0
		}
		if s.dataMatch < 0 {
			continue
		}
		if c == data[s.dataMatch] {
			if s.dataMatch++; s.dataMatch == len(data) {
				s.inData = true
				s.json = jsonUsage{}
			}
			continue
		}
		s.dataMatch = -1
	}
}

// jsonUsage is the tokenizer's state for one JSON document.
type jsonUsage struct {
	depth      int  // of objects and arrays
	inString   bool // inside a string
	escaped    bool // after a backslash in a string
	str        [16]byte
	strLen     int  // bytes of the string so far, capped (longer: not a key we want)
	lastString int8 // the string just ended: 0 none, 1 "usage", 2 "total_tokens", 3 other
	key        int8 // the key whose value comes next, as lastString
	inUsage    bool // inside the top-level object's "usage" object
	usageDepth int
	number     int64
	digits     int // digits of the number being read; -1 not a number we take
}

const (
	keyNone = iota
	keyUsage
	keyTotalTokens
	keyOther
)

func (j *jsonUsage) feed(b []byte, s *usageScanner) {
	for _, c := range b {
		if j.inString {
			switch {
			case j.escaped:
				j.escaped = false
				j.strLen = len(j.str) + 1 // an escape: not a key we want
			case c == '\\':
				j.escaped = true
			case c == '"':
				j.inString = false
				j.lastString = keyOther
				switch string(j.str[:min(j.strLen, len(j.str))]) {
				case "usage":
					if j.strLen == len("usage") {
						j.lastString = keyUsage
					}
				case "total_tokens":
					if j.strLen == len("total_tokens") {
						j.lastString = keyTotalTokens
					}
				}
			default:
				if j.strLen < len(j.str) {
					j.str[j.strLen] = c
				}
				j.strLen++
			}
			continue
		}
		if j.digits != 0 {
			if c >= '0' && c <= '9' {
				if j.digits > 0 {
					if j.digits < 18 {
						j.number = j.number*10 + int64(c-'0')
					}
					j.digits++
				}
				continue
			}
			// The number ended: a whole one, not too long, is the usage.
			if j.digits > 0 && j.digits <= 18 && c != '.' && c != 'e' && c != 'E' {
				s.found, s.total = true, j.number
			}
			j.digits, j.number, j.key = 0, 0, keyNone
		}
		switch c {
		case '"':
			j.inString, j.strLen = true, 0
		case ':':
			j.key, j.lastString = j.lastString, keyNone
		case ',':
			j.key, j.lastString = keyNone, keyNone
		case '{':
			if j.key == keyUsage && j.depth == 1 && !j.inUsage {
				j.inUsage, j.usageDepth = true, j.depth+1
			}
			j.depth++
			j.key = keyNone
		case '[':
			j.depth++
			j.key = keyNone
		case '}', ']':
			if j.inUsage && j.depth == j.usageDepth {
				j.inUsage = false
			}
			j.depth--
			j.key = keyNone
		default:
			if c >= '0' && c <= '9' && j.key == keyTotalTokens && j.inUsage && j.depth == j.usageDepth {
				j.number, j.digits = int64(c-'0'), 1
			} else if c == '-' && j.key == keyTotalTokens {
				j.digits = -1 // negative: not usage
			}
		}
	}
}
