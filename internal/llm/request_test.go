package llm

import (
	"crypto/sha256"
	"errors"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// TestScanRequest: the ceiling of a request body is its top-level
// max_tokens, max_completion_tokens or max_output_tokens (the largest),
// and its prompt's estimate the bytes of its strings at 4 a token; a body
// that does not say is reserved at max.
func TestScanRequest(t *testing.T) {
	for _, tc := range []struct {
		name      string
		body      string
		truncated bool
		length    int64
		ok        bool
		maxTokens int64
		prompt    int64
	}{
		// "gpt-4o-mini" "system" "You are terse." "user" "Say hi": 41 bytes.
		{"chat completions", llmtest.ChatRequest, false, 0, true, 50, 11},
		{"newer chat completions", `{"model":"o3","messages":[{"role":"user","content":"Hi"}],"max_completion_tokens":4000}`, false, 0, true, 4000, 2},
		{"responses", llmtest.ResponsesRequest, false, 0, true, 200, TokensOf(int64(len("gpt-4.1") + len("Tell me a three sentence bedtime story about a unicorn.")))},
		{"anthropic messages", llmtest.AnthropicRequest, false, 0, true, 1024, TokensOf(int64(len("claude-sonnet-4-5") + len("user") + len("Hello, Claude")))},
		{"both names: the largest", `{"max_tokens":10,"max_completion_tokens":30}`, false, 0, true, 30, 0},
		{"the field after the messages", `{"messages":[{"role":"user","content":"abcd"}],"max_tokens":7}`, false, 0, true, 7, 2},
		{"the prompt says max_tokens", `{"messages":[{"role":"user","content":"use \"max_tokens\": 5"}],"max_tokens":100}`, false, 0, true, 100, 7},
		{"only the prompt says max_tokens", `{"messages":[{"role":"user","content":"{\"max_tokens\": 5}"}]}`, false, 0, false, 0, 6},
		{"nested is not the request's", `{"metadata":{"max_tokens":5},"messages":[]}`, false, 0, false, 0, 0},
		{"absent", `{"model":"gpt-4o","messages":[{"role":"user","content":"Hi"}]}`, false, 0, false, 0, 3},
		{"null", `{"max_tokens":null}`, false, 0, false, 0, 0},
		{"zero", `{"max_tokens":0}`, false, 0, false, 0, 0},
		{"negative", `{"max_tokens":-5}`, false, 0, false, 0, 0},
		{"fractional", `{"max_tokens":5.5}`, false, 0, false, 0, 0},
		{"a string", `{"max_tokens":"5"}`, false, 0, false, 0, 1},
		{"not JSON", `max_tokens=5`, false, 0, false, 0, 0},
		{"cut JSON", `{"max_tokens":5,"messages":[`, false, 0, false, 5, 0},
		{"an array", `[{"max_tokens":5}]`, false, 0, false, 0, 0},
		{"longer than the prefix, with a length", `{"max_tokens":5,"messages":[{"content":"xxxx`, true, 400_000, true, 5, 100_000},
		{"longer than the prefix, without a length", `{"max_tokens":5,"messages":[{"content":"xxxx`, true, -1, false, 5, 0},
		{"longer than the prefix, the field beyond it", `{"messages":[{"content":"xxxx`, true, 400_000, false, 0, 100_000},
	} {
		rb := scanRequest([]byte(tc.body), tc.truncated, tc.length)
		if rb.ok != tc.ok || tc.ok && rb.maxTokens != tc.maxTokens || rb.promptTokens != tc.prompt {
			t.Errorf("%s: %+v, want ok %v, max_tokens %d, prompt %d", tc.name, rb, tc.ok, tc.maxTokens, tc.prompt)
		}
	}
	// The reservation: weighed, at least 1, at most max, max when the body
	// does not say.
	rb := Request{ok: true, maxTokens: 50, promptTokens: 11}
	for _, tc := range []struct {
		rb   Request
		w    Weights
		max  int64
		want int64
	}{
		{rb, UnitWeights, 8000, 61},
		{rb, Weights{Input: WeightUnit, Output: 4 * WeightUnit}, 8000, 211},
		{rb, UnitWeights, 40, 40},
		{Request{}, UnitWeights, 8000, 8000},
		{Request{ok: true, maxTokens: 1}, Weights{Input: 0, Output: 1}, 8000, 1},
	} {
		if got := tc.rb.Reservation(tc.w, tc.max); got != tc.want {
			t.Errorf("%+v weighed %+v, max %d: reserves %d, want %d", tc.rb, tc.w, tc.max, got, tc.want)
		}
	}
}

// TestReadRequestBody: whatever the body's size, framing or fate, the
// upstream reads it byte for byte after its prefix was read.
func TestReadRequestBody(t *testing.T) {
	big := `{"max_tokens":64,"messages":[{"role":"user","content":"` + strings.Repeat("long prompt ", 20_000) + `"}]}`
	for _, tc := range []struct {
		name    string
		body    string
		chunked bool // no Content-Length
		ok      bool
		prompt  int64
	}{
		{"empty", "", false, false, 0},
		{"chat", llmtest.ChatRequest, false, true, 11},
		{"chat, chunked", llmtest.ChatRequest, true, true, 11},
		{"exactly the prefix", `{"max_tokens":3,"x":"` + strings.Repeat("a", maxRequestPrefix-len(`{"max_tokens":3,"x":""}`)) + `"}`, false, true, TokensOf(maxRequestPrefix - int64(len(`{"max_tokens":3,"x":""}`)-3))},
		{"one more than the prefix", `{"max_tokens":3,"x":"` + strings.Repeat("a", maxRequestPrefix+1-len(`{"max_tokens":3,"x":""}`)) + `"}`, false, true, TokensOf(maxRequestPrefix + 1)},
		{"240 KB", big, false, true, TokensOf(int64(len(big)))},
		{"240 KB, chunked", big, true, false, 0},
	} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(tc.body))
		if tc.chunked {
			r.ContentLength = -1
			r.Body = io.NopCloser(struct{ io.Reader }{strings.NewReader(tc.body)}) // hides its length
		}
		rb := ReadRequest(r)
		got, err := io.ReadAll(r.Body)
		if err != nil || sha256.Sum256(got) != sha256.Sum256([]byte(tc.body)) {
			t.Errorf("%s: the upstream read %d bytes (%v) of %d, not the same", tc.name, len(got), err, len(tc.body))
		}
		if rb.ok != tc.ok || rb.promptTokens != tc.prompt {
			t.Errorf("%s: %+v, want ok %v and a prompt of %d", tc.name, rb, tc.ok, tc.prompt)
		}
	}
	// A compressed body is not read (max), and not changed.
	r := httptest.NewRequest("POST", "/", strings.NewReader("\x1f\x8b..."))
	r.Header.Set("Content-Encoding", "gzip")
	if rb := ReadRequest(r); rb.ok {
		t.Errorf("a gzip body read: %+v", rb)
	}
	if got, _ := io.ReadAll(r.Body); string(got) != "\x1f\x8b..." {
		t.Errorf("a gzip body changed: %q", got)
	}
	// A body that fails while its prefix is read: max, and the upstream
	// gets the bytes that came and then the same error.
	failing := errors.New("connection reset")
	r = httptest.NewRequest("POST", "/", nil)
	r.ContentLength = -1
	r.Body = io.NopCloser(io.MultiReader(strings.NewReader(`{"max_tokens":5`), &errReader{failing}))
	if rb := ReadRequest(r); rb.ok {
		t.Errorf("a failed body read: %+v", rb)
	}
	got, err := io.ReadAll(r.Body)
	if string(got) != `{"max_tokens":5` || !errors.Is(err, failing) {
		t.Errorf("a failed body reached the upstream as %q, %v", got, err)
	}
}

