// Package redisinfo says which server a Redis-compatible address runs,
// from the reply of INFO server: Redis, Valkey, Dragonfly, KeyDB, and the
// version of the Redis they speak.
package redisinfo

import (
	"strconv"
	"strings"
)

// Server is who answered INFO server.
type Server struct {
	// Name is the server's product: "Redis", "Valkey", "Dragonfly",
	// "KeyDB", or "Redis-compatible" when the reply names none of them.
	Name string
	// Version is the product's own version ("8.0.1" for Valkey 8.0.1,
	// "df-v1.25.1" for Dragonfly), and Redis the redis_version it reports:
	// the Redis it says it is compatible with ("7.2.4" for Valkey 8).
	Version, Redis string
	// Mode is redis_mode (or server_mode): standalone, cluster, sentinel.
	Mode string
}

// Parse reads the fields of an INFO server reply (CRLF or LF lines,
// "field:value").
func Parse(info string) Server {
	f := map[string]string{}
	for _, line := range strings.Split(info, "\n") {
		k, v, ok := strings.Cut(strings.TrimRight(line, "\r"), ":")
		if ok && !strings.HasPrefix(k, "#") {
			f[k] = v
		}
	}
	s := Server{Redis: f["redis_version"], Mode: f["redis_mode"]}
	if s.Mode == "" {
		s.Mode = f["server_mode"]
	}
	switch {
	case f["dragonfly_version"] != "":
		s.Name, s.Version = "Dragonfly", f["dragonfly_version"]
	case f["valkey_version"] != "" || strings.EqualFold(f["server_name"], "valkey"):
		s.Name, s.Version = "Valkey", f["valkey_version"]
	case strings.Contains(strings.ToLower(f["executable"]), "keydb"):
		s.Name = "KeyDB" // its INFO server says no more than Redis's
	case f["redis_version"] != "":
		s.Name, s.Version = "Redis", f["redis_version"]
	default:
		s.Name = "Redis-compatible"
	}
	if s.Version == "" {
		s.Version = s.Redis
	}
	return s
}

// String names the server and its version: "Redis 7.0.15", "Valkey 8.0.1
// (redis_version 7.2.4)".
func (s Server) String() string {
	out := s.Name
	if s.Version != "" {
		out += " " + s.Version
	}
	if s.Name != "Redis" && s.Redis != "" && s.Redis != s.Version {
		out += " (redis_version " + s.Redis + ")"
	}
	return out
}

// RedisAtLeast reports whether the Redis version the server reports is
// major.minor or later. A server that reports none, or one that does not
// parse, is not known to be older: true.
func (s Server) RedisAtLeast(major, minor int) bool {
	maj, min, ok := majorMinor(s.Redis)
	if !ok {
		return true
	}
	return maj > major || maj == major && min >= minor
}

func majorMinor(v string) (major, minor int, ok bool) {
	parts := strings.SplitN(v, ".", 3)
	if len(parts) < 2 {
		return 0, 0, false
	}
	maj, err1 := strconv.Atoi(parts[0])
	min, err2 := strconv.Atoi(parts[1])
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return maj, min, true
}

// FromHello is the server HELLO names (its server and version fields):
// what a user whose ACL refuses INFO may still learn. Valkey's HELLO gives
// its own version, not the Redis one it speaks.
func FromHello(server, version, mode string) Server {
	s := Server{Version: version, Mode: mode}
	switch strings.ToLower(server) {
	case "valkey":
		s.Name = "Valkey"
		if maj, _, ok := majorMinor(version); ok && maj >= 7 {
			s.Redis = "7.2" // Valkey began as Redis 7.2.4
		}
	case "redis", "":
		s.Name, s.Redis = "Redis", version
	default:
		s.Name, s.Redis = server, version
	}
	return s
}
