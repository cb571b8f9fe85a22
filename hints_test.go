package ratelimit

import (
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig"
)

// TestCaddyfileErrorsSayWhatToDo: a mistake whose fix is known gets it in
// its error, at the mistake's line: a misspelt subdirective the nearest
// one, a subdirective in the wrong block the block it belongs in, a rate
// written in words the duration, an unset {$VAR} what to export.
func TestCaddyfileErrorsSayWhatToDo(t *testing.T) {
	for _, tc := range []struct {
		name string
		body string // the wrong line ends in mark
		want string // in the error
	}{
		{"misspelt policy subdirective", inPolicy("burts 5 " + mark), `"burts": did you mean burst?`},
		{"misspelt policy subdirective, another", inPolicy("concurent 5 " + mark), "did you mean concurrent?"},
		{"misspelt handler subdirective", "jiter 10% " + mark + "\n" + base, "did you mean jitter?"},
		{"misspelt redis subdirective", redisBlock("timout 1s " + mark), "did you mean timeout?"},
		{"policy's subdirective misspelt outside a policy", "brust 5 " + mark + "\n" + base, "did you mean burst? (burst is a policy's: it belongs inside a policy block"},
		{"key outside a policy", "key {client_ip} " + mark + "\n" + base, "key is a policy's: it belongs inside a policy block, policy <name> { key ... }"},
		{"rate outside a policy", "rate 10/1s " + mark + "\n" + base, "rate is a policy's: it belongs inside a policy block"},
		{"address outside the redis block", "address 127.0.0.1:6379 " + mark + "\n" + base, "address is a Redis setting: it belongs inside the redis block"},
		{"timeout in a policy", inPolicy("timeout 1s " + mark), "timeout is a Redis setting"},
		{"jitter in a policy", inPolicy("jitter 10% " + mark), "jitter is the handler's, for all its policies: it belongs directly inside rate_limit { }, outside the policy block"},
		{"key_secret in the redis block", redisBlock("key_secret s " + mark), "outside the redis block"},
		{"key in the redis block", redisBlock("key {client_ip} " + mark), "key is a policy's"},
		{"nothing near", inPolicy("frobnicate 5 " + mark), "expected one of match, key, rate"},
		{"mholt's window in a policy", inPolicy("window 1m " + mark), "window is mholt/caddy-ratelimit's, in a zone: a policy's limit is rate <events>/<window>"},
		{"rate per minute in words", "policy api {\n\tkey k\n\trate 100/minute " + mark + "\n}\n", `"100/minute": bad duration "minute": did you mean 100/1m?`},
		{"rate per second abbreviated", "policy api {\n\tkey k\n\trate 5/sec " + mark + "\n}\n", "did you mean 5/1s?"},
		{"rate per 2 minutes in words", "policy api {\n\tkey k\n\trate 5/2minutes " + mark + "\n}\n", "did you mean 5/2m?"},
		{"rate per hour, unit alone", "policy api {\n\tkey k\n\trate 5/h " + mark + "\n}\n", "did you mean 5/1h?"},
		{"rate per month", "policy api {\n\tkey k\n\trate 5/month " + mark + "\n}\n", "quota 5/month counts per calendar month; a rolling window is a duration, as rate 5/30d"},
		{"quota in plural", "policy q {\n\tkey k\n\tquota 5/months " + mark + "\n}\n", "did you mean 5/month?"},
		{"quota misspelt", "policy q {\n\tkey k\n\tquota 5/mnoth " + mark + "\n}\n", "did you mean 5/month?"},
		{"quota of a duration", "policy q {\n\tkey k\n\tquota 5/24h " + mark + "\n}\n", "for a rolling window of 24h, use rate 5/24h"},
		{"key_secret from an unset {$VAR}", "key_secret {$RATE_LIMIT_TEST_UNSET_SECRET} " + mark + "\n" + base, "a {$VAR} whose variable is unset when the Caddyfile is adapted leaves nothing here: export it first"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			caddyfileText, lines := siteWith(tc.body)
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
			if err == nil {
				t.Fatalf("adapted without error:\n%s", caddyfileText)
			}
			t.Log(err)
			if !strings.Contains(err.Error(), tc.want) {
				t.Errorf("the error does not say %q:\n\t%v", tc.want, err)
			}
			m := atLine.FindAllStringSubmatch(err.Error(), -1)
			if len(m) == 0 {
				t.Fatalf("the error has no Caddyfile:<line>: %v", err)
			}
			if got, _ := strconv.Atoi(m[len(m)-1][1]); !lines[got] {
				t.Errorf("the error points at line %d, want %s: %v\n%s", got, lineList(lines), err, numbered(caddyfileText))
			}
		})
	}
}

// TestSubdirectiveLists holds the lists the errors suggest from (hints.go)
// to the parser's switches in caddyfile.go.
func TestSubdirectiveLists(t *testing.T) {
	accepted, err := parserNames("caddyfile.go")
	if err != nil {
		t.Fatal(err)
	}
	for b, list := range map[string][]string{blockHandler: handlerSubdirectives, blockRedis: redisSubdirectives, blockPolicy: policySubdirectives} {
		got, want := slices.Sorted(slices.Values(list)), slices.Sorted(slices.Values(accepted[b]))
		if !slices.Equal(got, want) {
			t.Errorf("%s: hints.go lists %v, the parser takes %v", b, got, want)
		}
	}
}
