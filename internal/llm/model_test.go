package llm

import (
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// TestResponseModel: the model a response names (what was served) in each
// format, whatever the chunking; text that only looks like a model's name
// (in the answer, nested elsewhere) is not one.
func TestResponseModel(t *testing.T) {
	for _, tc := range []struct {
		name string
		sse  bool
		body string
		want string
	}{
		{"openai chat completion", false, llmtest.OpenAIChatJSON, modelOf(llmtest.OpenAIChatJSON)},
		{"openai chat stream", true, llmtest.OpenAIChatSSE, modelOf(llmtest.OpenAIChatSSE)},
		{"openai responses", false, llmtest.OpenAIResponsesJSON, modelOf(llmtest.OpenAIResponsesJSON)},
		{"openai responses stream", true, llmtest.OpenAIResponsesSSE, modelOf(llmtest.OpenAIResponsesSSE)},
		{"anthropic messages", false, llmtest.AnthropicJSON, modelOf(llmtest.AnthropicJSON)},
		{"anthropic stream: message_start's", true, llmtest.AnthropicSSE, modelOf(llmtest.AnthropicSSE)},
		{"the last named", true, "data: {\"model\":\"a\"}\n\ndata: {\"model\":\"b\"}\n\n", "b"},
		{"escaped", false, `{"model":"gpt\u002d4.1"}`, "gpt-4.1"},
		{"bad escape", false, `{"model":"gpt\x-4.1"}`, ""},
		{"too long", false, `{"model":"` + strings.Repeat("m", 300) + `"}`, ""},
		{"a number", false, `{"model":5}`, ""},
		{"in the answer", false, `{"choices":[{"message":{"content":"{\"model\":\"free\"}"}}]}`, ""},
		{"nested elsewhere", false, `{"choices":[{"model":"free"}],"metadata":{"model":"free"}}`, ""},
		{"a key named so", false, `{"x":"model"}`, ""},
	} {
		for _, chunk := range []int{1, 3, 7, len(tc.body)} {
			s := scanAll(tc.body, tc.sse, chunk)
			if got := s.found.model.String(); got != tc.want {
				t.Errorf("%s, chunks of %d: model %q, want %q", tc.name, chunk, got, tc.want)
			}
		}
	}
}

// modelOf is the first "model":"..." a fixture holds, to check the test
// against the fixtures' own text.
func modelOf(body string) string {
	_, rest, ok := strings.Cut(body, `"model":"`)
	if !ok {
		return "none"
	}
	m, _, _ := strings.Cut(rest, `"`)
	return m
}

// TestRequestModel: the model a request body names; a body naming two
// hides which one the provider reads, and reserves max.
func TestRequestModel(t *testing.T) {
	for _, tc := range []struct {
		body  string
		want  string
		hides bool
	}{
		{llmtest.ChatRequest, "gpt-4o-mini", false},
		{llmtest.AnthropicRequest, "claude-sonnet-4-5", false},
		{`{"messages":[],"max_tokens":5,"model":"gpt-4.1-2025-04-14"}`, "gpt-4.1-2025-04-14", false},
		{`{"model":"cheap","max_tokens":5,"model":"dear"}`, "dear", true},
		{`{"max_tokens":5}`, "", false},
		{`{"model":"","max_tokens":5}`, "", false},
	} {
		rb := scanRequest([]byte(tc.body), false, int64(len(tc.body)))
		if rb.Model() != tc.want || rb.hides != tc.hides {
			t.Errorf("%s: model %q, hides %v; want %q, %v", tc.body, rb.Model(), rb.hides, tc.want, tc.hides)
		}
	}
}
