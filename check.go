package ratelimit

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"slices"
	"sort"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/ratelimit-caddy/caddy-ratelimit/internal/fleet"
)

// `caddy rate-limit check [--config <file>] [--adapter <name>]`: loads a
// config as `caddy validate` does, provisions each rate_limit handler in
// it, runs one read-only decision per policy against its Redis (the probe
// of probe.go), and compares what the config enforces with the live
// instances of its fleet (fleet.go). It fails, naming them, when a policy
// would not be decided by Redis or would not share its budget with a live
// instance of its fleet. Nothing is written but the expiry of dead
// instances' records; this process does not announce itself.

// foundHandler is a rate_limit handler of a config, with where it is.
type foundHandler struct {
	path string
	raw  []byte
}

// findHandlers finds the rate_limit handlers anywhere in a JSON config
// (in routes, subroutes, error routes), in a stable order.
func findHandlers(raw []byte) ([]foundHandler, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber() // integers as written
	var v any
	if err := dec.Decode(&v); err != nil {
		return nil, err
	}
	var out []foundHandler
	var walk func(path string, v any)
	walk = func(path string, v any) {
		switch x := v.(type) {
		case map[string]any:
			if x["handler"] == "rate_limit" {
				h := make(map[string]any, len(x))
				for k, val := range x {
					if k != "handler" {
						h[k] = val
					}
				}
				b, _ := json.Marshal(h)
				out = append(out, foundHandler{path: path, raw: b})
				return
			}
			keys := make([]string, 0, len(x))
			for k := range x {
				keys = append(keys, k)
			}
			sort.Strings(keys)
			for _, k := range keys {
				next := k
				if path != "" {
					next = path + "." + k
				}
				walk(next, x[k])
			}
		case []any:
			for i, e := range x {
				walk(path+"["+strconv.Itoa(i)+"]", e)
			}
		}
	}
	walk("", v)
	return out, nil
}

// runCheck checks the config in configFile and writes what it finds to
// w; problems are what would not be decided by Redis, or not shared;
// alone names the fleets of the config without a live instance (nothing
// to compare with).
func runCheck(w io.Writer, configFile, adapter string) (problems, alone []string, err error) {
	raw, file, _, err := caddycmd.LoadConfig(configFile, adapter)
	if err != nil {
		return nil, nil, err
	}
	if raw == nil {
		return nil, nil, fmt.Errorf("no config to check: give --config <file> (and --adapter), or run it where a Caddyfile is")
	}
	found, err := findHandlers(raw)
	if err != nil {
		return nil, nil, fmt.Errorf("reading the config: %v", err)
	}
	if len(found) == 0 {
		fmt.Fprintf(w, "%s has no rate_limit handler: nothing to check.\n", file)
		return nil, nil, nil
	}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	var hs []*Handler
	defer func() {
		for _, h := range hs {
			_ = h.Cleanup()
		}
	}()
	for _, f := range found {
		h := new(Handler)
		err := caddy.StrictUnmarshalJSON(f.raw, h)
		if err == nil {
			hs = append(hs, h)
			err = h.Provision(ctx)
		}
		if err != nil {
			fmt.Fprintf(w, "rate_limit at %s: the config does not load: %v\n", f.path, err)
			problems = append(problems, fmt.Sprintf("the handler at %s does not load", f.path))
			continue
		}
		fmt.Fprintf(w, "rate_limit at %s: %s\n", f.path, h.storeName())
		p, lonely := checkHandler(ctx, w, h)
		problems = append(problems, p...)
		if lonely && !slices.Contains(alone, h.storeName()) {
			alone = append(alone, h.storeName())
		}
	}
	return problems, alone, nil
}

