package ratelimit

// Version is this module's release. `caddy list-modules --versions` shows
// the version Go recorded for the module, which is this one for a build
// made with `make xcaddy` (xcaddy's `--with module@<version>=<path>`); the
// handler logs it when provisioned. CHANGELOG.md says what each release
// changed.
const Version = "v0.4.0"
