package ratelimit

import (
	"encoding/json"
	"fmt"
	"net/http"
	"sort"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Which rate_limit handlers a request reaches, from a config's routes: for
// a replay (the config of a file, its routes' matchers provisioned here)
// and a dry run (the running config's routes). A route applies when its
// matchers match, as Caddy runs it: only the first matching route of a
// group, nothing after a terminal route, and nothing after a handler that
// answers the request itself (reverse_proxy, file_server, respond...).
// Handlers that change the request on its way (rewrite, headers) are not
// run: a policy's matcher sees the request as the client sent it.

// routeTree is the routes of a config's HTTP servers.
type routeTree struct {
	servers []serverRoutes
}

type serverRoutes struct {
	name   string
	routes []routeNode
}

type routeNode struct {
	matchers caddyhttp.MatcherSets
	group    string
	terminal bool
	steps    []routeStep
}

// routeStep is one handler of a route: a rate_limit handler, a subroute,
// or another handler, which may answer the request (ending the chain).
type routeStep struct {
	handler  *Handler
	sub      []routeNode
	responds bool
}

// responders are the handlers that answer a request themselves rather
// than pass it on: nothing after them in a chain runs.
var responders = map[string]bool{
	"reverse_proxy": true, "file_server": true, "static_response": true, "error": true,
	"copy_response": true,
}

// reach returns the rate_limit handlers the request passes through, in
// order, in the first server whose routes lead it to one.
func (t *routeTree) reach(r *http.Request) ([]*Handler, error) {
	for _, s := range t.servers {
		groups := map[string]bool{}
		var out []*Handler
		if _, err := walkRoutes(s.routes, r, groups, &out); err != nil {
			return nil, err
		}
		if len(out) > 0 {
			return out, nil
		}
	}
	return nil, nil
}

// walkRoutes runs routes for r as far as rate_limit handlers go, adding
// them to out; answered is true once a handler answered the request.
func walkRoutes(routes []routeNode, r *http.Request, groups map[string]bool, out *[]*Handler) (answered bool, err error) {
	for _, rt := range routes {
		if rt.group != "" && groups[rt.group] {
			continue
		}
		ok, err := rt.matchers.AnyMatchWithError(r)
		if err != nil {
			return false, err
		}
		if !ok {
			continue
		}
		if rt.group != "" {
			groups[rt.group] = true
		}
		for _, st := range rt.steps {
			switch {
			case st.handler != nil:
				*out = append(*out, st.handler)
			case st.sub != nil:
				done, err := walkRoutes(st.sub, r, groups, out)
				if err != nil || done {
					return done, err
				}
			case st.responds:
				return true, nil
			}
		}
		if rt.terminal {
			return true, nil
		}
	}
	return false, nil
}

// handlers is every rate_limit handler of the tree, each once, in order.
func (t *routeTree) handlers() []*Handler {
	var out []*Handler
	var walk func([]routeNode)
	walk = func(routes []routeNode) {
		for _, rt := range routes {
			for _, st := range rt.steps {
				if st.handler != nil {
					out = append(out, st.handler)
				}
				walk(st.sub)
			}
		}
	}
	for _, s := range t.servers {
		walk(s.routes)
	}
	return out
}

// liveRoutes is the route tree of the running config's HTTP app, whose
// matchers and handlers are provisioned already; nil when it has none.
func liveRoutes() *routeTree {
	app, err := caddy.ActiveContext().AppIfConfigured("http")
	if err != nil {
		return nil
	}
	a, ok := app.(*caddyhttp.App)
	if !ok {
		return nil
	}
	t := &routeTree{}
	for _, name := range sortedKeys(a.Servers) {
		t.servers = append(t.servers, serverRoutes{name: name, routes: liveNodes(a.Servers[name].Routes)})
	}
	return t
}

func liveNodes(routes caddyhttp.RouteList) []routeNode {
	nodes := make([]routeNode, 0, len(routes))
	for _, rt := range routes {
		n := routeNode{matchers: rt.MatcherSets, group: rt.Group, terminal: rt.Terminal}
		for _, mh := range rt.Handlers {
			switch h := mh.(type) {
			case *Handler:
				n.steps = append(n.steps, routeStep{handler: h})
			case *caddyhttp.Subroute:
				n.steps = append(n.steps, routeStep{sub: nonNil(liveNodes(h.Routes))})
			default:
				if m, ok := mh.(caddy.Module); ok && responders[moduleName(m.CaddyModule().ID)] {
					n.steps = append(n.steps, routeStep{responds: true})
				}
			}
		}
		nodes = append(nodes, n)
	}
	return nodes
}

func nonNil(n []routeNode) []routeNode {
	if n == nil {
		return []routeNode{}
	}
	return n
}

func moduleName(id caddy.ModuleID) string {
	s := string(id)
	return s[strings.LastIndexByte(s, '.')+1:]
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// configRoutes builds the route tree of a JSON config: the routes'
// matchers are provisioned in ctx; each rate_limit handler is made by
// newHandler from its JSON (its path in the config for messages), and no
// other handler is loaded.
func configRoutes(ctx caddy.Context, raw []byte, newHandler func(path string, raw json.RawMessage) (*Handler, error)) (*routeTree, error) {
	var cfg struct {
		Apps struct {
			HTTP struct {
				Servers map[string]struct {
					Routes []json.RawMessage `json:"routes"`
				} `json:"servers"`
			} `json:"http"`
		} `json:"apps"`
	}
	if err := json.Unmarshal(raw, &cfg); err != nil {
		return nil, fmt.Errorf("reading the config: %v", err)
	}
	t := &routeTree{}
	for _, name := range sortedKeys(cfg.Apps.HTTP.Servers) {
		nodes, err := configNodes(ctx, cfg.Apps.HTTP.Servers[name].Routes, "apps.http.servers."+name+".routes", newHandler)
		if err != nil {
			return nil, err
		}
		t.servers = append(t.servers, serverRoutes{name: name, routes: nodes})
	}
	return t, nil
}

func configNodes(ctx caddy.Context, routes []json.RawMessage, path string, newHandler func(string, json.RawMessage) (*Handler, error)) ([]routeNode, error) {
	nodes := []routeNode{}
	for i, raw := range routes {
		at := fmt.Sprintf("%s[%d]", path, i)
		var rt caddyhttp.Route
		if err := json.Unmarshal(raw, &rt); err != nil {
			return nil, fmt.Errorf("%s: %v", at, err)
		}
		if err := rt.ProvisionMatchers(ctx); err != nil {
			return nil, fmt.Errorf("%s: %v", at, err)
		}
		n := routeNode{matchers: rt.MatcherSets, group: rt.Group, terminal: rt.Terminal}
		for j, hraw := range rt.HandlersRaw {
			hat := fmt.Sprintf("%s.handle[%d]", at, j)
			var head struct {
				Handler string            `json:"handler"`
				Routes  []json.RawMessage `json:"routes"`
			}
			if err := json.Unmarshal(hraw, &head); err != nil {
				return nil, fmt.Errorf("%s: %v", hat, err)
			}
			switch head.Handler {
			case "rate_limit":
				h, err := newHandler(hat, hraw)
				if err != nil {
					return nil, err
				}
				n.steps = append(n.steps, routeStep{handler: h})
			case "subroute":
				sub, err := configNodes(ctx, head.Routes, hat+".routes", newHandler)
				if err != nil {
					return nil, err
				}
				n.steps = append(n.steps, routeStep{sub: sub})
			default:
				if responders[head.Handler] {
					n.steps = append(n.steps, routeStep{responds: true})
				}
			}
		}
		nodes = append(nodes, n)
	}
	return nodes, nil
}
