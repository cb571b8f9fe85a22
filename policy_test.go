package ratelimit

import (
	"context"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	_ "github.com/caddyserver/caddy/v2/modules/standard"
)

// TestJSONConfigErrors checks that a JSON config mistake fails provisioning
// (what `caddy validate` and a config load run) with an error that names
// the policy, when there is one, and the field.
func TestJSONConfigErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handler string   // the handler's JSON, without "handler"
		want    []string // substrings of the error
	}{
		{
			name:    "max_cost above the burst",
			handler: `{"policies":[{"name":"llm","key":"{http.rate_limit.credential}","rate":"500/1m","cost":"openai","max_cost":8000,"settle":{"from":"openai"}}]}`,
			want:    []string{`policy "llm"`, "cost: max 8000 is more than the burst 500"},
		},
		{
			name:    "error_format unknown",
			handler: `{"error_format":"gemini","policies":[{"name":"api","key":"{client_ip}","rate":"1/1s"}]}`,
			want:    []string{`error_format: "gemini"`},
		},
		{
			name:    "settle debt negative",
			handler: `{"policies":[{"name":"api","key":"k","rate":"1/1s","settle":{"from":"openai","debt":-1}}]}`,
			want:    []string{`policy "api"`, "settle: debt -1"},
		},
		{
			name:    "cache_write for openai",
			handler: `{"policies":[{"name":"api","key":"k","rate":"1/1s","settle":{"from":"openai","weights":{"input":1,"output":1,"cache_write":1}}}]}`,
			want:    []string{`policy "api"`, "cache_write is for anthropic"},
		},
		{
			name:    "rate zero",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"0/1s"}]}`,
			want:    []string{`policy "api"`, `rate: "0/1s"`, "positive integer"},
		},
		{
			name:    "rate negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"-5/1m"}]}`,
			want:    []string{`policy "api"`, `rate: "-5/1m"`},
		},
		{
			name:    "rate fractional",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"1.5/1s"}]}`,
			want:    []string{`policy "api"`, `rate: "1.5/1s"`},
		},
		{
			name:    "rate without slash",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100"}]}`,
			want:    []string{`policy "api"`, `rate: "100" is not N/duration`},
		},
		{
			name:    "rate bad duration",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/1fortnight"}]}`,
			want:    []string{`policy "api"`, `rate: "100/1fortnight": bad duration`},
		},
		{
			name:    "hot_keys not a rate",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/1s","hot_keys":"often"}]}`,
			want:    []string{`policy "api"`, `hot_keys: "often" is not N/duration`, "or off"},
		},
		{
			name:    "hot_keys on a concurrency limit",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","concurrent":3,"hot_keys":"off"}]}`,
			want:    []string{`policy "api"`, "hot_keys: a concurrent policy has no tokens to take ahead"},
		},
		{
			name:    "rate missing",
			handler: `{"policies":[{"name":"api","key":"{client_ip}"}]}`,
			want:    []string{`policy "api"`, "rate:"},
		},
		{
			name:    "burst negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","burst":-1}]}`,
			want:    []string{`policy "api"`, "burst: -1"},
		},
		{
			name:    "max_cost negative",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","cost":"{http.request.header.X-Cost}","max_cost":-1}]}`,
			want:    []string{`policy "api"`, "max_cost: -1"},
		},
		{
			name:    "cost zero",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","cost":"0"}]}`,
			want:    []string{`policy "api"`, `cost: "0"`},
		},
		{
			name:    "duplicate policy names",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"},{"name":"api","key":"global","rate":"100/1s"}]}`,
			want:    []string{`policy "api"`, "defined twice"},
		},
		{
			name:    "ipv6_prefix above 128",
			handler: `{"ipv6_prefix":129,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"ipv6_prefix: 129 must be from 1 to 128"},
		},
		{
			name:    "ipv4_prefix negative",
			handler: `{"ipv4_prefix":-8,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"ipv4_prefix: -8 must be from 1 to 32"},
		},
		{
			name:    "policy ipv4_prefix above 32",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","ipv4_prefix":33}]}`,
			want:    []string{`policy "api"`, "ipv4_prefix: 33 must be from 1 to 32"},
		},
		{
			name:    "concurrent policy ipv6_prefix above 128",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","concurrent":3,"ipv6_prefix":200}]}`,
			want:    []string{`policy "api"`, "ipv6_prefix: 200 must be from 1 to 128"},
		},
		{
			name:    "bad on_error",
			handler: `{"on_error":"fail_maybe","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`on_error: "fail_maybe"`},
		},
		{
			name:    "bad policy on_error",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","on_error":"retry"}]}`,
			want:    []string{`policy "api"`, `on_error: "retry"`},
		},
		{
			name:    "bad headers",
			handler: `{"headers":"ietf","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`headers: "ietf"`},
		},
		{
			name:    "negative jitter",
			handler: `{"jitter":-1,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"jitter: -1"},
		},
		{
			name:    "jitter too large",
			handler: `{"jitter":20,"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"jitter: 20"},
		},
		{
			name:    "missing key",
			handler: `{"policies":[{"name":"api","rate":"10/1s"}]}`,
			want:    []string{`policy "api"`, "key: required"},
		},
		{
			name:    "policy name with a space",
			handler: `{"policies":[{"name":"per user","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`policy "per user"`, `name "per user"`},
		},
		{
			name:    "policy without a name",
			handler: `{"policies":[{"key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{`policy ""`, `name ""`},
		},
		{
			name:    "no policy",
			handler: `{"key_secret":"s"}`,
			want:    []string{"at least one policy is required"},
		},
		{
			name:    "redis without addresses",
			handler: `{"redis":{"password":"x"},"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"redis: address: at least one host:port is required"},
		},
		{
			name:    "redis cluster and sentinel",
			handler: `{"redis":{"addresses":["10.0.0.1:6379"],"cluster":true,"sentinel":"mymaster"},"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"redis: cluster and sentinel exclude each other"},
		},
		{
			name:    "unknown policy field",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","brust":5}]}`,
			want:    []string{`unknown field "brust"`},
		},
		{
			name:    "bad matcher",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"10/1s","match":{"no_such_matcher":{}}}]}`,
			want:    []string{`policy "api"`, "match:", "no_such_matcher"},
		},
		{
			name:    "quota of an unknown period",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/fortnight"}]}`,
			want:    []string{`policy "monthly"`, "quota:", "minute, hour, day, week, month or year"},
		},
		{
			name:    "quota above 2^53",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"9007199254740993/month"}]}`,
			want:    []string{`policy "monthly"`, "quota:", "from 1 to 9007199254740992"},
		},
		{
			name:    "quota and rate",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","rate":"10/1s"}]}`,
			want:    []string{`policy "monthly"`, "rate:", "a rate or a quota"},
		},
		{
			name:    "quota and concurrent",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","concurrent":3}]}`,
			want:    []string{`policy "monthly"`, "concurrent:", "a quota or concurrent"},
		},
		{
			name:    "unknown time zone",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","timezone":"Mars/Olympus"}]}`,
			want:    []string{`policy "monthly"`, "timezone:", `"Mars/Olympus"`, "IANA"},
		},
		{
			name:    "durable replicas 0",
			handler: `{"redis":{"addresses":["127.0.0.1:6379"]},"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":0}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "replicas <n> (at least 1) or aof"},
		},
		{
			name:    "durable replicas negative",
			handler: `{"redis":{"addresses":["127.0.0.1:6379"]},"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":-1}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "from 1 to 1000"},
		},
		{
			name:    "rate in words",
			handler: `{"policies":[{"name":"api","key":"{client_ip}","rate":"100/minute"}]}`,
			want:    []string{`policy "api"`, `rate: "100/minute"`, "did you mean 100/1m?"},
		},
		{
			name:    "key_secret from an unset variable",
			handler: `{"key_secret":"{env.RATE_LIMIT_TEST_UNSET_SECRET}","policies":[{"name":"api","key":"{client_ip}","rate":"10/1s"}]}`,
			want:    []string{"key_secret:", "environment variable RATE_LIMIT_TEST_UNSET_SECRET is not set", "export RATE_LIMIT_TEST_UNSET_SECRET="},
		},
		{
			name:    "durable without redis",
			handler: `{"policies":[{"name":"monthly","key":"{client_ip}","quota":"5/month","durable":{"replicas":1}}]}`,
			want:    []string{`policy "monthly"`, "durable:", "needs a redis block"},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			check := func(how string, err error) {
				t.Helper()
				if err == nil {
					t.Fatalf("%s: %s succeeded; want an error containing %q", tc.handler, how, tc.want)
				}
				t.Logf("%s: %v", how, err)
				for _, w := range tc.want {
					if !strings.Contains(err.Error(), w) {
						t.Errorf("%s: %s error\n\t%v\ndoes not contain %q", tc.handler, how, err, w)
					}
				}
			}

			// The handler alone, provisioned as Caddy provisions a module.
			var err error
			h := new(Handler)
			if err = caddy.StrictUnmarshalJSON([]byte(tc.handler), h); err == nil {
				ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
				err = h.Provision(ctx)
				if err == nil {
					_ = h.Cleanup()
				}
				cancel()
			}
			check("provisioning", err)

			// The same handler in a whole config, as `caddy validate` loads it.
			withName := `{"handler":"rate_limit",` + strings.TrimPrefix(tc.handler, "{")
			config := `{"apps":{"http":{"servers":{"srv0":{"listen":[":8080"],"routes":[{"handle":[` + withName + `]}]}}}}}`
			cfg := new(caddy.Config)
			if err := caddy.StrictUnmarshalJSON([]byte(config), cfg); err != nil {
				t.Fatal(err)
			}
			check("caddy.Validate", caddy.Validate(cfg))
		})
	}
}
