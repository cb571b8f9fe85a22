package llm

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
)

// TestAskUsage: a streaming chat completions body asks for its usage after
// the rewrite, whatever it said of stream_options, and is otherwise the
// same JSON; a body that does not stream, or asks itself, is left alone.
func TestAskUsage(t *testing.T) {
	const msgs = `"messages":[{"role":"user","content":"a \"stream\": true, } {"}]`
	for _, tc := range []struct {
		name, body, want string
		strip            bool // the client did not ask: the usage is taken back out
	}{
		{"stream, no options", `{"model":"m",` + msgs + `,"stream":true}`,
			`{"model":"m",` + msgs + `,"stream":true,"stream_options":{"include_usage":true}}`, true},
		{"stream first", `{"stream":true,"model":"m",` + msgs + `}`,
			`{"stream":true,"model":"m",` + msgs + `,"stream_options":{"include_usage":true}}`, true},
		{"spaces", "{ \"model\" : \"m\" , \"stream\" : true }\n",
			"{ \"model\" : \"m\" , \"stream\" : true ,\"stream_options\":{\"include_usage\":true}}\n", true},
		{"empty options", `{"stream":true,"stream_options":{}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, true},
		{"other options", `{"stream_options":{"include_obfuscation":false},"stream":true}`,
			`{"stream_options":{"include_obfuscation":false,"include_usage":true},"stream":true}`, true},
		{"include_usage false", `{"stream":true,"stream_options":{"include_usage":false,"x":1}}`,
			`{"stream":true,"stream_options":{"include_usage":true,"x":1}}`, true},
		{"include_usage null", `{"stream":true,"stream_options":{"include_usage":null}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, true},
		{"options null", `{"stream":true,"stream_options":null}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, true},
		{"options null before stream: left", `{"stream_options":null,"stream":true}`,
			`{"stream_options":null,"stream":true}`, false},
		{"asked", `{"stream":true,"stream_options":{"include_usage":true}}`,
			`{"stream":true,"stream_options":{"include_usage":true}}`, false},
		{"not streaming", `{"model":"m",` + msgs + `,"stream":false}`, `{"model":"m",` + msgs + `,"stream":false}`, false},
		{"no stream member", `{"model":"m",` + msgs + `}`, `{"model":"m",` + msgs + `}`, false},
		{"stream as a string", `{"stream":"true"}`, `{"stream":"true"}`, false},
		{"nested stream", `{"metadata":{"stream":true}}`, `{"metadata":{"stream":true}}`, false},
		{"nested options", `{"stream":true,"metadata":{"stream_options":{}}}`,
			`{"stream":true,"metadata":{"stream_options":{}},"stream_options":{"include_usage":true}}`, true},
		{"escaped key", `{"stre\u0061m":true}`, `{"stre\u0061m":true}`, false},
		{"an array", `[{"stream":true}]`, `[{"stream":true}]`, false},
		{"not JSON", `stream=true`, `stream=true`, false},
		{"cut", `{"stream":true,"messages":[`, `{"stream":true,"messages":[`, false},
		{"after the end", `{"stream":true} {"stream":true}`, `{"stream":true,"stream_options":{"include_usage":true}} {"stream":true}`, true},
	} {
		var a usageAsker
		got := string(a.feed([]byte(tc.body), nil))
		u := new(UsageAsk)
		a.report(u)
		if got != tc.want || u.Strip() != tc.strip {
			t.Errorf("%s:\n got %s (strip %v)\nwant %s (strip %v)", tc.name, got, u.Strip(), tc.want, tc.strip)
		}
		if a.grown != int64(len(got)-len(tc.body)) || a.grown > maxGrowth {
			t.Errorf("%s: grown %d, by %d", tc.name, a.grown, len(got)-len(tc.body))
		}
		if json.Valid([]byte(tc.body)) && !json.Valid([]byte(got)) {
			t.Errorf("%s: not JSON after the rewrite: %s", tc.name, got)
		}
		// Byte by byte, as a body may come.
		var b usageAsker
		var out []byte
		for i := range len(tc.body) {
			out = b.feed([]byte(tc.body[i:i+1]), out)
		}
		if string(out) != tc.want {
			t.Errorf("%s, byte by byte: %s", tc.name, out)
		}
	}
}

// TestAskUsageBody: the body as the provider reads it, read whole or
// longer than the prefix, with and without a Content-Length: the same JSON
// (ending in spaces when longer, its length declared still exact).
func TestAskUsageBody(t *testing.T) {
	long := strings.Repeat("tell me a story ", 8000) // past the prefix
	for _, tc := range []struct {
		name, body string
		length     bool
	}{
		{"whole, with a length", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, true},
		{"whole, chunked", `{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}`, false},
		{"longer, with a length", `{"model":"m","messages":[{"role":"user","content":"` + long + `"}],"stream":true}`, true},
		{"longer, chunked", `{"model":"m","messages":[{"role":"user","content":"` + long + `"}],"stream":true}`, false},
		{"longer, not streaming", `{"model":"m","stream":false,"messages":[{"role":"user","content":"` + long + `"}]}`, true},
	} {
		r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(tc.body))
		if !tc.length {
			r.ContentLength = -1
		} else {
			r.Header.Set("Content-Length", strconv.Itoa(len(tc.body)))
		}
		ReadRequest(r)
		u := AskUsage(r)
		got, err := io.ReadAll(r.Body)
		if err != nil {
			t.Fatal(err)
		}
		var req map[string]any
		if err := json.Unmarshal(got, &req); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		streaming := req["stream"] == true
		so, _ := req["stream_options"].(map[string]any)
		if streaming != (so != nil && so["include_usage"] == true) || u.Strip() != streaming {
			t.Errorf("%s: stream_options %v, strip %v", tc.name, req["stream_options"], u.Strip())
		}
		if r.ContentLength >= 0 && r.ContentLength != int64(len(got)) {
			t.Errorf("%s: declares %d bytes, has %d", tc.name, r.ContentLength, len(got))
		}
		if tc.length && r.Header.Get("Content-Length") != strconv.FormatInt(r.ContentLength, 10) {
			t.Errorf("%s: Content-Length %s, length %d", tc.name, r.Header.Get("Content-Length"), r.ContentLength)
		}
		if !tc.length && strings.HasPrefix(tc.name, "longer") && r.ContentLength != -1 {
			t.Errorf("%s: a chunked body declares %d", tc.name, r.ContentLength)
		}
		if !streaming && string(got) != tc.body {
			t.Errorf("%s: a body that does not stream is changed", tc.name)
		}
	}
	// A body never read (compressed), or that failed: left alone.
	r := httptest.NewRequest("POST", "/v1/chat/completions", strings.NewReader(`{"stream":true}`))
	r.Header.Set("Content-Encoding", "gzip")
	ReadRequest(r)
	if AskUsage(r) != nil {
		t.Error("a compressed body is rewritten")
	}
}

// openAIStream is a chat completions stream as OpenAI writes it, with
// include_usage (every chunk's usage null, then the usage chunk) or
// without (no usage member at all); azure adds the prompt filter chunk
// Azure sends first (no choices, no usage).
func openAIStream(includeUsage, azure bool, eol string) string {
	usage := ""
	if includeUsage {
		usage = `,"usage":null`
	}
	var b strings.Builder
	chunk := func(choices string) {
		fmt.Fprintf(&b, `data: {"id":"chatcmpl-B9","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4.1-2025-04-14","service_tier":"default","system_fingerprint":"fp_1","choices":[%s]%s,"obfuscation":"x1"}`+eol+eol, choices, usage)
	}
	if azure {
		b.WriteString(`data: {"choices":[],"created":0,"id":"","model":"","object":"","prompt_filter_results":[{"prompt_index":0,"content_filter_results":{}}]}` + eol + eol)
	}
	chunk(`{"index":0,"delta":{"role":"assistant","content":"","refusal":null},"logprobs":null,"finish_reason":null}`)
	for _, w := range []string{"Hello", " \"usage\":null", " {\"choices\":[]}"} {
		chunk(`{"index":0,"delta":{"content":` + strconv.Quote(w) + `},"logprobs":null,"finish_reason":null}`)
	}
	chunk(`{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}`)
	if includeUsage {
		b.WriteString(`data: {"id":"chatcmpl-B9","object":"chat.completion.chunk","created":1741569952,"model":"gpt-4.1-2025-04-14","service_tier":"default","system_fingerprint":"fp_1","choices":[],"usage":{"prompt_tokens":19,"completion_tokens":10,"total_tokens":29,"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}},"obfuscation":"x2"}` + eol + eol)
	}
	b.WriteString("data: [DONE]" + eol + eol)
	return b.String()
}

// TestUsageFilter: the stream asked for usage, filtered, is byte for byte
// the stream without it, however its bytes are split; the usage is read
// from what passed.
func TestUsageFilter(t *testing.T) {
	for _, eol := range []string{"\n", "\r\n"} {
		for _, azure := range []bool{false, true} {
			with, without := openAIStream(true, azure, eol), openAIStream(false, azure, eol)
			for _, chunk := range []int{1, 2, 3, 7, 50, 333, len(with)} {
				var got bytes.Buffer
				f := NewUsageFilter(&got)
				for i := 0; i < len(with); i += chunk {
					if n, err := f.Write([]byte(with[i:min(i+chunk, len(with))])); err != nil || n != min(chunk, len(with)-i) {
						t.Fatalf("Write: %d, %v", n, err)
					}
				}
				if err := f.Close(); err != nil {
					t.Fatal(err)
				}
				if got.String() != without || f.Removed != 1 {
					t.Fatalf("eol %q, azure %v, chunks of %d: removed %d\n got %q\nwant %q", eol, azure, chunk, f.Removed, got.String(), without)
				}
			}
			s := scanAll(with, true, 5)
			if u, ok := s.found.usage(OpenAI, UnitWeights); !ok || u != 29 {
				t.Errorf("the usage of the stream asked: %d, %v", u, ok)
			}
		}
	}
}

// TestUsageFilterLeaves: what is not the usage's passes untouched: a
// stream that never asked, events of other shapes, an event too long to
// hold, the end of a cut stream.
func TestUsageFilterLeaves(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"no usage asked", openAIStream(false, false, "\n"), openAIStream(false, false, "\n")},
		{"usage in a chunk with choices", "data: {\"choices\":[{}],\"usage\":{\"total_tokens\":1}}\n\n", "data: {\"choices\":[{}],\"usage\":{\"total_tokens\":1}}\n\n"},
		{"usage null, first", "data: {\"usage\":null,\"choices\":[]}\n\n", "data: {\"choices\":[]}\n\n"},
		{"usage null, alone", "data: {\"usage\" : null}\n\n", "data: {}\n\n"},
		{"usage null, spaced", "data: {\"a\":1 , \"usage\" : null , \"b\":2}\n\n", "data: {\"a\":1 , \"b\":2}\n\n"},
		{"two data lines", "data: {\"choices\":[],\ndata: \"usage\":{}}\n\n", "data: {\"choices\":[],\ndata: \"usage\":{}}\n\n"},
		{"other fields", "event: x\ndata: {\"choices\":[],\"usage\":{}}\n\n", "event: x\ndata: {\"choices\":[],\"usage\":{}}\n\n"},
		{"not JSON", "data: {\"choices\":[],\"usage\":{}\n\n", "data: {\"choices\":[],\"usage\":{}\n\n"},
		{"comments", ": keep-alive\n\n", ": keep-alive\n\n"},
		{"cut mid-event", "data: {\"choices\":[],\"usage\":{\"total", "data: {\"choices\":[],\"usage\":{\"total"},
		{"too long to hold", "data: {\"choices\":[],\"x\":\"" + strings.Repeat("y", maxEvent) + "\",\"usage\":{}}\n\ndata: {\"usage\":null}\n\n",
			"data: {\"choices\":[],\"x\":\"" + strings.Repeat("y", maxEvent) + "\",\"usage\":{}}\n\ndata: {}\n\n"},
	} {
		for _, chunk := range []int{1, 4096, len(tc.in)} {
			var got bytes.Buffer
			f := NewUsageFilter(&got)
			for i := 0; i < len(tc.in); i += chunk {
				f.Write([]byte(tc.in[i:min(i+chunk, len(tc.in))]))
			}
			f.Close()
			if got.String() != tc.want {
				t.Errorf("%s, chunks of %d:\n got %q\nwant %q", tc.name, chunk, trim(got.String()), trim(tc.want))
			}
		}
	}
}

func trim(s string) string {
	if len(s) > 200 {
		return s[:100] + "..." + s[len(s)-100:]
	}
	return s
}
