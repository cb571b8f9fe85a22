//go:build !ratelimit_noop_script

package ratelimit

import _ "embed"

// decideLua decides every bucket operation (see lua/decide.lua).
//
//go:embed lua/decide.lua
var decideLua string
