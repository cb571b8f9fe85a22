package llm

import (
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// scanAll scans body in chunks of chunk bytes.
func scanAll(body string, sse bool, chunk int) *usageScanner {
	s := &usageScanner{sse: sse}
	for i := 0; i < len(body); i += chunk {
		s.Write([]byte(body[i:min(i+chunk, len(body))]))
	}
	return s
}

// TestUsageScanner: the usage of OpenAI (chat completions, Responses API)
// and Anthropic (Messages) responses, JSON and server-sent events,
// whatever the chunking, weighed or not; and the bytes of the answer's
// text, for the estimate of a cut stream. Text that only looks like usage
// (inside strings, nested deeper, not a whole number) is not usage.
func TestUsageScanner(t *testing.T) {
	w14 := Weights{Input: 1 * WeightUnit, Output: 4 * WeightUnit}
	wFrac := Weights{Input: WeightUnit / 4, Output: 3 * WeightUnit / 2} // 0.25 and 1.5
	for _, tc := range []struct {
		name     string
		sse      bool
		body     string
		provider Provider
		w        Weights
		usage    int64 // -1: none found
		text     int64 // bytes of text; -1 not checked
	}{
		{"openai chat completion", false, llmtest.OpenAIChatJSON, OpenAI, UnitWeights, 29, int64(len("Hello! How can I assist you today?"))},
		{"openai chat completion, weighed", false, llmtest.OpenAIChatJSON, OpenAI, w14, 19 + 4*10, -1},
		{"openai chat stream", true, llmtest.OpenAIChatSSE, OpenAI, UnitWeights, 12, int64(len("Hello there"))},
		{"openai chat stream, weighed", true, llmtest.OpenAIChatSSE, OpenAI, w14, 9 + 4*3, -1},
		{"openai chat stream cut before the usage", true, llmtest.OpenAIChatSSE[:strings.Index(llmtest.OpenAIChatSSE, `"choices":[]`)], OpenAI, UnitWeights, -1, int64(len("Hello there"))},
		{"openai tool call stream: the arguments are text", true, llmtest.OpenAIToolCallSSE, OpenAI, UnitWeights, -1, int64(len(`{\"city\":` + `\"Paris\"}`))},
		{"openai responses", false, llmtest.OpenAIResponsesJSON, OpenAI, UnitWeights, 123, int64(len("In a peaceful grove beneath a silver moon..."))},
		{"openai responses, weighed", false, llmtest.OpenAIResponsesJSON, OpenAI, w14, 36 + 4*87, -1},
		// The deltas count once: not the done events' and the completed
		// response's copies of the text.
		{"openai responses stream", true, llmtest.OpenAIResponsesSSE, OpenAI, UnitWeights, 48, int64(len("Hi there"))},
		{"openai responses stream, weighed", true, llmtest.OpenAIResponsesSSE, OpenAI, w14, 37 + 4*11, -1},
		{"openai responses stream cut before completed", true, llmtest.OpenAIResponsesSSE[:strings.Index(llmtest.OpenAIResponsesSSE, "event: response.completed")], OpenAI, UnitWeights, -1, int64(len("Hi there"))},
		{"anthropic messages", false, llmtest.AnthropicJSON, Anthropic, UnitWeights, 18, int64(len("Hello!"))},
		{"anthropic messages, weighed", false, llmtest.AnthropicJSON, Anthropic, wFrac, 3 + 9, -1}, // 12×0.25 + 6×1.5
		{"anthropic stream", true, llmtest.AnthropicSSE, Anthropic, UnitWeights, 25 + 15, int64(len("Hello!"))},
		{"anthropic stream, weighed, rounded up", true, llmtest.AnthropicSSE, Anthropic, wFrac, 29, -1}, // 6.25 + 22.5
		// message_start's output_tokens is a first count: a stream cut
		// before message_delta has no usage.
		{"anthropic stream cut before message_delta", true, llmtest.AnthropicSSEStart, Anthropic, UnitWeights, -1, int64(len("Hello!"))},
		{"anthropic read as openai: no total", false, llmtest.AnthropicJSON, OpenAI, UnitWeights, 18, -1},
		{"openai read as anthropic", false, `{"usage":{"total_tokens":29}}`, Anthropic, UnitWeights, -1, -1},
		{"anthropic with input_tokens in message_delta", true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n" +
			"data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":7,\"output_tokens\":3}}\n\n", Anthropic, UnitWeights, 10, -1},

		{"spaces and newlines", false, "{\n  \"usage\" : {\n    \"total_tokens\" : 1234 \n  }\n}", OpenAI, UnitWeights, 1234, -1},
		{"usage before choices", false, `{"usage":{"total_tokens":7},"choices":[{"message":{"content":"x"}}]}`, OpenAI, UnitWeights, 7, 1},
		{"the model writes usage in its answer", false, `{"choices":[{"message":{"content":"{\"usage\":{\"total_tokens\":999999}}"}}],"usage":{"total_tokens":5}}`, OpenAI, UnitWeights, 5, -1},
		{"only in the answer", false, `{"choices":[{"message":{"content":"\"usage\": {\"total_tokens\": 999999}"}}]}`, OpenAI, UnitWeights, -1, -1},
		{"nested deeper", false, `{"data":{"usage":{"total_tokens":50}}}`, OpenAI, UnitWeights, -1, 0},
		{"usage in an array", false, `[{"usage":{"total_tokens":50}}]`, OpenAI, UnitWeights, -1, -1},
		{"usage details are not usage", false, `{"usage":{"prompt_tokens_details":{"total_tokens":9}}}`, OpenAI, UnitWeights, -1, -1},
		{"fractional", false, `{"usage":{"total_tokens":5.5}}`, OpenAI, UnitWeights, -1, -1},
		{"exponent", false, `{"usage":{"total_tokens":5e3}}`, OpenAI, UnitWeights, -1, -1},
		{"negative", false, `{"usage":{"total_tokens":-5}}`, OpenAI, UnitWeights, -1, -1},
		{"a string", false, `{"usage":{"total_tokens":"5"}}`, OpenAI, UnitWeights, -1, -1},
		{"other fields named alike", false, `{"usage":{"total_tokens_x":9,"xtotal_tokens":8,"total_tokens":3}}`, OpenAI, UnitWeights, 3, -1},
		{"escaped key", false, `{"usage":{"total\u005ftokens":9}}`, OpenAI, UnitWeights, -1, -1},
		{"a value that looks like a key", false, `{"usage":{"x":"total_tokens","y":5}}`, OpenAI, UnitWeights, -1, -1},
		{"too many digits", false, `{"usage":{"total_tokens":12345678901234567890}}`, OpenAI, UnitWeights, -1, -1},
		{"stream, CRLF and comments", true, ": keep-alive\r\nevent: message\r\ndata: {\"usage\":{\"total_tokens\":11}}\r\n\r\ndata: [DONE]\r\n\r\n", OpenAI, UnitWeights, 11, -1},
		{"stream, usage in two events: the last wins", true, "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":2}}\n\n", OpenAI, UnitWeights, 2, -1},
		{"a line that only contains data:", true, "event: data: {\"usage\":{\"total_tokens\":1}}\n\n", OpenAI, UnitWeights, -1, -1},
		{"stream: text outside a delta is not counted", true, "data: {\"message\":{\"content\":\"abcd\"},\"delta\":{\"role\":\"assistant\"}}\n\n", OpenAI, UnitWeights, -1, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whole, and in small chunks: chunking never matters.
			for _, chunk := range []int{len(tc.body), 1, 3} {
				s := scanAll(tc.body, tc.sse, chunk)
				got, ok := s.found.usage(tc.provider, tc.w)
				if !ok {
					got = -1
				}
				if got != tc.usage {
					t.Fatalf("chunks of %d: usage %d, want %d", chunk, got, tc.usage)
				}
				if tc.text >= 0 && s.found.text != tc.text {
					t.Fatalf("chunks of %d: %d bytes of text, want %d", chunk, s.found.text, tc.text)
				}
			}
		})
	}
}

