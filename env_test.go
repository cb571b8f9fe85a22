package ratelimit

import (
	"os"
	"time"

	"github.com/caddyserver/caddy/v2"
)

// testTimeout is the Redis timeout of tests that do not test timeouts: a
// machine loaded by other tests stalls a call for far longer than the
// default 100 ms now and then, which is not what they measure.
const testTimeout = caddy.Duration(5 * time.Second)

// The adapt fixtures and fuzz seeds key their identities with
// {env.RATE_LIMIT_SECRET}, as a deployment should; a secret that resolves
// to nothing is a load error, so the tests provide one.
func init() {
	if os.Getenv("RATE_LIMIT_SECRET") == "" {
		os.Setenv("RATE_LIMIT_SECRET", "test-secret")
	}
}
