package ratelimit

import (
	"net/http"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
)

// `cost openai`: the reservation of an LLM request, read from its JSON
// body before it runs (llm.ReadRequest), once per request.

// costOpenAI is the Cost that reserves from the request body.
const costOpenAI = "openai"

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
