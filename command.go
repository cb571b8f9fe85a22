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

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/calendar"
)

// `caddy rate-limit`: the admin API's /rate_limit/ routes from the command
// line, as `caddy reload` calls /load: the admin address from --address,
// or from the config given with --config, or Caddy's default.

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "rate-limit",
		Usage: "inspect|reset|grant|top|format|fleet|check|override|overrides|apply|try|replay [--address <interface>] [--config <path> [--adapter <name>]] [--json]",
		Short: "Inspects and resets the rate_limit buckets of a running Caddy",
		Long: `
Answers "why is this customer blocked, and can you unblock them?" through the
admin API of a running Caddy:

  caddy rate-limit inspect <policy> <identity>           tokens, burst, rate, time to full
  caddy rate-limit reset   <policy> <identity>           a full bucket, on every instance at once
  caddy rate-limit grant   <policy> <identity> <tokens>  gives tokens back
  caddy rate-limit top     <policy> [n] [--show-keys]    the identities this instance denied most in the last 5 minutes:
                                                         their keyed fingerprints, the raw values with --show-keys
  caddy rate-limit format  [v1|v2]                       the fleet's storage format: v2 once every instance runs
                                                         v0.3.0 or later, v1 before rolling back (docs/redis.md)
  caddy rate-limit fleet                                 the live instances on each Redis, by database and
                                                         key_prefix, and the policies they disagree on
  caddy rate-limit check [--config <file>]               before starting: one read-only decision per policy
                                                         against its Redis, and the config against the live
                                                         fleet; non-zero exit naming what fails (no running
                                                         Caddy needed)
  caddy rate-limit override <policy> <identity> rate <N>/<duration> [burst <n>] [for <duration>] [note <text>]
  caddy rate-limit override <policy> <identity> concurrent <n> [for <duration>] [note <text>]
  caddy rate-limit override <policy> <identity> quota <N>[/<unit>] [for <duration>] [note <text>]
                                                         one identity's limit instead of its plan's, on every
                                                         instance at once; for: it expires by itself
  caddy rate-limit override <policy> <identity> delete   back to its plan's limit
  caddy rate-limit overrides <policy>                    every override: hash, limit, expiry, note
  caddy rate-limit apply <file> [--dry-run]              a limits file (YAML or JSON): the overrides of many
                                                         identities, applied as a diff on every instance
  caddy rate-limit try <url> [-H <header>]... [--method <m>] [--body <file>]
                                                         what each policy would decide for that request
                                                         now, read from the store, nothing charged
  caddy rate-limit replay --config <file> <access log>...
                                                         Caddy's JSON access logs run through the config's
                                                         policies: what they would have denied, and when
                                                         (no running Caddy, nothing sent anywhere)

Inspect, reset and grant read the bucket under the policy's own limit, or
under a plan's with --plan <name> (docs/plans-and-overrides.md); with
--empty-key and no identity, the bucket every request whose key resolved
empty shares (caddy_rate_limit_empty_keys_total counts them).

The identity is the raw value the policy's key resolves to (an API key, a
user id, an IP address); it is hashed as the handler hashes it. With Redis,
inspect, reset and grant act on the shared bucket; top is this instance's.

The admin endpoint is found as caddy reload finds it: from --address if given,
otherwise from the config given with --config, otherwise the default. check
reads the config given with --config (and --adapter) instead.
`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.PersistentFlags().String("address", "", "Address of the administration listener, if different from config")
			cmd.PersistentFlags().StringP("config", "c", "", "Configuration file, to find the administration listener (check, replay: the config to check or replay)")
			cmd.PersistentFlags().StringP("adapter", "a", "", "Name of config adapter to apply")
			cmd.PersistentFlags().Bool("json", false, "Print the admin API's JSON answer")
			cmd.PersistentFlags().String("plan", "", "inspect, reset, grant: the plan whose limit to read the bucket under")
			cmd.PersistentFlags().Bool("empty-key", false, "inspect, reset, grant: the bucket of the requests whose key resolved empty (give no identity)")
			cmd.PersistentFlags().Bool("show-keys", false, "top: show the raw identities (API keys, for a policy keyed on the credential), not only their keyed fingerprints")
			cmd.AddCommand(
				&cobra.Command{Use: "inspect <policy> <identity>", Short: "Shows a bucket: tokens, burst, rate, time to full",
					Args: cobra.RangeArgs(1, 2), RunE: rateLimitCommand("inspect")},
				&cobra.Command{Use: "reset <policy> <identity>", Short: "Makes a bucket full, on every instance at once",
					Args: cobra.RangeArgs(1, 2), RunE: rateLimitCommand("reset")},
				&cobra.Command{Use: "grant <policy> <identity> <tokens>", Short: "Gives tokens back to a bucket",
					Args: cobra.RangeArgs(2, 3), RunE: rateLimitCommand("grant")},
				&cobra.Command{Use: "top <policy> [n]", Short: "Lists the identities this instance denied most in the last 5 minutes",
					Args: cobra.RangeArgs(1, 2), RunE: rateLimitCommand("top")},
				&cobra.Command{Use: "format [v1|v2]", Short: "Shows or sets the format the fleet stores buckets in (see docs/redis.md, Upgrading)",
					Args: cobra.RangeArgs(0, 1), RunE: rateLimitCommand("format")},
			)
			addOverrideCommands(cmd)                                      // command_override.go
			addFleetCommands(cmd)                                         // command_fleet.go
			cmd.AddCommand(applyCommand(), tryCommand(), replayCommand()) // command_apply.go, command_try.go, command_replay.go
			for _, sub := range cmd.Commands() {
				numbersAsArgs(sub) // command_cli.go
			}
		},
	})
}

