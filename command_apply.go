package ratelimit

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/limitsfile"
)

// `caddy rate-limit apply <file> [--dry-run] [--source <tag>] [--show-keys]`: a limits
// file (internal/limitsfile) applied through the admin API
// (admin_apply.go), its diff printed. The exit status is non-zero when any
// entry was refused, the others applied all the same.

func applyCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "apply <file>",
		Short: "Makes the fleet's overrides what a limits file says, as a diff (YAML or JSON)",
		Long: `Makes the overrides of many identities of many policies what one file says,
on every instance at once, as a diff against the overrides the store holds:

  source: billing                 # names the overrides this file owns
  overrides:
    - {policy: per_tenant, identity: acme, rate: 5000/1m, burst: 500, note: contract 123}
    - {policy: exports, identity: acme, concurrent: 10, expires: 2026-01-01T00:00:00Z}
    - {policy: monthly, identity: acme, quota: 5000000/month}

An override of the file not in force is added; one that differs is changed;
one this source set before that the file no longer names is removed.
Overrides set by hand (caddy rate-limit override) or by another source are
never removed. A wrong entry is refused with its line, and the others are
applied: the exit status is then non-zero. Applying the same file again
changes nothing; buckets keep their state through every change.

--dry-run prints the diff and changes nothing. The source is the file's
source, --source, or else the file's name without its extension. The diff
names each identity by its keyed fingerprint (as top does) and the file's
line; --show-keys prints the identities themselves.`,
		Args: cobra.ExactArgs(1),
		RunE: runApply,
	}
	c.Flags().Bool("dry-run", false, "Print the diff; change nothing")
	c.Flags().Bool("show-keys", false, "Name each identity in the diff (API keys, for a policy keyed on the credential), not only its keyed fingerprint")
	c.Flags().String("source", "", "The tag naming the overrides this file owns (default: the file's source, or its name)")
	return c
}

func runApply(cmd *cobra.Command, args []string) error {
	cmd.SilenceUsage = true
	dryRun, _ := cmd.Flags().GetBool("dry-run")
	source, _ := cmd.Flags().GetString("source")
	showKeys, _ := cmd.Flags().GetBool("show-keys")
	data, err := os.ReadFile(args[0])
	if err != nil {
		return err
	}
	f, err := limitsfile.Parse(data)
	if err != nil {
		return fmt.Errorf("%s: %v", args[0], err)
	}
	switch {
	case source != "" && f.Source != "" && source != f.Source:
		return fmt.Errorf("%s says source %s, --source %s: which one owns these overrides?", args[0], f.Source, source)
	case source == "":
		source = f.Source
	}
	if source == "" {
		base := filepath.Base(args[0])
		source = strings.TrimSuffix(base, filepath.Ext(base))
		if !limitsfile.ValidSource(source) {
			return fmt.Errorf("%s has no source, and its name %q cannot be one: add source: <tag> to it, or give --source", args[0], source)
		}
	} else if !limitsfile.ValidSource(source) {
		return fmt.Errorf("--source %q: 1 to 64 letters, digits, _ . - : / @", source)
	}
	target, err := adminTargetOf(cmd) // command_cli.go
	if err != nil {
		return err
	}
	raw, _ := json.Marshal(applyRequest{Source: source, DryRun: dryRun, Overrides: f.Entries, ShowKeys: showKeys})
	answer, err := target.call(os.Stdout, http.MethodPost, "/rate_limit/apply", bytes.NewReader(raw))
	if err != nil {
		return err
	}
	var a applyAnswer
	if err := json.Unmarshal(answer, &a); err != nil {
		return fmt.Errorf("the admin API's answer: %v", err)
	}
	a.Errors = append(a.Errors, f.Errors...)
	slices.SortStableFunc(a.Errors, func(x, y limitsfile.LineError) int { return x.Line - y.Line })
	if !target.asJSON {
		printApply(os.Stdout, args[0], a, len(f.Entries)+len(f.Errors))
	}
	if len(a.Errors) > 0 {
		return fmt.Errorf("%d of %d entries of %s refused (the others %s)", len(a.Errors), len(f.Entries)+len(f.Errors), args[0],
			map[bool]string{true: "would apply", false: "applied"}[dryRun])
	}
	return nil
}

// applyShown is how many lines of each part of a diff are printed; --json
// has them all.
const applyShown = 50

// printApply writes an apply's diff for a person.
func printApply(w io.Writer, file string, a applyAnswer, entries int) {
	verb := map[bool]string{true: "would change (dry run: nothing changed)", false: "applied"}[a.DryRun]
	fmt.Fprintf(w, "%s, source %s: %s, %s in %s.\n", file, a.Source, plural(entries, "entry", "entries"), verb, strings.Join(a.Stores, "; "))
	part := func(mark string, changes []applyChange) {
		for i, c := range changes {
			if i == applyShown {
				fmt.Fprintf(w, "  %s ... and %d more (--json lists them all)\n", mark, len(changes)-applyShown)
				break
			}
			who := c.Fingerprint  // the keyed hash's start, as top shows
			if c.Identity != "" { // --show-keys (a removal has none: the store holds only the hash)
				who = strconv.Quote(c.Identity)
			}
			line := fmt.Sprintf("  %s %s %s", mark, c.Policy, who)
			switch {
			case c.Override != nil && c.Was != nil:
				line += ": " + overrideText(*c.Was) + " -> " + overrideText(*c.Override)
				if c.Was.Source == "" {
					line += " (was set by hand)"
				} else if c.Was.Source != a.Source {
					line += " (was source " + c.Was.Source + ")"
				}
			case c.Override != nil:
				line += ": " + overrideText(*c.Override)
			default:
				line += ": " + overrideText(*c.Was) + " (no longer in the file)"
			}
			if c.Line > 0 {
				line += fmt.Sprintf("  [line %d]", c.Line)
			}
			fmt.Fprintln(w, line)
		}
	}
	part("+", a.Added)
	part("~", a.Changed)
	part("-", a.Removed)
	fmt.Fprintf(w, "  %d added, %d changed, %d removed, %d unchanged.\n", len(a.Added), len(a.Changed), len(a.Removed), a.Unchanged)
	for _, e := range a.Errors {
		fmt.Fprintf(w, "%s:%d: refused: %s\n", file, e.Line, e.Msg)
	}
	if !a.DryRun && !a.Announced {
		fmt.Fprintln(w, "Other instances may take up to 10s to see the changes (the announcement through Redis was not confirmed).")
	}
}

// overrideText is an override's limit, expiry and note, for a diff.
func overrideText(e overrideEntry) string {
	s := e.describe()
	if e.Expires > 0 {
		s += ", " + expiry(e.Expires)
	}
	if e.Note != "" {
		s += ", note " + strconv.Quote(e.Note)
	}
	return s
}

// plural is n with the noun's form for it.
func plural(n int, one, many string) string {
	if n == 1 {
		return "1 " + one
	}
	return thousands(int64(n)) + " " + many
}
