package ratelimit

import (
	"math"
	"math/bits"
)

// The usage an LLM response reports, read as its bytes stream past, and
// what the request asks for, read from its body: one JSON tokenizer
// (jsonScan) in fixed memory, whatever the body's size, that never holds
// the body. It reads JSON tokens, not text: a field counts only at its own
// place in the document (`usage.total_tokens` as a member of the top-level
// object's `usage` object, `max_tokens` as a member of the top-level
// object), so text a model writes or a prompt holds, inside JSON strings,
// cannot pass for one.

// usageScanner reads a response body: a JSON document, or the `data:`
// events of a server-sent-events stream, each a JSON document; a field
// found again in a later event replaces the earlier one (the final event
// carries the usage). It also counts the bytes of the text the response
// delivered, for the estimate of a response cut before its usage.
type usageScanner struct {
	sse bool // the body is text/event-stream

	// SSE framing.
	midLine   bool // past the start of the line
	dataMatch int  // bytes of "data:" matched at the line's start; -1 no match
	inData    bool // in a data line's value

	json  jsonScan
	found scanFound
}

// scanFound is what a scan found: the whole numbers at the places it reads,
// and byte counts.
type scanFound struct {
	nums [numSlots]int64
	have uint32 // bit s: nums[s] was found

	// text is the bytes of the strings that hold the text of an answer
	// (see jsonScan.textString), escapes as sent.
	text int64
	// strings is the bytes of every string value (keys excluded): the text
	// of a request's prompt, roles and names included.
	strings int64
}

// The places a scan reads a whole number from.
const (
	slotUsageTotal    = iota // usage.total_tokens
	slotUsageInput           // usage.prompt_tokens or usage.input_tokens
	slotUsageOutput          // usage.completion_tokens or usage.output_tokens
	slotRespTotal            // response.usage.total_tokens (Responses API events)
	slotRespInput            // response.usage.input_tokens
	slotRespOutput           // response.usage.output_tokens
	slotMsgInput             // message.usage.input_tokens (Anthropic's message_start)
	slotMsgOutput            // message.usage.output_tokens
	slotMaxTokens            // max_tokens (request)
	slotMaxCompletion        // max_completion_tokens (request)
	slotMaxOutput            // max_output_tokens (request)
	numSlots
)

func (f *scanFound) get(slot int) (int64, bool) { return f.nums[slot], f.have&(1<<slot) != 0 }

// first is the value of the first of the slots found.
func (f *scanFound) first(slots ...int) (int64, bool) {
	for _, s := range slots {
		if v, ok := f.get(s); ok {
			return v, true
		}
	}
	return 0, false
}

func (s *usageScanner) Write(b []byte) {
	if !s.sse {
		s.json.feed(b, &s.found, textAnywhere)
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
			s.json.feed(b[i:j], &s.found, textInDelta)
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
				s.json = jsonScan{}
			}
			continue
		}
		s.dataMatch = -1
	}
}

// Which strings hold the text of an answer.
const (
	// textAnywhere: a JSON body holds the whole answer: the strings of
	// the text fields, wherever they are (choices[].message.content,
	// output[].content[].text, content[].text).
	textAnywhere = iota
	// textInDelta: a stream's events repeat the text they delivered
	// (OpenAI's Responses API sends each part's text again when it is
	// done, and the whole response at the end): only the increments count,
	// the strings of a `delta` (choices[].delta.content,
	// delta.text, or a `delta` that is itself a string).
	textInDelta
)

// The keys a scan knows; every other key is keyOther.
const (
	keyNone uint8 = iota
	keyOther
	keyElement // an array's element, not a member
	keyUsage
	keyTotalTokens
	keyPromptTokens
	keyInputTokens
	keyCompletionTokens
	keyOutputTokens
	keyResponse
	keyMessage
	keyDelta
	keyMaxTokens
	keyMaxCompletionTokens
	keyMaxOutputTokens
	keyText // the first of the keys of text
	keyContent
	keyArguments
	keyPartialJSON
	keyThinking
	keyRefusal
	keyReasoningContent
)

