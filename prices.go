package ratelimit

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/price"
	"go.uber.org/zap"
)

// The prices of the LLM models a gateway serves, for the policies that
// budget in money (`unit usd`): lines of the config, and a price list in
// LiteLLM's JSON format. The table itself, its matching of a model's name
// and its price list reader are internal/price's; this file is their
// config.

// Prices are what the models served cost, for policies with `unit usd`.
type Prices struct {
	// Models' prices, in USD per million tokens (up to 6 decimals). They
	// win over the file's.
	Models []*ModelPrice `json:"models,omitempty"`

	// A price list in LiteLLM's JSON format (its
	// model_prices_and_context_window.json, which most LLM gateways
	// share), read when the config loads: for each model,
	// `input_cost_per_token` and `output_cost_per_token`, and
	// `cache_creation_input_token_cost` and `cache_read_input_token_cost`
	// (each defaults to the input price), in USD a token. Entries priced
	// otherwise (images, audio) are left out. A list that does not parse,
	// lists a model twice, or has a price that is missing or negative
	// fails the load, naming the entry. Accepts placeholders such as
	// `{env.PRICES}`.
	File string `json:"file,omitempty"`

	// What a model that neither the lines nor the file price costs:
	// `deny` (the default) refuses a request for it before it reaches the
	// provider (403, naming the model and the policy); a listed model's
	// name prices it as that model. A response that names a model with no
	// price is priced as its request's model.
	Unknown string `json:"unknown,omitempty"`

	table *price.Table
	// fromFile and skipped: the file's models, and its entries left out.
	fromFile, skipped int
}

// ModelPrice is one model's price, in USD per million tokens.
type ModelPrice struct {
	// The model's name, as requests and responses name it. A dated
	// snapshot (gpt-4.1-2025-04-14) or a tagged variant (llama3:8b) the
	// table lacks is priced as the longest listed name it starts with
	// followed by `-`, `:` or `@`.
	Model string `json:"model"`
	// The price of a prompt token. Required.
	Input json.Number `json:"input"`
	// The price of an answer token. Required.
	Output json.Number `json:"output"`
	// The price of a prompt token written to the provider's cache
	// (Anthropic's cache_creation_input_tokens). Default: input's.
	CacheWrite json.Number `json:"cache_write,omitempty"`
	// The price of a prompt token read from the provider's cache
	// (Anthropic's cache_read_input_tokens, OpenAI's cached_tokens).
	// Default: input's.
	CacheRead json.Number `json:"cache_read,omitempty"`
}

// unknownDeny is the Unknown that refuses a model with no price.
const unknownDeny = "deny"

// check checks the lines, without reading the file (which load does):
// what `caddy adapt` can tell.
func (pr *Prices) check() (map[string]price.Price, error) {
	if pr.File == "" && len(pr.Models) == 0 {
		return nil, errors.New("prices: a model's price (<model> input <usd> output <usd>) or a file is required")
	}
	lines := make(map[string]price.Price, len(pr.Models))
	for i, m := range pr.Models {
		if m == nil || m.Model == "" {
			return nil, fmt.Errorf("prices: models[%d]: a model's name is required", i)
		}
		if _, dup := lines[m.Model]; dup {
			return nil, fmt.Errorf("prices: %s: listed twice", m.Model)
		}
		p, err := m.price()
		if err != nil {
			return nil, fmt.Errorf("prices: %s: %v", m.Model, err)
		}
		lines[m.Model] = p
	}
	return lines, nil
}

// price is the line's price in pico-dollars a token.
func (m *ModelPrice) price() (price.Price, error) {
	var p price.Price
	for _, f := range []struct {
		name string
		v    json.Number
		dst  *int64
	}{{"input", m.Input, &p.Input}, {"output", m.Output, &p.Output}, {"cache_write", m.CacheWrite, &p.CacheWrite}, {"cache_read", m.CacheRead, &p.CacheRead}} {
		if f.v == "" {
			if f.name == "input" || f.name == "output" {
				return p, fmt.Errorf("%s: a price is required (USD per million tokens), as in %s input 2.50 output 10", f.name, m.Model)
			}
			*f.dst = -1
			continue
		}
		v, err := price.ParsePerMillion(f.v.String())
		if err != nil {
			return p, fmt.Errorf("%s: %v", f.name, err)
		}
		*f.dst = v
	}
	if p.CacheWrite < 0 {
		p.CacheWrite = p.Input
	}
	if p.CacheRead < 0 {
		p.CacheRead = p.Input
	}
	return p, nil
}

// load builds the table: the lines, over the file's models. Loaded once
// (Validate runs before and during provisioning).
func (pr *Prices) load() error {
	if pr.table != nil {
		return nil
	}
	lines, err := pr.check()
	if err != nil {
		return err
	}
	models := map[string]price.Price{}
	if pr.File != "" {
		path := caddy.NewReplacer().ReplaceAll(pr.File, "")
		data, err := os.ReadFile(path)
		if err != nil {
			return fmt.Errorf("prices: file %q: %v", path, err)
		}
		if models, pr.skipped, err = price.ReadLiteLLM(data); err != nil {
			return fmt.Errorf("prices: file %q: %v", path, err)
		}
		pr.fromFile = len(models)
	}
	maps.Copy(models, lines) // the lines win
	unknown := pr.Unknown
	if unknown == unknownDeny {
		unknown = ""
	}
	if pr.table, err = price.NewTable(models, unknown); err != nil {
		return fmt.Errorf("prices: %v", err)
	}
	return nil
}

