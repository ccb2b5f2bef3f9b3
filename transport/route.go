package transport

// Which address a rank binds and advertises. Asked for, it is the given
// host or an interface's address (ResolveBindHost). When nobody said, it is
// the one its peers can reach: a rank that joins through a rendezvous host
// (MASTER_ADDR, a Slurm node, the host in a unique id) binds this machine's
// address on the route to that host (RouteSourceAddress), as the Python
// plugins do: on a single machine that host is loopback and so is the
// address; across hosts it is the interface that faces the others. Binding
// loopback there would advertise an address no other host can reach.

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"time"
)

// routeLookupTimeout bounds the name lookup of the rendezvous host (the
// route itself is a local table lookup).
const routeLookupTimeout = 5 * time.Second

// RouteSourceAddress is this machine's IPv4 address on the route to host,
// or "" when host is loopback, does not resolve, or has no route. A UDP
// connect picks the route and the socket's local address is its source;
// no packet is sent.
func RouteSourceAddress(ctx context.Context, host string, port int) string {
	ctx, cancel := context.WithTimeout(ctx, routeLookupTimeout)
	defer cancel()
	ips, err := net.DefaultResolver.LookupIP(ctx, "ip4", host)
	if err != nil {
		return ""
	}
	if port <= 0 || port > 65535 {
		port = DefaultRendezvousPort
	}
	for _, ip := range ips {
		if ip.IsLoopback() {
			return "" // the host is this machine's loopback: a single-machine job
		}
		c, err := net.Dial("udp4", net.JoinHostPort(ip.String(), strconv.Itoa(port)))
		if err != nil {
			continue
		}
		local := c.LocalAddr().(*net.UDPAddr).IP
		c.Close()
		if !local.IsUnspecified() {
			return local.String()
		}
	}
	return ""
}

// ResolveBindHost decides which address a rank binds and advertises: the
// explicit host if given, else the IPv4 address of the named interface
// (ifname, or $OKTOPK_SOCKET_IFNAME), else loopback. It never picks the
// wildcard address on its own; "0.0.0.0" must be asked for explicitly.
func ResolveBindHost(bindHost, ifname string) (string, error) {
	if bindHost != "" {
		return bindHost, nil
	}
	if ifname == "" {
		ifname = Getenv("OKTOPK_SOCKET_IFNAME")
	}
	if ifname == "" {
		return "127.0.0.1", nil
	}
	iface, err := net.InterfaceByName(ifname)
	if err != nil {
		return "", fmt.Errorf("%w: interface %q: %w", ErrRendezvous, ifname, err)
	}
	addrs, err := iface.Addrs()
	if err != nil {
		return "", fmt.Errorf("%w: interface %q: %w", ErrRendezvous, ifname, err)
	}
	for _, a := range addrs {
		if ipn, ok := a.(*net.IPNet); ok && ipn.IP.To4() != nil {
			return ipn.IP.String(), nil
		}
	}
	return "", fmt.Errorf("%w: interface %q has no IPv4 address", ErrRendezvous, ifname)
}
