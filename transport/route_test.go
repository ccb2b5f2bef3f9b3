package transport

// Tests of the bind address: the source address of the route to a host,
// and ResolveBindHost never binding the wildcard address by default.

import (
	"context"
	"testing"

	"github.com/oktopk/oktopk/internal/testnet"
)

func TestRouteSourceAddress(t *testing.T) {
	ctx := context.Background()
	for _, host := range []string{"127.0.0.1", "localhost", "127.0.1.1", "no-such-host.invalid"} {
		if got := RouteSourceAddress(ctx, host, 29500); got != "" {
			t.Errorf("route to %q: %q, want none (loopback or unresolvable)", host, got)
		}
	}
	own := testnet.NonLoopbackIPv4(t)
	if got := RouteSourceAddress(ctx, own, 29500); got != own {
		t.Errorf("route to this machine's %s: source %q", own, got)
	}
}

func TestResolveBindHostNeverWildcardByDefault(t *testing.T) {
	t.Setenv("OKTOPK_SOCKET_IFNAME", "")
	h, err := ResolveBindHost("", "")
	if err != nil || h != "127.0.0.1" {
		t.Fatalf("default bind host %q, %v", h, err)
	}
	h, err = ResolveBindHost("", "lo")
	if err != nil || h != "127.0.0.1" {
		t.Fatalf("interface lo: %q, %v", h, err)
	}
	if _, err := ResolveBindHost("", "no-such-if0"); err == nil {
		t.Fatal("unknown interface accepted")
	}
}
