package ratelimit

import (
	"strings"
	"testing"
)

// TestUsageScanner: usage.total_tokens of OpenAI-style bodies, JSON and
// server-sent events, whatever the chunking; text that only looks like
// usage (inside strings, nested deeper, not a whole number) is not usage.
func TestUsageScanner(t *testing.T) {
	for _, tc := range []struct {
		name  string
		sse   bool
		body  string
		total int64 // -1: none found
	}{
		{"chat completion", false, `{"id":"c1","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"Hi"}}],"usage":{"prompt_tokens":9,"completion_tokens":12,"total_tokens":21}}`, 21},
		{"spaces and newlines", false, "{\n  \"usage\" : {\n    \"total_tokens\" : 1234 \n  }\n}", 1234},
		{"usage before choices", false, `{"usage":{"total_tokens":7},"choices":[{"message":{"content":"x"}}]}`, 7},
		{"the model writes usage in its answer", false, `{"choices":[{"message":{"content":"{\"usage\":{\"total_tokens\":999999}}"}}],"usage":{"total_tokens":5}}`, 5},
		{"only in the answer", false, `{"choices":[{"message":{"content":"\"usage\": {\"total_tokens\": 999999}"}}]}`, -1},
		{"nested deeper", false, `{"data":{"usage":{"total_tokens":50}}}`, -1},
		{"usage in an array", false, `[{"usage":{"total_tokens":50}}]`, -1},
		{"fractional", false, `{"usage":{"total_tokens":5.5}}`, -1},
		{"negative", false, `{"usage":{"total_tokens":-5}}`, -1},
		{"a string", false, `{"usage":{"total_tokens":"5"}}`, -1},
		{"other fields named alike", false, `{"usage":{"total_tokens_x":9,"xtotal_tokens":8,"total_tokens":3}}`, 3},
		{"escaped key", false, `{"usage":{"total\u005ftokens":9}}`, -1},
		{"too many digits", false, `{"usage":{"total_tokens":12345678901234567890}}`, -1},
		{"stream with usage in the final event", true, "data: {\"choices\":[{\"delta\":{\"content\":\"Hel\"}}]}\n\n" +
			"data: {\"choices\":[{\"delta\":{\"content\":\"lo \\\"usage\\\":{\\\"total_tokens\\\":77}\"}}]}\n\n" +
			"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":4,\"total_tokens\":7}}\n\n" +
			"data: [DONE]\n\n", 7},
		{"stream, CRLF and comments", true, ": keep-alive\r\nevent: message\r\ndata: {\"usage\":{\"total_tokens\":11}}\r\n\r\ndata: [DONE]\r\n\r\n", 11},
		{"stream without usage", true, "data: {\"choices\":[{\"delta\":{\"content\":\"x\"}}]}\n\ndata: [DONE]\n\n", -1},
		{"stream, usage in two events: the last wins", true, "data: {\"usage\":{\"total_tokens\":1}}\n\ndata: {\"usage\":{\"total_tokens\":2}}\n\n", 2},
		{"a line that only contains data:", true, "event: data: {\"usage\":{\"total_tokens\":1}}\n\n", -1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Whole, and one byte at a time: chunking never matters.
			for _, chunk := range []int{len(tc.body), 1, 3} {
				s := &usageScanner{sse: tc.sse}
				for i := 0; i < len(tc.body); i += chunk {
					s.Write([]byte(tc.body[i:min(i+chunk, len(tc.body))]))
				}
				got := int64(-1)
				if s.found {
					got = s.total
				}
				if got != tc.total {
					t.Fatalf("chunks of %d: total %d, want %d", chunk, got, tc.total)
				}
			}
		})
	}
}

// FuzzUsageScanner: whatever bytes an upstream sends, the scanner neither
// panics nor reports a negative usage, and reports the same whatever the
// chunking.
func FuzzUsageScanner(f *testing.F) {
	f.Add(`{"usage":{"total_tokens":21}}`, false, 2)
	f.Add("data: {\"usage\":{\"total_tokens\":7}}\n\ndata: [DONE]\n\n", true, 1)
	f.Add(strings.Repeat("{", 100)+`"usage":`+strings.Repeat("}", 100), false, 5)
	f.Fuzz(func(t *testing.T, body string, sse bool, chunk int) {
		chunk = 1 + (chunk&0xff)%17
		whole, split := &usageScanner{sse: sse}, &usageScanner{sse: sse}
		whole.Write([]byte(body))
		for i := 0; i < len(body); i += chunk {
			split.Write([]byte(body[i:min(i+chunk, len(body))]))
		}
		if whole.found != split.found || whole.total != split.total || whole.total < 0 {
			t.Fatalf("whole %v %d, in chunks of %d %v %d", whole.found, whole.total, chunk, split.found, split.total)
		}
	})
}
