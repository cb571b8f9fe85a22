package ratelimit

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
	"github.com/spf13/cobra"
)

// `caddy rate-limit fleet`, the admin API's /rate_limit/fleet
// (admin_fleet.go) from the command line, and `caddy rate-limit check`
// (check.go), which needs no running Caddy.

// addFleetCommands adds fleet and check to `caddy rate-limit`.
func addFleetCommands(cmd *cobra.Command) {
	cmd.AddCommand(
		&cobra.Command{Use: "fleet", Short: "Lists the live instances on each Redis of the loaded config, by database and key_prefix, and the policies they disagree on",
			Args: cobra.NoArgs, RunE: fleetCommand},
		&cobra.Command{Use: "check", Short: "Checks a config before it runs: one read-only decision per policy against its Redis, and what it enforces against the live fleet",
			Long: `Loads a config as caddy validate does (--config, --adapter; by default the
Caddyfile of the current directory), connects to each Redis it names, runs one
read-only decision per policy, and compares what each policy enforces with the
live instances of its fleet (the same Redis database and key_prefix). It exits
non-zero, naming them, when a policy would not be decided by Redis (Redis
unreachable, a wrong password, an ACL without the limiter's commands, no
scripting) or when a live instance enforces a policy of the same name with
another limit, key or key_secret. It needs no running Caddy, and announces
nothing.`,
			Args: cobra.NoArgs, RunE: checkCommand},
	)
}

func fleetCommand(cmd *cobra.Command, _ []string) error {
	cmd.SilenceUsage = true
	target, err := adminTargetOf(cmd) // command_cli.go
	if err != nil {
		return err
	}
	raw, err := target.call(os.Stdout, http.MethodGet, "/rate_limit/fleet", nil)
	if err != nil || target.asJSON {
		return err
	}
	return printFleet(os.Stdout, raw)
}

func checkCommand(cmd *cobra.Command, _ []string) error {
	cmd.SilenceUsage = true
	configFile, _ := cmd.Flags().GetString("config")
	adapter, _ := cmd.Flags().GetString("adapter")
	problems, alone, err := runCheck(os.Stdout, configFile, adapter)
	if err != nil {
		return err
	}
	if len(problems) > 0 {
		return fmt.Errorf("check: %d problem(s): %s", len(problems), strings.Join(problems, "; "))
	}
	if len(alone) > 0 {
		fmt.Printf("check: every policy is decided by Redis; no live instance announces itself in %s to compare with: "+
			"a first instance, or not the Redis, db or key_prefix the others use?\n", strings.Join(alone, "; "))
		return nil
	}
	fmt.Println("check: every policy is decided by Redis, and agrees with the live instances of its fleet")
	return nil
}

// printFleet writes what /rate_limit/fleet answered for a person.
func printFleet(w io.Writer, raw []byte) error {
	var a fleetAnswer
	if err := json.Unmarshal(raw, &a); err != nil {
		return err
	}
	type at struct {
		db int
		id string
	}
	for _, st := range a.Stores {
		fmt.Fprintf(w, "%s:\n", st.Store)
		byID := map[at]fleetInstance{}
		for _, in := range st.Instances {
			byID[at{in.DB, in.ID}] = in
		}
		if len(st.Fleets) == 0 {
			fmt.Fprintln(w, "  no live instance announces itself")
		}
		for _, f := range st.Fleets {
			fmt.Fprintf(w, "  fleet db %d, key_prefix %s: %d live instance(s)\n", f.DB, f.Prefix, len(f.Instances))
			tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "    INSTANCE\tHOST\tPID\tVERSION\tFORMAT\tSTARTED\tPOLICIES")
			for _, id := range f.Instances {
				in := byID[at{f.DB, id}]
				var names []string
				for _, p := range in.Policies {
					if p.Prefix == f.Prefix && !slices.Contains(names, p.Name) {
						names = append(names, p.Name)
					}
				}
				mark := ""
				if in.Self {
					mark = " *"
				}
				started := "-"
				if in.Started > 0 {
					started = time.UnixMilli(in.Started).UTC().Format(time.RFC3339)
				}
				fmt.Fprintf(tw, "    %s%s\t%s\t%d\t%s\t%s\t%s\t%s\n", id, mark, in.Host, in.PID, in.Version, in.Format, started, strings.Join(names, ", "))
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			for _, s := range f.Splits {
				fmt.Fprintf(w, "    DISAGREEMENT policy %s: %s; they do not share one budget\n", s.Policy, differText(s.Differs))
				for _, v := range s.Variants {
					fmt.Fprintf(w, "      %s: %s\n", strings.Join(v.Instances, ", "), variantText(v))
				}
			}
		}
		if st.OtherDatabases != "" {
			fmt.Fprintf(w, "  (%s)\n", st.OtherDatabases)
		}
	}
	fmt.Fprintln(w, "* this instance ("+a.Instance+"). Instances of releases before v0.4.0 do not announce themselves and are not listed.")
	return nil
}

func variantText(v fleet.Variant) string {
	secret := "key_secret fingerprint " + v.Secret
	if v.Secret == fleet.NoSecret {
		secret = "no key_secret"
	}
	return v.Limit + "; key " + strconv.Quote(v.Key) + "; " + secret
}
