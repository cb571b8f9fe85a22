package integration_test

import (
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// No secret in any log or listing (issue 45, item 6): the docs' LLM
// gateway, with the log filters its guide gives, driven by the official
// SDKs and by clients sending each credential header, through cut
// streams, the provider's errors and the provider unreachable, then `top`
// and `inspect` from the command line; every log Caddy wrote (its default
// log at INFO, with the admin API's lines, and the access log) and top's
// listing hold none of the credentials.

// logFilters: the test's config carries the guide's log filters (the
// configuration the docs gave before carried none).
const logFilters = true

// credentialFilters are the guide's filters: the credential headers Caddy
// logs in clear (it redacts Authorization itself).
func credentialFilters(wrapped map[string]any) map[string]any {
	if !logFilters {
		return wrapped
	}
	fields := map[string]any{}
	for _, h := range []string{"X-Api-Key", "Api-Key", "X-Goog-Api-Key"} {
		fields["request>headers>"+h] = map[string]any{"filter": "delete"}
	}
	return map[string]any{"format": "filter", "wrap": wrapped, "fields": fields}
}

func TestNoCredentialInLogs(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	access := filepath.Join(t.TempDir(), "access.log")
	tune := func(cfg map[string]any) {
		cfg["logging"] = map[string]any{"logs": map[string]any{
			"default": map[string]any{"level": "INFO", "encoder": credentialFilters(map[string]any{"format": "json"}), "exclude": []string{"http.log.access.access"}},
			"access": map[string]any{"level": "INFO", "writer": map[string]any{"output": "file", "filename": access},
				"encoder": credentialFilters(map[string]any{"format": "json"}), "include": []string{"http.log.access.access"}},
		}}
		srvCfg := cfg["apps"].(map[string]any)["http"].(map[string]any)["servers"].(map[string]any)["test"].(map[string]any)
		srvCfg["logs"] = map[string]any{"default_logger_name": "access"}
	}
	tokens := sdkPolicy("llm_tokens", "openai", "100000/2400h", 100000, 8000)
	requests := map[string]any{"name": "llm_requests", "key": "{http.rate_limit.credential}", "rate": "6/1h"}
	in := startCaddyTuned(t, tune, sdkLimiter(srv.Addr, "rl:", map[string]any{"error_format": "openai"}, requests, tokens), proxyTo(prov.addr))
	down := startCaddyTuned(t, tune, sdkLimiter(srv.Addr, "down:", nil, requests, tokens), proxyTo("127.0.0.1:1"))

	creds := map[string]string{"openai": "sk-log-openai-5a1e", "azure": "az-log-azure-77b2", "anthropic": "sk-ant-log-anthropic-3c9d",
		"x-api-key": "xkey-log-direct-91f0", "x-goog-api-key": "AIza-log-google-c4d1"}
	chat := func(stream bool, header ...string) map[string]any {
		p := map[string]any{"model": "gpt-4o-mini", "max_tokens": 50, "messages": []any{map[string]any{"role": "user", "content": "Hi"}}}
		if stream {
			p["stream"] = true
		}
		return p
	}
	var calls []*sdkCall
	add := func(sdk string, c *sdkCall) {
		calls = append(calls, c)
		base := map[string]string{"openai": in.URL + "/v1", "azure": in.URL, "anthropic": in.URL}[sdk]
		runSDK(t, sdkPlan{SDK: sdk, BaseURL: base, MaxRetries: intp(0), Calls: []*sdkCall{c}}, 60*time.Second)
	}
	for i := range 8 { // some over llm_requests' 6 an hour: denied, for top
		add("openai", &sdkCall{ID: fmt.Sprintf("openai %d", i), APIKey: creds["openai"], Kind: "chat", Params: chat(false)})
	}
	add("openai", &sdkCall{ID: "openai cut", APIKey: "sk-log-openai-cut-8e2f", Kind: "chat", Params: chat(true), AbortAfterText: 40,
		Headers: map[string]any{"X-Cut": "40"}})
	add("azure", &sdkCall{ID: "azure cut", APIKey: creds["azure"], Kind: "chat", Params: chat(true), AbortAfterText: 40,
		Headers: map[string]any{"X-Cut": "40"}})
	add("azure", &sdkCall{ID: "azure 503", APIKey: creds["azure"], Kind: "chat", Params: chat(false), Headers: map[string]any{"X-Provider-Status": "503"}})
	msg := map[string]any{"model": "claude-sonnet-4-5", "max_tokens": 50, "stream": true, "messages": []any{map[string]any{"role": "user", "content": "Hi"}}}
	add("anthropic", &sdkCall{ID: "anthropic cut", APIKey: creds["anthropic"], Kind: "messages", Params: msg, AbortAfterText: 40, Headers: map[string]any{"X-Cut": "40"}})
	// Clients sending the other headers, cut and failing, and the provider
	// unreachable (Caddy's own 502, which its error log records).
	body := `{"model":"gpt-4o-mini","max_tokens":50,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`
	for _, h := range []struct{ name, value string }{{"X-Api-Key", creds["x-api-key"]}, {"X-Goog-Api-Key", creds["x-goog-api-key"]}} {
		for _, extra := range [][]string{{"X-Cut", "40"}, {"X-Provider-Status", "500"}} {
			cutAfter(t, in.URL+"/v1/chat/completions", body, append([]string{h.name, h.value}, extra...)...)
		}
		postWith(t, down.URL+"/v1/chat/completions", body, h.name, h.value, "Content-Type", "application/json")
	}
	// The operator's handles.
	top := rateLimitCLI(t, in, "top", "llm_requests")
	inspected := rateLimitCLI(t, in, "inspect", "llm_requests", creds["openai"])
	t.Logf("caddy rate-limit top llm_requests:\n%s", top)
	time.Sleep(500 * time.Millisecond) // the cut streams' lines, written once Caddy notices the clients gone

	logs := map[string]string{}
	for name, path := range map[string]string{"default log": in.Log, "access log": access, "default log (provider down)": down.Log} {
		raw, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		logs[name] = string(raw)
	}
	logs["top's listing"] = top
	lines := 0
	for _, text := range logs {
		lines += strings.Count(text, "\n")
	}
	leaks := 0
	for name, text := range logs {
		for kind, cred := range creds {
			if n := strings.Count(text, cred); n > 0 {
				leaks += n
				t.Errorf("the %s credential appears %d times in the %s", kind, n, name)
			}
		}
	}
	t.Logf("%d SDK calls, %d lines written (default and access logs, top); credentials found in them: %d; inspect answered:\n%s", len(calls), lines, leaks, inspected)
	if !strings.Contains(logs["default log"], "aborting with incomplete response") || !strings.Contains(logs["access log"], `"status":500`) ||
		!strings.Contains(logs["default log (provider down)"], `"logger":"http.log.error`) {
		t.Errorf("the logs do not hold what this test searches: a cut stream's WARN (with its request) %v, an upstream error's access line %v, the unreachable provider's error (with its request) %v",
			strings.Contains(logs["default log"], "aborting with incomplete response"), strings.Contains(logs["access log"], `"status":500`), strings.Contains(logs["default log (provider down)"], `"logger":"http.log.error`))
	}
}

// cutAfter sends a POST and reads a little of the answer before going away.
func cutAfter(t *testing.T, url, body string, headers ...string) {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	c := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{DisableCompression: true}}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	_, _ = resp.Body.Read(buf)
	resp.Body.Close() // gone
	c.CloseIdleConnections()
}
