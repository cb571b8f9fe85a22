// Command daylog writes a generated day of an API's Caddy access log (see
// internal/accesslog.Day): tenants with API keys, a noisy neighbour, a
// burst, a scraper, the Authorization header REDACTED as Caddy logs it.
// docs/choosing-limits.md replays it:
//
//	go run ./cmd/daylog -o day.log.gz
//	caddy rate-limit replay --config Caddyfile day.log.gz
package main

import (
	"compress/gzip"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
)

func main() {
	out := flag.String("o", "-", "where to write it (a name ending in .gz is gzip-compressed; - is standard output)")
	requests := flag.Int("requests", 200_000, "about how many regular requests")
	tenants := flag.Int("tenants", 500, "how many API keys")
	seed := flag.Uint64("seed", 1, "the generator's seed: the same seed, the same day")
	day := flag.String("day", "2025-03-03", "the day (UTC)")
	flag.Parse()
	start, err := time.Parse("2006-01-02", *day)
	if err != nil {
		fail(err)
	}
	var w io.Writer = os.Stdout
	if *out != "-" {
		f, err := os.Create(*out)
		if err != nil {
			fail(err)
		}
		defer f.Close()
		w = f
		if strings.HasSuffix(*out, ".gz") {
			zw := gzip.NewWriter(f)
			defer zw.Close()
			w = zw
		}
	}
	d := accesslog.Day{Start: start, Requests: *requests, Tenants: *tenants, Seed: *seed}
	if _, err := d.WriteTo(w); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "daylog:", err)
	os.Exit(1)
}
