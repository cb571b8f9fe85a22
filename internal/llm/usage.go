// Package llm reads what an LLM API request and its response say of the
// tokens they use, without holding either body: the usage a response
// reports (usage.go), read through its compression (decode.go) as its
// bytes stream past (Response); what a request asks for, read from its
// body (Request); and what a response cut before its usage is charged
// (cut_estimate.go). It knows the formats of OpenAI's chat completions and
// Responses API and of Anthropic's Messages API, JSON and server-sent
// events.
package llm

import (
	"encoding/json"
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
	// hides: a request body carries input its bytes do not show (see
	// jsonScan.hidden): a stored conversation or prompt, an image, a file,
	// a provider-side tool; or a key or type written with an escape, which
	// the provider reads decoded and the scan does not.
	hides bool
	// The output multipliers of a request (request.go, outputs): the
	// prompts of a top-level `prompt` array (strings, or arrays of token
	// ids), whether that array is itself one prompt of token ids, and the
	// token ids read (one token each, which no byte shows).
	prompts  int64
	idPrompt bool
	tokenIDs int64
	// background: the request sets `"background": true` (the Responses
	// API answers at once and bills as the work runs, after).
	background bool

	// model is the last model named (see jsonScan.modelPlace), as sent
	// (escapes and all) up to maxModel bytes; models counts the names.
	model  modelName
	models int
}

// maxModel is the longest model name read: a longer one is no model's.
const maxModel = 256

// modelName is a model's name as a JSON string holds it.
type modelName struct {
	raw     [maxModel]byte
	n       int  // bytes of the string (more than maxModel: too long)
	escaped bool // it holds an escape
}

// String is the model's name, decoded; empty when none was read, or it is
// too long or not a valid JSON string.
func (m *modelName) String() string {
	if m.n == 0 || m.n > maxModel {
		return ""
	}
	if !m.escaped {
		return string(m.raw[:m.n])
	}
	var s string
	if json.Unmarshal(append(append([]byte{'"'}, m.raw[:m.n]...), '"'), &s) != nil || len(s) > maxModel {
		return ""
	}
	return s
}

// The places a scan reads a whole number from: three usage objects
// (`usage`, the Responses API events' `response.usage`, Anthropic's
// `message.usage` of message_start), each read for the same fields
// (usageFields apart), then the request's ceilings.
const (
	slotUsage = 0               // usage.*
	slotResp  = usageFields     // response.usage.*
	slotMsg   = 2 * usageFields // message.usage.*

	slotMaxTokens     = 3 * usageFields   // max_tokens (request)
	slotMaxCompletion = slotMaxTokens + 1 // max_completion_tokens (request)
	slotMaxOutput     = slotMaxTokens + 2 // max_output_tokens (request)
	slotN             = slotMaxTokens + 3 // n (request): choices per prompt
	slotBestOf        = slotMaxTokens + 4 // best_of (request): completions generated per prompt
	numSlots          = slotMaxTokens + 5
)

// The fields of a usage object, from its slot.
const (
	fieldTotal      = iota // total_tokens
	fieldInput             // prompt_tokens or input_tokens
	fieldOutput            // completion_tokens or output_tokens
	fieldCacheWrite        // cache_creation_input_tokens (Anthropic)
	fieldCacheRead         // cache_read_input_tokens (Anthropic)
	fieldCached            // prompt_tokens_details.cached_tokens or input_tokens_details.cached_tokens (OpenAI)
	usageFields
)

const (
	slotUsageTotal  = slotUsage + fieldTotal
	slotUsageInput  = slotUsage + fieldInput
	slotUsageOutput = slotUsage + fieldOutput
	slotRespTotal   = slotResp + fieldTotal
	slotRespInput   = slotResp + fieldInput
	slotRespOutput  = slotResp + fieldOutput
	slotMsgInput    = slotMsg + fieldInput
	slotMsgOutput   = slotMsg + fieldOutput
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
	keyCacheCreation // cache_creation_input_tokens
	keyCacheRead     // cache_read_input_tokens
	keyCached        // cached_tokens
	keyTokenDetails  // prompt_tokens_details, input_tokens_details
	keyType
	keyPreviousResponseID
	keyConversation
	keyPrompt
	keyTools
	keyMCPServers
	keyContainer
	keyWebSearchOptions
	keyImageURL
	keyFileID
	keyModel
	keyText // the first of the keys of text
	keyContent
	keyArguments
	keyPartialJSON
	keyThinking
	keyRefusal
	keyReasoningContent
	keyN
	keyBestOf
	keyBackground
)

