package main

// How communicators come to exist, the only file that knows: NCCL-style
// unique id, torchrun-style environment, or the two-step bind and connect
// for callers that rendezvous through their own framework.

import (
	"context"
	"fmt"
	"sync"

	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

func zmqOptions(rank, size int, token string, s settings) zmq.Options {
	return zmq.Options{
		Rank: rank, Size: size, Token: token,
		BindHost: s.bindHost, Ifname: s.ifname,
		ConnectTimeout: s.timeout,
		Curve:          s.curve,
	}
}

// initContext bounds a whole initialisation by the configured timeout.
func initContext(s settings) (context.Context, context.CancelFunc) {
	if s.timeout > 0 {
		return context.WithTimeout(context.Background(), s.timeout)
	}
	return context.WithCancel(context.Background())
}

// uniqueIDServers holds the rendezvous servers that oktopk_get_unique_id
// started in this process, by id, until the communicator made from that id
// takes ownership (and closes it on destroy).
var uniqueIDServers = struct {
	sync.Mutex
	m map[string]*transport.StoreServer
}{m: make(map[string]*transport.StoreServer)}

func newUniqueID(s settings) (string, error) {
	id, server, err := zmq.NewUniqueID(zmqOptions(0, 0, "", s))
	if err != nil {
		return "", err
	}
	text := id.String()
	if len(text) >= 256 {
		server.Close()
		return "", fmt.Errorf("oktopk: unique id of %d bytes does not fit oktopk_unique_id_t", len(text))
	}
	uniqueIDServers.Lock()
	uniqueIDServers.m[text] = server
	uniqueIDServers.Unlock()
	return text, nil
}

func initFromUniqueID(text string, rank, size int, s settings) (*communicator, error) {
	id, err := transport.ParseUniqueID(text)
	if err != nil {
		return nil, invalidArgument("unique id: %s", withoutSentinel(err, transport.ErrRendezvous))
	}
	ctx, cancel := initContext(s)
	defer cancel()
	net, err := zmq.InitFromUniqueID(ctx, id, rank, size, zmqOptions(rank, size, id.Token, s))
	// Whatever the outcome, this id's rendezvous is over here: the
	// communicator takes the server, or a failure closes it (its port and
	// goroutines would otherwise stay for the life of the process).
	uniqueIDServers.Lock()
	server := uniqueIDServers.m[text]
	delete(uniqueIDServers.m, text)
	uniqueIDServers.Unlock()
	if err != nil {
		if server != nil {
			server.Close()
		}
		return nil, err
	}
	c := newCommunicator(rank, size, s, net, storeCloser(server))
	c.Connected()
	return c, nil
}

func initFromEnv(s settings) (*communicator, error) {
	ctx, cancel := initContext(s)
	defer cancel()
	net, err := zmq.InitFromEnv(ctx, zmqOptions(0, 0, "", s))
	if err != nil {
		return nil, err
	}
	c := newCommunicator(net.Rank(), net.Size(), s, net, nil)
	c.Connected()
	return c, nil
}

func bind(rank, size int, token string, s settings) (*communicator, error) {
	net, err := zmq.Listen(zmqOptions(rank, size, token, s))
	if err != nil {
		return nil, err
	}
	return newCommunicator(rank, size, s, net, nil), nil
}

// connect is blocking and outside the worker: nothing can be queued before
// it succeeds. oktopk_comm_abort from another thread cancels it.
func (c *communicator) connect(endpoints []string) error {
	if c.isConnected() {
		return invalidUsage("communicator is already connected")
	}
	ctx, cancel := c.CallContext()
	defer cancel()
	if err := c.Net.Connect(ctx, endpoints); err != nil {
		return err
	}
	c.Connected()
	return nil
}

func (c *communicator) isConnected() bool {
	return c.IsConnected()
}

func storeCloser(s *transport.StoreServer) interface{ Close() error } {
	if s == nil {
		return nil
	}
	return s
}

func newToken() string { return transport.NewToken() }
