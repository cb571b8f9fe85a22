package ratelimit

import (
	"fmt"
	"io"
	"regexp"
	"strconv"
	"strings"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// What `caddy rate-limit` reads from its command line before it calls the
// admin API: the admin address (and where it came from, for an error that
// names it), and arguments that look like negative numbers, read as the
// numbers they are.

// adminTarget is the admin API a command calls, and where its address came
// from.
type adminTarget struct {
	addr, from string
	asJSON     bool
}

// adminTargetOf finds the admin address as `caddy reload` does: --address,
// otherwise the admin listener of --config (with --adapter), otherwise
// Caddy's default.
func adminTargetOf(cmd *cobra.Command) (adminTarget, error) {
	flags := cmd.Flags()
	address, _ := flags.GetString("address")
	configFile, _ := flags.GetString("config")
	adapter, _ := flags.GetString("adapter")
	asJSON, _ := flags.GetBool("json")
	addr, err := caddycmd.DetermineAdminAPIAddress(address, nil, configFile, adapter)
	if err != nil {
		return adminTarget{}, fmt.Errorf("finding the admin API: %v", err)
	}
	from := "Caddy's default admin address"
	switch {
	case address != "":
		from = "from --address"
	case configFile != "" && addr != "localhost:2019":
		from = "the admin listener of " + configFile
	case configFile != "":
		from = "Caddy's default admin address: " + configFile + " sets no other"
	}
	return adminTarget{addr: addr, from: from, asJSON: asJSON}, nil
}

// call makes a call of the admin API and returns the answer's body, which
// it also writes to stdout with --json. When nothing answers at the
// address, the error says so, names the address, and what to do.
func (t adminTarget) call(stdout io.Writer, method, uri string, body io.Reader) ([]byte, error) {
	raw, err := callAdmin(t.addr, method, uri, body, t.asJSON)
	if err != nil && notListening(err) {
		return nil, fmt.Errorf("no Caddy is answering at %s (%s): is Caddy running? Start it (caddy run), "+
			"or name its admin address with --address <host:port> or its config with --config <file> (%v)", t.addr, t.from, err)
	}
	return raw, err
}

// notListening reports whether err is a connection nobody accepted: no
// process listens at the address (or the unix socket is not there).
func notListening(err error) bool {
	msg := err.Error()
	if strings.Contains(msg, "caddy responded with error") {
		return false // Caddy answered: whatever its error says (Redis refusing a connection) is its own
	}
	return strings.Contains(msg, "connection refused") || strings.Contains(msg, "no such file or directory")
}

// negativeNumber is an argument that looks like a negative number (-5,
// -5s, -1/1m): an argument, not a shorthand flag (no flag of
// `caddy rate-limit` is a digit).
var negativeNumber = regexp.MustCompile(`^-[0-9.]`)

// numbersAsArgs makes cmd read arguments that look like negative numbers as
// arguments, so that `grant p id -3` or `override … for -5s` is refused for
// its value ("must be positive"), not as "unknown shorthand flag: '5' in
// -5s". The flags are parsed by cmd's own flag set, the numbers masked
// from it; cmd's Args check runs on what is left.
func numbersAsArgs(cmd *cobra.Command) {
	run, validate := cmd.RunE, cmd.Args
	cmd.DisableFlagParsing = true
	cmd.Args = cobra.ArbitraryArgs
	cmd.RunE = func(c *cobra.Command, args []string) error {
		var numbers []string
		masked := make([]string, len(args))
		for i, a := range args {
			masked[i] = a
			if negativeNumber.MatchString(a) {
				masked[i] = "\x00" + strconv.Itoa(len(numbers))
				numbers = append(numbers, a)
			}
		}
		c.DisableFlagParsing = false
		err := c.ParseFlags(masked)
		c.DisableFlagParsing = true
		if err != nil {
			c.SilenceUsage = true
			return fmt.Errorf("%v (caddy rate-limit %s --help)", err, c.Name())
		}
		if help, _ := c.Flags().GetBool("help"); help {
			return c.Help()
		}
		rest := c.Flags().Args()
		for i, a := range rest {
			if n, ok := strings.CutPrefix(a, "\x00"); ok {
				j, _ := strconv.Atoi(n)
				rest[i] = numbers[j]
			}
		}
		if validate != nil {
			if err := validate(c, rest); err != nil {
				c.SilenceUsage = true
				return fmt.Errorf("%v: expected caddy rate-limit %s", err, c.Use)
			}
		}
		return run(c, rest)
	}
}