type errReader struct{ err error }

func (e *errReader) Read([]byte) (int, error) { return 0, e.err }

// FuzzRequestBody: whatever a client sends, the reading never panics,
// reserves within [1, max], and hands the upstream the same bytes.
func FuzzRequestBody(f *testing.F) {
	for _, body := range []string{llmtest.ChatRequest, llmtest.ResponsesRequest, llmtest.AnthropicRequest, `{"max_tokens":9999999999999999999}`, `{"a":"\"`, `{{{{[[[[`} {
		f.Add(body, false, int64(3000))
	}
	f.Add(llmtest.ChatRequest, true, int64(1))
	f.Fuzz(func(t *testing.T, body string, chunked bool, maxCost int64) {
		maxCost = 1 + (maxCost&0xffffff)%1_000_000
		r := httptest.NewRequest("POST", "/", strings.NewReader(body))
		if chunked {
			r.ContentLength = -1
			r.Body = io.NopCloser(struct{ io.Reader }{strings.NewReader(body)})
		}
		rb := ReadRequest(r)
		if c := rb.Reservation(Weights{Input: WeightUnit / 2, Output: 3 * WeightUnit}, maxCost); c < 1 || c > maxCost {
			t.Fatalf("reserved %d of max %d", c, maxCost)
		}
		if rb.promptTokens < 0 || rb.maxTokens < 0 {
			t.Fatalf("%+v", rb)
		}
		if got, _ := io.ReadAll(r.Body); string(got) != body {
			t.Fatalf("the upstream read %q of %q", got, body)
		}
	})
}