// checkHandler probes the handler's policies and compares them with the
// live instances of their fleet; alone: Redis decides, and no live
// instance of the fleet was there to compare with.
func checkHandler(ctx context.Context, w io.Writer, h *Handler) (problems []string, alone bool) {
	pr, ok := h.store.(prober)
	if !ok {
		fmt.Fprintln(w, "  in-process buckets (no redis block): each instance decides alone; nothing to check against Redis")
		return nil, false
	}
	server := ""
	if s, err := pr.serverInfo(ctx); err == nil {
		server = s.String()
		fmt.Fprintf(w, "  server: %s\n", server)
		if tooOld(s) {
			var ps []*Policy
			for _, d := range storeDefinitions([]*Handler{h}) {
				ps = append(ps, d.policy)
			}
			fmt.Fprintf(w, "  server: TOO OLD: %s. Until then, where it refuses a call, %s\n", tooOldText(s), failureModes(ps))
			problems = append(problems, fmt.Sprintf("the server (%s) is older than Redis %s", server, minRedisText))
		}
	} else {
		fmt.Fprintf(w, "  server: did not say who it is (%v)\n", err)
	}
	decided := 0
	for _, r := range pr.probe(storeDefinitions([]*Handler{h})) {
		p := r.def.policy
		if r.kind == "" {
			decided++
			fmt.Fprintf(w, "  policy %s: decided by Redis\n", p.Name)
			continue
		}
		fmt.Fprintf(w, "  policy %s: NOT decided by Redis: %s (%v): %s. Until then, %s\n", p.Name, causeOf(r.kind, server), r.err, fixOf(r.kind), failureModes([]*Policy{p}))
		problems = append(problems, fmt.Sprintf("policy %s would not be decided by Redis (%s)", p.Name, r.kind))
	}
	for _, p := range h.Policies {
		if !p.usesStore() {
			fmt.Fprintf(w, "  policy %s: its adaptive limit is this instance's own; nothing in Redis\n", p.Name)
		}
	}
	fm, ok := h.store.(fleetMember)
	if decided == 0 || !ok {
		return problems, false
	}
	db, others, err := fm.fleetView().liveRecords(ctx)
	if err != nil {
		fmt.Fprintf(w, "  the fleet's records could not be read: %v\n", err)
		return append(problems, "the fleet's records could not be read"), false
	}
	self := fm.fleetView().fleetRecord([]*Handler{h})
	self.ID = "check"
	var mates []string // the live instances of this config's fleet
	sameNames := map[string][]string{}
	for _, r := range others {
		for _, p := range r.Policies {
			if p.Prefix == h.keyPrefix {
				if !slices.Contains(mates, r.ID) {
					mates = append(mates, r.ID)
				}
			} else if slices.ContainsFunc(h.Policies, func(q *Policy) bool { return q.Name == p.Name }) && !slices.Contains(sameNames[p.Prefix], p.Name) {
				sameNames[p.Prefix] = append(sameNames[p.Prefix], p.Name)
			}
		}
	}
	fmt.Fprintf(w, "  fleet (db %d, key_prefix %s): %d live instance(s) announce themselves%s\n", db, h.keyPrefix, len(mates), idList(mates))
	for _, s := range fleet.Against(self, others) {
		what, ids, _ := splitDetails(s)
		fmt.Fprintf(w, "  policy %s: DIFFERS from live instance(s) %s, which enforce it with %s: they would not share one budget\n",
			s.Policy, strings.Join(ids, ", "), strings.Join(what, " and "))
		problems = append(problems, fmt.Sprintf("policy %s differs from the live instances of its fleet (%s)", s.Policy, strings.Join(s.Differs, ", ")))
	}
	if len(mates) == 0 {
		prefixes := make([]string, 0, len(sameNames))
		for prefix := range sameNames {
			prefixes = append(prefixes, prefix)
		}
		sort.Strings(prefixes)
		for _, prefix := range prefixes {
			fmt.Fprintf(w, "  note: on this database, instances with key_prefix %s enforce policies of the same names (%s): they do not share buckets with this config. "+
				"If they should, use key_prefix %s\n", prefix, strings.Join(sameNames[prefix], ", "), prefix)
		}
	}
	return problems, len(mates) == 0
}

func idList(ids []string) string {
	if len(ids) == 0 {
		return " (releases before v0.4.0 do not)"
	}
	return ": " + strings.Join(ids, ", ")
}