var knownKeys = map[string]uint8{
	"usage": keyUsage, "total_tokens": keyTotalTokens, "prompt_tokens": keyPromptTokens, "input_tokens": keyInputTokens,
	"completion_tokens": keyCompletionTokens, "output_tokens": keyOutputTokens, "response": keyResponse, "message": keyMessage,
	"delta": keyDelta, "max_tokens": keyMaxTokens, "max_completion_tokens": keyMaxCompletionTokens, "max_output_tokens": keyMaxOutputTokens,
	"text": keyText, "content": keyContent, "arguments": keyArguments, "partial_json": keyPartialJSON, "thinking": keyThinking,
	"refusal": keyRefusal, "reasoning_content": keyReasoningContent,
	"cache_creation_input_tokens": keyCacheCreation, "cache_read_input_tokens": keyCacheRead, "cached_tokens": keyCached,
	"prompt_tokens_details": keyTokenDetails, "input_tokens_details": keyTokenDetails,
	"type": keyType, "previous_response_id": keyPreviousResponseID, "conversation": keyConversation, "prompt": keyPrompt,
	"tools": keyTools, "mcp_servers": keyMCPServers, "container": keyContainer, "web_search_options": keyWebSearchOptions,
	"image_url": keyImageURL, "file_id": keyFileID, "model": keyModel,
	"n": keyN, "best_of": keyBestOf, "background": keyBackground,
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
	capture  bool // the string is the value of a `type`, kept in str
	naming   bool // the string is a model's name (modelPlace), kept in the scanFound
	str      [32]byte
	strLen   int // bytes of the key (or captured value) so far (longer than str: not one we know)

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
				if j.isKey || j.capture {
					f.hides = true // no SDK escapes a key or a type; the provider reads it decoded
				}
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
					if k == keyImageURL || k == keyFileID {
						f.hides = true
					}
					j.wantKey = false
				} else if j.capture {
					j.capture = false
					f.hides = f.hides || j.hiddenType()
				}
				j.naming = false
				continue
			}
			if j.capture {
				if j.strLen < len(j.str) {
					j.str[j.strLen] = c
				}
				j.strLen++
			}
			if j.naming {
				m := &f.model
				if m.n < maxModel {
					m.raw[m.n] = c
				}
				m.n++
				m.escaped = m.escaped || c == '\\'
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
			} else if j.multiplier() {
				// `n: 128.0` (or 1e2, or a number too long to read) may still
				// be read by the provider as answers asked for: what the body
				// asks cannot be known, as for input it hides.
				f.hides = true
			}
			j.digits, j.number = 0, 0
		}
		switch c {
		case '"':
			j.inString, j.escaped, j.strLen = true, false, 0
			j.isKey = j.wantKey && j.inObject()
			if !j.isKey && j.inPromptArray() {
				f.prompts++ // a prompt of text
			}
			j.isText = !j.isKey && j.textString(text)
			if !j.isKey {
				j.capture = j.key() == keyType
				f.hides = f.hides || j.hiddenValue(c) || j.multiplier() // `n: "128"` is no number read
				if j.naming = j.modelPlace(); j.naming {
					f.model = modelName{}
					f.models++
				}
			}
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
			if c == '[' && j.inPromptArray() {
				f.prompts++ // a prompt of token ids
			}
			f.hides = f.hides || j.hiddenValue(c)
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
			switch {
			case c >= '0' && c <= '9':
				j.number, j.digits = int64(c-'0'), 1
			case c == '-':
				j.digits = -1 // negative: never a count
			case c == 't' && j.depth == 1 && j.key() == keyBackground:
				f.background = true // the literal true
			}
		}
	}
}

// modelPlace reports whether the string value starting now names the
// model: the top-level object's `model` (a request; a chat completion, its
// chunks, a Responses API or Anthropic Messages response), or the `model`
// of the top-level `response` (Responses API events) or `message`
// (Anthropic's message_start event).
func (j *jsonScan) modelPlace() bool {
	switch {
	case j.depth == 1:
		return j.objects&1 == 1 && j.keys[1] == keyModel
	case j.depth == 2:
		return j.objects&3 == 3 && j.keys[2] == keyModel && (j.keys[1] == keyResponse || j.keys[1] == keyMessage)
	}
	return false
}

