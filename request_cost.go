package ratelimit

import (
	"net/http"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
)

// `cost openai`: the reservation of an LLM request, read from its JSON
// body before it runs (llm.ReadRequest), once per request.

// costOpenAI and costAnthropic are the Costs that reserve from the request
// body (the two read it alike: its model, max_tokens and prompt).
const (
	costOpenAI    = "openai"
	costAnthropic = "anthropic"
)

// requestBodyOf reads the request body once for all the policies of all
// the handlers a request passes through.
func requestBodyOf(r *http.Request, rs *requestState) llm.Request {
	if rs == nil {
		return llm.ReadRequest(r)
	}
	if !rs.bodyRead {
		rs.body, rs.bodyRead = llm.ReadRequest(r), true
	}
	return rs.body
}
