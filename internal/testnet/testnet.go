// Package testnet tells the transport's tests about this machine's network.
package testnet

import (
	"errors"
	"net"
	"testing"
)

// NonLoopbackIPv4 is one of this machine's own non-loopback IPv4 addresses:
// a host other ranks could reach, which routes to itself. The test fails
// where the machine has none.
func NonLoopbackIPv4(t testing.TB) string {
	t.Helper()
	addr, err := nonLoopbackIPv4()
	if err != nil {
		t.Fatal(err)
	}
	return addr
}

func nonLoopbackIPv4() (string, error) {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "", err
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() {
			return ipn.IP.String(), nil
		}
	}
	return "", errors.New("this machine has no non-loopback IPv4 address to route to")
}
