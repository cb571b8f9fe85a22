package ratelimit

import (
	"encoding/json"
	"net/http"
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
)

// Money budgets at request time: the model a request names, priced before
// it runs (refused when it has no price), the model its response names,
// priced when it settles, and the spend counted. A money policy's amounts
// are micro-dollars (unit.go), and a price in pico-dollars a token is a
// weight of llm.Weights in millionths: tokens × price / 10^6 µ$, rounded
// up, by the same arithmetic as a token budget's weights.

// Where a model with no price was named: unpricedModels's label `at`.
const (
	unpricedRequest = iota
	unpricedResponse
)

// moneyMetrics are a money policy's counters.
type moneyMetrics struct {
	unpriced [2]prometheus.Counter // by where (unpricedRequest, unpricedResponse)
	// spent holds the policy's spend counter of each model priced (a
	// listed name, or empty: a bounded set), found without hashing labels
	// on every settle.
	spent *sync.Map // model -> prometheus.Counter
}

// provisionMoney sets up a money policy's counters.
func (p *Policy) provisionMoney() {
	if p.unit != unitUSD {
		return
	}
	p.money.unpriced = [2]prometheus.Counter{unpricedModels.WithLabelValues(p.Name, "request"), unpricedModels.WithLabelValues(p.Name, "response")}
	p.money.spent = new(sync.Map)
}

// unpricedModel reports whether the request names a model this money
// policy has no price for (counted): a request refused before it runs,
// under `unknown deny`. A request that names no model is not refused: it
// reserves max.
func (p *Policy) unpricedModel(rb llm.Request) bool {
	m := rb.Model()
	if m == "" && !rb.NamesModel() {
		return false
	}
	_, _, listed, ok := p.prices.Of(m) // a name too long or broken to read is no model's
	if !listed {
		p.money.unpriced[unpricedRequest].Inc()
	}
	return !ok
}

// moneyCost is what an LLM request reserves under a money policy: its
// prompt's estimate and its ceiling on output, at its model's prices; max
// when it names no model (or hides input, or does not say).
func (p *Policy) moneyCost(rb llm.Request) int64 {
	_, pr, _, ok := p.prices.Of(rb.Model())
	if !ok {
		return p.costs.max
	}
	return rb.Reservation(llm.Weights(pr), p.costs.max)
}

// settlePrice is what a response's usage is priced at under a money
// policy: the prices of the model the response names (what was served),
// else of the request's (a response naming a model the prices lack is
// counted); the listed name priced, for the spend's label; false when
// neither has a price (the reservation stands).
func (p *Policy) settlePrice(served string, rb llm.Request) (llm.Weights, string, bool) {
	if served != "" {
		if name, pr, ok := p.prices.Lookup(served); ok {
			return llm.Weights(pr), name, true
		}
		p.money.unpriced[unpricedResponse].Inc()
	}
	name, pr, _, ok := p.prices.Of(rb.Model())
	return llm.Weights(pr), name, ok
}

// spend counts a money policy's charge of one request, in micro-dollars,
// for the model priced.
func (p *Policy) spend(model string, micros int64) {
	if p.unit != unitUSD || micros <= 0 || p.money.spent == nil {
		return
	}
	c, ok := p.money.spent.Load(model)
	if !ok {
		c, _ = p.money.spent.LoadOrStore(model, spendUSD.WithLabelValues(p.Name, model))
	}
	c.(prometheus.Counter).Add(float64(micros) / price.Micro)
}

// spendAtAdmission counts the charges of the money policies an admitted
// request leaves as they are (neither settled nor charged if): their
// cost.
func (res *admission) spendAtAdmission(rs *requestState) {
	for _, pt := range res.decidedParts() {
		p := pt.policy
		if p.unit != unitUSD || p.givesBack() || !pt.v.allowed {
			continue
		}
		model := ""
		if p.pricesModels() && rs.bodyRead {
			model, _, _, _ = p.prices.Of(rs.body.Model())
		}
		p.spend(model, pt.rq.cost)
	}
}

// modelPlaceholder is the placeholder of the request's model.
const modelPlaceholder = "http.rate_limit.model"

// readsModel reports whether a key template uses the request's model,
// which is read from its body before the key resolves.
func readsModel(key string) bool { return strings.Contains(key, "{"+modelPlaceholder+"}") }

// model is the request's model as {http.rate_limit.model} gives it: with
// prices, the listed name it is priced as (a dated snapshot is its
// family's: one bucket per model whatever the client writes), the unknown
// model's for one the prices lack, or empty under unknown deny; without
// prices, the model as the body names it. Empty when the body was not read
// or names none.
func (rs *requestState) model() string {
	if !rs.bodyRead {
		return ""
	}
	m := rs.body.Model()
	if rs.prices == nil || m == "" {
		return m
	}
	name, _, _, _ := rs.prices.Of(m)
	return name
}

