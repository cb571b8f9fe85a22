package ratelimit

import (
	"errors"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// TestShedConfig: the JSON checks of shed and priority, each naming its
// field, as caddy validate reports them.
func TestShedConfig(t *testing.T) {
	shed := func(mod func(p *Policy)) *Policy {
		p := &Policy{Name: "capacity", Key: "global", Shed: &Shed{Concurrent: 200, Latency: caddy.Duration(250 * time.Millisecond)}, Priority: designClasses()}
		mod(p)
		return p
	}
	classes := func(cs ...string) func(p *Policy) {
		return func(p *Policy) {
			p.Priority.Classes = nil
			for i := 0; i+1 < len(cs); i += 2 {
				p.Priority.Classes = append(p.Priority.Classes, PriorityClass{Name: cs[i], Share: cs[i+1]})
			}
		}
	}
	for _, ok := range []*Policy{
		shed(func(*Policy) {}),
		shed(func(p *Policy) { p.Priority = nil }),
		shed(func(p *Policy) { p.Shed.Latency = 0; p.Key = "{http.request.host}" }), // slots per host
		shed(func(p *Policy) { p.Shed.Concurrent = 0 }),
		shed(func(p *Policy) { p.Lease = caddy.Duration(5 * time.Second); p.OnError = failLocal; p.Shadow = true }),
		shed(classes("critical", "100%", "bulk", "0.5%")),
	} {
		if err := ok.check(); err != nil {
			t.Errorf("%+v: %v", ok, err)
		}
	}
	for _, c := range []struct {
		field, want string
		p           *Policy
	}{
		{"priority", "only a shed policy has priority", shed(func(p *Policy) { p.Shed = nil; p.Rate = "10/1s" })},
		{"rate", "a rate or shed, not both", shed(func(p *Policy) { p.Rate = "10/1s" })},
		{"concurrent", "shed { concurrent <n> }", shed(func(p *Policy) { p.Concurrent = 5 })},
		{"burst", "one slot", shed(func(p *Policy) { p.Burst = 5 })},
		{"cost", "one slot", shed(func(p *Policy) { p.Cost = "2" })},
		{"charge_if", "charges nothing", shed(func(p *Policy) { p.ChargeIf = &caddyhttp.ResponseMatcher{StatusCode: []int{500}} })},
		{"settle", "charges nothing", shed(func(p *Policy) { p.Settle = &Settle{From: settleOpenAI} })},
		{"wait", "answers at once", shed(func(p *Policy) { p.Wait = caddy.Duration(time.Second) })},
		{"shed", "is required", shed(func(p *Policy) { p.Shed = &Shed{} })},
		{"shed", "concurrent -1", shed(func(p *Policy) { p.Shed.Concurrent = -1 })},
		{"shed", "latency 500µs", shed(func(p *Policy) { p.Shed.Latency = caddy.Duration(500 * time.Microsecond) })},
		{"shed", "latency 2h0m0s", shed(func(p *Policy) { p.Shed.Latency = caddy.Duration(2 * time.Hour) })},
		{"lease", "only shed { concurrent <n> } holds leases", shed(func(p *Policy) { p.Shed.Concurrent = 0; p.Lease = caddy.Duration(time.Minute) })},
		{"lease", "must be from 1s", shed(func(p *Policy) { p.Lease = caddy.Duration(time.Millisecond) })},
		{"key", "fixed string such as global", shed(func(p *Policy) { p.Key = "{http.request.host}" })},
		{"on_error", "is not fail_open", shed(func(p *Policy) { p.OnError = "retry" })},
		{"priority", "placeholder that names the class is required", shed(func(p *Policy) { p.Priority.From = "" })},
		{"priority", "has no placeholder", shed(func(p *Policy) { p.Priority.From = "critical" })},
		{"priority", "at least one class", shed(classes())},
		{"priority", "is 1 to 64 letters", shed(classes("critical", "100%", "best effort", "50%"))},
		{"priority", `share "50"`, shed(classes("critical", "100%", "batch", "50"))},
		{"priority", "above 0%", shed(classes("critical", "100%", "batch", "0%"))},
		{"priority", "its share is 100%", shed(classes("critical", "90%", "batch", "50%"))},
		{"priority", `"batch": share 80% is not below "default"'s 50%`, shed(classes("critical", "100%", "default", "50%", "batch", "80%"))},
		{"priority", "not below", shed(classes("critical", "100%", "default", "50%", "batch", "50%"))},
		{"priority", `"default" is listed twice`, shed(classes("critical", "100%", "default", "50%", "default", "20%"))},
		{"priority", "less than one slot", shed(func(p *Policy) { p.Shed.Concurrent = 10; p.Priority.Classes[2].Share = "5%" })},
	} {
		err := c.p.check()
		var fe *fieldError
		if err == nil || !errors.As(err, &fe) || fe.field != c.field || !strings.Contains(err.Error(), c.want) || !strings.HasPrefix(err.Error(), c.field+":") {
			t.Errorf("%s: error %v, want one of field %s saying %q", c.want, err, c.field, c.want)
		}
	}
	// Through Validate, the policy is named as caddy validate shows it.
	h := &Handler{Policies: []*Policy{shed(classes("critical", "100%", "batch", "100%"))}}
	if err := h.Validate(); err == nil || !strings.HasPrefix(err.Error(), `policy "capacity": priority: class "batch"`) {
		t.Errorf("Validate: %v", err)
	}
}

// TestCaddyfileShedErrors: each mistake in shed and priority blocks, at
// caddy adapt, names what is wrong and points at its line.
func TestCaddyfileShedErrors(t *testing.T) {
	shedPolicy := func(lines ...string) string {
		return "policy capacity {\n\tkey global\n\t" + strings.Join(lines, "\n\t") + "\n}\n"
	}
	classes := "priority {header.X-Priority} {\n\t\tcritical 100%\n\t\tdefault 80%\n\t\tbatch 50%\n\t}"
	for _, tc := range []struct{ sub, name, body string }{
		{"shed", "no block", shedPolicy("shed " + mark)},
		{"shed", "an argument", shedPolicy("shed 200 { " + mark + "\n\t\tconcurrent 200\n\t}")},
		{"shed", "empty block", shedPolicy("shed { " + mark + "\n\t}")},
		{"concurrent", "shed: not a number", shedPolicy("shed {\n\t\tconcurrent many " + mark + "\n\t}")},
		{"concurrent", "shed: zero", shedPolicy("shed {\n\t\tconcurrent 0 " + mark + "\n\t}")},
		{"concurrent", "shed: twice", shedPolicy("shed {\n\t\tconcurrent 10\n\t\tconcurrent 20 " + mark + "\n\t}")},
		{"latency", "shed: not a duration", shedPolicy("shed {\n\t\tlatency fast " + mark + "\n\t}")},
		{"latency", "shed: below 1ms", shedPolicy("shed { " + mark + "\n\t\tlatency 10us\n\t}")},
		{"queue", "shed: unknown", shedPolicy("shed {\n\t\tqueue 10 " + mark + "\n\t}")},
		{"rate", "shed with rate", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "rate 10/1s "+mark)},
		{"concurrent", "shed with concurrent", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "concurrent 5 "+mark)},
		{"burst", "shed with burst", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "burst 5 "+mark)},
		{"wait", "shed with wait", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "wait 1s "+mark)},
		{"charge_if", "shed with charge_if", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "charge_if status 500 "+mark)},
		{"key", "latency with a placeholder key", "policy capacity {\n\tkey {header.X-Site} " + mark + "\n\tshed {\n\t\tlatency 100ms\n\t}\n}\n"},
		{"lease", "without shed concurrent", shedPolicy("shed {\n\t\tlatency 100ms\n\t}", "lease 10s "+mark)},
		{"priority", "without shed", "policy api {\n\tkey global\n\trate 10/1s\n\t" + strings.Replace(classes, "{header.X-Priority} {", "{header.X-Priority} { "+mark, 1) + "\n}\n"},
		{"priority", "no placeholder", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority { "+mark+"\n\t\tcritical 100%\n\t}")},
		{"priority", "a fixed value", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority critical { "+mark+"\n\t\tcritical 100%\n\t}")},
		{"priority", "no class", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} { "+mark+"\n\t}")},
		{"priority", "no share", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical "+mark+"\n\t}")},
		{"priority", "two shares", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 100% 90% "+mark+"\n\t}")},
		{"priority", "a share of 0", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 100%\n\t\tbatch 0% "+mark+"\n\t}")},
		{"priority", "a share without %", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 100%\n\t\tbatch 0.5 "+mark+"\n\t}")},
		{"priority", "the first below 100%", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 80% "+mark+"\n\t\tbatch 50%\n\t}")},
		{"priority", "shares not decreasing", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 100%\n\t\tbatch 50%\n\t\tdefault 80% "+mark+"\n\t}")},
		{"priority", "a class repeated", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} {\n\t\tcritical 100%\n\t\tbatch 50%\n\t\tbatch 20% "+mark+"\n\t}")},
		{"priority", "less than one slot", shedPolicy("shed {\n\t\tconcurrent 10\n\t}", "priority {header.X-Priority} { "+mark+"\n\t\tcritical 100%\n\t\tbatch 5%\n\t}")},
		{"priority", "twice", shedPolicy("shed {\n\t\tconcurrent 100\n\t}", classes, strings.Replace(classes, "{header.X-Priority} {", "{header.X-Priority} { "+mark, 1))},
	} {
		t.Run(tc.sub+"/"+tc.name, func(t *testing.T) {
			caddyfileText, lines := siteWith(tc.body)
			_, _, err := caddyconfig.GetAdapter("caddyfile").Adapt([]byte(caddyfileText), nil)
			if err == nil {
				t.Fatalf("adapted without error:\n%s", numbered(caddyfileText))
			}
			msg := err.Error()
			if !regexp.MustCompile(`(^|[^A-Za-z_])` + regexp.QuoteMeta(tc.sub) + `([^A-Za-z_]|$)`).MatchString(msg) {
				t.Errorf("the error does not name %q: %v", tc.sub, err)
			}
			m := atLine.FindAllStringSubmatch(msg, -1)
			if len(m) == 0 {
				t.Fatalf("the error has no Caddyfile:<line>: %v", err)
			}
			if got, _ := strconv.Atoi(m[len(m)-1][1]); !lines[got] {
				t.Errorf("the error points at line %d, want %s: %v\n%s", got, lineList(lines), err, numbered(caddyfileText))
			}
		})
	}
}

// checkShedProvisioned requires a provisioned shed policy's state: its
// classes' slots (with shed { concurrent }), its limiter (with latency),
// a failure mode.
func checkShedProvisioned(t *testing.T, where string, p *Policy) {
	t.Helper()
	st := p.shed
	switch {
	case st == nil || len(st.byClass) != len(p.classes.Names()) || !validOnError(p.onError):
		t.Errorf("%s: shed policy %q provisioned without its state", where, p.Name)
	case (p.Shed.Latency > 0) != (st.limiter != nil):
		t.Errorf("%s: shed policy %q: latency %v, limiter %v", where, p.Name, p.Shed.Latency, st.limiter)
	case p.Shed.Concurrent > 0 && (p.limit.burst != p.Shed.Concurrent || p.limit.interval < 1 || st.byClass[0].limit.burst != p.Shed.Concurrent):
		t.Errorf("%s: shed policy %q provisioned with bad slots: %+v", where, p.Name, p.limit)
	}
	for i, cp := range st.byClass {
		if p.Shed.Concurrent > 0 && cp.limit.burst < 1 {
			t.Errorf("%s: shed policy %q: class %d has no slot", where, p.Name, i)
		}
	}
}
