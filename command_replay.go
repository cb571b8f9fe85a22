package ratelimit

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	"github.com/ratelimit-caddy/caddy-ratelimit/internal/accesslog"
)

// `caddy rate-limit replay --config <file> <access log>...`: access logs
// run through a config's policies (replay.go), its report printed. It
// needs no running Caddy and sends nothing anywhere.

func replayCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "replay --config <Caddyfile|JSON> <access log>...",
		Short: "Runs Caddy's JSON access logs through a config's policies: what they would have denied, and when",
		Long: `Runs Caddy's JSON access logs (plain or gzip, rotated files in any order)
through the rate_limit policies of a config, on the logs' own clock, in a
store of its own: no running Caddy, no Redis, nothing sent anywhere. For each
policy it prints the requests it matched, those it would have denied (and
their share), the first time it would have denied, the keys it would have
denied most (as the keyed hashes the module stores; --show-keys for the
identities), and for a concurrent policy the most requests of one key the
log had in flight at once.

A policy whose key comes from a header the log redacts (Authorization and
Cookie, by default) or lacks is named, with what that means (those requests
are one key) and what to log instead. What a log cannot tell (the usage in a
response body) is named, never guessed.

  caddy rate-limit replay --config Caddyfile /var/log/caddy/access.log*`,
		Args: cobra.MinimumNArgs(1),
		RunE: runReplay,
	}
	c.Flags().Bool("show-keys", false, "Show the identities denied most, not only their hashes")
	return c
}

func runReplay(cmd *cobra.Command, args []string) error {
	cmd.SilenceUsage = true
	configFile, _ := cmd.Flags().GetString("config")
	adapter, _ := cmd.Flags().GetString("adapter")
	showKeys, _ := cmd.Flags().GetBool("show-keys")
	asJSON, _ := cmd.Flags().GetBool("json")
	if configFile == "" {
		return fmt.Errorf("replay: give the config to replay with --config <Caddyfile or JSON>")
	}
	raw, _, _, err := caddycmd.LoadConfig(configFile, adapter)
	if err != nil {
		return err
	}
	report, err := replayFiles(raw, args, showKeys)
	if err != nil {
		return err
	}
	if asJSON {
		enc := json.NewEncoder(os.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(report)
	}
	printReplay(os.Stdout, configFile, report)
	return nil
}

// replayFiles replays the access logs at paths through the config raw
// (JSON).
func replayFiles(raw []byte, paths []string, showKeys bool) (*replayReport, error) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	tree, err := replayConfig(ctx, raw)
	if err != nil {
		return nil, err
	}
	hs := tree.handlers()
	defer func() {
		for _, h := range hs {
			_ = h.Cleanup()
		}
	}()
	if len(hs) == 0 {
		return nil, fmt.Errorf("the config has no rate_limit handler: nothing to replay")
	}
	rd, err := accesslog.Open(paths)
	if err != nil {
		return nil, err
	}
	defer rd.Close()
	return replayReader(tree, rd, showKeys)
}

// replayBatch is how many entries the reader hands over at once.
const replayBatch = 512

// replayReader replays what rd reads.
func replayReader(tree *routeTree, rd *accesslog.Reader, showKeys bool) (*replayReport, error) {
	rp := newReplayer(tree, showKeys)
	rd.Fields = rp.fields()
	began := time.Now()
	// Lines are read and parsed on one core while they are replayed on the
	// other, in batches handed over through a short queue.
	batches, free := make(chan []accesslog.Entry, 4), make(chan []accesslog.Entry, 6)
	for range cap(free) {
		free <- make([]accesslog.Entry, 0, replayBatch)
	}
	go func() {
		defer close(batches)
		for {
			b := (<-free)[:0]
			var e accesslog.Entry
			for len(b) < replayBatch && rd.Next(&e) {
				b = append(b, e)
			}
			if len(b) == 0 {
				return
			}
			batches <- b
		}
	}()
	for b := range batches {
		for i := range b {
			rp.add(&b[i])
		}
		free <- b
	}
	if err := rd.Err(); err != nil {
		return nil, err
	}
	rp.finish()
	rep := &rp.report
	rep.Log = rd.Stats()
	rep.Elapsed = time.Since(began).Seconds()
	if rep.Elapsed > 0 {
		rep.LinesPerMinute = float64(rep.Log.Lines) / rep.Elapsed * 60
	}
	return rep, nil
}

