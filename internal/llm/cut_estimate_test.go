package llm

import (
	"strings"
	"testing"
)

// TestCutEstimate: a response without usage is estimated at one token per
// byte of the prompt, or, for an Anthropic stream past its message_start,
// the input it reported; and the answer at the ceiling the request set
// (which the provider enforces) times the answers it asked for, and at
// least the text delivered at a token a byte; weighed as the usage.
func TestCutEstimate(t *testing.T) {
	dense := Request{ok: true, maxTokens: 10, promptBytes: 40000, promptTokens: 10000}
	const u, unset = WeightUnit, -1
	anthropic := Weights{Input: u, Output: u, CacheWrite: unset, CacheRead: unset}.Defaults(Anthropic)
	openai := Weights{Input: u, Output: u, CacheWrite: unset, CacheRead: unset}.Defaults(OpenAI)
	weighed := Weights{Input: u, Output: 5 * u, CacheWrite: unset, CacheRead: 0.1 * u}.Defaults(Anthropic)
	started := scanAll("event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":40000,\"cache_read_input_tokens\":10011,\"output_tokens\":1}}}\n\n"+
		"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\""+strings.Repeat("x", 400)+"\"}}\n\n", true, 1<<20)
	cut := scanAll("data: {\"choices\":[{\"delta\":{\"content\":\""+strings.Repeat("x", 40)+"\"}}]}\n\n", true, 1<<20)
	for _, tc := range []struct {
		name     string
		provider Provider
		w        Weights
		body     Request
		found    *scanFound
		want     int64
	}{
		// The text delivered (40 bytes) is more than the ceiling of 10: at
		// least what came is charged.
		{"openai, a dense prompt: its bytes, and the text beyond max_tokens", OpenAI, openai, dense, &cut.found, 40000 + 40},
		{"no ceiling: the text", OpenAI, openai, Request{promptBytes: 100}, &cut.found, 100 + 40},
		{"a ceiling above the text", OpenAI, openai, Request{ok: true, maxTokens: 1000, promptBytes: 100}, &cut.found, 100 + 1000},
		{"anthropic past message_start: its input, cache reads at their weight", Anthropic, anthropic, dense, &started.found, 40000 + 400},
		{"anthropic weighed", Anthropic, weighed, Request{ok: true, maxTokens: 1000, promptBytes: 5}, &started.found, 40000 + 1002 + 5*1000},
		{"anthropic before message_start: the prompt's bytes", Anthropic, anthropic, dense, &cut.found, 40000 + 40},
		// n = 128 answers of at most 50 tokens each: what reading it all
		// could have cost, however little of it came.
		{"n = 128: the ceiling of every answer", OpenAI, openai, Request{ok: true, maxTokens: 50, outputs: 128, promptBytes: 82}, &cut.found, 82 + 128*50},
	} {
		if got := cutEstimate(tc.provider, tc.w, tc.body, tc.found); got != tc.want {
			t.Errorf("%s: %d, want %d", tc.name, got, tc.want)
		}
	}
}
