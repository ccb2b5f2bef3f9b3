package transport

import (
	"context"
	"net"
	"testing"
)

// nonLoopbackIPv4 is one of this machine's own non-loopback IPv4 addresses:
// a host other ranks could reach, which routes to itself.
func nonLoopbackIPv4(t *testing.T) string {
	t.Helper()
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() {
			return ipn.IP.String()
		}
	}
	t.Fatal("this machine has no non-loopback IPv4 address to route to")
	return ""
}

func TestRouteSourceAddress(t *testing.T) {
	ctx := context.Background()
	for _, host := range []string{"127.0.0.1", "localhost", "127.0.1.1", "no-such-host.invalid"} {
		if got := RouteSourceAddress(ctx, host, 29500); got != "" {
			t.Errorf("route to %q: %q, want none (loopback or unresolvable)", host, got)
		}
	}
	own := nonLoopbackIPv4(t)
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