// refuseUnpriced answers a request for a model a money policy has no
// price for: 403, before it reaches the provider, charged nothing. The
// body names the model and the policy, shaped as the policy's
// error_format.
func (h *Handler) refuseUnpriced(w http.ResponseWriter, rs *requestState, res *admission) error {
	p, model := res.unpriced, rs.body.Model()
	rs.decidedAs(outcomeDenied, p.Name, "", -1, 0)
	named := "The model " + jsonQuote(model)
	if model == "" {
		named = "The model named (a name too long, or written with a broken escape)"
	}
	msg := named + " has no price in this gateway's budget " + p.Name +
		": a request for it is refused before it reaches the provider. Use a model the gateway prices."
	format := p.ErrorFormat
	if format == "" {
		format = h.ErrorFormat
	}
	var body []byte
	switch format {
	case errorFormatOpenAI:
		param := "model"
		body, _ = json.Marshal(map[string]any{"error": map[string]any{"message": msg, "type": "invalid_request_error", "param": &param, "code": "model_not_priced"}})
	case errorFormatAnthropic:
		body, _ = json.Marshal(map[string]any{"type": "error", "error": map[string]any{"type": "permission_error", "message": msg}})
	default:
		body, _ = json.Marshal(struct {
			problem
			Policy string `json:"policy"`
			Model  string `json:"model"`
		}{problem{Type: "about:blank", Title: "Forbidden", Status: http.StatusForbidden, Detail: msg}, p.Name, model})
		return writeProblemBody(w, http.StatusForbidden, body)
	}
	return writeProviderError(w, http.StatusForbidden, body)
}

// jsonQuote quotes s as JSON does, for messages that show a client's text.
func jsonQuote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// isChatCompletions reports whether the request is for OpenAI's chat
// completions API (or an OpenAI-compatible one), whose streams report
// usage only when asked.
func isChatCompletions(r *http.Request) bool {
	return strings.HasSuffix(strings.TrimSuffix(r.URL.Path, "/"), "/chat/completions")
}

// askUsage makes a streaming chat completions request ask for its usage
// when an admitted policy settles it with include_usage (see
// llm.AskUsage); the response is then given back without what asking
// added (afterResponse). The upstream is asked for an uncompressed
// stream, which is what is filtered.
func (res *admission) askUsage(r *http.Request, rs *requestState) {
	if !isChatCompletions(r) {
		return
	}
	for _, pt := range res.decidedParts() {
		if p := pt.policy; p.Settle == nil || !p.Settle.IncludeUsage || !pt.v.allowed {
			continue
		}
		requestBodyOf(r, rs)
		if rs.usageAsk == nil && !rs.usageAskTried {
			rs.usageAsk, rs.usageAskTried = llm.AskUsage(r), true
		}
		if rs.usageAsk != nil && (rs.usageAsk.Strip() || !rs.bodyWhole()) {
			r.Header.Del("Accept-Encoding")
		}
		return
	}
}

// usageFilterFor is the filter of a response to a request whose body asked
// for usage for the gateway (not its client): an uncompressed event
// stream; nil for any other.
func usageFilterFor(rs *requestState, hdr http.Header, w http.ResponseWriter) *llm.UsageFilter {
	if rs == nil || !rs.usageAsk.Strip() || !strings.HasPrefix(strings.ToLower(hdr.Get("Content-Type")), "text/event-stream") {
		return nil
	}
	if ce := hdr.Get("Content-Encoding"); ce != "" && !strings.EqualFold(ce, "identity") {
		return nil
	}
	hdr.Del("Content-Length") // what is removed shortens it
	return llm.NewUsageFilter(writerOnlyOf(w))
}

// writerOnlyOf hides w's other methods: the filter only writes.
func writerOnlyOf(w http.ResponseWriter) writerOnly { return writerOnly{w} }

// moneyBudget is a money policy's part of a denial's problem details: its
// budget, what is left and what the request asked, in dollars (decimal
// strings, exact).
type moneyBudget struct {
	Policy    string `json:"policy"`
	Currency  string `json:"currency"`
	Limit     string `json:"limit"`
	Remaining string `json:"remaining"`
	Request   string `json:"request"`
}

// moneyDenial says, in dollars, which money budgets denied the request:
// a sentence for the message, and the problem's members; empty when no
// money policy denied it.
func (res *admission) moneyDenial() (string, []moneyBudget) {
	var say []string
	var budgets []moneyBudget
	for pt := range res.callerDenials() {
		p, v := pt.policy, pt.v
		if p.unit != unitUSD {
			continue
		}
		capacity := pt.decidedLimit().burst
		if pt.rq.kind() == quotaBucket {
			capacity = pt.decidedQuota()
		}
		cost := max(v.cost, pt.rq.cost)
		left := max(v.remaining, 0)
		budgets = append(budgets, moneyBudget{Policy: p.Name, Currency: "USD", Limit: p.unit.number(capacity), Remaining: p.unit.number(left), Request: p.unit.number(cost)})
		say = append(say, "budget "+p.Name+" has "+p.unit.format(left)+" left of "+p.unit.format(capacity)+", and this request reserves "+p.unit.format(cost))
	}
	if len(say) == 0 {
		return "", nil
	}
	s := strings.Join(say, "; ") + "."
	return strings.ToUpper(s[:1]) + s[1:], budgets
}
