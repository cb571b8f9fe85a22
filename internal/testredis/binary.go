package testredis

import (
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"sync"
)

// The server the tests run is a variable: REDIS_SERVER and REDIS_CLI name
// the binaries (a path, or a name looked up in PATH), and redis-server and
// redis-cli from PATH are the default. So the whole suite runs against any
// Redis-compatible server: `make test REDIS_SERVER=.../valkey-server
// REDIS_CLI=.../valkey-cli` (see docs/redis.md, "Servers").

// ServerBinary is the server the tests start: $REDIS_SERVER, or
// redis-server from PATH.
func ServerBinary() (string, error) {
	return binary("REDIS_SERVER", "redis-server", "run `make test`, which installs it")
}

// CLIBinary is the client the tests run (redis-cli --cluster create):
// $REDIS_CLI, or redis-cli from PATH.
func CLIBinary() (string, error) {
	return binary("REDIS_CLI", "redis-cli", "run `make test`, which installs redis-tools")
}

func binary(env, name, hint string) (string, error) {
	if v := os.Getenv(env); v != "" {
		p, err := exec.LookPath(v)
		if err != nil {
			return "", fmt.Errorf("%s=%s: %w", env, v, err)
		}
		return p, nil
	}
	p, err := exec.LookPath(name)
	if err != nil {
		return "", fmt.Errorf("%s not found (%s, or name another with %s): %w", name, hint, env, err)
	}
	return p, nil
}

// binaryVersion is what `<bin> --version` says: "Redis server v=6.2.16
// ...", "Valkey server v=8.0.1 ...". Its major and minor numbers choose
// the options a server is started with (see serverArgs).
type binaryVersion struct {
	text         string
	major, minor int
}

var versions sync.Map // bin -> binaryVersion

var versionRE = regexp.MustCompile(`v=(\d+)\.(\d+)`)

func versionOf(bin string) binaryVersion {
	if v, ok := versions.Load(bin); ok {
		return v.(binaryVersion)
	}
	out, _ := exec.Command(bin, "--version").Output()
	v := binaryVersion{text: string(out)}
	if m := versionRE.FindStringSubmatch(v.text); m != nil {
		v.major, _ = strconv.Atoi(m[1])
		v.minor, _ = strconv.Atoi(m[2])
	}
	versions.Store(bin, v)
	return v
}

// atLeast reports whether the binary is version major.minor or later
// (Redis's numbering; Valkey 7.2 and later count as Redis 7.2).
func (v binaryVersion) atLeast(major, minor int) bool {
	return v.major > major || v.major == major && v.minor >= minor
}