// logLoaded says what the table holds, once the config loads.
func (pr *Prices) logLoaded(logger *zap.Logger) {
	if pr == nil || pr.table == nil {
		return
	}
	fields := []zap.Field{zap.Int("models", pr.table.Len()), zap.Int("lines", len(pr.Models))}
	if pr.File != "" {
		fields = append(fields, zap.String("file", pr.File), zap.Int("from_file", pr.fromFile), zap.Int("file_entries_not_priced_by_token", pr.skipped))
	}
	unknown := pr.table.Unknown()
	if unknown == "" {
		unknown = unknownDeny
	}
	logger.Info("prices loaded", append(fields, zap.String("unknown", unknown))...)
}

// checkPrices checks the prices against the policies that need them: a
// money policy that prices an LLM request (cost or settle from its body)
// needs the handler's prices.
func (h *Handler) checkPrices() error {
	if h.Prices != nil {
		if _, err := h.Prices.check(); err != nil {
			return fieldErr("prices", "%v", err)
		}
	}
	for _, p := range h.Policies {
		if p == nil || p.unit != unitUSD || !p.pricesModels() || h.Prices != nil {
			continue
		}
		return fmt.Errorf("policy %q: unit usd prices LLM requests (%s) with the handler's prices: add a prices block, e.g. prices { gpt-4.1 input 2 output 8 }, or prices { file <LiteLLM price list> }", p.Name, p.bodyWhat())
	}
	return nil
}

// pricesModels reports whether the policy prices the model of an LLM
// request: a money policy whose cost or settle reads the body.
func (p *Policy) pricesModels() bool {
	return p.unit == unitUSD && (p.costs.fromBody || p.Settle != nil && p.Settle.fromBody())
}

// bodyWhat names what of the policy reads an LLM body, for messages.
func (p *Policy) bodyWhat() string {
	var what []string
	if p.costs.fromBody {
		what = append(what, "cost "+string(p.Cost))
	}
	if p.Settle != nil && p.Settle.fromBody() {
		what = append(what, "settle "+p.Settle.From)
	}
	return strings.Join(what, ", ")
}

// unmarshalCaddyfile reads a prices block:
//
//	prices {
//	    <model> input <usd> output <usd> [cache_write <usd>] [cache_read <usd>]
//	    file    <path>
//	    unknown deny|<model>
//	}
func (pr *Prices) unmarshalCaddyfile(d *caddyfile.Dispenser) error {
	s := newSection(d, "prices: ")
	if d.NextArg() {
		return s.errf(d, "unexpected argument %q: the prices go in the block, one model a line", d.Val())
	}
	lines := map[string]int{}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		name := d.Val()
		args := d.RemainingArgs()
		switch {
		case (name == "file" || name == "unknown") && len(args) == 1:
			if err := s.once(d); err != nil {
				return err
			}
			if name == "file" {
				pr.File = args[0]
			} else {
				pr.Unknown = args[0]
			}
			continue
		case name == "file" || name == "unknown":
			if len(args) == 0 {
				return s.errf(d, "%s: a value is required", name)
			}
		}
		if first, dup := lines[name]; dup {
			return s.errf(d, "%s: listed twice (first at line %d)", name, first)
		}
		lines[name] = d.Line()
		m := &ModelPrice{Model: name}
		seen := map[string]bool{}
		for len(args) > 0 {
			var dst *json.Number
			switch args[0] {
			case "input":
				dst = &m.Input
			case "output":
				dst = &m.Output
			case "cache_write":
				dst = &m.CacheWrite
			case "cache_read":
				dst = &m.CacheRead
			default:
				return s.errf(d, "%s: unexpected %q: a model's line is <model> input <usd> output <usd> [cache_write <usd>] [cache_read <usd>], in USD per million tokens", name, args[0])
			}
			if seen[args[0]] {
				return s.errf(d, "%s: %s given twice", name, args[0])
			}
			seen[args[0]] = true
			if len(args) < 2 {
				return s.errf(d, "%s: %s: a price is required (USD per million tokens)", name, args[0])
			}
			v, err := price.ParsePerMillion(args[1])
			if err != nil {
				return s.errf(d, "%s: %s: %v", name, args[0], err)
			}
			*dst, args = json.Number(price.FormatPerMillion(v)), args[2:]
		}
		if _, err := m.price(); err != nil {
			return s.errf(d, "%s: %v", name, err)
		}
		pr.Models = append(pr.Models, m)
	}
	if pr.File == "" && len(pr.Models) == 0 {
		return s.errf(d, "a model's price (<model> input <usd> output <usd>) or a file is required")
	}
	return nil
}
