package ratelimit

import "os"

// The adapt fixtures and fuzz seeds key their identities with
// {env.RATE_LIMIT_SECRET}, as a deployment should; a secret that resolves
// to nothing is a load error, so the tests provide one.
func init() {
	if os.Getenv("RATE_LIMIT_SECRET") == "" {
		os.Setenv("RATE_LIMIT_SECRET", "test-secret")
	}
}
