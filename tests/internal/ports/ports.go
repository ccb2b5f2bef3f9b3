// Package ports helps the multi-process tests and the chaos harness pick a
// job's MASTER_PORT: below the kernel's ephemeral range (a port inside it
// can be taken before rank 0 binds by any outgoing connection's source
// port, even by another rank's own dial to it: a Linux self-connection,
// whose TIME_WAIT then blocks the listener for a minute), with the port
// after it free too (rank 0 serves the rendezvous on MASTER_PORT+1).
package ports

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
)

// EphemeralLow is the lowest port of the kernel's ephemeral range, or 32768
// (Linux's default) where it cannot be read.
func EphemeralLow() int {
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) > 0 {
			if v, err := strconv.Atoi(f[0]); err == nil {
				low = v
			}
		}
	}
	return low
}

// PairFree reports whether port and port+1 could both be listened on at
// 127.0.0.1 a moment ago.
func PairFree(port int) bool {
	l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port))
	if err != nil {
		return false
	}
	l2, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", port+1))
	l.Close()
	if err != nil {
		return false
	}
	l2.Close()
	return true
}
