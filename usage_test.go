package ratelimit

import (
	"strings"
	"testing"
)

// Bodies as the providers send them (from their API references), usage
// and text included.
const (
	openaiChatJSON = `{"id":"chatcmpl-B9MBs8CjcvOU2jLn4n570S5qMJKcT","object":"chat.completion","created":1741569952,"model":"gpt-4.1-2025-04-14",` +
		`"choices":[{"index":0,"message":{"role":"assistant","content":"Hello! How can I assist you today?","refusal":null,"annotations":[]},"logprobs":null,"finish_reason":"stop"}],` +
		`"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},` +
		`"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"service_tier":"default"}`
	openaiChatSSE = "data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n" +
		"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hello\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n" +
		"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" there\"},\"logprobs\":null,\"finish_reason\":null}],\"usage\":null}\n\n" +
		"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[{\"index\":0,\"delta\":{},\"logprobs\":null,\"finish_reason\":\"stop\"}],\"usage\":null}\n\n" +
		"data: {\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1694268190,\"model\":\"gpt-4o-mini\",\"system_fingerprint\":\"fp_44709d6fcb\",\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":3,\"total_tokens\":12,\"prompt_tokens_details\":{\"cached_tokens\":0},\"completion_tokens_details\":{\"reasoning_tokens\":0}}}\n\n" +
		"data: [DONE]\n\n"
	openaiToolCallSSE = "data: {\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_weather\",\"arguments\":\"\"}}]}}]}\n\n" +
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"{\\\"city\\\":\"}}]}}]}\n\n" +
		"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"arguments\":\"\\\"Paris\\\"}\"}}]}}]}\n\n" +
		"data: [DONE]\n\n"
	openaiResponsesJSON = `{"id":"resp_67ccd2bed1ec8190b14f964abc0542670bb6a6b452d3795b","object":"response","created_at":1741476542,"status":"completed","error":null,` +
		`"incomplete_details":null,"instructions":"Be brief.","max_output_tokens":null,"model":"gpt-4.1-2025-04-14","output":[{"type":"message","id":"msg_67ccd2bf17f0819081ff3bb2cf6508e60bb6a6b452d3795b",` +
		`"status":"completed","role":"assistant","content":[{"type":"output_text","text":"In a peaceful grove beneath a silver moon...","annotations":[]}]}],"parallel_tool_calls":true,` +
		`"previous_response_id":null,"reasoning":{"effort":null,"summary":null},"store":true,"temperature":1.0,"text":{"format":{"type":"text"}},"tool_choice":"auto","tools":[],"top_p":1.0,` +
		`"truncation":"disabled","usage":{"input_tokens":36,"input_tokens_details":{"cached_tokens":0},"output_tokens":87,"output_tokens_details":{"reasoning_tokens":0},"total_tokens":123},"user":null,"metadata":{}}`
	openaiResponsesSSE = "event: response.created\ndata: {\"type\":\"response.created\",\"sequence_number\":0,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"in_progress\",\"model\":\"gpt-4.1\",\"output\":[],\"usage\":null}}\n\n" +
		"event: response.output_item.added\ndata: {\"type\":\"response.output_item.added\",\"sequence_number\":1,\"output_index\":0,\"item\":{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"in_progress\",\"role\":\"assistant\",\"content\":[]}}\n\n" +
		"event: response.content_part.added\ndata: {\"type\":\"response.content_part.added\",\"sequence_number\":2,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":\"\",\"annotations\":[]}}\n\n" +
		"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":3,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\"Hi\"}\n\n" +
		"event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"sequence_number\":4,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"delta\":\" there\"}\n\n" +
		"event: response.output_text.done\ndata: {\"type\":\"response.output_text.done\",\"sequence_number\":5,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"text\":\"Hi there\"}\n\n" +
		"event: response.content_part.done\ndata: {\"type\":\"response.content_part.done\",\"sequence_number\":6,\"item_id\":\"msg_1\",\"output_index\":0,\"content_index\":0,\"part\":{\"type\":\"output_text\",\"text\":\"Hi there\",\"annotations\":[]}}\n\n" +
		"event: response.output_item.done\ndata: {\"type\":\"response.output_item.done\",\"sequence_number\":7,\"output_index\":0,\"item\":{\"id\":\"msg_1\",\"type\":\"message\",\"status\":\"completed\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi there\",\"annotations\":[]}]}}\n\n" +
		"event: response.completed\ndata: {\"type\":\"response.completed\",\"sequence_number\":8,\"response\":{\"id\":\"resp_1\",\"object\":\"response\",\"status\":\"completed\",\"model\":\"gpt-4.1\",\"output\":[{\"id\":\"msg_1\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[{\"type\":\"output_text\",\"text\":\"Hi there\",\"annotations\":[]}]}],\"usage\":{\"input_tokens\":37,\"input_tokens_details\":{\"cached_tokens\":0},\"output_tokens\":11,\"output_tokens_details\":{\"reasoning_tokens\":0},\"total_tokens\":48}}}\n\n"
	anthropicJSON = `{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","content":[{"type":"text","text":"Hello!"}],"model":"claude-sonnet-4-5",` +
		`"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":6}}`
	anthropicSSEStart = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_1nZdL29xx5MUA1yADyHTEsnR8uuvGzszyY\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n" +
		"event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n" +
		"event: ping\ndata: {\"type\": \"ping\"}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"Hello\"}}\n\n" +
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"!\"}}\n\n" +
		"event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
	anthropicSSE = anthropicSSEStart +
		"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":15}}\n\n" +
		"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"
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
	w14 := weights{input: 1 * weightUnit, output: 4 * weightUnit}
	wFrac := weights{input: weightUnit / 4, output: 3 * weightUnit / 2} // 0.25 and 1.5
	for _, tc := range []struct {
		name     string
		sse      bool
		body     string
		provider int
		w        weights
		usage    int64 // -1: none found
		text     int64 // bytes of text; -1 not checked
	}{
		{"openai chat completion", false, openaiChatJSON, providerOpenAI, unitWeights, 29, int64(len("Hello! How can I assist you today?"))},
		{"openai chat completion, weighed", false, openaiChatJSON, providerOpenAI, w14, 19 + 4*10, -1},
		{"openai chat stream", true, openaiChatSSE, providerOpenAI, unitWeights, 12, int64(len("Hello there"))},
		{"openai chat stream, weighed", true, openaiChatSSE, providerOpenAI, w14, 9 + 4*3, -1},
		{"openai chat stream cut before the usage", true, openaiChatSSE[:strings.Index(openaiChatSSE, `"choices":[]`)], providerOpenAI, unitWeights, -1, int64(len("Hello there"))},
		{"openai tool call stream: the arguments are text", true, openaiToolCallSSE, providerOpenAI, unitWeights, -1, int64(len(`{\"city\":` + `\"Paris\"}`))},
		{"openai responses", false, openaiResponsesJSON, providerOpenAI, unitWeights, 123, int64(len("In a peaceful grove beneath a silver moon..."))},
		{"openai responses, weighed", false, openaiResponsesJSON, providerOpenAI, w14, 36 + 4*87, -1},
		// The deltas count once: not the done events' and the completed
		// response's copies of the text.
		{"openai responses stream", true, openaiResponsesSSE, providerOpenAI, unitWeights, 48, int64(len("Hi there"))},
		{"openai responses stream, weighed", true, openaiResponsesSSE, providerOpenAI, w14, 37 + 4*11, -1},
		{"openai responses stream cut before completed", true, openaiResponsesSSE[:strings.Index(openaiResponsesSSE, "event: response.completed")], providerOpenAI, unitWeights, -1, int64(len("Hi there"))},
		{"anthropic messages", false, anthropicJSON, providerAnthropic, unitWeights, 18, int64(len("Hello!"))},
		{"anthropic messages, weighed", false, anthropicJSON, providerAnthropic, wFrac, 3 + 9, -1}, // 12×0.25 + 6×1.5
		{"anthropic stream", true, anthropicSSE, providerAnthropic, unitWeights, 25 + 15, int64(len("Hello!"))},
		{"anthropic stream, weighed, rounded up", true, anthropicSSE, providerAnthropic, wFrac, 29, -1}, // 6.25 + 22.5
		// message_start's output_tokens is a first count: a stream cut
		// before message_delta has no usage.
		{"anthropic stream cut before message_delta", true, anthropicSSEStart, providerAnthropic, unitWeights, -1, int64(len("Hello!"))},
		{"anthropic read as openai: no total", false, anthropicJSON, providerOpenAI, unitWeights, 18, -1},
		{"openai read as anthropic", false, `{"usage":{"total_tokens":29}}`, providerAnthropic, unitWeights, -1, -1},
		{"anthropic with input_tokens in message_delta", true, "data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"output_tokens\":1}}}\n\n" +
			"data: {\"type\":\"message_delta\",\"usage\":{\"input_tokens\":7,\"output_tokens\":3}}\n\n", providerAnthropic, unitWeights, 10, -1},

		{"spaces and newlines", false, "{\n  \"usage\" : {\n    \"total_tokens\" : 1234 \n  }\n}", providerOpenAI, unitWeights, 1234, -1},
		{"usage before choices", false, `{"usage":{"total_tokens":7},"choices":[{"message":{"content":"x"}}]}`, providerOpenAI, unitWeights, 7, 1},
		{"the model writes usage in its answer", false, `{"choices":[{"message":{"content":"{\"usage\":{\"total_tokens\":999999}}"}}],"usage":{"total_tokens":5}}`, providerOpenAI, unitWeights, 5, -1},
		{"only in the answer", false, `{"choices":[{"message":{"content":"\"usage\": {\"total_tokens\": 999999}"}}]}`, providerOpenAI, unitWeights, -1, -1},
		{"nested deeper", false, `{"data":{"usage":{"total_tokens":50}}}`, providerOpenAI, unitWeights, -1, 0},
		{"usage in an array", false, `[{"usage":{"total_tokens":50}}]`, providerOpenAI, unitWeights, -1, -1},
		{"usage details are not usage", false, `{"usage":{"prompt_tokens_details":{"total_tokens":9}}}`, providerOpenAI, unitWeights, -1, -1},
		{"fractional", false, `{"usage":{"total_tokens":5.5}}`, providerOpenAI, unitWeights, -1, -1},
		{"exponent", false, `{"usage":{"total_tokens":5e3}}`, providerOpenAI, unitWeights, -1, -1},
		{"negative", false, `{"usage":{"total_tokens":-5}}`, providerOpenAI, unitWeights, -1, -1},
		{"a string", false, `{"usage":{"total_tokens":"5"}}`, providerOpenAI, unitWeights, -1, -1},
		{"other fields named alike", false, `{"usage":{"total_tokens_x":9,"xtotal_tokens":8,"total_tokens":3}}`, providerOpenAI, unitWeights, 3, -1},
		{"escaped key", false, `{"usage":{"total\u005ftokens":9}}`, providerOpenAI, unitWeights, -1, -1},
		{"a value that looks like a key", false, `{"usage":{"x":"total_tokens","y":5}}`, providerOpenAI, unitWeights, -1, -1},
		{"too many digits", false, `{"usage":{"total_tokens":12345678901234567890}}`, providerOpenAI, unitWeights, -1, -1},
		{"stream, CRLF and comments", true, ": keep-alive\r\nevent: message\r\ndata: {\"usage\":{\"total_tokens\":11}}\r\n\r\ndata: [DONE]\r\n\r\n", providerOpenAI, unitWeights, 11, -1},
		{"stream, usage in two events: the last wins", true, "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":2}}\n\n", providerOpenAI, unitWeights, 2, -1},
		{"a line that only contains data:", true, "event: data: {\"usage\":{\"total_tokens\":1}}\n\n", providerOpenAI, unitWeights, -1, -1},
		{"stream: text outside a delta is not counted", true, "data: {\"message\":{\"content\":\"abcd\"},\"delta\":{\"role\":\"assistant\"}}\n\n", providerOpenAI, unitWeights, -1, 0},
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
	for _, tc := range []struct {
		w       weights
		in, out int64
		want    int64
	}{
		{unitWeights, 3, 4, 7},
		{weights{input: weightUnit / 10, output: weightUnit / 10}, 10, 10, 2}, // 0.1 × 20: exactly 2, not 2.0000000000000004
		{weights{input: weightUnit / 3, output: 0}, 3, 100, 1},                // 0.333333 × 3 = 0.999999, rounded up
		{weights{input: 0, output: 4 * weightUnit}, 1000, 5, 20},
		{weights{input: 1, output: 1}, 1, 0, 1},                                                                              // a millionth of a token still costs one
		{weights{input: maxWeight * weightUnit, output: maxWeight * weightUnit}, 1 << 62, 1 << 62, (1<<63-1)/weightUnit + 1}, // saturated, rounded up
		{unitWeights, 0, 0, 0},
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
	for _, body := range []string{openaiChatJSON, openaiResponsesJSON, anthropicJSON} {
		f.Add(body, false, 3)
	}
	for _, body := range []string{openaiChatSSE, openaiToolCallSSE, openaiResponsesSSE, anthropicSSE} {
		f.Add(body, true, 7)
	}
	f.Add(strings.Repeat(`{"delta":[`, 40)+`"x"`, true, 4)
	f.Fuzz(func(t *testing.T, body string, sse bool, chunk int) {
		chunk = 1 + (chunk&0xff)%17
		whole, split := scanAll(body, sse, max(1, len(body))), scanAll(body, sse, chunk)
		if whole.found != split.found {
			t.Fatalf("whole %+v, in chunks of %d %+v", whole.found, chunk, split.found)
		}
		for _, provider := range []int{providerOpenAI, providerAnthropic} {
			for _, w := range []weights{unitWeights, {input: weightUnit / 2, output: 3 * weightUnit}} {
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
	weigh := func(from string, sw *SettleWeights) weights {
		w, err := sw.check(from)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	f := func(v float64) *float64 { return &v }
	anthropicDefault := weigh(settleAnthropic, nil)
	anthropicAll := weigh(settleAnthropic, &SettleWeights{Input: f(1), Output: f(1), CacheRead: f(1)})
	anthropicPriced := weigh(settleAnthropic, &SettleWeights{Input: f(1), Output: f(5), CacheWrite: f(1.25), CacheRead: f(0.1)})
	openaiDefault := weigh(settleOpenAI, nil)
	openaiWeighed := weigh(settleOpenAI, &SettleWeights{Input: f(1), Output: f(4)})
	openaiCheapCache := weigh(settleOpenAI, &SettleWeights{Input: f(1), Output: f(4), CacheRead: f(0.5)})
	for _, tc := range []struct {
		name     string
		sse      bool
		body     string
		provider int
		w        weights
		usage    int64
	}{
		{"anthropic cache write, default", false, cachedAnthropic, providerAnthropic, anthropicDefault, 12 + 10011 + 190},
		{"anthropic cache read, default: not counted", false, readAnthropic, providerAnthropic, anthropicDefault, 12 + 190},
		{"anthropic cache read, cache_read 1", false, readAnthropic, providerAnthropic, anthropicAll, 12 + 10011 + 190},
		{"anthropic cache write, priced", false, cachedAnthropic, providerAnthropic, anthropicPriced, 12 + 5*190 + 12514}, // 10011 × 1.25 = 12513.75
		{"anthropic cache read, priced", false, readAnthropic, providerAnthropic, anthropicPriced, 12 + 5*190 + 1002},     // 1001.1, rounded up
		{"anthropic stream, cache read in message_start", true, cachedAnthropicSSE, providerAnthropic, anthropicAll, 12 + 10011 + 190},
		{"anthropic stream, repeated in message_delta", true, repeatedAnthropicSSE, providerAnthropic, anthropicDefault, 12 + 10011 + 190},
		{"openai chat, default: total_tokens", false, cachedChat, providerOpenAI, openaiDefault, 2306},
		{"openai chat, weighed: cached as input", false, cachedChat, providerOpenAI, openaiWeighed, 2006 + 4*300},
		{"openai chat, cache_read 0.5", false, cachedChat, providerOpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"openai chat stream, cache_read 0.5", true, cachedChatSSE, providerOpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"openai responses stream, cache_read 0.5", true, cachedResponsesSSE, providerOpenAI, openaiCheapCache, 86 + 960 + 4*300},
		{"cached_tokens elsewhere is not the usage's", false, notCached, providerOpenAI, openaiCheapCache, 10 + 4*5},
	} {
		for _, chunk := range []int{1, 7, 1 << 20} {
			s := scanAll(tc.body, tc.sse, chunk)
			if got, ok := s.found.usage(tc.provider, tc.w); !ok || got != tc.usage {
				t.Errorf("%s (chunks of %d): usage %d (found %v), want %d", tc.name, chunk, got, ok, tc.usage)
			}
		}
	}
	if anthropicDefault.cacheRead != 0 || anthropicDefault.cacheWrite != weightUnit || openaiDefault != unitWeights {
		t.Errorf("default weights: anthropic %+v, openai %+v", anthropicDefault, openaiDefault)
	}
}
