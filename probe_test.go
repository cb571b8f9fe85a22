package ratelimit

import (
	"context"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// probeHandler is a handler of three policies (a rate, a concurrency
// limit, a quota) on the Redis of redis, provisioned.
func probeHandler(t *testing.T, redis *RedisConfig, onError string) *Handler {
	t.Helper()
	return testHandler(t, &Handler{Redis: redis, OnError: onError, Policies: []*Policy{
		{Name: "api", Key: "{client_ip}", Rate: "100/1m"},
		{Name: "slots", Key: "global", Concurrent: 2, OnError: failClosed},
		{Name: "monthly", Key: "{client_ip}", Quota: "1000/month"},
	}}, nil)
}

// TestProbe: one read-only decision per policy, straight to Redis, says
// what stops Redis deciding, by cause, and writes nothing.
func TestProbe(t *testing.T) {
	srv := testredis.Start(t)
	mustDo := func(args ...string) {
		t.Helper()
		if _, err := srv.Do(args...); err != nil {
			t.Fatalf("%v: %v", args, err)
		}
	}
	mustDo("ACL", "SETUSER", "limiter", "on", ">pw", "~rl:*", "+@all")
	mustDo("ACL", "SETUSER", "noscript", "on", ">pw", "~rl:*", "+@all", "-evalsha", "-eval")
	mustDo("ACL", "SETUSER", "nozset", "on", ">pw", "~rl:*", "+@all", "-zremrangebyscore")
	mustDo("ACL", "SETUSER", "otherkeys", "on", ">pw", "~app:*", "+@all")
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))

	for _, tc := range []struct {
		name  string
		redis RedisConfig
		want  string // kind: policies, by cause
	}{
		{"decides", RedisConfig{Addresses: []string{srv.Addr}}, ""},
		{"an ACL user", RedisConfig{Addresses: []string{srv.Addr}, Username: "limiter", Password: "pw"}, ""},
		{"nothing listens", RedisConfig{Addresses: []string{closed}}, "connection: api, slots, monthly"},
		{"a wrong password", RedisConfig{Addresses: []string{srv.Addr}, Username: "limiter", Password: "wrong"}, "wrongpass: api, slots, monthly"},
		{"no scripts in the ACL", RedisConfig{Addresses: []string{srv.Addr}, Username: "noscript", Password: "pw"}, "noperm: api, slots, monthly"},
		{"one command missing", RedisConfig{Addresses: []string{srv.Addr}, Username: "nozset", Password: "pw"}, "noperm: slots"},
		{"keys of another prefix", RedisConfig{Addresses: []string{srv.Addr}, Username: "otherkeys", Password: "pw"}, "noperm: api, slots, monthly"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := tc.redis
			h := probeHandler(t, &cfg, "")
			c := h.store.(*redisStore)
			var got []string
			for _, f := range failuresOf(c.probe(storeDefinitions([]*Handler{h}))) {
				var names []string
				for _, p := range f.policies {
					names = append(names, p.Name)
				}
				got = append(got, f.kind+": "+strings.Join(names, ", "))
				if !strings.Contains(f.describe(), fixOf(f.kind)) {
					t.Errorf("%q does not say the fix", f.describe())
				}
			}
			if g := strings.Join(got, "; "); g != tc.want {
				t.Errorf("probe found %q, want %q", g, tc.want)
			}
		})
	}
	if n, _ := srv.Do("DBSIZE"); n != "0" {
		t.Errorf("the probes left %s keys in Redis, want 0", n)
	}
}

// TestRequireRedis: with require_redis, a config whose Redis cannot
// decide fails to load, naming the cause and the fix; one whose Redis
// decides loads. Without it, both load.
func TestRequireRedis(t *testing.T) {
	srv := testredis.Start(t)
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	for _, tc := range []struct {
		addr    string
		require bool
		err     string
	}{
		{srv.Addr, true, ""},
		{closed, true, "require_redis: Redis cannot decide for policy api: Redis cannot be reached: check the redis address"},
		{closed, false, ""},
	} {
		h := &Handler{Redis: &RedisConfig{Addresses: []string{tc.addr}}, RequireRedis: tc.require,
			Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "100/1m"}}}
		ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
		err := h.Provision(ctx)
		_ = h.Cleanup()
		cancel()
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.HasPrefix(err.Error(), tc.err)) {
			t.Errorf("%s, require_redis %v: %v, want %q", tc.addr, tc.require, err, tc.err)
		}
	}
	h := &Handler{RequireRedis: true, Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "100/1m"}}}
	if err := h.Validate(); err == nil || !strings.Contains(err.Error(), "require_redis: needs a redis block") {
		t.Errorf("require_redis without redis: %v", err)
	}
}

func TestFailureModes(t *testing.T) {
	ps := []*Policy{{Name: "api", onError: failOpen}, {Name: "login", onError: failClosed}, {Name: "search", onError: failOpen}, {Name: "pay", onError: failLocal}}
	want := "policies api, search will fail_open (admit every request) until Redis answers; " +
		"policy login will fail_closed (answer 503) until Redis answers; " +
		"policy pay will decide locally (each instance alone, on its share: see instances) until Redis answers"
	if got := failureModes(ps); got != want {
		t.Errorf("failureModes:\n got %q\nwant %q", got, want)
	}
}

// redisError is an error reply of Redis, as go-redis reports one.
type redisError string

func (e redisError) Error() string { return string(e) }
func (redisError) RedisError()     {}

func TestProbeKind(t *testing.T) {
	for err, want := range map[error]string{
		redisError("ERR unknown command 'evalsha', with args beginning with: "):                                                                        "noscripting",
		redisError("NOPERM User x has no permissions to run the 'evalsha' command"):                                                                    "noperm",
		redisError("WRONGPASS invalid username-password pair or user is disabled."):                                                                    "wrongpass",
		redisError("LOADING Redis is loading the dataset in memory"):                                                                                   "loading",
		redisError("ERR The user executing the script can't run this command or subcommand script: 7580, on @user_script:1."):                          "noperm",
		redisError("ERR ACL failure in script: User nozset has no permissions to run the 'zremrangebyscore' command script: 7580, on @user_script:1."): "noperm", // Valkey 8
		// Redis 6.2 wraps what a script raised in ERR.
		redisError("ERR Error running script (call to f_58): @user_script:1: @user_script: 1: -READONLY You can't write against a read only replica."): "readonly",
		redisError("ERR Error running script (call to f_75): @user_script:203: The user executing the script can't run this command or subcommand"):    "noperm",
		redisError("ERR Error running script (call to f_75): @user_script:1: OOM command not allowed when used memory > 'maxmemory'."):                 "oom",
		// Dragonfly's default: a key the call did not declare.
		redisError("ERR Error running script (call to f_75): @user_script:1: script tried accessing undeclared key"): "undeclared",
	} {
		if got := probeKind(err); got != want {
			t.Errorf("%v: %s, want %s", err, got, want)
		}
	}
}