// TestWeigh: weights are exact in millionths, rounded up, and saturate
// instead of overflowing.
func TestWeigh(t *testing.T) {
	const maxWeight = 1000 // the largest a settle takes
	for _, tc := range []struct {
		w       Weights
		in, out int64
		want    int64
	}{
		{UnitWeights, 3, 4, 7},
		{Weights{Input: WeightUnit / 10, Output: WeightUnit / 10}, 10, 10, 2}, // 0.1 × 20: exactly 2, not 2.0000000000000004
		{Weights{Input: WeightUnit / 3, Output: 0}, 3, 100, 1},                // 0.333333 × 3 = 0.999999, rounded up
		{Weights{Input: 0, Output: 4 * WeightUnit}, 1000, 5, 20},
		{Weights{Input: 1, Output: 1}, 1, 0, 1},                                                                              // a millionth of a token still costs one
		{Weights{Input: maxWeight * WeightUnit, Output: maxWeight * WeightUnit}, 1 << 62, 1 << 62, (1<<63-1)/WeightUnit + 1}, // saturated, rounded up
		{UnitWeights, 0, 0, 0},
	} {
		if got := tc.w.weigh(tc.in, tc.out); got != tc.want {
			t.Errorf("%+v weighs %d in, %d out as %d, want %d", tc.w, tc.in, tc.out, got, tc.want)
		}
	}
}

