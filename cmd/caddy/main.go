// Command caddy is Caddy with the rate_limit module built in, the same
// program `xcaddy build --with` this module would produce.
package main

import (
	caddycmd "github.com/caddyserver/caddy/v2/cmd"

	_ "github.com/caddyserver/caddy/v2/modules/standard"

	_ "github.com/ratelimit-caddy/caddy-ratelimit"
)

func main() {
	caddycmd.Main()
}
