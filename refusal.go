package ratelimit

import (
	"encoding/json"
	"net/http"
)

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
	var body []byte
	switch format {
	case errorFormatOpenAI:
		type openaiError struct {
			Message string  `json:"message"`
			Type    string  `json:"type"`
			Param   *string `json:"param"`
			Code    string  `json:"code"`
		}
		body, _ = json.Marshal(struct {
			Error openaiError `json:"error"`
		}{openaiError{Message: rf.detail, Type: "invalid_request_error", Code: rf.code}})
	case errorFormatAnthropic:
		type anthropicError struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		}
		body, _ = json.Marshal(struct {
			Type  string         `json:"type"`
			Error anthropicError `json:"error"`
		}{"error", anthropicError{Type: "invalid_request_error", Message: rf.detail}})
	default:
		return writeProblem(w, problem{Type: "about:blank", Title: rf.title, Status: http.StatusBadRequest, Detail: rf.detail})
	}
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusBadRequest)
	_, err := w.Write(body)
	return err
}