var knownKeys = map[string]uint8{
	"usage": keyUsage, "total_tokens": keyTotalTokens, "prompt_tokens": keyPromptTokens, "input_tokens": keyInputTokens,
	"completion_tokens": keyCompletionTokens, "output_tokens": keyOutputTokens, "response": keyResponse, "message": keyMessage,
	"delta": keyDelta, "max_tokens": keyMaxTokens, "max_completion_tokens": keyMaxCompletionTokens, "max_output_tokens": keyMaxOutputTokens,
	"text": keyText, "content": keyContent, "arguments": keyArguments, "partial_json": keyPartialJSON, "thinking": keyThinking,
	"refusal": keyRefusal, "reasoning_content": keyReasoningContent,
}

// maxKeyDepth is how deep a scan follows keys; deeper, it only counts
// brackets (nothing it reads is that deep).
const maxKeyDepth = 32

// jsonScan is the tokenizer's state in one JSON document (or a sequence of
// them).
type jsonScan struct {
	depth   int    // of objects and arrays: inside the top-level value, 1
	objects uint32 // bit d-1: the container at depth d is an object
	keys    [maxKeyDepth + 1]uint8
	wantKey bool // in an object, a key comes next

	inString bool
	escaped  bool // after a backslash in a string
	isKey    bool // the string is a key
	isText   bool // the string's bytes count as text
	str      [24]byte
	strLen   int // bytes of the key so far (longer than str: not one we know)

	digits int // > 0: digits of the whole number being read; -1: a number not taken
	number int64

	deltaAt int // > 0: inside the object or array that is the value of a "delta" at this depth
}

func (j *jsonScan) inObject() bool {
	return j.depth >= 1 && j.depth <= maxKeyDepth && j.objects&(1<<(j.depth-1)) != 0
}

// key is the key of the member being read at the current depth.
func (j *jsonScan) key() uint8 {
	if j.depth < 1 || j.depth > maxKeyDepth {
		return keyNone
	}
	return j.keys[j.depth]
}

func (j *jsonScan) feed(b []byte, f *scanFound, text int) {
	for _, c := range b {
		if j.inString {
			switch {
			case j.escaped:
				j.escaped = false
				j.strLen = len(j.str) + 1 // an escape: not a key we know
			case c == '\\':
				j.escaped = true
			case c == '"':
				j.inString = false
				if j.isKey {
					k := keyOther
					if j.strLen <= len(j.str) {
						if known, ok := knownKeys[string(j.str[:j.strLen])]; ok {
							k = known
						}
					}
					if j.depth >= 1 && j.depth <= maxKeyDepth {
						j.keys[j.depth] = k
					}
					j.wantKey = false
				}
				continue
			}
			switch {
			case j.isKey:
				if j.strLen < len(j.str) {
					j.str[j.strLen] = c
				}
				j.strLen++
			case j.isText:
				f.text++
				f.strings++
			default:
				f.strings++
			}
			continue
		}
		if j.digits != 0 {
			switch {
			case c >= '0' && c <= '9':
				if j.digits > 0 {
					if j.digits < 19 {
						j.number = j.number*10 + int64(c-'0')
					}
					j.digits++
				}
				continue
			case c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-':
				j.digits = -1 // not a whole number
				continue
			}
			// The number ended: a whole one, not too long, is taken.
			if j.digits > 0 && j.digits <= 18 {
				j.take(f)
			}
			j.digits, j.number = 0, 0
		}
		switch c {
		case '"':
			j.inString, j.escaped, j.strLen = true, false, 0
			j.isKey = j.wantKey && j.inObject()
			j.isText = !j.isKey && j.textString(text)
		case ':':
			j.wantKey = false
		case ',':
			if j.inObject() {
				j.wantKey = true
				j.keys[j.depth] = keyNone
			}
		case '{', '[':
			if j.deltaAt == 0 && j.key() == keyDelta {
				j.deltaAt = j.depth
			}
			j.depth++
			if j.depth <= maxKeyDepth {
				bit := uint32(1) << (j.depth - 1)
				if c == '{' {
					j.objects |= bit
					j.keys[j.depth] = keyNone
				} else {
					j.objects &^= bit
					j.keys[j.depth] = keyElement
				}
			}
			j.wantKey = c == '{'
		case '}', ']':
			if j.depth > 0 {
				j.depth--
			}
			if j.deltaAt > 0 && j.depth <= j.deltaAt {
				j.deltaAt = 0
			}
			j.wantKey = false
		default:
			if c >= '0' && c <= '9' {
				j.number, j.digits = int64(c-'0'), 1
			} else if c == '-' {
				j.digits = -1 // negative: never a count
			}
		}
	}
}

