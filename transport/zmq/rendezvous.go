package zmq

// How a rank joins a job with this transport: the rendezvous flows of
// package transport (a Store, a unique id, a launcher's environment), with
// Listen binding the rank and Connect reaching every other.

import (
	"context"

	"github.com/oktopk/oktopk/transport"
)

// Rendezvous binds this rank, publishes its endpoint in store and connects
// to every rank's.
func Rendezvous(ctx context.Context, store transport.Store, opts Options) (*Transport, error) {
	z, err := Listen(opts)
	if err != nil {
		return nil, err
	}
	endpoints, err := transport.ExchangeEndpoints(ctx, store, opts.Generation, opts.Rank, opts.Size, z.Endpoint())
	if err != nil {
		z.Close()
		return nil, err
	}
	if err := z.Connect(ctx, endpoints); err != nil {
		z.Close()
		return nil, err
	}
	return z, nil
}

// NewUniqueID starts a StoreServer on rank 0's bind host (opts.BindHost or
// opts.Ifname, as Listen resolves them) and returns its id, carrying
// opts.Token or a new token. The caller keeps the server running until
// every rank has connected (the C ABI closes it with the communicator made
// from this id).
func NewUniqueID(opts Options) (transport.UniqueID, *transport.StoreServer, error) {
	host, err := transport.ResolveBindHost(opts.BindHost, opts.Ifname)
	if err != nil {
		return transport.UniqueID{}, nil, err
	}
	return transport.ServeUniqueID(host, opts.Token)
}

// InitFromUniqueID joins the job named by id as rank of size.
func InitFromUniqueID(ctx context.Context, id transport.UniqueID, rank, size int, opts Options) (*Transport, error) {
	return transport.JoinUniqueID(ctx, id, rank, size, opts.route(transport.Getenv), opts.join())
}

// InitFromEnv joins a job started by a launcher: torchrun (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE), Open MPI's or MPICH's mpirun, or Slurm's
// srun (transport.JoinLaunch says how). Rank 0 serves the rendezvous
// store, and its transport's Close stops it.
func InitFromEnv(ctx context.Context, opts Options) (*Transport, error) {
	return initFromLaunch(ctx, opts, transport.Getenv)
}

func initFromLaunch(ctx context.Context, opts Options, getenv func(string) string) (*Transport, error) {
	z, srv, err := transport.JoinLaunch(ctx, getenv, opts.route(getenv), opts.join())
	if err != nil {
		return nil, err
	}
	if srv != nil {
		z.onClose = func() { srv.Close() }
	}
	return z, nil
}

// route has opts bind on the route to the rendezvous host once it is known
// (routeToRendezvous); join then binds with opts as they are by then.
func (opts *Options) route(getenv func(string) string) transport.RouteFunc {
	return func(ctx context.Context, host string, port int) {
		*opts = routeToRendezvous(ctx, *opts, host, port, getenv)
	}
}

// join binds and connects this rank where the rendezvous placed it.
func (opts *Options) join() transport.JoinFunc[*Transport] {
	return func(ctx context.Context, store transport.Store, p transport.Placement) (*Transport, error) {
		o := *opts
		o.Rank, o.Size, o.Token = p.Rank, p.Size, p.Token
		z, err := Rendezvous(ctx, store, o)
		if err == nil {
			z.storeAddr, z.storeToken = p.StoreAddr, p.StoreToken
		}
		return z, err
	}
}

// routeToRendezvous fills opts.BindHost with the address on the route to
// the rendezvous host when the caller configured neither a host nor an
// interface (opts, or OKTOPK_SOCKET_IFNAME read through getenv); otherwise,
// or when there is no such route, opts is unchanged and ResolveBindHost
// decides as before.
func routeToRendezvous(ctx context.Context, opts Options, host string, port int, getenv func(string) string) Options {
	if opts.BindHost != "" || opts.Ifname != "" || getenv("OKTOPK_SOCKET_IFNAME") != "" {
		return opts
	}
	if src := transport.RouteSourceAddress(ctx, host, port); src != "" {
		opts.BindHost = src
	}
	return opts
}
