package ratelimit

import "github.com/ratelimit-caddy/caddy-ratelimit/internal/pace"

// pacing spreads the Retry-After of the denials of this process
// (internal/pace): one calendar of return turns per bucket, whichever
// handler denied.
var pacing = pace.New(monotonicMicros)
