package ratelimit

import (
	"bytes"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// rateLimitCobra is `caddy rate-limit` as the caddy binary builds it.
func rateLimitCobra(t *testing.T) *cobra.Command {
	t.Helper()
	c, ok := caddycmd.Commands()["rate-limit"]
	if !ok {
		t.Fatal("no rate-limit command registered")
	}
	cmd := &cobra.Command{Use: c.Name, Short: c.Short}
	c.CobraFunc(cmd)
	return cmd
}

// runCLI runs `caddy rate-limit <args>` in process and returns its error and
// what it printed.
func runCLI(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := rateLimitCobra(t)
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

// closedAddr is a loopback address nothing listens at.
func closedAddr(t *testing.T) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

// TestCLIErrorsSayWhatToDo: `caddy rate-limit` with no Caddy at the admin
// address says so, names the address and where it came from; arguments
// that look like negative numbers are read as numbers and refused for
// their value; a misspelt subcommand gets the nearest; flags are read
// wherever they are on the line.
func TestCLIErrorsSayWhatToDo(t *testing.T) {
	addr := closedAddr(t)
	config := filepath.Join(t.TempDir(), "caddy.json")
	if err := os.WriteFile(config, []byte(`{"admin":{"listen":"`+addr+`"}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"inspect", "per_ip", "192.0.2.1", "--address", addr}, "no Caddy is answering at " + addr + " (from --address): is Caddy running?"},
		{[]string{"--address", addr, "reset", "per_ip", "192.0.2.1"}, "no Caddy is answering at " + addr},
		{[]string{"top", "per_ip", "--config", config}, "no Caddy is answering at " + addr + " (the admin listener of " + config + ")"},
		{[]string{"overrides", "per_ip", "--address", addr}, "no Caddy is answering at " + addr},
		{[]string{"grant", "per_ip", "192.0.2.1", "-3", "--address", addr}, `tokens: "-3" is not a positive integer`},
		{[]string{"top", "per_ip", "-5", "--address", addr}, `n: "-5" is not a positive integer`},
		{[]string{"override", "per_ip", "192.0.2.1", "rate", "5/1m", "for", "-5s", "--address", addr}, "for: -5s must be positive"},
		{[]string{"override", "per_ip", "192.0.2.1", "rate", "5/1m", "burst", "-5", "--address", addr}, `burst: "-5" is not a positive integer`},
		{[]string{"override", "per_ip", "192.0.2.1", "concurrent", "-1"}, `concurrent: "-1" is not a positive integer`},
		{[]string{"inspct", "per_ip", "192.0.2.1"}, `unknown command "inspct" for caddy rate-limit: did you mean inspect?`},
		{[]string{"grant", "per_ip", "--address", addr}, "expected caddy rate-limit grant <policy> <identity> <tokens>"},
		{[]string{"inspect", "per_ip", "x", "--adress", addr}, "unknown flag: --adress"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			out, err := runCLI(t, tc.args...)
			if err == nil {
				t.Fatalf("no error; printed %q", out)
			}
			t.Log(err)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("the error does not say %q:\n\t%v", tc.want, err)
			}
			if strings.Contains(err.Error(), "shorthand flag") {
				t.Errorf("a number read as a flag: %v", err)
			}
		})
	}
	out, err := runCLI(t, "grant", "--help")
	if err != nil || !strings.Contains(out, "grant <policy> <identity> <tokens>") {
		t.Errorf("grant --help: %v, %q", err, out)
	}
}

// TestCLICaddyAnswersAnError: an error of the admin API whose message
// mentions a refused connection (Redis down) is Caddy's answer, printed as
// it is, not taken for no Caddy at the address.
func TestCLICaddyAnswersAnError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(503)
		w.Write([]byte(`{"error":"the rate-limit store did not answer (dial tcp 127.0.0.1:6379: connect: connection refused)"}`))
	}))
	defer srv.Close()
	addr := strings.TrimPrefix(srv.URL, "http://")
	for _, args := range [][]string{{"inspect", "p", "x"}, {"try", "http://example.com/"}} {
		_, err := runCLI(t, append(args, "--address", addr)...)
		if err == nil || strings.Contains(err.Error(), "no Caddy is answering") || !strings.Contains(err.Error(), "store did not answer") {
			t.Errorf("%v: %v", args, err)
		}
	}
	// apply, try and replay refuse what they cannot use, saying why.
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("overrides: {not: a list}"), 0o600)
	noSource := filepath.Join(dir, "bad name!.yaml")
	os.WriteFile(noSource, []byte("overrides: []"), 0o600)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"apply", filepath.Join(dir, "none.yaml")}, "no such file"},
		{[]string{"apply", bad}, "expected a list"},
		{[]string{"apply", noSource}, "add source: <tag> to it, or give --source"},
		{[]string{"apply", bad, "--source", "a b"}, "expected a list"},
		{[]string{"try", "http://x/", "-H", "nocolon"}, "expected 'Name: value'"},
		{[]string{"replay", "access.log"}, "give the config to replay with --config"},
	} {
		_, err := runCLI(t, append(tc.args, "--address", addr)...)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%v: %v, want %q", tc.args, err, tc.want)
		}
	}
}
