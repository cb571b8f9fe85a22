package ratelimit

import (
	"encoding/json"
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestLLMExampleFiltersCredentials: the docs' LLM gateway deletes the
// credential headers Caddy logs as sent (x-api-key, api-key,
// x-goog-api-key; it redacts Authorization itself) from its default log
// and from each site's access log (integration_test's
// TestNoCredentialInLogs runs it with SDK traffic and searches the logs).
func TestLLMExampleFiltersCredentials(t *testing.T) {
	t.Setenv("RATE_LIMIT_SECRET", "test")
	adapted, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(llmGatewayExample(t)), nil)
	if err != nil {
		t.Fatal(err)
	}
	var cfg struct {
		Logging struct {
			Logs map[string]struct {
				Encoder struct {
					Format string                     `json:"format"`
					Fields map[string]json.RawMessage `json:"fields"`
				} `json:"encoder"`
				Include []string `json:"include"`
			} `json:"logs"`
		} `json:"logging"`
	}
	if err := json.Unmarshal(adapted, &cfg); err != nil {
		t.Fatal(err)
	}
	filtered, access := 0, 0
	for name, l := range cfg.Logging.Logs {
		if len(l.Include) > 0 {
			access++
		}
		for _, h := range []string{"X-Api-Key", "Api-Key", "X-Goog-Api-Key"} {
			if f, ok := l.Encoder.Fields["request>headers>"+h]; !ok || !strings.Contains(string(f), `"delete"`) || l.Encoder.Format != "filter" {
				t.Errorf("log %s does not delete %s: %s", name, h, f)
			}
		}
		filtered++
	}
	if filtered < 3 || access < 2 || cfg.Logging.Logs["default"].Encoder.Format != "filter" {
		t.Errorf("%d logs filtered, %d access logs: want the default log and both sites' access logs", filtered, access)
	}
}

// llmGatewayExample is the LLM gateway's Caddyfile in docs/after-admission.md.
func llmGatewayExample(t *testing.T) string {
	t.Helper()
	raw, err := os.ReadFile("docs/after-admission.md")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range regexp.MustCompile("(?ms)^```caddyfile\n(.*?)^```").FindAllStringSubmatch(string(raw), -1) {
		if strings.Contains(m[1], "openai.llm.example.com") {
			return m[1]
		}
	}
	t.Fatal("no LLM gateway example in docs/after-admission.md")
	return ""
}
