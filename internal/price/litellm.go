package price

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// The price list in LiteLLM's format (its model_prices_and_context_window.json,
// which most LLM gateways share): one JSON object whose members are
// models, each an object of which four members are read, in USD a token:
//
//	"gpt-4.1": {"input_cost_per_token": 2e-06, "output_cost_per_token": 8e-06,
//	            "cache_read_input_token_cost": 5e-07, ...}
//
// input_cost_per_token and output_cost_per_token price a model by its
// tokens; cache_creation_input_token_cost and cache_read_input_token_cost
// price the prompt tokens written to and read from the provider's cache,
// and default to the input price (never cheaper than the provider may
// bill). An entry with neither per-token price is not priced by tokens (an
// image, audio or search model) and is left out; "sample_spec", the list's
// own documentation, too.

// The members of an entry that are read.
const (
	fieldInput      = "input_cost_per_token"
	fieldOutput     = "output_cost_per_token"
	fieldCacheWrite = "cache_creation_input_token_cost"
	fieldCacheRead  = "cache_read_input_token_cost"
)

// EntryError is a mistake in one entry of a price list: its model, and
// what is wrong.
type EntryError struct {
	Model string
	Err   error
}

func (e *EntryError) Error() string { return fmt.Sprintf("entry %q: %v", e.Model, e.Err) }

func (e *EntryError) Unwrap() error { return e.Err }

// ReadLiteLLM reads a price list in LiteLLM's format: the models priced by
// the token, and how many entries were left out (not priced by the
// token). A list that is not such a JSON object, a model listed twice, or
// an entry with a price that is missing (one of input and output without
// the other), negative, not a number or above MaxPrice is an error, an
// *EntryError naming the entry where there is one; a price more precise
// than a pico-dollar a token is rounded up.
func ReadLiteLLM(data []byte) (models map[string]Price, skipped int, err error) {
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		return nil, 0, syntaxError(data, dec, err, "the price list is not a JSON object of models")
	}
	models = map[string]Price{}
	seen := map[string]bool{}
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return nil, 0, syntaxError(data, dec, err, "")
		}
		model := tok.(string) // an object's member names are strings
		var entry map[string]json.RawMessage
		if err := dec.Decode(&entry); err != nil {
			var typeErr *json.UnmarshalTypeError
			if errors.As(err, &typeErr) {
				return nil, 0, &EntryError{model, errors.New("not an object of prices")}
			}
			return nil, 0, syntaxErrorAt(data, dec, dec.InputOffset(), err, "")
		}
		if seen[model] {
			return nil, 0, &EntryError{model, errors.New("listed twice")}
		}
		seen[model] = true
		if model == "sample_spec" {
			continue
		}
		p, priced, err := readEntry(entry)
		if err != nil {
			return nil, 0, &EntryError{model, err}
		}
		if !priced {
			skipped++
			continue
		}
		models[model] = p
	}
	if _, err := dec.Token(); err != nil {
		return nil, 0, syntaxError(data, dec, err, "")
	}
	if _, err := dec.Token(); err != io.EOF {
		return nil, 0, syntaxError(data, dec, nil, "more after the price list's object")
	}
	return models, skipped, nil
}

// readEntry reads one model's prices; priced is false for an entry with
// no price by the token.
func readEntry(entry map[string]json.RawMessage) (p Price, priced bool, err error) {
	_, hasIn := entry[fieldInput]
	_, hasOut := entry[fieldOutput]
	switch {
	case !hasIn && !hasOut:
		return Price{}, false, nil
	case !hasIn:
		return Price{}, false, fmt.Errorf("%s is missing (%s is given)", fieldInput, fieldOutput)
	case !hasOut:
		return Price{}, false, fmt.Errorf("%s is missing (%s is given)", fieldOutput, fieldInput)
	}
	p.CacheWrite, p.CacheRead = -1, -1
	for _, f := range []struct {
		name string
		dst  *int64
	}{{fieldInput, &p.Input}, {fieldOutput, &p.Output}, {fieldCacheWrite, &p.CacheWrite}, {fieldCacheRead, &p.CacheRead}} {
		raw, ok := entry[f.name]
		if !ok {
			continue
		}
		if *f.dst, err = perToken(raw); err != nil {
			return Price{}, false, fmt.Errorf("%s %s", f.name, err)
		}
	}
	if p.CacheWrite < 0 {
		p.CacheWrite = p.Input
	}
	if p.CacheRead < 0 {
		p.CacheRead = p.Input
	}
	return p, true, nil
}

// perToken reads a price in USD a token (a JSON number, or a string
// holding one) as pico-dollars a token, rounded up.
func perToken(raw json.RawMessage) (int64, error) {
	text := string(bytes.TrimSpace(raw))
	if len(text) >= 2 && text[0] == '"' {
		if err := json.Unmarshal(raw, &text); err != nil {
			return 0, errors.New("is not a number")
		}
	}
	v, exact, err := scaled(text, 12, MaxPrice)
	switch {
	case errors.Is(err, errNegative):
		return 0, fmt.Errorf("%s is negative", text)
	case errors.Is(err, errTooLarge):
		return 0, fmt.Errorf("%s is more than a dollar a token", text)
	case err != nil:
		return 0, fmt.Errorf("%s is not a number", text)
	case !exact:
		v++ // never below what the provider bills
	}
	return v, nil
}

// syntaxError is the error of a price list that is not JSON, with the
// line it fails at: where the decoder is, or where a syntax error is
// (counted from base: the start of the value a Decode read).
func syntaxError(data []byte, dec *json.Decoder, err error, what string) error {
	return syntaxErrorAt(data, dec, 0, err, what)
}

func syntaxErrorAt(data []byte, dec *json.Decoder, base int64, err error, what string) error {
	at := dec.InputOffset()
	var se *json.SyntaxError
	if errors.As(err, &se) {
		at = base + se.Offset
	}
	line := 1 + bytes.Count(data[:min(int(at), len(data))], []byte("\n"))
	switch {
	case what != "" && err != nil && !errors.Is(err, io.EOF):
		return fmt.Errorf("line %d: %s: %v", line, what, err)
	case what != "":
		return fmt.Errorf("line %d: %s", line, what)
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("line %d: the JSON ends early", line)
	}
	return fmt.Errorf("line %d: not JSON: %v", line, err)
}
