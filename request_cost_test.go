package ratelimit

import (
	"bytes"
	"io"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/llm/llmtest"
)

// TestRequestBodyOf: nothing is read twice: a second policy takes the
// first reading, and the upstream reads the body byte for byte.
func TestRequestBodyOf(t *testing.T) {
	rs := &requestState{}
	r := httptest.NewRequest("POST", "/", strings.NewReader(llmtest.ChatRequest))
	first, second := requestBodyOf(r, rs), requestBodyOf(r, rs)
	if first != second || first.Reservation(llm.UnitWeights, 8000) != 50+11 {
		t.Errorf("read twice: %+v, %+v", first, second)
	}
	if got, _ := io.ReadAll(r.Body); !bytes.Equal(got, []byte(llmtest.ChatRequest)) {
		t.Errorf("after two policies, the upstream read %q", got)
	}
}