// rateLimitCommand runs one action against the admin API.
func rateLimitCommand(action string) func(*cobra.Command, []string) error {
	return func(cmd *cobra.Command, args []string) error {
		cmd.SilenceUsage = true
		plan, _ := cmd.Flags().GetString("plan")
		emptyKey, _ := cmd.Flags().GetBool("empty-key")
		showKeys, _ := cmd.Flags().GetBool("show-keys")
		target, err := adminTargetOf(cmd) // command_cli.go
		if err != nil {
			return err
		}
		req := adminRequest{Plan: plan, EmptyKey: emptyKey}
		if len(args) > 0 && action != "format" {
			req.Policy = args[0]
		}
		if action == "grant" && emptyKey {
			args = append([]string{args[0], ""}, args[1:]...) // grant <policy> <tokens>
		}
		if len(args) != 3 && action == "grant" {
			return fmt.Errorf("grant: expected <policy> <identity> <tokens>, or <policy> <tokens> with --empty-key")
		}
		if len(args) > 1 && action != "top" {
			req.Identity = args[1]
		}
		var method, uri string
		var body io.Reader
		switch action {
		case "format":
			method, uri = http.MethodGet, "/rate_limit/format"
			if len(args) == 1 {
				if args[0] != markerV1 && args[0] != markerV2 {
					return fmt.Errorf("format: %q is not v1 or v2", args[0])
				}
				method = http.MethodPost
				body = bytes.NewReader([]byte(`{"format":"` + args[0] + `"}`))
			}
		case "top":
			method = http.MethodGet
			q := url.Values{"policy": {req.Policy}}
			if len(args) > 1 {
				if n, err := strconv.Atoi(args[1]); err != nil || n < 1 {
					return fmt.Errorf("n: %q is not a positive integer", args[1])
				}
				q.Set("n", args[1])
			}
			if showKeys {
				q.Set("show_keys", "true")
			}
			uri = "/rate_limit/top?" + q.Encode()
		case "inspect":
			// The identity in the body, never in the URL: Caddy's admin API
			// logs URLs.
			method, uri = http.MethodPost, "/rate_limit/inspect"
			raw, _ := json.Marshal(req)
			body = bytes.NewReader(raw)
		case "grant":
			// Tokens, or dollars for a money policy: the policy's unit, which
			// the admin API reads the amount in.
			if n, err := strconv.ParseInt(args[2], 10, 64); err == nil && n >= 1 {
				req.Tokens = n
			} else if _, err := strconv.ParseFloat(args[2], 64); err != nil || strings.HasPrefix(args[2], "-") {
				return fmt.Errorf("tokens: %q is not a positive integer (or, for a policy with unit usd, an amount of dollars)", args[2])
			}
			req.Amount = args[2]
			fallthrough
		case "reset":
			method, uri = http.MethodPost, "/rate_limit/"+action
			raw, _ := json.Marshal(req)
			body = bytes.NewReader(raw)
		}
		raw, err := target.call(os.Stdout, method, uri, body)
		if err != nil || target.asJSON {
			return err
		}
		return printAnswer(os.Stdout, action, raw)
	}
}

