package ratelimit

import (
	"context"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestConflictingDefinitions: one policy name is one budget: two handlers
// of one config may share a name only with the same rate, burst, key and
// store; otherwise the second fails to provision, naming both.
func TestConflictingDefinitions(t *testing.T) {
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	a := &Handler{Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "10/1s"}}}
	same := &Handler{Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "10/1s", Cost: "2"}}}
	other := &Handler{Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "20/1s"}}}
	for _, h := range []*Handler{a, same} {
		if err := h.Provision(ctx); err != nil {
			t.Fatalf("the same budget in two handlers: %v", err)
		}
		defer h.Cleanup()
	}
	err := other.Provision(ctx)
	if err == nil {
		other.Cleanup()
		t.Fatal("a second definition of api with another rate provisioned")
	}
	if !strings.Contains(err.Error(), "rate 20/1s") || !strings.Contains(err.Error(), "rate 10/1s") {
		t.Fatalf("the error does not name both definitions: %v", err)
	}
	// Another prefix length for the key's client address is another
	// partition: other buckets under the same name.
	otherPrefix := &Handler{IPv6Prefix: 48, Policies: []*Policy{{Name: "api", Key: "{client_ip}", Rate: "10/1s"}}}
	if err := otherPrefix.Provision(ctx); err == nil {
		otherPrefix.Cleanup()
		t.Fatal("a second definition of api with ipv6_prefix 48 provisioned")
	} else if !strings.Contains(err.Error(), "IPv6 /48") || !strings.Contains(err.Error(), "IPv6 /64") {
		t.Fatalf("the error does not name both prefixes: %v", err)
	}
	// Another config (a reload) may redefine it.
	ctx2, cancel2 := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel2()
	if err := other.Provision(ctx2); err != nil {
		t.Fatalf("another config redefining api: %v", err)
	}
	other.Cleanup()
}