// hiddenTypes are the `type`s of the parts of a request that the provider
// bills as input the body does not show: an image or a file behind a URL
// or an id, audio, an item or reasoning stored by the provider, a stored
// conversation's compaction, a server tool's encrypted results sent back.
var hiddenTypes = map[string]bool{
	"image_url": true, "input_image": true, "image": true, "document": true, "input_file": true, "file": true,
	"input_audio": true, "container_upload": true, "item_reference": true, "reasoning": true, "redacted_thinking": true,
	"compaction": true, "web_search_tool_result": true, "web_fetch_tool_result": true,
}

// multiplier reports whether the value being read is the request's `n` or
// `best_of`.
func (j *jsonScan) multiplier() bool {
	return j.depth == 1 && (j.keys[1] == keyN || j.keys[1] == keyBestOf)
}

// inPromptArray reports whether a value starting now is an element of the
// top-level `prompt` array (legacy completions: one completion per
// element).
func (j *jsonScan) inPromptArray() bool {
	return j.depth == 2 && j.keys[1] == keyPrompt && j.objects&3 == 1
}

// hiddenValue reports whether the value starting now (with c: a string's
// quote, or a bracket) is input the body does not show: a stored response
// to continue (previous_response_id), conversation, prompt or container
// referenced by its id, the provider's web search, MCP servers it calls.
func (j *jsonScan) hiddenValue(c byte) bool {
	switch j.depth {
	case 1:
		switch j.key() {
		case keyPreviousResponseID:
			return c == '"'
		case keyConversation, keyContainer:
			return c == '"' || c == '{'
		case keyPrompt, keyWebSearchOptions:
			return c == '{'
		}
	case 2:
		return c == '{' && j.keys[1] == keyMCPServers && j.objects&1 == 1
	}
	return false
}

// hiddenType reports whether the `type` value just read, kept in str,
// names input the body does not show: a hidden part (hiddenTypes), or,
// in the top-level `tools`, a tool the provider runs (web search, file
// search, code execution...), whose results are input: every type but a
// function the client runs (function, custom).
func (j *jsonScan) hiddenType() bool {
	if j.strLen > len(j.str) {
		return false // too long for any of them (an escape is flagged already)
	}
	v := j.str[:j.strLen]
	if j.depth == 3 && j.keys[1] == keyTools && j.keys[2] == keyElement && j.objects&7 == 5 {
		return string(v) != "function" && string(v) != "custom"
	}
	return hiddenTypes[string(v)]
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
		case keyN:
			slot = slotN
		case keyBestOf:
			slot = slotBestOf
		}
	case 2, 3, 4:
		if j.keys[1] == keyPrompt && j.objects&1 == 1 && j.objects&(1<<(j.depth-1)) == 0 && j.depth <= 3 {
			// A token id of a prompt array (`prompt: [1, 2]`, or
			// `prompt: [[1, 2], [3]]`): a token each.
			f.tokenIDs++
			f.idPrompt = f.idPrompt || j.depth == 2
			return
		}
		// A usage object's member (usage.input_tokens), or its cached
		// tokens one level down (usage.prompt_tokens_details.cached_tokens),
		// at the top level, or in `response` or `message`.
		d := j.depth
		if j.objects&(1<<d-1) != 1<<d-1 {
			break
		}
		field := usageSlot(j.keys[d])
		if field < 0 && j.keys[d] == keyCached && j.keys[d-1] == keyTokenDetails {
			field, d = fieldCached, d-1
		}
		if field < 0 || j.keys[d-1] != keyUsage {
			break
		}
		switch {
		case d == 2:
			slot = slotUsage + field
		case d == 3 && j.keys[1] == keyResponse:
			slot = slotResp + field
		case d == 3 && j.keys[1] == keyMessage:
			slot = slotMsg + field
		}
	}
	if slot >= 0 {
		f.nums[slot], f.have = j.number, f.have|1<<slot
	}
}

// usageSlot is the field of a usage object's member (see fieldTotal), or
// -1 for other members.
func usageSlot(k uint8) int {
	switch k {
	case keyTotalTokens:
		return fieldTotal
	case keyPromptTokens, keyInputTokens:
		return fieldInput
	case keyCompletionTokens, keyOutputTokens:
		return fieldOutput
	case keyCacheCreation:
		return fieldCacheWrite
	case keyCacheRead:
		return fieldCacheRead
	}
	return -1
}

