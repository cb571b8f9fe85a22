package redisinfo

import "testing"

// TestParse: each server named as it names itself in INFO server, with
// the Redis version it speaks.
func TestParse(t *testing.T) {
	for _, tc := range []struct {
		info, want string
		at62       bool
	}{
		{"# Server\r\nredis_version:7.0.15\r\nredis_git_sha1:00000000\r\nredis_mode:standalone\r\n", "Redis 7.0.15", true},
		{"# Server\r\nredis_version:6.2.16\r\nredis_mode:cluster\r\n", "Redis 6.2.16", true},
		{"# Server\r\nredis_version:6.0.20\r\n", "Redis 6.0.20", false},
		{"# Server\r\nredis_version:7.2.4\r\nserver_name:valkey\r\nvalkey_version:8.0.1\r\nredis_mode:standalone\r\n", "Valkey 8.0.1 (redis_version 7.2.4)", true},
		{"# Server\nredis_version:7.4.0\ndragonfly_version:df-v1.40.1\nredis_mode:standalone\n", "Dragonfly df-v1.40.1 (redis_version 7.4.0)", true},
		{"# Server\r\nredis_version:6.3.4\r\nexecutable:/data/keydb-server\r\n", "KeyDB 6.3.4", true},
		{"", "Redis-compatible", true}, // says nothing: not known to be old
	} {
		s := Parse(tc.info)
		if s.String() != tc.want || s.RedisAtLeast(6, 2) != tc.at62 {
			t.Errorf("%q: %q (at least 6.2: %v), want %q (%v)", tc.info, s, s.RedisAtLeast(6, 2), tc.want, tc.at62)
		}
	}
}

// TestFromHello: a user whose ACL refuses INFO still learns the server's
// product and version from HELLO.
func TestFromHello(t *testing.T) {
	for _, tc := range []struct {
		server, version, want string
		at62                  bool
	}{
		{"redis", "7.0.15", "Redis 7.0.15", true},
		{"redis", "6.0.9", "Redis 6.0.9", false},
		{"valkey", "8.0.1", "Valkey 8.0.1 (redis_version 7.2)", true},
	} {
		s := FromHello(tc.server, tc.version, "standalone")
		if s.String() != tc.want || s.RedisAtLeast(6, 2) != tc.at62 {
			t.Errorf("HELLO %s %s: %q (at least 6.2: %v), want %q (%v)", tc.server, tc.version, s, s.RedisAtLeast(6, 2), tc.want, tc.at62)
		}
	}
}
