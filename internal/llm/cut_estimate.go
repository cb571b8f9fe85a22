package llm

// What a response cut before its usage (the client gone, the upstream cut,
// no usage event) is charged: never less than its reservation, and never
// less than its true usage could be, so that cutting a stream is never
// cheaper than reading it. Four bytes a token is about right for English,
// but code, digits and many languages run at 1 to 3 bytes a token: a cut
// stream of a dense prompt estimated at 4 would be charged a quarter of
// what reading it costs. GPT's and Claude's tokenizers are byte-level: a
// token stands for at least one byte of text, so one token per byte of
// text (JSON escapes only make the text longer) is a bound the true count
// never exceeds.

// denseBytesPerToken is the cut estimate's ratio: at most one token per
// byte of text.
const denseBytesPerToken = 1

// cutEstimate is the usage of a response without usage, weighed as the
// settle weighs usage (w), at least what reading it whole could have cost:
// its prompt, as the stream counted it (Anthropic's message_start carries
// the input, cache writes and reads: exact), or else the prompt's bytes
// that its request's body showed (ReadRequest) at one token each; plus its
// answer at the ceiling the request set (max_tokens, which the provider
// enforces, times the answers it asked for: what the rest of the stream
// could have used), and at least the text it delivered at one token a
// byte.
func cutEstimate(p Provider, w Weights, body Request, found *scanFound) int64 {
	out := found.text / denseBytesPerToken
	if body.ok {
		// Its ceilings (each answer's, times the answers asked for), and at
		// least what it delivered: a ceiling the request does not show
		// binding (n not read, reasoning) is no discount.
		out = max(out, body.ceiling())
	}
	if p == Anthropic {
		if in, ok := found.first(slotUsageInput, slotMsgInput); ok {
			written, _ := found.first(slotUsage+fieldCacheWrite, slotMsg+fieldCacheWrite)
			read, _ := found.first(slotUsage+fieldCacheRead, slotMsg+fieldCacheRead)
			return w.weighParts(in, out, written, read)
		}
	}
	return w.weigh(body.promptBytes/denseBytesPerToken, out)
}
