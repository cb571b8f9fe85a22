package ratelimit

import (
	"encoding/json"
	"reflect"
	"regexp"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// warnUnauthenticatedKeys warns, at provision, of each policy keyed on an
// authenticated identity ({http.auth.user.id}, ...) in an HTTP app that
// has no authentication handler at all: the placeholder is then empty for
// every request, and every request shares the policy's empty-key bucket,
// one budget for everyone, silently. It warns only when it is sure: the
// app's routes (every server's routes, error routes and named routes, with
// the subroutes and other handlers in them, provisioned or still JSON) hold
// no `authentication` handler (basic_auth, or a plugin's provider). An
// authentication handler elsewhere in the app, even on another site, keeps
// it quiet: which routes run before this handler cannot be known at
// provision (several routes compile into one chain per request).
func (h *Handler) warnUnauthenticatedKeys(ctx caddy.Context) {
	var keyed []*Policy
	for _, p := range h.Policies {
		if strings.Contains(p.Key, "{http.auth.") {
			keyed = append(keyed, p)
		}
	}
	if len(keyed) == 0 {
		return
	}
	app := httpAppOf(ctx)
	if app == nil || mayAuthenticate(app) {
		return
	}
	for _, p := range keyed {
		h.logger.Warn("rate_limit: policy "+p.Name+" keys on "+p.Key+", but this config has no authentication handler "+
			"(basic_auth, or another http.handlers.authentication): the placeholder is empty for every request, so every request "+
			"shares the policy's empty-key bucket, one budget for everyone. Add basic_auth before rate_limit, or key on what "+
			"identifies the client: forward_auth sets request headers, not {http.auth.*} (with copy_headers Remote-User, key on "+
			"{http.request.header.Remote-User})",
			zap.String("policy", p.Name), zap.String("key", p.Key))
	}
}

// clientChosen are the placeholders whose value the client picks: a key
// made of one of them without authentication is a fresh identity per
// value the client sends.
var clientChosen = []string{"{http.request.header.", "{http.request.cookie.", "{http.request.uri", "{http.request.orig_uri"}

// warnAnonymousQuotaKeys warns, at provision, of each quota policy keyed
// on a value the client chooses (a header, a cookie, the query) in an app
// that has no authentication handler and no forward_auth (a reverse_proxy
// with handle_response routes): every value a client makes up is a count
// that Redis keeps until the quota's period ends, a month for /month, and
// an anonymous client rotating the value grows Redis for that long. The
// warning says what a key costs and how to bound it (docs/quotas.md).
func (h *Handler) warnAnonymousQuotaKeys(ctx caddy.Context) {
	var keyed []*Policy
	for _, p := range h.Policies {
		if p.kind != kindQuota {
			continue
		}
		for _, c := range clientChosen {
			if strings.Contains(p.Key, c) {
				keyed = append(keyed, p)
				break
			}
		}
	}
	if len(keyed) == 0 {
		return
	}
	app := httpAppOf(ctx)
	if app == nil || mayAuthenticate(app) || mayForwardAuth(app) {
		return
	}
	for _, p := range keyed {
		h.logger.Warn("rate_limit: quota policy "+p.Name+" keys on "+p.Key+", a value the client chooses, and nothing in this config "+
			"authenticates it: every value a client sends is a count that Redis keeps until the "+p.quota.unit.String()+" ends "+
			"(about 200 bytes each), so a client rotating the value grows Redis for that long. Key the quota on an authenticated "+
			"identity (basic_auth, forward_auth's copied headers), or use a shorter period (docs/quotas.md, \"What a key costs\")",
			zap.String("policy", p.Name), zap.String("key", p.Key), zap.String("period", p.quota.unit.String()))
	}
}

// httpAppOf is the HTTP app being provisioned with the handler, from the
// lineage of modules Caddy is provisioning; nil when the handler is
// provisioned outside one.
func httpAppOf(ctx caddy.Context) *caddyhttp.App {
	for _, m := range ctx.Modules() {
		if app, ok := m.(*caddyhttp.App); ok {
			return app
		}
	}
	return nil
}

// mayAuthenticate reports whether the app may hold an authentication
// handler: one found, or a config too large to search (then it does not
// know, and says it may).
func mayAuthenticate(app *caddyhttp.App) bool {
	s := authSearch{seen: map[uintptr]bool{}, budget: authSearchBudget, module: isAuthentication, raw: authHandlerJSON}
	return s.found(reflect.ValueOf(app.Servers))
}

// mayForwardAuth reports whether the app may hold a forward_auth: a
// reverse_proxy whose handle_response routes copy what the auth server
// says into the request.
func mayForwardAuth(app *caddyhttp.App) bool {
	s := authSearch{seen: map[uintptr]bool{}, budget: authSearchBudget, module: isForwardAuth, raw: handleResponseJSON}
	return s.found(reflect.ValueOf(app.Servers))
}

func isAuthentication(m caddy.Module) bool {
	return caddy.GetModuleID(m) == "http.handlers.authentication"
}

func isForwardAuth(m caddy.Module) bool {
	if caddy.GetModuleID(m) != "http.handlers.reverse_proxy" {
		return false
	}
	v := reflect.Indirect(reflect.ValueOf(m)).FieldByName("HandleResponse")
	return v.IsValid() && v.Kind() == reflect.Slice && v.Len() > 0
}

// authSearchBudget bounds the values an authSearch visits.
const authSearchBudget = 1_000_000

// authHandlerJSON is an authentication handler in a config's JSON;
// handleResponseJSON a reverse_proxy's handle_response routes.
var (
	authHandlerJSON    = regexp.MustCompile(`"handler"\s*:\s*"authentication"`)
	handleResponseJSON = regexp.MustCompile(`"handle_response"\s*:\s*\[\s*\{`)
)

var rawMessageType = reflect.TypeFor[json.RawMessage]()

// authSearch walks the exported fields of a config's values: the modules
// Caddy provisioned already (routes' Handlers, a Subroute's Routes, a
// reverse_proxy's handle_response routes...) and the JSON of those it has
// not yet (routes' HandlersRaw, which holds nested subroutes as text).
type authSearch struct {
	seen   map[uintptr]bool
	budget int
	module func(caddy.Module) bool // what is looked for, provisioned
	raw    *regexp.Regexp          // and in JSON
}

func (s *authSearch) found(v reflect.Value) bool {
	if s.budget--; s.budget < 0 {
		return true
	}
	switch v.Kind() {
	case reflect.Interface:
		return !v.IsNil() && s.found(v.Elem())
	case reflect.Pointer:
		if v.IsNil() || s.seen[v.Pointer()] {
			return false
		}
		s.seen[v.Pointer()] = true
		if m, ok := v.Interface().(caddy.Module); ok && s.module(m) {
			return true
		}
		return s.found(v.Elem())
	case reflect.Struct:
		t := v.Type()
		for i := range t.NumField() {
			if t.Field(i).IsExported() && s.found(v.Field(i)) {
				return true
			}
		}
	case reflect.Slice:
		if v.Type() == rawMessageType {
			return s.raw.Match(v.Bytes())
		}
		if v.Type().Elem().Kind() == reflect.Uint8 {
			return false
		}
		fallthrough
	case reflect.Array:
		for i := range v.Len() {
			if s.found(v.Index(i)) {
				return true
			}
		}
	case reflect.Map:
		for it := v.MapRange(); it.Next(); {
			if s.found(it.Value()) {
				return true
			}
		}
	}
	return false
}