// printAnswer writes an admin API answer for a person.
func printAnswer(w io.Writer, action string, raw []byte) error {
	if action == "format" {
		var f formatAnswer
		if err := json.Unmarshal(raw, &f); err != nil {
			return err
		}
		for _, st := range f.Stores {
			fmt.Fprintf(w, "%s: fleet marker %s; this instance writes %s.\n", st.Store, st.Marker, st.Writes)
		}
		return nil
	}
	if action == "top" {
		var t topAnswer
		if err := json.Unmarshal(raw, &t); err != nil {
			return err
		}
		fmt.Fprintf(w, "Identities policy %s denied most on this instance in the last %s:\n", t.Policy, time.Duration(t.Window*float64(time.Second)))
		if len(t.Identities) == 0 {
			fmt.Fprintln(w, "(none)")
			return nil
		}
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		money := t.Currency != ""
		shown := false // the raw identities, with --show-keys
		for _, e := range t.Identities {
			shown = shown || e.Identity != ""
		}
		header := "DENIALS\tAT MOST OVER BY"
		if money {
			header += "\tLEFT NOW"
		}
		header += "\tFINGERPRINT"
		if shown {
			header += "\tIDENTITY"
		}
		fmt.Fprintln(tw, header)
		for _, e := range t.Identities {
			line := fmt.Sprintf("%d\t%d", e.Denials, e.Error)
			if money {
				left := "?"
				if e.Limit != "" {
					left = "$" + e.Left + " of $" + e.Limit
				}
				line += "\t" + left
			}
			line += "\t" + e.Fingerprint
			if !shown {
				fmt.Fprintln(tw, line)
				continue
			}
			id := strconv.Quote(e.Identity)
			if e.Truncated {
				id += "..."
			}
			fmt.Fprintf(tw, "%s\t%s\n", line, id)
		}
		if err := tw.Flush(); err != nil {
			return err
		}
		if t.Truncated {
			fmt.Fprintln(w, "(truncated: more identities were denied than listed)")
		}
		return nil
	}
	var st bucketState
	if err := json.Unmarshal(raw, &st); err != nil {
		return err
	}
	if st.Kind == "shed" {
		printShed(w, action, st)
		return nil
	}
	if st.Used != nil {
		return printQuota(w, action, st)
	}
	if st.InUse != nil {
		fmt.Fprintf(w, "%s %q (concurrency limit, key %s): %d of %d slots in use", st.Policy, st.Identity, st.Key, *st.InUse, st.Slots)
		if action == "reset" && st.Dropped != nil {
			fmt.Fprintf(w, "; reset: %d running, kept; %d stale, dropped", *st.InUse, *st.Dropped)
		}
		fmt.Fprintln(w, ".")
		printPlanAndOverride(w, st)
		return nil
	}
	full := "full"
	if st.Full > 0 {
		full = fmt.Sprintf("next token in %s, full in %s", secondsString(st.NextToken), secondsString(st.Full))
	}
	n, tokens := st.amounts(), "tokens" // dollars for a money policy
	if st.Currency != "" {
		tokens, full = "left", strings.ReplaceAll(full, "next token", "next micro-dollar")
	}
	switch action {
	case "reset":
		fmt.Fprintf(w, "%s %q: reset; %s of %s %s, %s.\n", st.Policy, st.Identity, n(st.Tokens), n(st.Burst), tokens, full)
	case "grant":
		var granted int64
		if st.Granted != nil {
			granted = *st.Granted
		}
		fmt.Fprintf(w, "%s %q: granted %s; %s of %s now, %s.\n", st.Policy, st.Identity, unitsOf(st, granted, "tokens"), n(st.Tokens), n(st.Burst), full)
	default:
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "policy\t%s (%s policy: rate %s, burst %s)\n", st.Policy, st.Kind, st.Rate, n(st.Burst))
		fmt.Fprintf(tw, "identity\t%q\n", st.Identity)
		fmt.Fprintf(tw, "key\t%s\n", st.Key)
		fmt.Fprintf(tw, "store\t%s\n", st.Store)
		fmt.Fprintf(tw, "%s\t%s of %s; %s\n", tokens, n(st.Tokens), n(st.Burst), full)
		if st.BlocksHere != nil {
			fmt.Fprintf(tw, "blocks here\t%d tokens in %d blocks, taken and not spent yet (a hot key on this instance)\n", st.BlocksHere.Tokens, st.BlocksHere.Blocks)
		}
		if st.Learned != nil && *st.Learned > 0 {
			fmt.Fprintf(tw, "learned\t%s: its recent requests used up to this beyond their reservations; a request like them reserves what they used beyond (at most the burst)\n", n(*st.Learned))
		}
		printPlanAndOverride(tw, st) // command_override.go
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if st.Announced != nil && !*st.Announced {
		fmt.Fprintln(w, "Other instances may take up to a second to see it (the announcement through Redis was not confirmed).")
	}
	return nil
}

