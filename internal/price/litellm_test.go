package price

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestReadLiteLLM(t *testing.T) {
	list := `{
    "sample_spec": {"input_cost_per_token": 0.0, "output_cost_per_token": 0.0, "max_tokens": "LEGACY"},
    "gpt-4.1": {"input_cost_per_token": 2e-06, "output_cost_per_token": 8e-06, "cache_read_input_token_cost": 5e-07,
                "litellm_provider": "openai", "mode": "chat", "supports_vision": true},
    "claude-sonnet-4-5": {"input_cost_per_token": 3e-06, "output_cost_per_token": 1.5e-05,
                "cache_creation_input_token_cost": 3.75e-06, "cache_read_input_token_cost": 3e-07},
    "odd": {"input_cost_per_token": "1e-06", "output_cost_per_token": 0},
    "fine": {"input_cost_per_token": 1.0416666666666667e-07, "output_cost_per_token": 1e-13},
    "dall-e-3": {"output_cost_per_image": 0.04, "mode": "image_generation"},
    "whisper-1": {"input_cost_per_second": 0.0001, "mode": "audio_transcription"}
}`
	models, skipped, err := ReadLiteLLM([]byte(list))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Price{
		"gpt-4.1":           {Input: 2_000_000, Output: 8_000_000, CacheWrite: 2_000_000, CacheRead: 500_000},
		"claude-sonnet-4-5": {Input: 3_000_000, Output: 15_000_000, CacheWrite: 3_750_000, CacheRead: 300_000},
		"odd":               {Input: 1_000_000, Output: 0, CacheWrite: 1_000_000, CacheRead: 1_000_000},
		// More precise than a pico-dollar: rounded up.
		"fine": {Input: 104_167, Output: 1, CacheWrite: 104_167, CacheRead: 104_167},
	}
	if len(models) != len(want) || skipped != 2 {
		t.Errorf("%d models, %d skipped; want %d and 2: %v", len(models), skipped, len(want), models)
	}
	for m, p := range want {
		if models[m] != p {
			t.Errorf("%s: %+v, want %+v", m, models[m], p)
		}
	}
}

func TestReadLiteLLMErrors(t *testing.T) {
	for _, tc := range []struct{ list, entry, want string }{
		{`{"a": {"input_cost_per_token": -1e-06, "output_cost_per_token": 1e-06}}`, "a", "input_cost_per_token -1e-06 is negative"},
		{`{"a": {"input_cost_per_token": 1e-06}}`, "a", "output_cost_per_token is missing"},
		{`{"a": {"output_cost_per_token": 1e-06}}`, "a", "input_cost_per_token is missing"},
		{`{"a": {"input_cost_per_token": "cheap", "output_cost_per_token": 1e-06}}`, "a", "input_cost_per_token cheap is not a number"},
		{`{"a": {"input_cost_per_token": true, "output_cost_per_token": 1e-06}}`, "a", "is not a number"},
		{`{"a": {"input_cost_per_token": null, "output_cost_per_token": 1e-06}}`, "a", "is not a number"},
		{`{"a": {"input_cost_per_token": 2, "output_cost_per_token": 1e-06}}`, "a", "more than a dollar a token"},
		{`{"a": {"input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06, "cache_read_input_token_cost": -1}}`, "a", "cache_read_input_token_cost -1 is negative"},
		{`{"a": {"input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06}, "a": {"input_cost_per_token": 1e-06, "output_cost_per_token": 1e-06}}`, "a", "listed twice"},
		{`{"a": "expensive"}`, "a", "not an object of prices"},
		{`{"a": [1, 2]}`, "a", "not an object of prices"},
	} {
		_, _, err := ReadLiteLLM([]byte(tc.list))
		var ee *EntryError
		if !errors.As(err, &ee) || ee.Model != tc.entry || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v; want entry %q: %s", tc.list, err, tc.entry, tc.want)
		}
	}
	for _, tc := range []struct{ list, want string }{
		{``, "line 1: the price list is not a JSON object"},
		{`[]`, "line 1: the price list is not a JSON object"},
		{"{\n\"a\": {\"input_cost_per_token\": 1e-06,\n}}", "line 3: not JSON"},
		{`{"a": {}`, "ends early"},
		{`{"a": {}} {}`, "more after"},
		{"{\n\n\"a\" {}}", "line 3"},
	} {
		_, _, err := ReadLiteLLM([]byte(tc.list))
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v; want %q", tc.list, err, tc.want)
		}
	}
}

// liteLLMList is a price list of n models shaped as LiteLLM's (about 1.6
// MB for 3,000 models, as its list today).
func liteLLMList(n int) []byte {
	var b strings.Builder
	b.WriteString("{\n")
	for i := range n {
		if i > 0 {
			b.WriteString(",\n")
		}
		fmt.Fprintf(&b, `    "provider-%d/model-%d-2025-04-14": {
        "cache_read_input_token_cost": 5e-07,
        "input_cost_per_token": %d.5e-07,
        "litellm_provider": "openai",
        "max_input_tokens": 1047576,
        "max_output_tokens": 32768,
        "max_tokens": 32768,
        "mode": "chat",
        "output_cost_per_token": 8e-06,
        "supported_endpoints": ["/v1/chat/completions", "/v1/batch", "/v1/responses"],
        "supported_modalities": ["text", "image"],
        "supports_function_calling": true,
        "supports_prompt_caching": true,
        "supports_vision": true
    }`, i%7, i, 1+i%9)
	}
	b.WriteString("\n}\n")
	return []byte(b.String())
}

func TestReadLiteLLMLarge(t *testing.T) {
	models, _, err := ReadLiteLLM(liteLLMList(3000))
	if err != nil || len(models) != 3000 {
		t.Fatalf("%d models, %v", len(models), err)
	}
}

// BenchmarkReadLiteLLM reads a list of 3,000 models, LiteLLM's size.
func BenchmarkReadLiteLLM(b *testing.B) {
	list := liteLLMList(3000)
	b.SetBytes(int64(len(list)))
	for b.Loop() {
		if _, _, err := ReadLiteLLM(list); err != nil {
			b.Fatal(err)
		}
	}
}
