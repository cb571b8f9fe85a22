package integration_test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// TestTwoCredentialsEscape is the attack (issue 45, item 3): a
// tenant that drained its budget adds `x-api-key: junk` beside its
// `Authorization: Bearer`. The provider reads the Bearer token and bills
// the tenant; the request must not escape to another bucket (before: the
// empty key's, which gave it 5 more answers here). It is refused before
// the provider, with a 400 naming the fields.
func TestTwoCredentialsEscape(t *testing.T) {
	srv := testredis.Start(t)
	prov := startProvider(t)
	in := startCaddy(t, sdkLimiter(srv.Addr, "rl:", nil,
		map[string]any{"name": "per_key", "key": "{http.rate_limit.credential}", "rate": "5/1h"}), proxyTo(prov.addr))
	body := `{"model":"gpt-4o-mini","max_tokens":5,"messages":[{"role":"user","content":"hi"}]}`
	send := func(header ...string) response {
		return postWith(t, in.URL+"/v1/chat/completions", body, append([]string{"Content-Type", "application/json"}, header...)...)
	}
	for i := range 5 {
		if r := send("Authorization", "Bearer sk-drained"); r.status != 200 {
			t.Fatalf("the tenant's call %d: %d", i+1, r.status)
		}
	}
	if r := send("Authorization", "Bearer sk-drained"); r.status != 429 {
		t.Fatalf("the drained tenant's 6th call: %d, want 429", r.status)
	}
	before := prov.count()
	answered, refused := 0, 0
	var last response
	for i := range 10 {
		last = send("Authorization", "Bearer sk-drained", "X-Api-Key", fmt.Sprintf("junk-%d", i))
		switch last.status {
		case 200:
			answered++
		case 400:
			refused++
		}
	}
	billed := prov.count() - before
	t.Logf("a drained tenant adding x-api-key: junk: %d of 10 answered, %d refused, the provider billed %d (last: %d %s)", answered, refused, billed, last.status, strings.TrimSpace(string(last.body)))
	if answered != 0 || billed != 0 {
		t.Errorf("%d answered, the provider billed %d: the second credential escaped the tenant's budget", answered, billed)
	}
	if refused != 10 || !strings.Contains(string(last.body), "two different credentials") || strings.Contains(string(last.body), "junk") || strings.Contains(string(last.body), "sk-drained") {
		t.Errorf("%d refused; body %s: want 10, a problem naming the fields, never a value", refused, last.body)
	}
}

// postWith sends a POST of body with the header pairs and returns the
// response.
func postWith(t *testing.T, url, body string, headers ...string) response {
	t.Helper()
	req, _ := http.NewRequest("POST", url, strings.NewReader(body))
	for i := 0; i+1 < len(headers); i += 2 {
		req.Header.Set(headers[i], headers[i+1])
	}
	resp, err := newClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	return response{resp.StatusCode, resp.Header, raw}
}
