# The commands of the README: `make run`, `make demo`, `make test`, `make bench` and `make build`.
GO ?= go

.PHONY: run build xcaddy test demo fleet bench redis-server prometheus node wrk check

# Build Caddy with the module and serve Caddyfile.example on
# http://localhost:8080 (in-process buckets: no Redis needed).
run:
	$(GO) run ./cmd/caddy run --config Caddyfile.example --adapter caddyfile

# A Caddy binary with the module, as xcaddy would build it.
build:
	$(GO) build -o bin/caddy ./cmd/caddy

# The build of xcaddy.md, from this checkout (whose module need not be
# published: the @<version>=<path> stops xcaddy asking the module proxy for
# a published version, and is the version list-modules shows): xcaddy from
# the Go module proxy, then Caddy with the module, then a check that the
# module and its version are in the binary. A cold build takes minutes.
XCADDY_CADDY ?= v2.11.9
# The module's version (version.go), which list-modules --versions shows.
VERSION := $(shell sed -n 's/^const Version = "\(.*\)"/\1/p' version.go)
xcaddy:
	$(GO) install github.com/caddyserver/xcaddy/cmd/xcaddy@v0.4.5
	mkdir -p bin
	cd "$$(mktemp -d)" && "$$($(GO) env GOPATH)/bin/xcaddy" build $(XCADDY_CADDY) \
		--with github.com/ratelimit-caddy/caddy-ratelimit@$(VERSION)=$(CURDIR) --output $(CURDIR)/bin/caddy-xcaddy
	bin/caddy-xcaddy list-modules --versions | grep -x 'http.handlers.rate_limit $(VERSION)'

# Every test: formatting, vet, the package under the race detector, and the
# integration tests that run the built Caddy against real redis-server
# processes (started by the tests on free loopback ports) and drive it with
# the official LLM SDKs under Node (integration_test/sdk: the tests run its
# npm ci, from package-lock.json, once). One package at a
# time (-p 1): the integration tests load the machine on purpose, and must
# not also compete with the unit tests for its two cores. The integration
# package takes some 5 to 7 minutes on 2 cores, and more on a busy machine:
# -timeout 25m rather than go test's 10m, so that a slow machine is not
# mistaken for a hung test.
test: redis-server prometheus node check
	$(GO) test -race -count=1 -p 1 -timeout 25m ./...

# Four Caddy instances on one budget, with in-process buckets (about 4x over)
# and with buckets in Redis (on budget), then four sidecars sharing a 1/s
# upstream budget in wait mode: prints the tables, writes
# demo-output/admitted.svg, and stops every process it started.
demo: redis-server
	$(GO) run ./cmd/demo

# A Redis and two Caddy instances running Caddyfile.fleet (one file, two
# sets of ports) on one shared budget: prints how to send requests to each,
# runs a short scripted load and what each instance admitted against the
# budget, then keeps the fleet up until Ctrl-C, or a kill of make, of go run
# or of the fleet program (it prints the pids), stops every process it
# started. FLEET_FLAGS passes flags to cmd/fleet (-caddy <binary>, -load=false).
FLEET_FLAGS ?=
fleet: redis-server
	$(GO) run ./cmd/fleet $(FLEET_FLAGS)

# What the limiter costs: plain Caddy against rate_limit (Redis, in-process,
# an abusive identity with and without Retry-After pacing, two policies, a
# settle, a concurrency slot) under wrk, side by side in one run, then the Go
# benchmarks of the decision path with allocations per operation.
bench: redis-server wrk
	$(GO) run ./cmd/bench
	$(GO) test -run '^$$' -bench . -benchmem -count 3 .

check:
	@unformatted="$$(gofmt -l .)"; if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	@# Caddy is built for Windows too: the module must compile there.
	GOOS=windows $(GO) build .

# The tests start their own redis-server processes; install the binary
# from Debian's packages when it is missing (root only). The server is a
# variable: `make test REDIS_SERVER=/path/to/valkey-server
# REDIS_CLI=/path/to/valkey-cli` runs every test against that server
# instead (docs/redis.md, "Servers"); nothing is installed then.
redis-server:
	@if [ -n "$(REDIS_SERVER)$(REDIS_CLI)" ]; then \
		server="$${REDIS_SERVER:-redis-server}"; cli="$${REDIS_CLI:-redis-cli}"; \
		command -v "$$server" >/dev/null 2>&1 || { echo "REDIS_SERVER=$$server: not found"; exit 1; }; \
		command -v "$$cli" >/dev/null 2>&1 || { echo "REDIS_CLI=$$cli: not found"; exit 1; }; \
		"$$server" --version; exit 0; \
	fi; \
	command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then echo "redis-server is missing: install it (e.g. apt-get install redis-server) or run make test as root"; exit 1; fi; \
		echo "installing redis-server from Debian's packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends redis-server redis-tools >/dev/null; \
	}; \
	redis-server --version

# The dashboard and alert rules tests (docs/grafana, docs/prometheus) run
# a real Prometheus and promtool; install them from Debian's packages when
# missing (root only), as redis-server. The tests start their own
# Prometheus on a free loopback port, never the packaged service.
prometheus:
	@command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then echo "prometheus is missing: install it (e.g. apt-get install prometheus) or run make test as root"; exit 1; fi; \
		echo "installing prometheus and promtool from Debian's packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null; \
	}
	@prometheus --version 2>&1 | head -1

# The SDK tests run the official LLM SDKs under Node; install it from
# Debian's packages when it is missing (root only), as redis-server.
node:
	@command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then echo "node is missing: install it (e.g. apt-get install nodejs npm) or run make test as root"; exit 1; fi; \
		echo "installing nodejs and npm from Debian's packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null; \
	}
	@node --version

wrk:
	@command -v wrk >/dev/null 2>&1 || { \
		if [ "$$(id -u)" != 0 ]; then echo "wrk is missing: install it (e.g. apt-get install wrk) or run make bench as root"; exit 1; fi; \
		echo "installing wrk from Debian's packages"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends wrk >/dev/null; \
	}