// TestScanRequestHidden: a request carrying input its body does not show
// (a stored conversation, a stored prompt, an image, a file or audio, a
// provider-side tool, MCP servers, encrypted reasoning) is marked, and
// reserves max; as is a body whose keys or types are written with escapes
// (the provider reads them decoded) or one longer than the prefix read.
// Text that only mentions them, a function tool and a null
// previous_response_id do not.
func TestScanRequestHidden(t *testing.T) {
	for _, tc := range []struct {
		name   string
		body   string
		hidden bool
	}{
		{"chat", llmtest.ChatRequest, false},
		{"responses", llmtest.ResponsesRequest, false},
		{"anthropic", llmtest.AnthropicRequest, false},
		{"previous_response_id", `{"model":"gpt-4.1","previous_response_id":"resp_68af","input":"And then?","max_output_tokens":100}`, true},
		{"previous_response_id null", `{"model":"gpt-4.1","previous_response_id":null,"input":"Hi","max_output_tokens":100}`, false},
		{"conversation", `{"model":"gpt-4.1","conversation":"conv_689667905b048191b4740501625afd940c7533ace33a2dab","input":"Hi","max_output_tokens":100}`, true},
		{"stored prompt", `{"model":"gpt-4.1","prompt":{"id":"pmpt_abc123","version":"2"},"input":"Hi","max_output_tokens":100}`, true},
		{"a legacy prompt string", `{"model":"gpt-3.5-turbo-instruct","prompt":"Say hi","max_tokens":10}`, false},
		{"chat image_url", `{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"text","text":"What is in it?"},{"type":"image_url","image_url":{"url":"https://x.example/a.jpg","detail":"high"}}]}],"max_tokens":50}`, true},
		{"responses input_image", `{"model":"gpt-4.1","input":[{"role":"user","content":[{"type":"input_text","text":"Describe"},{"type":"input_image","image_url":"https://x.example/a.jpg"}]}],"max_output_tokens":50}`, true},
		{"responses input_file", `{"model":"gpt-4.1","input":[{"role":"user","content":[{"type":"input_file","file_id":"file-6F2ksmvXxt4VdoqmHRw6kL"}]}],"max_output_tokens":50}`, true},
		{"item_reference", `{"model":"gpt-4.1","input":[{"type":"item_reference","id":"msg_123"}],"max_output_tokens":50}`, true},
		{"encrypted reasoning", `{"model":"o4-mini","input":[{"type":"reasoning","id":"rs_1","encrypted_content":"gAAAA"}],"max_output_tokens":50}`, true},
		{"anthropic image", `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"user","content":[{"type":"image","source":{"type":"url","url":"https://x.example/a.jpg"}},{"type":"text","text":"Describe"}]}]}`, true},
		{"anthropic document", `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"file","file_id":"file_011"}}]}]}`, true},
		{"anthropic web search results sent back", `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"assistant","content":[{"type":"web_search_tool_result","tool_use_id":"srvtoolu_1","content":[{"type":"web_search_result","url":"https://x.example","encrypted_content":"EqgfCioIARgB"}]}]}]}`, true},
		{"anthropic redacted thinking", `{"model":"claude-sonnet-4-5","max_tokens":100,"messages":[{"role":"assistant","content":[{"type":"redacted_thinking","data":"EmwKAhgBEgy"}]}]}`, true},
		{"openai web search tool", `{"model":"gpt-4.1","tools":[{"type":"web_search_preview"}],"input":"News?","max_output_tokens":100}`, true},
		{"openai file search tool", `{"model":"gpt-4.1","tools":[{"type":"file_search","vector_store_ids":["vs_1"]}],"input":"?","max_output_tokens":100}`, true},
		{"openai function tool", `{"model":"gpt-4.1","tools":[{"type":"function","name":"get_weather","parameters":{"type":"object","properties":{"city":{"type":"string"}}}}],"input":"?","max_output_tokens":100}`, false},
		{"chat function tool", `{"model":"gpt-4o","tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}],"messages":[{"role":"user","content":"?"}],"max_tokens":10}`, false},
		{"anthropic server tool", `{"model":"claude-sonnet-4-5","max_tokens":100,"tools":[{"type":"web_search_20250305","name":"web_search","max_uses":5}],"messages":[{"role":"user","content":"?"}]}`, true},
		{"anthropic client tool", `{"model":"claude-sonnet-4-5","max_tokens":100,"tools":[{"name":"get_weather","input_schema":{"type":"object"}}],"messages":[{"role":"user","content":"?"}]}`, false},
		{"mcp servers", `{"model":"claude-sonnet-4-5","max_tokens":100,"mcp_servers":[{"type":"url","url":"https://mcp.example/sse","name":"x"}],"messages":[]}`, true},
		{"no mcp servers", `{"model":"claude-sonnet-4-5","max_tokens":100,"mcp_servers":[],"messages":[]}`, false},
		{"chat web search", `{"model":"gpt-4o-search-preview","web_search_options":{},"messages":[{"role":"user","content":"News?"}],"max_tokens":100}`, true},
		{"text that mentions them", `{"model":"gpt-4o","messages":[{"role":"user","content":"{\"type\":\"image_url\",\"previous_response_id\":\"r\",\"file_id\":\"f\"}"}],"max_tokens":10}`, false},
		{"an escaped key", `{"model":"gpt-4.1","previous\u005fresponse_id":"resp_68af","input":"And then?","max_output_tokens":100}`, true},
		{"an escaped type", `{"model":"gpt-4o","messages":[{"role":"user","content":[{"type":"image\u005furl","image_url":{"url":"https://x.example/a.jpg"}}]}],"max_tokens":50}`, true},
		{"nested previous_response_id is not the request's", `{"model":"gpt-4.1","metadata":{"previous_response_id":"x"},"input":"Hi","max_output_tokens":10}`, false},
	} {
		for _, chunk := range []int{1, 5, len(tc.body)} {
			var j jsonScan
			var f scanFound
			for i := 0; i < len(tc.body); i += chunk {
				j.feed([]byte(tc.body[i:min(i+chunk, len(tc.body))]), &f, textAnywhere)
			}
			if f.hides != tc.hidden {
				t.Errorf("%s (chunks of %d): hides %v, want %v", tc.name, chunk, f.hides, tc.hidden)
			}
		}
		rb := scanRequest([]byte(tc.body), false, -1)
		if want := map[bool]int64{true: 8000, false: min(8000, max(1, rb.promptTokens+rb.maxTokens))}[tc.hidden]; rb.Reservation(UnitWeights, 8000) != want {
			t.Errorf("%s: reserves %d, want %d", tc.name, rb.Reservation(UnitWeights, 8000), want)
		}
	}
	if rb := scanRequest([]byte(`{"max_tokens":5,"messages":[{"content":"xxxx`), true, 400_000); !rb.hides || rb.Reservation(UnitWeights, 8000) != 8000 {
		t.Errorf("a body longer than the prefix read: %+v reserves %d, want max", rb, rb.Reservation(UnitWeights, 8000))
	}
}

