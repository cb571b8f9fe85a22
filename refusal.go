package ratelimit

import "net/http"

// A request refused before any decision, for what it is rather than for a
// budget: two different credentials (credential.go), an answer without a
// ceiling under `unbounded refuse` (request_cost.go). It is answered 400
// before the provider, in the error_format of the policy that refuses it
// (or the handler's): the SDKs show a provider-shaped error's message, and
// nothing of a problem body.

// refusal is the error match returns for a request refused.
type refusal struct {
	policy *Policy
	code   string // the provider-shaped error's code
	title  string // the problem's title
	detail string // what the client is told: never a credential
}

func (r *refusal) Error() string { return r.detail }

// refuse answers a refused request: 400, in the error_format of the
// refusing policy, or the handler's.
func (h *Handler) refuse(w http.ResponseWriter, rf *refusal) error {
	format := rf.policy.ErrorFormat
	if format == "" {
		format = h.ErrorFormat
	}
	switch format {
	case errorFormatOpenAI:
		return writeProviderError(w, http.StatusBadRequest, openAIError(rf.detail, "invalid_request_error", rf.code))
	case errorFormatAnthropic:
		return writeProviderError(w, http.StatusBadRequest, anthropicError(rf.detail, "invalid_request_error"))
	}
	return writeProblem(w, problem{Type: "about:blank", Title: rf.title, Status: http.StatusBadRequest, Detail: rf.detail})
}
