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

// unboundedRefuse is `unbounded refuse`; unboundedMax, its default.
const (
	unboundedMax    = "max"
	unboundedRefuse = "refuse"
)

// checkUnbounded checks `cost openai ... unbounded <max|refuse>`.
func (p *Policy) checkUnbounded() error {
	p.costs.refuse = p.Unbounded == unboundedRefuse
	switch {
	case p.Unbounded == "":
		return nil
	case p.Unbounded != unboundedMax && p.Unbounded != unboundedRefuse:
		return fieldErr("cost", "cost: unbounded %q is not max or refuse", p.Unbounded)
	case string(p.Cost) != costOpenAI && string(p.Cost) != costAnthropic:
		return fieldErr("cost", "cost: unbounded is for cost openai or anthropic, which read the answer's ceiling from the body")
	}
	return nil
}

// unboundedRefusal refuses a request whose body does not bound its answer,
// for policy p (`unbounded refuse`).
func unboundedRefusal(p *Policy) *refusal {
	return &refusal{policy: p, code: "ceiling_required", title: "Output Without a Ceiling",
		detail: "This gateway needs a ceiling on the answer: set max_tokens (max_completion_tokens, max_output_tokens), " +
			"and do not ask for a background response, whose usage it cannot see."}
}
