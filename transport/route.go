package transport

// Which address a rank advertises when nobody said: the one its peers can
// reach. A rank that joins through a rendezvous host (MASTER_ADDR, a Slurm
// node, the host in a unique id) binds this machine's address on the route
// to that host, as the Python plugins do: on a single machine that host is
// loopback and so is the address; across hosts it is the interface that
// faces the others. Binding loopback there would advertise an address no
// other host can reach.

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"
)

// routeLookupTimeout bounds the name lookup of the rendezvous host (the
// route itself is a local table lookup).
const routeLookupTimeout = 5 * time.Second

// routeSourceAddress is this machine's IPv4 address on the route to host,
// or "" when host is loopback, does not resolve, or has no route. A UDP
// connect picks the route and the socket's local address is its source;
// no packet is sent.
func routeSourceAddress(ctx context.Context, host string, port int) string {
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

// routeToRendezvous fills opts.BindHost with the address on the route to
// the rendezvous host when the caller configured neither a host nor an
// interface (opts, or OKTOPK_SOCKET_IFNAME read through getenv); otherwise,
// or when there is no such route, opts is unchanged and ResolveBindHost
// decides as before.
func routeToRendezvous(ctx context.Context, opts ZMQOptions, host string, port int, getenv func(string) string) ZMQOptions {
	if opts.BindHost != "" || opts.Ifname != "" || getenv("OKTOPK_SOCKET_IFNAME") != "" {
		return opts
	}
	if src := routeSourceAddress(ctx, host, port); src != "" {
		opts.BindHost = src
	}
	return opts
}

// connectProblem says, for a Connect that timed out, which peers' addresses
// this rank never reached and which peers never connected to this rank's
// own address: the two sides of an address that one host cannot reach.
func (z *ZMQ) connectProblem(addrs []string) string {
	var unreached []string
	var silent []int
	for r := range addrs {
		if r == z.opts.Rank {
			continue
		}
		// hello[r]: this rank's inbox reached rank r's address and r
		// answered; bound[r]: rank r's inbox reached this rank's.
		if !z.hello[r].Load() {
			unreached = append(unreached, fmt.Sprintf("rank %d at %s", r, addrs[r]))
		}
		if !z.bound[r].Load() {
			silent = append(silent, r)
		}
	}
	var parts []string
	if len(unreached) > 0 {
		parts = append(parts, "no connection from this rank to "+strings.Join(unreached, ", ")+
			" (not started, or an address this host cannot reach: set OKTOPK_SOCKET_IFNAME or the bind host on that rank)")
	}
	if len(silent) > 0 {
		parts = append(parts, fmt.Sprintf("ranks %v never connected to this rank's %s (not started, or they cannot reach it)",
			silent, strings.SplitN(z.endpoint, "#", 2)[0]))
	}
	return strings.Join(parts, "; ")
}
