package price

import (
	"strings"
	"testing"
)

func TestLookup(t *testing.T) {
	models := map[string]Price{
		"gpt-4.1":           {Input: 2_000_000, Output: 8_000_000},
		"gpt-4.1-mini":      {Input: 400_000, Output: 1_600_000},
		"gpt-4o":            {Input: 2_500_000, Output: 10_000_000},
		"claude-sonnet-4-5": {Input: 3_000_000, Output: 15_000_000},
		"llama3":            {Input: 1, Output: 1},
		"o1":                {Input: 15_000_000, Output: 60_000_000},
	}
	tbl, err := NewTable(models, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ model, want string }{
		{"gpt-4.1", "gpt-4.1"},
		{"gpt-4.1-2025-04-14", "gpt-4.1"},
		{"gpt-4.1-mini", "gpt-4.1-mini"},
		{"gpt-4.1-mini-2025-04-14", "gpt-4.1-mini"}, // the longest listed family
		{"gpt-4.1-nano", "gpt-4.1"},                 // a family the list lacks: its listed parent
		{"claude-sonnet-4-5-20250929", "claude-sonnet-4-5"},
		{"llama3:8b", "llama3"},
		{"llama3@2024", "llama3"},
		{"gpt-4o-mini", "gpt-4o"},
		{"gpt-4.10", ""},                            // not followed by a separator
		{"gpt-4o2", ""},                             // idem
		{"o1x", ""},                                 // idem
		{"GPT-4.1", ""},                             // names are exact
		{"gpt-4.1 ", ""},                            // idem
		{" gpt-4.1", ""},                            // idem
		{"gpt", ""},                                 // shorter than any
		{"", ""},                                    // none
		{"-", ""},                                   // a separator alone
		{"gpt-4.1/x", ""},                           // '/' is no separator
		{"gpt-4.1-" + strings.Repeat("x", 300), ""}, // too long to be a model's
	} {
		got, _, ok := tbl.Lookup(tc.model)
		if got != tc.want || ok != (tc.want != "") {
			t.Errorf("Lookup(%q) = %q, %v; want %q", tc.model, got, ok, tc.want)
		}
	}
	if _, p, _ := tbl.Lookup("gpt-4.1-2025-04-14"); p != models["gpt-4.1"] {
		t.Errorf("a dated snapshot is priced %+v, want its family's %+v", p, models["gpt-4.1"])
	}
}

func TestUnknown(t *testing.T) {
	models := map[string]Price{"gpt-4.1": {Input: 2_000_000, Output: 8_000_000}, "cheap": {Input: 1, Output: 1}}
	deny, _ := NewTable(models, "")
	if _, _, listed, ok := deny.Of("nobody-knows"); listed || ok {
		t.Errorf("unknown deny: a model the table lacks has a price")
	}
	if name, _, listed, ok := deny.Of("gpt-4.1-2025-04-14"); name != "gpt-4.1" || !listed || !ok {
		t.Errorf("Of(a snapshot) = %q, %v, %v", name, listed, ok)
	}
	asBig, err := NewTable(models, "gpt-4.1-2025-04-14")
	if err != nil {
		t.Fatal(err)
	}
	if name, p, listed, ok := asBig.Of("nobody-knows"); name != "gpt-4.1" || listed || !ok || p != models["gpt-4.1"] {
		t.Errorf("unknown gpt-4.1: Of = %q, %+v, %v, %v", name, p, listed, ok)
	}
	if _, err := NewTable(models, "not-listed"); err == nil || !strings.Contains(err.Error(), "not-listed") {
		t.Errorf("unknown naming a model with no price: %v", err)
	}
	var none *Table
	if _, _, _, ok := none.Of("gpt-4.1"); ok {
		t.Error("no table: priced")
	}
}