// FuzzUsageScanner: whatever bytes an upstream sends, the scanner neither
// panics nor reports a negative usage or text, and reports the same
// whatever the chunking.
func FuzzUsageScanner(f *testing.F) {
	f.Add(`{"usage":{"total_tokens":21}}`, false, 2)
	f.Add("data: {\"usage\":{\"total_tokens\":7}}\n\ndata: [DONE]\n\n", true, 1)
	f.Add(strings.Repeat("{", 100)+`"usage":`+strings.Repeat("}", 100), false, 5)
	for _, body := range []string{llmtest.OpenAIChatJSON, llmtest.OpenAIResponsesJSON, llmtest.AnthropicJSON} {
		f.Add(body, false, 3)
	}
	for _, body := range []string{llmtest.OpenAIChatSSE, llmtest.OpenAIToolCallSSE, llmtest.OpenAIResponsesSSE, llmtest.AnthropicSSE} {
		f.Add(body, true, 7)
	}
	f.Add(strings.Repeat(`{"delta":[`, 40)+`"x"`, true, 4)
	f.Fuzz(func(t *testing.T, body string, sse bool, chunk int) {
		chunk = 1 + (chunk&0xff)%17
		whole, split := scanAll(body, sse, max(1, len(body))), scanAll(body, sse, chunk)
		if whole.found != split.found {
			t.Fatalf("whole %+v, in chunks of %d %+v", whole.found, chunk, split.found)
		}
		for _, provider := range []Provider{OpenAI, Anthropic} {
			for _, w := range []Weights{UnitWeights, {Input: WeightUnit / 2, Output: 3 * WeightUnit}} {
				if u, ok := whole.found.usage(provider, w); ok && u < 0 {
					t.Fatalf("usage %d", u)
				}
			}
		}
		if whole.found.text < 0 || whole.found.text > int64(len(body)) || whole.found.strings < whole.found.text {
			t.Fatalf("text %d, strings %d of a body of %d", whole.found.text, whole.found.strings, len(body))
		}
	})
}