func secondsString(s float64) string {
	return time.Duration(s * float64(time.Second)).Round(time.Millisecond).String()
}

// callAdmin makes a call of the admin API and returns the answer's body,
// which it also writes to stdout when asJSON (the --json flag) is set.
func callAdmin(adminAddr, method, uri string, body io.Reader, asJSON bool) ([]byte, error) {
	resp, err := caddycmd.AdminAPIRequest(adminAddr, method, uri, nil, body)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if asJSON {
		_, err = os.Stdout.Write(raw)
	}
	return raw, err
}

// printQuota writes an admin API answer about a quota for a person.
func printQuota(w io.Writer, action string, st bucketState) error {
	var used int64
	if st.Used != nil {
		used = *st.Used
	}
	var p calendar.PeriodText
	if st.Period != nil {
		p = *st.Period
	}
	n := st.amounts() // dollars for a money policy
	switch action {
	case "reset":
		fmt.Fprintf(w, "%s %q: reset; %s of %s used in the period that ends %s.\n", st.Policy, st.Identity, n(used), n(st.Quota), p.EndZone)
	case "grant":
		var granted int64
		if st.Granted != nil {
			granted = *st.Granted
		}
		fmt.Fprintf(w, "%s %q: granted %s; %s of %s used now, in the period that ends %s.\n", st.Policy, st.Identity, unitsOf(st, granted, "units"), n(used), n(st.Quota), p.EndZone)
	default:
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintf(tw, "policy\t%s (%s: %s per %s, %s)\n", st.Policy, st.Kind, n(st.Quota), st.Unit, p.Zone)
		fmt.Fprintf(tw, "identity\t%q\n", st.Identity)
		fmt.Fprintf(tw, "key\t%s\n", st.Key)
		fmt.Fprintf(tw, "store\t%s\n", st.Store)
		fmt.Fprintf(tw, "used\t%s of %s; %s left\n", n(used), n(st.Quota), n(max(st.Tokens, 0)))
		fmt.Fprintf(tw, "period\t%s to %s (%s to %s)\n", p.StartZone, p.EndZone, p.Start, p.End)
		printPlanAndOverride(tw, st) // command_override.go
		if err := tw.Flush(); err != nil {
			return err
		}
	}
	if st.Announced != nil && !*st.Announced {
		fmt.Fprintln(w, "Other instances may take up to a second to see it (the announcement through Redis was not confirmed).")
	}
	return nil
}

// printShed prints what inspect or reset answered of a shed policy.
func printShed(w io.Writer, action string, st bucketState) {
	fmt.Fprintf(w, "%s (shed policy, key %s)", st.Policy, st.Key)
	if st.InUse != nil {
		fmt.Fprintf(w, ": fleet-wide, %d of %d slots in use", *st.InUse, st.Slots)
		if action == "reset" && st.Dropped != nil {
			fmt.Fprintf(w, "; reset: %d running, kept; %d stale, dropped", *st.InUse, *st.Dropped)
		}
	}
	if st.ShedLimit != nil && st.ShedInFlight != nil {
		fmt.Fprintf(w, "; this instance: %d in flight, adaptive limit %d", *st.ShedInFlight, *st.ShedLimit)
	}
	fmt.Fprintln(w, ".")
}