// Provider is whose format a body has: where its usage is read from.
type Provider int

const (
	OpenAI Provider = iota
	Anthropic
)

// usage is the usage the response reported, weighed: for OpenAI,
// total_tokens (chat completions, the Responses API), or, weighed,
// prompt/completion (input/output) tokens, the prompt's cached tokens at
// their own weight; for Anthropic, input_tokens + output_tokens and the
// cache's writes and reads (cache_creation_input_tokens,
// cache_read_input_tokens), each weighed, the output as the last
// `message_delta` counts it (the `message_start` event's output_tokens is
// a first count, not the usage).
func (f *scanFound) usage(provider Provider, w Weights) (int64, bool) {
	switch provider {
	case OpenAI:
		in, hasIn := f.first(slotUsageInput, slotRespInput)
		out, hasOut := f.first(slotUsageOutput, slotRespOutput)
		if w.unit() {
			if total, ok := f.first(slotUsageTotal, slotRespTotal); ok {
				return total, true
			}
		}
		if hasIn && hasOut {
			// Cached tokens are part of the prompt's.
			cached, _ := f.first(slotUsage+fieldCached, slotResp+fieldCached)
			cached = min(cached, in)
			return w.weighParts(in-cached, out, 0, cached), true
		}
	case Anthropic:
		out, hasOut := f.get(slotUsageOutput)
		in, hasIn := f.first(slotUsageInput, slotMsgInput)
		if hasOut && hasIn {
			written, _ := f.first(slotUsage+fieldCacheWrite, slotMsg+fieldCacheWrite)
			read, _ := f.first(slotUsage+fieldCacheRead, slotMsg+fieldCacheRead)
			return w.weighParts(in, out, written, read), true
		}
	}
	return 0, false
}

// bytesPerToken is the estimate's ratio: about 4 bytes of English text per
// token for the tokenizers of GPT and Claude models.
const bytesPerToken = 4

// TokensOf is the estimate for n bytes of text: one token per
// bytesPerToken bytes, rounded up.
func TokensOf(n int64) int64 { return (n + bytesPerToken - 1) / bytesPerToken }

// Weights price input and output tokens apart, and the prompt tokens
// written to and read from the provider's cache: usage = input × Input +
// output × Output + cache writes × CacheWrite + cache reads × CacheRead,
// rounded up. In millionths (WeightUnit), so that decimals such as 0.25
// are exact.
type Weights struct{ Input, Output, CacheWrite, CacheRead int64 }

// WeightUnit is a weight of 1.
const WeightUnit = 1_000_000

// UnitWeights counts every token once.
var UnitWeights = Weights{WeightUnit, WeightUnit, WeightUnit, WeightUnit}

// Defaults is w with the defaults of the cache's weights, for provider p,
// where w has -1: a cache write counts as input (Anthropic's input-token
// rate limits count them); a cache read counts as input for OpenAI (its
// rate limits count cached tokens as any prompt's), nothing for Anthropic
// (its input-token rate limits do not count them).
func (w Weights) Defaults(p Provider) Weights {
	if w.CacheWrite < 0 {
		w.CacheWrite = w.Input
	}
	switch {
	case p == Anthropic && w.CacheRead < 0:
		w.CacheRead = 0
	case w.CacheRead < 0:
		w.CacheRead = w.Input
	}
	return w
}

// unit reports whether every token of an OpenAI usage counts once, as
// its total_tokens counts them.
func (w Weights) unit() bool {
	return w.Input == WeightUnit && w.Output == WeightUnit && w.CacheRead == WeightUnit
}

// weigh is in × input + out × output tokens, rounded up, saturating at
// the largest int64 (a usage that large is capped by settle max anyway).
func (w Weights) weigh(in, out int64) int64 { return w.weighParts(in, out, 0, 0) }

// weighParts weighs a usage's parts: input, output, cache writes and cache
// reads.
func (w Weights) weighParts(in, out, written, read int64) int64 {
	s := saturatingAdd(saturatingAdd(saturatingMul(in, w.Input), saturatingMul(out, w.Output)),
		saturatingAdd(saturatingMul(written, w.CacheWrite), saturatingMul(read, w.CacheRead)))
	q := s / WeightUnit
	if s%WeightUnit != 0 {
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