// TestUsageCache: the prompt tokens the providers' caches write and read
// are counted with their own weights: Anthropic's cache_creation and
// cache_read_input_tokens (JSON, message_start, and the message_delta that
// repeats them), OpenAI's prompt_tokens_details.cached_tokens and
// input_tokens_details.cached_tokens (a part of the prompt's tokens).
// Without weights, Anthropic's cache writes count as input and its reads
// not at all, and OpenAI settles total_tokens (cached tokens as any).
func TestUsageCache(t *testing.T) {
	const cachedAnthropic = `{"type":"message","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":12,"cache_creation_input_tokens":10011,"cache_read_input_tokens":0,"output_tokens":190,"cache_creation":{"ephemeral_5m_input_tokens":10011,"ephemeral_1h_input_tokens":0}}}`
	const readAnthropic = `{"type":"message","content":[{"type":"text","text":"Hi"}],"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":10011,"output_tokens":190}}`
	const cachedAnthropicSSE = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":10011,\"output_tokens\":1}}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hi\"}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":190}}\n\n"
	const repeatedAnthropicSSE = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":10011,\"cache_read_input_tokens\":0,\"output_tokens\":1}}}\n\n" +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"input_tokens\":12,\"cache_creation_input_tokens\":10011,\"cache_read_input_tokens\":0,\"output_tokens\":190}}\n\n"
	const cachedChat = `{"object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}],"usage":{"prompt_tokens":2006,"completion_tokens":300,"total_tokens":2306,"prompt_tokens_details":{"cached_tokens":1920,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0}}}`
	const cachedChatSSE = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hi\"}}],\"usage\":null}\n\n" +
		"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":2006,\"completion_tokens\":300,\"total_tokens\":2306,\"prompt_tokens_details\":{\"cached_tokens\":1920}}}\n\ndata: [DONE]\n\n"
	const cachedResponsesSSE = "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"usage\":{\"input_tokens\":2006,\"input_tokens_details\":{\"cached_tokens\":1920},\"output_tokens\":300,\"total_tokens\":2306}}}\n\n"
	const notCached = `{"usage":{"prompt_tokens":10,"completion_tokens":5,"total_tokens":15},"choices":[{"message":{"content":"\"cached_tokens\":9999"}}],"metadata":{"prompt_tokens_details":{"cached_tokens":7}}}`
	// Weights as a settle gives them, in millionths; -1 takes the default.
	const u, unset = WeightUnit, -1
	weigh := func(p Provider, in, out, write, read int64) Weights {
		return Weights{Input: in, Output: out, CacheWrite: write, CacheRead: read}.Defaults(p)
	}
	anthropicDefault := weigh(Anthropic, u, u, unset, unset)
	anthropicAll := weigh(Anthropic, u, u, unset, u)
	anthropicPriced := weigh(Anthropic, u, 5*u, 1.25*u, 0.1*u)
	openaiDefault := weigh(OpenAI, u, u, unset, unset)
	openaiWeighed := weigh(OpenAI, u, 4*u, unset, unset)
	openaiCheapCache := weigh(OpenAI, u, 4*u, unset, 0.5*u)
	for _, tc := range []struct {
		name     string
		sse      bool
		body     string
		provider Provider
		w        Weights
		usage    int64
	}{
		{"anthropic cache write, default", false, cachedAnthropic, Anthropic, anthropicDefault, 12 + 10011 + 190},
		{"anthropic cache read, default: not counted", false, readAnthropic, Anthropic, anthropicDefault, 12 + 190},
		{"anthropic cache read, cache_read 1", false, readAnthropic, Anthropic, anthropicAll, 12 + 10011 + 190},
		{"anthropic cache write, priced", false, cachedAnthropic, Anthropic, anthropicPriced, 12 + 5*190 + 12514}, // 10011 × 1.25 = 12513.75
		{"anthropic cache read, priced", false, readAnthropic, Anthropic, anthropicPriced, 12 + 5*190 + 1002},     // 1001.1, rounded up
		{"anthropic stream, cache read in message_start", true, cachedAnthropicSSE, Anthropic, anthropicAll, 12 + 10011 + 190},
		{"anthropic stream, repeated in message_delta", true, repeatedAnthropicSSE, Anthropic, anthropicDefault, 12 + 10011 + 190},
		{"openai chat, default: total_tokens", false, cachedChat, OpenAI, openaiDefault, 2306},
		{"openai chat, weighed: cached as input", false, cachedChat, OpenAI, openaiWeighed, 2006 + 4*300},
		{"openai chat, cache_read 0.5", false, cachedChat, OpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"openai chat stream, cache_read 0.5", true, cachedChatSSE, OpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"openai responses stream, cache_read 0.5", true, cachedResponsesSSE, OpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"cached_tokens elsewhere is not the usage's", false, notCached, OpenAI, openaiCheapCache, 10 + 4*5},
	} {
		for _, chunk := range []int{1, 7, 1 << 20} {
			s := scanAll(tc.body, tc.sse, chunk)
			if got, ok := s.found.usage(tc.provider, tc.w); !ok || got != tc.usage {
				t.Errorf("%s (chunks of %d): usage %d (found %v), want %d", tc.name, chunk, got, ok, tc.usage)
			}
		}
	}
	if anthropicDefault.CacheRead != 0 || anthropicDefault.CacheWrite != WeightUnit || openaiDefault != UnitWeights {
		t.Errorf("default weights: anthropic %+v, openai %+v", anthropicDefault, openaiDefault)
	}
}