// textString reports whether the string value starting now holds the text
// of an answer: one of the text keys' (content, text, arguments, ...), and,
// in a stream, inside a `delta`, or a `delta` itself.
func (j *jsonScan) textString(text int) bool {
	k := j.key()
	if k == keyDelta {
		return true
	}
	if k < keyText {
		return false
	}
	return text == textAnywhere || j.deltaAt > 0 && j.depth > j.deltaAt
}

// take records the whole number just read if it is at one of the places
// read (see the slots).
func (j *jsonScan) take(f *scanFound) {
	slot := -1
	switch j.depth {
	case 1:
		switch j.keys[1] {
		case keyMaxTokens:
			slot = slotMaxTokens
		case keyMaxCompletionTokens:
			slot = slotMaxCompletion
		case keyMaxOutputTokens:
			slot = slotMaxOutput
		}
	case 2:
		if j.keys[1] == keyUsage && j.objects&3 == 3 {
			slot = usageSlot(j.keys[2], slotUsageTotal)
		}
	case 3:
		if j.keys[2] == keyUsage && j.objects&7 == 7 {
			switch j.keys[1] {
			case keyResponse:
				slot = usageSlot(j.keys[3], slotRespTotal)
			case keyMessage:
				if s := usageSlot(j.keys[3], slotRespTotal); s == slotRespInput || s == slotRespOutput {
					slot = s - slotRespInput + slotMsgInput
				}
			}
		}
	}
	if slot >= 0 {
		f.nums[slot], f.have = j.number, f.have|1<<slot
	}
}

// usageSlot is the slot of a usage object's member, counted from the slot
// of its total_tokens; -1 for other members.
func usageSlot(k uint8, total int) int {
	switch k {
	case keyTotalTokens:
		return total
	case keyPromptTokens, keyInputTokens:
		return total + 1
	case keyCompletionTokens, keyOutputTokens:
		return total + 2
	}
	return -1
}

// Where a settle reads usage from the body.
const (
	providerOpenAI = iota
	providerAnthropic
)

// usage is the usage the response reported, weighed: for OpenAI,
// total_tokens (chat completions, the Responses API), or, weighed,
// prompt/completion (input/output) tokens; for Anthropic, input_tokens +
// output_tokens, the output as the last `message_delta` counts it (the
// `message_start` event's output_tokens is a first count, not the usage).
func (f *scanFound) usage(provider int, w weights) (int64, bool) {
	switch provider {
	case providerOpenAI:
		in, hasIn := f.first(slotUsageInput, slotRespInput)
		out, hasOut := f.first(slotUsageOutput, slotRespOutput)
		if w.unit() {
			if total, ok := f.first(slotUsageTotal, slotRespTotal); ok {
				return total, true
			}
		}
		if hasIn && hasOut {
			return w.weigh(in, out), true
		}
	case providerAnthropic:
		out, hasOut := f.get(slotUsageOutput)
		in, hasIn := f.first(slotUsageInput, slotMsgInput)
		if hasOut && hasIn {
			return w.weigh(in, out), true
		}
	}
	return 0, false
}

// bytesPerToken is the estimate's ratio: about 4 bytes of English text per
// token for the tokenizers of GPT and Claude models.
const bytesPerToken = 4

// tokensOf is the estimate for n bytes of text: one token per
// bytesPerToken bytes, rounded up.
func tokensOf(n int64) int64 { return (n + bytesPerToken - 1) / bytesPerToken }

// weights price input and output tokens apart: usage = input × in +
// output × out, rounded up. In millionths, so that decimals such as 0.25
// are exact.
type weights struct{ input, output int64 }

const weightUnit = 1_000_000

// unitWeights counts every token once: no weights.
var unitWeights = weights{weightUnit, weightUnit}

func (w weights) unit() bool { return w == unitWeights }

// weigh is in × input + out × output tokens, rounded up, saturating at
// the largest int64 (a usage that large is capped by settle max anyway).
func (w weights) weigh(in, out int64) int64 {
	s := saturatingAdd(saturatingMul(in, w.input), saturatingMul(out, w.output))
	q := s / weightUnit
	if s%weightUnit != 0 {
		q++
	}
	return q
}

// saturatingMul is a·b for non-negative a and b, at most MaxInt64.
func saturatingMul(a, b int64) int64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(lo)
}

// saturatingAdd is a+b for non-negative a and b, at most MaxInt64.
func saturatingAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
