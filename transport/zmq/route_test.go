package zmq

// Tests of the address a rank advertises: a configured one is kept, the
// routed one is used otherwise, and an unreachable peer address is named.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/internal/testnet"
	"github.com/oktopk/oktopk/transport"
)

func TestRouteToRendezvousKeepsAConfiguredAddress(t *testing.T) {
	ctx := context.Background()
	own := testnet.NonLoopbackIPv4(t)
	none := envOf(nil)
	for _, c := range []struct {
		opts Options
		env  func(string) string
	}{
		{Options{BindHost: "127.0.0.1"}, none},
		{Options{Ifname: "lo"}, none},
		{Options{}, envOf(map[string]string{"OKTOPK_SOCKET_IFNAME": "lo"})},
	} {
		if got := routeToRendezvous(ctx, c.opts, own, 29500, c.env); got.BindHost != c.opts.BindHost || got.Ifname != c.opts.Ifname {
			t.Errorf("%+v was changed to %+v", c.opts, got)
		}
	}
	if got := routeToRendezvous(ctx, Options{}, own, 29500, none); got.BindHost != own {
		t.Errorf("no configured address: bind host %q, want the routed %s", got.BindHost, own)
	}
	if got := routeToRendezvous(ctx, Options{}, "127.0.0.1", 29500, none); got.BindHost != "" {
		t.Errorf("rendezvous on loopback: bind host %q, want the library default", got.BindHost)
	}
}

// With MASTER_ADDR on a non-loopback address and nothing configured, every
// rank advertises the address on the route to it, not loopback (which
// ranks on other hosts could not reach).
func TestInitFromLaunchBindsTheRoutedAddress(t *testing.T) {
	own := testnet.NonLoopbackIPv4(t)
	port := freeRendezvousPort(t)
	envs := make([]map[string]string, 2)
	for r := range envs {
		envs[r] = map[string]string{"RANK": fmt.Sprint(r), "WORLD_SIZE": "2", "MASTER_ADDR": own, "OKTOPK_RENDEZVOUS_PORT": fmt.Sprint(port)}
	}
	zs, errs := joinFromEnvs(envs)
	for r, z := range zs {
		if errs[r] != nil {
			t.Fatalf("rank %d: %v", r, errs[r])
		}
		defer z.Close()
		if want := "tcp://" + own + ":"; !strings.HasPrefix(z.Endpoint(), want) {
			t.Errorf("rank %d advertises %s, want %s…", r, z.Endpoint(), want)
		}
	}
}

// A peer that advertises an address this rank cannot reach (here a closed
// port) fails this rank's Connect within its deadline, naming the address,
// even though that peer's own hello gets through to this rank.
func TestConnectFailsNamingAnUnreachablePeerAddress(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	bogus := "tcp://" + ln.Addr().String()
	ln.Close()
	token := transport.NewToken()
	zs := make([]*Transport, 2)
	for r := range zs {
		if zs[r], err = Listen(Options{Rank: r, Size: 2, Token: token, BindHost: "127.0.0.1"}); err != nil {
			t.Fatal(err)
		}
		defer zs[r].Close()
	}
	const deadline = 1500 * time.Millisecond
	errs := make([]error, 2)
	elapsed := make([]time.Duration, 2)
	var wg sync.WaitGroup
	for r, endpoints := range [][]string{{zs[0].Endpoint(), bogus}, {zs[0].Endpoint(), zs[1].Endpoint()}} {
		wg.Add(1)
		go func(r int, endpoints []string) {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), deadline)
			defer cancel()
			start := time.Now()
			errs[r] = zs[r].Connect(ctx, endpoints)
			elapsed[r] = time.Since(start)
		}(r, endpoints)
	}
	wg.Wait()
	if errs[0] == nil {
		t.Fatalf("rank 0 connected although rank 1's advertised %s is unreachable", bogus)
	}
	if !errors.Is(errs[0], transport.ErrTimeout) || !strings.Contains(errs[0].Error(), "rank 1 at "+bogus) {
		t.Errorf("rank 0: %v; want a timeout naming rank 1 at %s", errs[0], bogus)
	}
	if elapsed[0] > deadline+time.Second {
		t.Errorf("rank 0 failed after %v, past its %v deadline", elapsed[0], deadline)
	}
	// Rank 1 reaches rank 0 but never hears from it: it names its own
	// address, the one rank 0 was told and could not reach.
	if errs[1] == nil || !strings.Contains(errs[1].Error(), "never connected to this rank's tcp://127.0.0.1:") {
		t.Errorf("rank 1: %v; want a failure naming its own address", errs[1])
	}
}
