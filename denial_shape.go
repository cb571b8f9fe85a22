package ratelimit

import (
	"encoding/json"
	"net/http"
	"strconv"
	"strings"
)

// What an SDK makes of a denial. The official OpenAI and Anthropic SDKs
// retry a 429 by themselves, after the wait the response gives
// (setRetryFields says when not to), and surface its body as an error:
// OpenAI's reads `{"error": {"message", "type", "code", "param"}}` and
// shows anything else as "429 status code (no body)"; Anthropic's reads
// `{"type": "error", "error": {"type", "message"}}`. `error_format`
// shapes the 429 body as the provider's own rate-limit error, so the
// application can tell the gateway's budget from the provider's limit.
// The RateLimit fields are sent as with any format.

// Formats of a 429 body (error_format).
const (
	errorFormatProblem   = "problem" // RFC 9457, the default
	errorFormatOpenAI    = "openai"
	errorFormatAnthropic = "anthropic"
)

// checkErrorFormat checks an error_format.
func checkErrorFormat(f string) error {
	switch f {
	case "", errorFormatProblem, errorFormatOpenAI, errorFormatAnthropic:
		return nil
	}
	return fieldErr("error_format", "error_format: %q is not problem, openai or anthropic", f)
}

// retryable reports whether the client may retry a denial by itself: not
// when it can never fit (wait neverFits), when a quota denied it (it comes
// back at its period's end), or when its Retry-After is past
// maxRetryWait.
func (res *admission) retryable(wait, ra int64) bool {
	if wait == neverFits || ra > maxRetryWait {
		return false
	}
	for pt := range res.denials() {
		if pt.rq.kind() == quotaBucket {
			return false
		}
	}
	return true
}

// refundableWait reports whether a denial waits only for tokens that
// reservations hold, which their responses may give back (charge_if,
// settle): every policy that denied gives back after its responses, its
// bucket owes nothing beyond empty (no debt: the wait is not a usage
// already made), and the cost can fit. Such a wait may end with the next
// response: the client is told to come back within maxRetryWait, never
// not to retry (`x-should-retry: false`) — a tenant whose requests in
// flight reserved its budget would otherwise be sent away for the hours
// the bucket takes to refill, though their refunds come in seconds.
func (res *admission) refundableWait() bool {
	denied := false
	for pt := range res.callerDenials() {
		if !pt.policy.givesBack() || pt.rq.kind() == quotaBucket || pt.v.remaining < 0 || pt.v.untilFits == neverFits {
			return false
		}
		denied = true
	}
	return denied
}

// writeDenial writes the body of a 429, in the error_format of the first
// denying policy that sets one, or else the handler's: a problem (RFC
// 9457) by default.
func (h *Handler) writeDenial(w http.ResponseWriter, res *admission, violated []string, denier *Policy, ra int64) error {
	format, tokens := "", false
	for pt := range res.callerDenials() {
		p := pt.policy
		tokens = tokens || p.charging() == chargedBySettle || p.costs.fromBody
		if format == "" {
			format = p.ErrorFormat
		}
	}
	if format == "" {
		format = h.ErrorFormat
	}
	money, budgets := res.moneyDenial() // money.go
	switch format {
	case errorFormatOpenAI:
		kind := "requests"
		if tokens {
			kind = "tokens"
		}
		return writeProviderError(w, http.StatusTooManyRequests, openAIError(strings.TrimSpace(denialMessage(violated, ra)+" "+money), kind, "rate_limit_exceeded"))
	case errorFormatAnthropic:
		return writeProviderError(w, http.StatusTooManyRequests, anthropicError(strings.TrimSpace(denialMessage(violated, ra)+" "+money), "rate_limit_error"))
	}
	if budgets != nil {
		pr := quotaExceeded(violated)
		pr.Detail += " " + money
		body, _ := json.Marshal(struct {
			problem
			Budgets []moneyBudget `json:"budgets"`
		}{pr, budgets})
		return writeProblemBody(w, http.StatusTooManyRequests, body)
	}
	if len(violated) == 1 {
		return writeProblemBody(w, http.StatusTooManyRequests, denier.deniedBody)
	}
	return writeProblem(w, quotaExceeded(violated))
}

// openAIError is an error body as OpenAI's API writes one, which its SDK
// shows: {"error": {"message", "type", "param", "code"}}.
func openAIError(message, kind, code string) []byte {
	type openaiError struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    string  `json:"code"`
	}
	body, _ := json.Marshal(struct {
		Error openaiError `json:"error"`
	}{openaiError{Message: message, Type: kind, Code: code}})
	return body
}

// anthropicError is an error body as Anthropic's API writes one:
// {"type": "error", "error": {"type", "message"}}.
func anthropicError(message, kind string) []byte {
	type anthropicErr struct {
		Type    string `json:"type"`
		Message string `json:"message"`
	}
	body, _ := json.Marshal(struct {
		Type  string       `json:"type"`
		Error anthropicErr `json:"error"`
	}{"error", anthropicErr{Type: kind, Message: message}})
	return body
}

// writeProviderError answers status with a provider-shaped error body.
func writeProviderError(w http.ResponseWriter, status int, body []byte) error {
	hdr := w.Header()
	hdr.Set("Content-Type", "application/json")
	hdr.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_, err := w.Write(body)
	return err
}

// denialMessage is what the application is told of a denial: which
// policies, and when to come back (ra seconds; 0: never, the request's
// cost can never fit).
func denialMessage(violated []string, ra int64) string {
	noun := "policy"
	if len(violated) > 1 {
		noun = "policies"
	}
	msg := "Rate limit exceeded for " + noun + " " + strings.Join(violated, ", ") + " of this gateway."
	if ra == 0 {
		return msg + " This request costs more than the policy's burst, so it can never be admitted: ask for fewer tokens (max_tokens)."
	}
	return msg + " Please try again in " + strconv.FormatInt(ra, 10) + "s."
}
