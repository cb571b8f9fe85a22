package integration_test

import (
	"encoding/json"
	"errors"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// The fleet sees itself: instances that share a Redis announce what they
// enforce, and those of one fleet that disagree on a policy say so.

// fleetPolicy is the policy the fleet tests' instances enforce.
func fleetPolicy(rate string) map[string]any {
	return map[string]any{"name": "api", "key": "{http.request.header.X-User}", "rate": rate}
}

// fleetHandler is a limiter on Redis with a key_secret and more settings.
func fleetHandler(addr, secret string, redis map[string]any, rate string) map[string]any {
	h := limiter(addr, map[string]any{"key_secret": secret}, fleetPolicy(rate))
	for k, v := range redis {
		h["redis"].(map[string]any)[k] = v
	}
	return h
}

// waitForLog waits, at most bound, for an entry of the limiter's log that
// pred accepts, and returns it.
func waitForLog(t *testing.T, in *instance, bound time.Duration, what string, pred func(map[string]any) bool) map[string]any {
	t.Helper()
	deadline := time.Now().Add(bound)
	for {
		_, ours := readLogs(t, in.Log)
		for _, e := range ours {
			if pred(e) {
				return e
			}
		}
		if time.Now().After(deadline) {
			raw, _ := os.ReadFile(in.Log)
			t.Fatalf("%s: not logged within %s:\n%s", what, bound, raw)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// countLog counts the entries of the limiter's log that pred accepts.
func countLog(t *testing.T, in *instance, pred func(map[string]any) bool) int {
	t.Helper()
	_, ours := readLogs(t, in.Log)
	n := 0
	for _, e := range ours {
		if pred(e) {
			n++
		}
	}
	return n
}

// disagreement accepts the WARN of a disagreement on policy api.
func disagreement(e map[string]any) bool {
	msg, _ := e["msg"].(string)
	return e["level"] == "warn" && strings.HasPrefix(msg, "policy api is enforced with another")
}

// fleetAnswer is /rate_limit/fleet's answer, as far as the tests read it.
type fleetAnswer struct {
	Instance string `json:"instance"`
	Stores   []struct {
		Instances []struct {
			ID string `json:"id"`
			DB int    `json:"db"`
		} `json:"instances"`
		Fleets []fleet.Fleet `json:"fleets"`
	} `json:"stores"`
}

func fleetOf(t *testing.T, in *instance) fleetAnswer {
	t.Helper()
	resp, err := http.Get(in.Admin + "/rate_limit/fleet")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var a fleetAnswer
	if err := json.NewDecoder(resp.Body).Decode(&a); err != nil || resp.StatusCode != 200 {
		t.Fatalf("/rate_limit/fleet: %d, %v", resp.StatusCode, err)
	}
	return a
}

// TestFleetDisagreement: two instances on one Redis whose key_secret
// differs (so that each admits the whole budget of every client) each
// log one WARN naming the policy and what differs, never the secret,
// within 10 s of the second's start; the gauge is 1 on both; `caddy
// rate-limit fleet` lists both and the difference. When one stops, the
// other says the fleet agrees again, and its gauge is 0.
func TestFleetDisagreement(t *testing.T) {
	srv := testredis.Start(t)
	a := startCaddyTuned(t, logLevel("INFO"), fleetHandler(srv.Addr, "secret-one", nil, "5/1m"), echo())
	started := time.Now()
	b := startCaddyTuned(t, logLevel("INFO"), fleetHandler(srv.Addr, "secret-two", nil, "5/1m"), echo())

	warns := map[*instance]map[string]any{}
	for name, in := range map[string]*instance{"a": a, "b": b} {
		e := waitForLog(t, in, 10*time.Second, "the disagreement on "+name, disagreement)
		t.Logf("instance %s logged the disagreement %.2f s after the second instance was started: %s", name, time.Since(started).Seconds(), e["msg"])
		warns[in] = e
		raw, _ := json.Marshal(e)
		for _, secret := range []string{"secret-one", "secret-two", fleet.SecretFingerprint("secret-one"), fleet.SecretFingerprint("secret-two")} {
			if strings.Contains(string(raw), secret) {
				t.Errorf("%s's WARN shows a secret or its fingerprint: %s", name, raw)
			}
		}
		if d, _ := e["differs"].([]any); len(d) != 1 || d[0] != "key_secret" || e["policy"] != "api" {
			t.Errorf("%s's WARN: policy %v, differs %v; want api, [key_secret]", name, e["policy"], e["differs"])
		}
	}
	idA, idB := warns[a]["instance"].(string), warns[b]["instance"].(string)
	if others, _ := warns[a]["other_instances"].([]any); len(others) != 1 || others[0] != idB {
		t.Errorf("a's WARN names %v, want b (%s)", warns[a]["other_instances"], idB)
	}

	for name, in := range map[string]*instance{"a": a, "b": b} {
		if g := metricValue(t, in, "caddy_rate_limit_fleet_disagreements", nil); g != 1 {
			t.Errorf("%s: caddy_rate_limit_fleet_disagreements %v, want 1", name, g)
		}
	}
	out := rateLimitCLI(t, a, "fleet")
	t.Logf("caddy rate-limit fleet:\n%s", out)
	for _, s := range []string{idA + " *", idB, "2 live instance(s)", "DISAGREEMENT policy api: key_secret differs",
		"key_secret fingerprint " + fleet.SecretFingerprint("secret-one"), "key_secret fingerprint " + fleet.SecretFingerprint("secret-two")} {
		if !strings.Contains(out, s) {
			t.Errorf("caddy rate-limit fleet does not show %q", s)
		}
	}
	answer := fleetOf(t, b)
	if len(answer.Stores) != 1 || len(answer.Stores[0].Fleets) != 1 {
		t.Fatalf("/rate_limit/fleet: %+v, want one store with one fleet", answer)
	}
	if f := answer.Stores[0].Fleets[0]; len(f.Instances) != 2 || len(f.Splits) != 1 || !slices.Equal(f.Splits[0].Differs, []string{"key_secret"}) {
		t.Errorf("b's /rate_limit/fleet: %+v", f)
	}

	// Not again while it lasts: each instance rewrites and rereads the
	// fleet every 5 s.
	time.Sleep(6 * time.Second)
	for name, in := range map[string]*instance{"a": a, "b": b} {
		if n := countLog(t, in, disagreement); n != 1 {
			t.Errorf("%s logged the disagreement %d times over two refreshes, want once", name, n)
		}
	}

	b.Stop()
	waitForLog(t, a, 10*time.Second, "the fleet agreeing again", func(e map[string]any) bool {
		return e["msg"] == "the live instances of this fleet agree again on policy api"
	})
	if g := metricValue(t, a, "caddy_rate_limit_fleet_disagreements", nil); g != 0 {
		t.Errorf("caddy_rate_limit_fleet_disagreements %v once b stopped, want 0", g)
	}
}

// logLevel sets the level of Caddy's log.
func logLevel(level string) func(cfg map[string]any) {
	return func(cfg map[string]any) {
		cfg["logging"] = map[string]any{"logs": map[string]any{"default": map[string]any{"level": level}}}
	}
}

var debugLogs = logLevel("DEBUG")

// TestFleetAgreement: two instances with the same config see each other
// and log nothing about it; fleet lists both, without a disagreement.
func TestFleetAgreement(t *testing.T) {
	srv := testredis.Start(t)
	a := startCaddyTuned(t, debugLogs, fleetHandler(srv.Addr, "secret-one", nil, "5/1m"), echo())
	b := startCaddyTuned(t, debugLogs, fleetHandler(srv.Addr, "secret-one", nil, "5/1m"), echo())
	ids := map[*instance]string{a: fleetOf(t, a).Instance, b: fleetOf(t, b).Instance}
	for in, other := range map[*instance]*instance{a: b, b: a} {
		// Logged in the refresh that compares the two.
		waitForLog(t, in, 10*time.Second, "seeing the other instance", func(e map[string]any) bool {
			seen, _ := e["instances"].([]any)
			return e["msg"] == "the other live instances on this Redis database" && slices.Contains(seen, any(ids[other]))
		})
	}
	for name, in := range map[string]*instance{"a": a, "b": b} {
		if n := countLog(t, in, func(e map[string]any) bool { return e["level"] == "warn" || e["level"] == "error" }); n != 0 {
			raw, _ := os.ReadFile(in.Log)
			t.Errorf("%s: %d warnings or errors from the limiter, want none:\n%s", name, n, raw)
		}
		if g := metricValue(t, in, "caddy_rate_limit_fleet_disagreements", nil); g != 0 {
			t.Errorf("%s: caddy_rate_limit_fleet_disagreements %v, want 0", name, g)
		}
	}
	out := rateLimitCLI(t, b, "fleet")
	if !strings.Contains(out, "2 live instance(s)") || strings.Contains(out, "DISAGREEMENT") {
		t.Errorf("caddy rate-limit fleet:\n%s\nwant 2 live instances and no disagreement", out)
	}
}

// TestFleetsOfOneRedis: instances on one Redis under another key_prefix,
// or another database, are other fleets: listed apart, no disagreement
// (they share nothing, as two deployments on one Redis do).
func TestFleetsOfOneRedis(t *testing.T) {
	srv := testredis.Start(t)
	a := startCaddy(t, fleetHandler(srv.Addr, "secret-one", nil, "5/1m"), echo())
	startCaddy(t, fleetHandler(srv.Addr, "secret-two", map[string]any{"key_prefix": "staging:"}, "5/1m"), echo())
	startCaddy(t, fleetHandler(srv.Addr, "secret-two", map[string]any{"db": 3}, "5/1m"), echo())
	var fleets []fleet.Fleet
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		fleets = fleetOf(t, a).Stores[0].Fleets
		if len(fleets) == 3 || time.Now().After(deadline) {
			break
		}
	}
	var got []string
	for _, f := range fleets {
		got = append(got, strings.Join([]string{strconv.Itoa(f.DB), f.Prefix, strconv.Itoa(len(f.Instances)), strconv.Itoa(len(f.Splits))}, " "))
	}
	if want := []string{"0 rl: 1 0", "0 staging: 1 0", "3 rl: 1 0"}; !slices.Equal(got, want) {
		t.Errorf("fleets (db, key_prefix, instances, disagreements): %q, want %q", got, want)
	}
	t.Logf("caddy rate-limit fleet:\n%s", rateLimitCLI(t, a, "fleet"))
	if n := countLog(t, a, disagreement); n != 0 {
		t.Errorf("a logged %d disagreements with other fleets, want none", n)
	}
}

// writeConfig writes a JSON config of the handlers for `caddy run` or
// `caddy rate-limit check`, on fresh ports.
func writeConfig(t *testing.T, handlers ...map[string]any) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "caddy.json")
	raw := caddyConfig(testredis.FreePort(t), testredis.FreePort(t), nil, handlers)
	if err := os.WriteFile(path, raw, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// check runs `caddy rate-limit check --config <file>` and returns its
// output and whether it exited 0.
func check(t *testing.T, configFile string) (string, bool) {
	t.Helper()
	cmd := exec.Command(caddyBin, "rate-limit", "check", "--config", configFile)
	out, err := cmd.Output() // stdout: what check found; stderr: Caddy's log, and the error
	var exit *exec.ExitError
	if err != nil && !errors.As(err, &exit) {
		t.Fatalf("caddy rate-limit check: %v", err)
	}
	if exit != nil {
		out = append(out, exit.Stderr[max(0, strings.LastIndex(string(exit.Stderr), "Error:")):]...)
	}
	return string(out), err == nil
}

// TestCheckAgainstFleet: `caddy rate-limit check` of a config, beside a
// live instance: the same config passes; another key_secret or limit
// fails naming the difference; another key_prefix or database passes
// (another fleet) and says it shares nothing with the live one; a Redis
// that cannot be used fails naming the policy.
func TestCheckAgainstFleet(t *testing.T) {
	srv := testredis.Start(t)
	do(t, srv, "ACL", "SETUSER", "limiter", "on", ">right", "~rl:*", "~rate_limit:{fleet}*", "+@all")
	user := map[string]any{"username": "limiter", "password": "right"}
	live := startCaddy(t, fleetHandler(srv.Addr, "secret-one", user, "5/1m"), echo())
	for deadline := time.Now().Add(10 * time.Second); len(fleetOf(t, live).Stores[0].Instances) == 0; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the live instance did not announce itself within 10 s")
		}
	}
	closed := "127.0.0.1:" + strconv.Itoa(testredis.FreePort(t))
	with := func(kv ...any) map[string]any {
		m := map[string]any{"username": "limiter", "password": "right"}
		for i := 0; i < len(kv); i += 2 {
			m[kv[i].(string)] = kv[i+1]
		}
		return m
	}
	for _, tc := range []struct {
		name    string
		handler map[string]any
		ok      bool
		says    []string
	}{
		{"the same config", fleetHandler(srv.Addr, "secret-one", with(), "5/1m"), true,
			[]string{"policy api: decided by Redis", "1 live instance(s)", "agrees with the live instances"}},
		{"another key_secret", fleetHandler(srv.Addr, "secret-two", with(), "5/1m"), false,
			[]string{"policy api: DIFFERS from live instance(s)", "another key_secret"}},
		{"another limit", fleetHandler(srv.Addr, "secret-one", with(), "50/1m"), false,
			[]string{"policy api: DIFFERS", "another limit (kind rate, rate 5/1m, burst 5 there; kind rate, rate 50/1m, burst 50 here)"}},
		{"another key_prefix", fleetHandler(srv.Addr, "secret-one", with("key_prefix", "rl:other:"), "5/1m"), true,
			[]string{"0 live instance(s)", "note: on this database, instances with key_prefix rl: enforce policies of the same names (api)"}},
		{"another database", fleetHandler(srv.Addr, "secret-one", with("db", 1), "5/1m"), true,
			[]string{"db 1", "0 live instance(s)", "no live instance announces itself in Redis " /* its address follows */}},
		{"a wrong password", fleetHandler(srv.Addr, "secret-one", with("password", "wrong"), "5/1m"), false,
			[]string{"policy api: NOT decided by Redis: Redis refuses the username or password", "policy api will fail_open (admit every request) until Redis answers"}},
		{"an address nothing listens on", fleetHandler(closed, "secret-one", with(), "5/1m"), false,
			[]string{"policy api: NOT decided by Redis: Redis cannot be reached", "connection refused"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, ok := check(t, writeConfig(t, tc.handler, echo()))
			t.Logf("caddy rate-limit check (%s), exit 0: %v\n%s", tc.name, ok, out)
			if ok != tc.ok {
				t.Errorf("exit 0: %v, want %v", ok, tc.ok)
			}
			for _, s := range tc.says {
				if !strings.Contains(out, s) {
					t.Errorf("check does not say %q", s)
				}
			}
		})
	}
}