// TestScanRequestOutputs: every multiplier of the output is reserved: `n`
// choices, `best_of` completions generated, each prompt of a `prompt`
// array (strings, or arrays of token ids; an array of token ids is one
// prompt, each id a token of the prompt); `"background": true` has no
// ceiling the request shows (Unbounded, and hidden: max).
func TestScanRequestOutputs(t *testing.T) {
	for _, tc := range []struct {
		name       string
		body       string
		outputs    int64
		prompt     int64 // tokens
		reserved   int64 // weighed 1, max 1,000,000
		unbounded  bool
		background bool
	}{
		{"one answer", `{"max_tokens":50,"messages":[{"role":"user","content":"Hi"}]}`, 1, 2, 52, false, false},
		{"n = 128", `{"max_tokens":50,"n":128,"messages":[{"role":"user","content":"Hi"}]}`, 128, 2, 2 + 128*50, false, false},
		{"n in a message is not the request's", `{"max_tokens":50,"messages":[{"role":"user","content":"Hi","n":128}]}`, 1, 2, 52, false, false},
		{"best_of above n", `{"model":"davinci-002","prompt":"Hi","max_tokens":10,"n":2,"best_of":5}`, 5, 4, 4 + 5*10, false, false},
		{"a prompt array", `{"prompt":["one","two","three"],"max_tokens":10,"n":2}`, 6, 3, 3 + 60, false, false},
		{"a prompt of token ids", `{"prompt":[1212,318,257,1332],"max_tokens":10}`, 1, 4, 4 + 10, false, false},
		{"prompts of token ids", `{"prompt":[[1212,318],[257,1332,13]],"max_tokens":10}`, 2, 5, 5 + 20, false, false},
		{"background", `{"model":"o3","input":"Think","max_output_tokens":100,"background":true}`, 1, 2, 1_000_000, true, true},
		{"background false", `{"model":"o3","input":"Think","max_output_tokens":100,"background":false}`, 1, 2, 102, false, false},
		{"no ceiling", `{"model":"o3","input":"Think","reasoning":{"effort":"high"}}`, 1, 3, 1_000_000, true, false},
		{"an absurd n", `{"max_tokens":50,"n":999999999999}`, maxOutputs, 0, 1_000_000, false, false},
		// An n the scan cannot read as a whole number, which a provider may
		// still read as one: what the body asks is not known (hidden: max).
		{"n as a decimal", `{"max_tokens":50,"n":128.0}`, 1, 0, 1_000_000, false, false},
		{"n as a string", `{"max_tokens":50,"n":"128"}`, 1, 1, 1_000_000, false, false},
		{"best_of with an exponent", `{"max_tokens":50,"best_of":1e2}`, 1, 0, 1_000_000, false, false},
	} {
		rb := scanRequest([]byte(tc.body), false, 0)
		if rb.outputs != tc.outputs || rb.promptTokens != tc.prompt || rb.Unbounded() != tc.unbounded || rb.background != tc.background {
			t.Errorf("%s: outputs %d, prompt %d, unbounded %v, background %v; want %d, %d, %v, %v", tc.name, rb.outputs, rb.promptTokens, rb.Unbounded(), rb.background, tc.outputs, tc.prompt, tc.unbounded, tc.background)
		}
		if got := rb.Reservation(UnitWeights, 1_000_000); got != tc.reserved {
			t.Errorf("%s: reserves %d, want %d", tc.name, got, tc.reserved)
		}
	}
}
