//go:build ratelimit_noop_script

package ratelimit

import _ "embed"

// decideLua, in a build with the tag ratelimit_noop_script, is a script
// that decides nothing (see lua/noop.lua): make bench's scenario (z)
// measures with it the round trips of (b) without their decisions. Never
// for production: it admits everything.
//
//go:embed lua/noop.lua
var decideLua string
