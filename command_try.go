package ratelimit

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"unicode/utf8"

	"github.com/spf13/cobra"
)

// `caddy rate-limit try <url> [-H <header>]... [--method <m>] [--body
// <file>] [--client-ip <ip>]`: the admin API's dry run (dryrun.go) from
// the command line, its answer printed.

func tryCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "try <url> [-H 'Name: value']... [--method <m>] [--body <file>] [--client-ip <ip>] [--show-keys]",
		Short: "Says what each policy would decide for a request now, read from the store; nothing is charged",
		Long: `Answers "what would happen to this request, now, and why?": the request so
described goes through the running config as far as its rate_limit
handlers; for each policy that matches it, the command prints its key (the
hash stored), its cost, and what it would decide now (allowed, held for its
turn, or denied with the wait), read from the live store without touching
any counter, slot, lease, learned usage or hot-key block. When the store
cannot be read it says so, and what each policy's on_error would do.

  caddy rate-limit try https://api.example.com/v1/chat -H 'X-Api-Key: ak_live_4242' \
      --method POST --body request.json --client-ip 203.0.113.7`,
		Args: cobra.ExactArgs(1),
		RunE: runTry,
	}
	c.Flags().StringArrayP("header", "H", nil, "A request header, 'Name: value' (repeat for more)")
	c.Flags().StringP("method", "X", "GET", "The request's method")
	c.Flags().String("body", "", "A file holding the request's body (for policies that read it)")
	c.Flags().String("client-ip", "", "The client's address (for keys on {client_ip})")
	c.Flags().Bool("show-keys", false, "Show the identity each policy keys on (an API key, for a policy keyed on the credential), not only its keyed hash")
	return c
}

func runTry(cmd *cobra.Command, args []string) error {
	cmd.SilenceUsage = true
	headers, _ := cmd.Flags().GetStringArray("header")
	method, _ := cmd.Flags().GetString("method")
	bodyFile, _ := cmd.Flags().GetString("body")
	clientIP, _ := cmd.Flags().GetString("client-ip")
	showKeys, _ := cmd.Flags().GetBool("show-keys")
	req := dryRunRequest{Method: method, URL: args[0], ClientIP: clientIP, Headers: map[string][]string{}, ShowKeys: showKeys}
	for _, h := range headers {
		name, value, ok := strings.Cut(h, ":")
		if !ok || strings.TrimSpace(name) == "" {
			return fmt.Errorf("-H %q: expected 'Name: value'", h)
		}
		name = http.CanonicalHeaderKey(strings.TrimSpace(name))
		req.Headers[name] = append(req.Headers[name], strings.TrimSpace(value))
	}
	if bodyFile != "" {
		b, err := os.ReadFile(bodyFile)
		if err != nil {
			return err
		}
		if utf8.Valid(b) {
			req.Body = string(b)
		} else {
			req.BodyBase64 = base64.StdEncoding.EncodeToString(b)
		}
	}
	target, err := adminTargetOf(cmd) // command_cli.go
	if err != nil {
		return err
	}
	raw, _ := json.Marshal(req)
	answer, err := target.call(os.Stdout, http.MethodPost, "/rate_limit/dry_run", bytes.NewReader(raw))
	if err != nil || target.asJSON {
		return err
	}
	var a dryRunAnswer
	if err := json.Unmarshal(answer, &a); err != nil {
		return fmt.Errorf("the admin API's answer: %v", err)
	}
	printTry(os.Stdout, a)
	return nil
}

// printTry writes a dry run's answer for a person.
func printTry(w io.Writer, a dryRunAnswer) {
	who := ""
	if a.ClientIP != "" {
		who = " from " + a.ClientIP
	}
	switch a.Outcome {
	case "none":
		fmt.Fprintf(w, "%s%s: no policy matches it; it would be passed on.\n", a.Request, who)
	case "admitted":
		fmt.Fprintf(w, "%s%s: ADMITTED now.\n", a.Request, who)
	case "delayed":
		fmt.Fprintf(w, "%s%s: ADMITTED after a wait (held for its turn).\n", a.Request, who)
	case "denied":
		fmt.Fprintf(w, "%s%s: DENIED now (429) by %s.\n", a.Request, who, strings.Join(a.DeniedBy, ", "))
	case "unknown":
		fmt.Fprintf(w, "%s%s: UNKNOWN: the store could not be read. Meanwhile: %s.\n", a.Request, who, a.IfUnreadable)
	}
	for _, hd := range a.Handlers {
		fmt.Fprintln(w)
		if hd.Unreadable != "" {
			fmt.Fprintf(w, "%s could not be read: %s\n", hd.Store, hd.Unreadable)
		} else if hd.ReadAt != nil {
			fmt.Fprintf(w, "Read from %s at %s; nothing was charged.\n", hd.Store, hd.ReadAt.Format("15:04:05.000 MST"))
		}
		tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
		fmt.Fprintln(tw, "POLICY\tLIMIT\tKEY\tCOST\tNOW\tREMAINING\tWAIT")
		for _, p := range hd.Policies {
			name := p.Policy
			if p.Shadow {
				name += " (shadow)"
			}
			if p.Plan != "" {
				name += " [plan " + p.Plan + "]"
			}
			rem, wait := "-", "-"
			if p.Remaining != nil {
				rem = strconv.FormatInt(*p.Remaining, 10)
			}
			switch {
			case p.NeverFits:
				wait = "never: the cost is more than the burst"
			case p.RetryAfter != nil:
				wait = secondsString(*p.RetryAfter)
			case p.Delay != nil:
				wait = "held " + secondsString(*p.Delay)
			}
			decision := p.Decision
			if p.OnError != "" {
				decision += "; " + p.OnError
			}
			key := p.Key
			if p.Identity != "" { // --show-keys
				key += " (" + strconv.Quote(p.Identity) + ")"
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\t%s\n", name, p.Limit, key, p.Cost, decision, rem, wait)
		}
		tw.Flush()
		for _, p := range hd.Policies {
			if p.Override != nil {
				fmt.Fprintf(w, "%s: the override of this key: %s, %s", p.Policy, p.Override.describe(), expiry(p.Override.Expires))
				if p.Override.Source != "" {
					fmt.Fprintf(w, ", from limits file source %s", p.Override.Source)
				}
				fmt.Fprintln(w, ".")
			}
			if p.BlocksHere != nil {
				fmt.Fprintf(w, "%s: a hot key on this instance, which holds %d tokens of it in %d blocks: its next request here is decided from them.\n",
					p.Policy, p.BlocksHere.Tokens, p.BlocksHere.Blocks)
			}
			if p.Learned > 0 {
				fmt.Fprintf(w, "%s: the key learned that requests like this one use %d beyond their reservations: this one reserves that much more (at most the burst).\n", p.Policy, p.Learned)
			}
		}
		if len(hd.NotMatched) > 0 {
			fmt.Fprintf(w, "Not matched: %s.\n", strings.Join(hd.NotMatched, ", "))
		}
	}
	if a.Outcome == "denied" {
		fmt.Fprintln(w, "WAIT is the true wait; the Retry-After sent is at least that, in whole seconds, spread by jitter.")
	}
	for _, n := range a.Notes {
		fmt.Fprintln(w, "Note: "+n+".")
	}
}