// printReplay writes a replay's report for a person.
func printReplay(w io.Writer, config string, rep *replayReport) {
	st := rep.Log
	fmt.Fprintf(w, "Replayed %s requests of %s through %s", thousands(rep.Requests), strings.Join(st.Files, ", "), config)
	if rep.Requests > 0 {
		fmt.Fprintf(w, ", from %s to %s (%s)", rep.From.Format("2006-01-02 15:04:05"), rep.To.Format("2006-01-02 15:04:05 MST"), rep.To.Sub(rep.From).Round(time.Second))
	}
	fmt.Fprintf(w, ": %s reached a rate_limit handler.\n", thousands(rep.Reached))
	fmt.Fprintf(w, "Read %s lines in %.1fs (%s lines a minute)", thousands(st.Lines), rep.Elapsed, thousands(int64(rep.LinesPerMinute)))
	var skipped []string
	for _, c := range []struct {
		n    int64
		what string
	}{{st.NotAccess, "not access log entries"}, {st.Unreadable, "unreadable"}, {st.NoTime, "without a readable ts"}, {st.TooLong, "longer than 1 MiB"}} {
		if c.n > 0 {
			skipped = append(skipped, thousands(c.n)+" "+c.what)
		}
	}
	if len(skipped) > 0 {
		fmt.Fprintf(w, "; skipped: %s (first: %s)", strings.Join(skipped, ", "), st.FirstProblem)
	}
	fmt.Fprintln(w, ".")
	if rep.Late > 0 {
		fmt.Fprintf(w, "%s requests were logged more than %s after they began (or in a crowd of more than %s waiting): decided after some that began later, at their own start all the same.\n", thousands(rep.Late), replayWindow, thousands(replayPending))
	}
	if rep.Requests > 0 && rep.Reached == 0 {
		fmt.Fprintln(w, "No request reached a rate_limit handler: do the config's sites (their hosts, ports, paths) serve the requests of the log?")
	}
	if rep.EarlyEnds > 0 {
		fmt.Fprintf(w, "%s requests ended early: more than %s were in flight at once in the log.\n", thousands(rep.EarlyEnds), thousands(maxEnds))
	}
	if rep.MatchErrors > 0 {
		fmt.Fprintf(w, "%s requests could not be matched (a matcher failed on them): not decided.\n", thousands(rep.MatchErrors))
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "POLICY\tLIMIT\tMATCHED\tWOULD DENY\tFIRST DENIAL\tKEYS")
	for _, p := range rep.Policies {
		first := "-"
		if p.FirstDenial != nil {
			first = p.FirstDenial.Format("2006-01-02 15:04:05.000")
		}
		name := p.Policy
		if p.Shadow {
			name += " (shadow)"
		}
		keys := thousands(p.Keys)
		if p.KeysAtLeast {
			keys = "at least " + keys
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s (%s)\t%s\t%s\n", name, p.Limit, thousands(p.Matched), thousands(p.WouldDeny), percent(p.Share), first, keys)
	}
	tw.Flush()
	for _, p := range rep.Policies {
		if p.PeakInFlight != nil {
			fmt.Fprintf(w, "\n%s: at most %d requests of one key in flight at once in the log", p.Policy, *p.PeakInFlight)
			if p.PeakInFlightKey != "" {
				fmt.Fprintf(w, " (%s)", p.PeakInFlightKey)
			}
			fmt.Fprintln(w, ".")
		}
		if p.Delayed > 0 {
			fmt.Fprintf(w, "\n%s: %s requests would have been held for their turn (wait), then admitted.\n", p.Policy, thousands(p.Delayed))
		}
		if len(p.TopDenied) > 0 {
			how := "as the keyed hashes the module stores; --show-keys for the identities"
			if showsIdentities(p) {
				how = "keys and identities"
			}
			fmt.Fprintf(w, "\n%s: the keys it would have denied most (%s):\n", p.Policy, how)
			for _, k := range p.TopDenied {
				fmt.Fprintf(w, "  %10s  %s", thousands(k.Denials), k.Key)
				if k.Identity != "" {
					fmt.Fprintf(w, "  %s", strconv.Quote(k.Identity))
				}
				fmt.Fprintln(w)
			}
		}
		for _, s := range p.Sources {
			if s.Share < 0.01 && s.Redacted == 0 {
				continue // a few requests without it: the JSON has them
			}
			fmt.Fprintf(w, "\n%s: %s: %s.\n", p.Policy, s.Source, s.Meaning)
			if s.Fix != "" && strings.HasPrefix(s.Source, "its key") {
				fmt.Fprintf(w, "  To replay it per key: %s.\n", s.Fix)
			} else if s.Fix != "" {
				fmt.Fprintf(w, "  To replay it: %s.\n", s.Fix)
			}
		}
		for _, n := range p.NotReplayed {
			fmt.Fprintf(w, "\n%s: not replayed: %s.\n", p.Policy, n)
		}
	}
}

func showsIdentities(p *policyReplay) bool {
	for _, k := range p.TopDenied {
		if k.Identity != "" {
			return true
		}
	}
	return false
}

// thousands writes n with thousands separators.
func thousands(n int64) string {
	s := strconv.FormatInt(n, 10)
	neg := strings.HasPrefix(s, "-")
	s = strings.TrimPrefix(s, "-")
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	if neg {
		return "-" + b.String()
	}
	return b.String()
}
