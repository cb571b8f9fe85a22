package integration_test

import (
	"crypto/tls"
	"strings"
	"testing"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/testredis"
)

// limiterACL is the ACL docs/redis.md gives the limiter's Redis user.
const limiterACL = "~rl:* ~rate_limit:{fleet}* resetchannels &rl:* +evalsha +eval +time +get +set +del +type +publish +subscribe +zadd +zrem +zcard +zremrangebyscore +pexpire +hset +hdel +hget +hgetall +hkeys +hscan +pubsub|numsub"

// TestRedisTLSAndACL: a Redis that speaks only TLS, with an ACL user for
// the limiter. With the right CA and credentials Caddy limits exactly;
// with a CA that did not sign Redis's certificate, or a wrong password, the
// decisions follow on_error.
func TestRedisTLSAndACL(t *testing.T) {
	caFile, certFile, keyFile, pool := testredis.CA(t)
	srv := testredis.StartTLS(t, certFile, keyFile, &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12})
	// The ACL the docs give the limiter: its keys and the commands of its
	// script, nothing else.
	if _, err := srv.Do(append([]string{"ACL", "SETUSER", "limiter", "on", ">s3cret"}, strings.Fields(limiterACL)...)...); err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Do("ACL", "SETUSER", "default", "off"); err != nil {
		t.Fatal(err)
	}
	policy := map[string]any{"name": "per_user", "key": "{http.request.header.X-User}", "rate": "3/1h"}
	// A concurrency policy beside it: its slots need the ACL's sorted-set
	// commands and the events channel.
	slots := map[string]any{"name": "slots", "key": "{http.request.header.X-User}", "concurrent": 5}
	withRedis := func(password, ca string) map[string]any {
		h := limiter("", map[string]any{"on_error": "fail_closed"}, policy, slots)
		h["redis"] = map[string]any{"addresses": []string{srv.Addr}, "username": "limiter", "password": password,
			"tls": map[string]any{"ca": ca}, "timeout": "1s"}
		return h
	}

	good := startCaddy(t, withRedis("s3cret", caFile), echo())
	var got []int
	for range 4 {
		got = append(got, get(t, good.URL, "X-User", "tls-user").status)
	}
	if got[0] != 200 || got[1] != 200 || got[2] != 200 || got[3] != 429 {
		t.Fatalf("over TLS with ACL user: %v, want 200 200 200 429", got)
	}
	// Overrides need the index's hash commands, a script of their own and
	// the confirmations of their announcement (PUBSUB NUMSUB).
	if status, body := adminCall(t, good, "POST", "/rate_limit/override", `{"policy":"per_user","identity":"tls-user","rate":"10/1h","for":"1h","note":"acl"}`); status != 200 || !strings.Contains(body, `"announced":true`) {
		t.Fatalf("an override with the ACL user: %d %s", status, body)
	}
	if r := get(t, good.URL, "X-User", "tls-user"); r.status != 200 {
		t.Fatalf("under the override with the ACL user: %d", r.status)
	}
	if l := listOverrides(t, good, "per_user"); len(l.Overrides) != 1 || l.Overrides[0].Note != "acl" {
		t.Fatalf("overrides listed with the ACL user: %+v", l.Overrides)
	}
	if status, body := adminCall(t, good, "DELETE", "/rate_limit/override", `{"policy":"per_user","identity":"tls-user"}`); status != 200 {
		t.Fatalf("deleting the override with the ACL user: %d %s", status, body)
	}
	// The fleet's records need their keys and the hash commands: the
	// instance is listed, and says nothing of not announcing itself.
	for deadline := time.Now().Add(10 * time.Second); len(fleetOf(t, good).Stores[0].Instances) != 1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the instance did not announce itself with the ACL user within 10 s")
		}
	}
	if logMentions(t, good, "cannot announce") {
		t.Error("with the documented ACL, the instance cannot announce itself to the fleet")
	}

	otherCA, _, _, _ := testredis.CA(t)
	if r := get(t, startCaddy(t, withRedis("s3cret", otherCA), echo()).URL, "X-User", "x"); r.status != 503 {
		t.Errorf("with a CA that did not sign Redis's certificate: %d, want 503 (fail_closed)", r.status)
	}
	if r := get(t, startCaddy(t, withRedis("wrong", caFile), echo()).URL, "X-User", "x"); r.status != 503 {
		t.Errorf("with a wrong password: %d, want 503 (fail_closed)", r.status)
	}
}
