package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/suggest"
)

// `caddy rate-limit override` and `overrides`, the admin API's overrides
// (admin_override.go) from the command line; and a `caddy rate-limit` whose
// subcommand is unknown fails, as a script calling a misspelt one must see.

// addOverrideCommands adds the override commands to `caddy rate-limit`.
func addOverrideCommands(cmd *cobra.Command) {
	cmd.AddCommand(
		&cobra.Command{
			Use:   "override <policy> <identity> rate <N>/<duration> [burst <n>] | concurrent <n> | quota <N>[/<unit>] | delete [for <duration>] [note <text>]",
			Short: "Sets (or deletes) one identity's limit, in place of its plan's, on every instance at once",
			Long: `Sets one identity's limit, in place of its plan's (or its policy's), on every
instance at once, until deleted or, with for, until it expires by itself:

  caddy rate-limit override per_tenant acme rate 5000/1m burst 500 for 72h note "contract 123"
  caddy rate-limit override exports acme concurrent 10
  caddy rate-limit override monthly acme quota 5000000/month for 30d
  caddy rate-limit override per_tenant acme delete

The identity's bucket keeps its state: an override that raises the limit
frees it at once; one that lowers it applies at once. A quota's override sets
its N; the period and the timezone stay the policy's, and the units used so
far in the period count against the new N.`,
			Args: cobra.MinimumNArgs(3), RunE: overrideCommand("override")},
		&cobra.Command{Use: "overrides <policy>", Short: "Lists a policy's overrides: hash, limit, expiry, note",
			Args: cobra.ExactArgs(1), RunE: overrideCommand("overrides")},
	)
	// Without a known subcommand, cobra prints the help and exits 0: a
	// script calling a misspelt one would never know.
	cmd.Args = cobra.ArbitraryArgs
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) == 0 {
			return cmd.Help()
		}
		cmd.SilenceUsage = true
		var names []string
		for _, sub := range cmd.Commands() {
			names = append(names, sub.Name())
		}
		if near := suggest.Nearest(args[0], names); near != "" {
			return fmt.Errorf("unknown command %q for caddy rate-limit: did you mean %s? (caddy rate-limit --help)", args[0], near)
		}
		return fmt.Errorf("unknown command %q for caddy rate-limit: use inspect, reset, grant, top, format, fleet, check, override, overrides, apply, try or replay (caddy rate-limit --help)", args[0])
	}
}

// parseOverrideArgs reads an override's command line after the policy and
// the identity: its limit, for and note (the rest of the line), or delete.
func parseOverrideArgs(args []string) (req overrideRequest, del bool, err error) {
	if len(args) == 1 && args[0] == "delete" {
		return req, true, nil
	}
	seen := map[string]bool{}
	for i := 0; i < len(args); i++ {
		word := args[i]
		if seen[word] {
			return req, false, fmt.Errorf("%s given twice", word)
		}
		seen[word] = true
		if word == "note" {
			if i+1 >= len(args) {
				return req, false, fmt.Errorf("note: a text is required")
			}
			req.Note = strings.Join(args[i+1:], " ")
			break
		}
		if i+1 >= len(args) {
			return req, false, fmt.Errorf("%s: a value is required", word)
		}
		v := args[i+1]
		i++
		switch word {
		case "rate":
			req.Rate = v
		case "quota":
			req.Quota = v
		case "for":
			if _, err := parseOverrideFor(v); err != nil {
				return req, false, err
			}
			req.For = v
		case "burst", "concurrent":
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil || n < 1 {
				return req, false, fmt.Errorf("%s: %q is not a positive integer", word, v)
			}
			if word == "burst" {
				req.Burst = n
			} else {
				req.Concurrent = n
			}
		default:
			return req, false, fmt.Errorf("unknown %q: an override is rate <N>/<duration> [burst <n>], concurrent <n> or quota <N>, then [for <duration>] [note <text>]; or delete", word)
		}
	}
	return req, false, nil
}

// overrideCommand runs override or overrides against the admin API.
func overrideCommand(action string) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		cmd.SilenceUsage = true
		var method, uri string
		var body io.Reader
		del := false
		switch action {
		case "overrides":
			method, uri = http.MethodGet, "/rate_limit/overrides?"+url.Values{"policy": {args[0]}}.Encode()
		default:
			req, d, err := parseOverrideArgs(args[2:])
			if err != nil {
				return err
			}
			del = d
			req.Policy, req.Identity = args[0], args[1]
			raw, _ := json.Marshal(req)
			method, uri, body = http.MethodPost, "/rate_limit/override", bytes.NewReader(raw)
			if del {
				method = http.MethodDelete
			}
		}
		target, err := adminTargetOf(cmd) // command_cli.go
		if err != nil {
			return err
		}
		raw, err := target.call(os.Stdout, method, uri, body)
		if err != nil || target.asJSON {
			return err
		}
		return printOverrideAnswer(os.Stdout, action, del, raw)
	}
}

// printOverrideAnswer writes an override answer for a person.
func printOverrideAnswer(w io.Writer, action string, del bool, raw []byte) error {
	if action == "overrides" {
		var a overridesAnswer
		if err := json.Unmarshal(raw, &a); err != nil {
			return err
		}
		fmt.Fprintf(w, "Overrides of policy %s (%s): %d\n", a.Policy, a.Store, len(a.Overrides))
		if len(a.Overrides) == 0 {
			return nil
		}
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "HASH\tLIMIT\tEXPIRES\tNOTE")
		for _, e := range a.Overrides {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", e.Hash, e.describe(), expiry(e.Expires), strconv.Quote(e.Note))
		}
		return tw.Flush()
	}
	var a overrideAnswer
	if err := json.Unmarshal(raw, &a); err != nil {
		return err
	}
	if del {
		fmt.Fprintf(w, "%s %q (key %s): override deleted; its plan's limit applies from its next request.\n", a.Policy, a.Identity, a.Key)
	} else if e := a.Override; e != nil {
		fmt.Fprintf(w, "%s %q (key %s): override %s, %s", a.Policy, a.Identity, a.Key, e.describe(), expiry(e.Expires))
		if e.Note != "" {
			fmt.Fprintf(w, ", note %q", e.Note)
		}
		fmt.Fprintln(w, "; it applies from the identity's next request.")
	}
	if !a.Announced {
		fmt.Fprintln(w, "Other instances may take up to 10s to see it (the announcement through Redis was not confirmed).")
	}
	return nil
}

// expiry is when an override expires, for a person.
func expiry(ms int64) string {
	if ms == 0 {
		return "until deleted"
	}
	at := time.UnixMilli(ms).UTC()
	return fmt.Sprintf("until %s (in %s)", at.Format(time.RFC3339), time.Until(at).Round(time.Second))
}

// printPlanAndOverride adds the plan and the override in force to an
// inspect's answer.
func printPlanAndOverride(w io.Writer, st bucketState) {
	if st.Plan != "" {
		fmt.Fprintf(w, "plan\t%s\n", st.Plan)
	}
	if e := st.Override; e != nil {
		fmt.Fprintf(w, "override\t%s, %s", e.describe(), expiry(e.Expires))
		if e.Note != "" {
			fmt.Fprintf(w, ", note %q", e.Note)
		}
		fmt.Fprintln(w)
	}
}
