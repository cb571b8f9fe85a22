package testredis

import (
	"crypto/tls"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeServer writes a script that answers --version as the server named
// would, writes its arguments to args, and exits saying what says.
func fakeServer(t *testing.T, version, says string) (bin, args string) {
	t.Helper()
	dir := t.TempDir()
	bin, args = filepath.Join(dir, "fake-server"), filepath.Join(dir, "args")
	script := fmt.Sprintf("#!/bin/sh\nif [ \"$1\" = --version ]; then echo '%s'; exit 0; fi\necho \"$@\" > %s\necho '%s'\nexit 1\n", version, args, says)
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, args
}

// recorder is a TB whose Fatalf ends the start it is given to, recorded.
type recorder struct {
	*testing.T
	fatal string
}

func (r *recorder) Fatalf(format string, args ...any) {
	r.fatal = fmt.Sprintf(format, args...)
	panic(r)
}

func (r *recorder) start(f func(TB)) {
	defer func() {
		if p := recover(); p != nil && p != any(r) {
			panic(p)
		}
	}()
	f(r)
}

// TestServerVariable: REDIS_SERVER names the server the tests start; a
// server that exits at start fails the test with what it said; the
// options a server lacks are not given to it (Redis 6.2 has no
// enable-debug-command); a server without TLS skips the TLS test.
func TestServerVariable(t *testing.T) {
	bin, args := fakeServer(t, "Redis server v=6.2.16 sha=00000000:0", "FATAL CONFIG FILE ERROR (Redis 6.2.16): Bad directive")
	t.Setenv("REDIS_SERVER", bin)
	if got, err := ServerBinary(); err != nil || got != bin {
		t.Fatalf("ServerBinary: %q %v, want %q", got, err, bin)
	}
	r := &recorder{T: t}
	r.start(func(tb TB) { Start(tb) })
	if !strings.Contains(r.fatal, "exited at start") || !strings.Contains(r.fatal, "Bad directive") {
		t.Errorf("a server that exits at start: %q", r.fatal)
	}
	b, _ := os.ReadFile(args)
	if !strings.Contains(string(b), "--port") || strings.Contains(string(b), "enable-debug-command") {
		t.Errorf("Redis 6.2 started with %q", b)
	}
	seven, args7 := fakeServer(t, "Valkey server v=8.0.1 sha=00000000:1", "bye")
	t.Setenv("REDIS_SERVER", seven)
	(&recorder{T: t}).start(func(tb TB) { Start(tb) })
	if b, _ := os.ReadFile(args7); !strings.Contains(string(b), "--enable-debug-command local") {
		t.Errorf("Valkey 8 started with %q, without DEBUG", b)
	}

	noTLS, _ := fakeServer(t, "Redis server v=6.2.16", "FATAL CONFIG FILE ERROR: Bad directive or wrong number of arguments >>> 'tls-port \"6379\"'")
	t.Setenv("REDIS_SERVER", noTLS)
	skipped := false
	t.Run("tls", func(t *testing.T) {
		defer func() { skipped = t.Skipped() }()
		StartTLS(t, "cert.pem", "key.pem", &tls.Config{})
	})
	if !skipped {
		t.Error("a server without TLS did not skip the TLS test")
	}

	t.Setenv("REDIS_SERVER", filepath.Join(t.TempDir(), "missing"))
	if _, err := ServerBinary(); err == nil || !strings.Contains(err.Error(), "REDIS_SERVER=") {
		t.Errorf("a missing REDIS_SERVER: %v", err)
	}
}
