package transport

// Three ways for P processes to find each other, all ending in Connect with
// the full list of endpoints:
//   - a Store shared by the job (RendezvousZMQ): each rank publishes its
//     endpoint and reads everyone else's;
//   - an NCCL-style unique id (NewUniqueID on rank 0, passed to the other
//     ranks by the caller's own means): it names rank 0's StoreServer and
//     carries the job token;
//   - a launcher's environment (InitFromEnv): torchrun's MASTER_ADDR,
//     MASTER_PORT, RANK, WORLD_SIZE, or mpirun's or srun's variables
//     (launchers.go).
// A caller that did its own rendezvous uses ListenZMQ and Connect directly.

import (
	"context"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// RendezvousZMQ binds this rank, publishes its endpoint in store and
// connects to every rank's.
func RendezvousZMQ(ctx context.Context, store Store, opts ZMQOptions) (*ZMQ, error) {
	z, err := ListenZMQ(opts)
	if err != nil {
		return nil, err
	}
	prefix := fmt.Sprintf("oktopk/g%d/ep/", opts.Generation)
	if err := store.Set(ctx, prefix+strconv.Itoa(opts.Rank), []byte(z.Endpoint())); err != nil {
		z.Close()
		return nil, err
	}
	endpoints := make([]string, opts.Size)
	for r := range endpoints {
		v, err := store.Get(ctx, prefix+strconv.Itoa(r))
		if err != nil {
			z.Close()
			return nil, fmt.Errorf("endpoint of rank %d: %w", r, err)
		}
		endpoints[r] = string(v)
	}
	if err := z.Connect(ctx, endpoints); err != nil {
		z.Close()
		return nil, err
	}
	return z, nil
}

// UniqueID names rank 0's rendezvous server and the job token.
type UniqueID struct {
	Addr  string // host:port of the StoreServer
	Token string
}

const uniqueIDPrefix = "oktopk1:"

// String is the id's text form, at most 255 bytes for an IPv4 or short host.
func (id UniqueID) String() string { return uniqueIDPrefix + id.Token + "@" + id.Addr }

// ParseUniqueID reads the form String writes.
func ParseUniqueID(s string) (UniqueID, error) {
	rest, ok := strings.CutPrefix(s, uniqueIDPrefix)
	token, addr, ok2 := strings.Cut(rest, "@")
	if !ok || !ok2 || token == "" || addr == "" {
		return UniqueID{}, fmt.Errorf("%w: malformed unique id", ErrRendezvous)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return UniqueID{}, fmt.Errorf("%w: unique id address: %w", ErrRendezvous, err)
	}
	return UniqueID{Addr: addr, Token: token}, nil
}

// NewUniqueID starts a StoreServer on rank 0's bind host and returns its id.
// The caller keeps the server running until every rank has connected (the
// C ABI closes it with the communicator made from this id).
func NewUniqueID(opts ZMQOptions) (UniqueID, *StoreServer, error) {
	host, err := ResolveBindHost(opts.BindHost, opts.Ifname)
	if err != nil {
		return UniqueID{}, nil, err
	}
	token := opts.Token
	if token == "" {
		token = NewToken()
	}
	srv, err := ServeStore(host, 0, token)
	if err != nil {
		return UniqueID{}, nil, err
	}
	return UniqueID{Addr: srv.Addr(), Token: token}, srv, nil
}

// InitFromUniqueID joins the job named by id as rank of size.
func InitFromUniqueID(ctx context.Context, id UniqueID, rank, size int, opts ZMQOptions) (*ZMQ, error) {
	store, err := DialStore(ctx, id.Addr, id.Token)
	if err != nil {
		return nil, fmt.Errorf("%w; the process that made the unique ID (usually rank 0) serves it and never answered: it has exited or is unreachable from this host", err)
	}
	defer store.(*tcpStore).Close()
	if host, port, err := net.SplitHostPort(id.Addr); err == nil {
		p, _ := strconv.Atoi(port)
		opts = routeToRendezvous(ctx, opts, host, p, Getenv)
	}
	opts.Rank, opts.Size, opts.Token = rank, size, id.Token
	return RendezvousZMQ(ctx, store, opts)
}

// InitFromEnv joins a job started by a launcher: torchrun (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE), Open MPI's or MPICH's mpirun, or Slurm's
// srun; launchers.go says which variables each sets and how the rendezvous
// address is chosen. Rank 0 serves rendezvous there (by default on
// MASTER_PORT+1, since torchrun's own store holds MASTER_PORT). The job
// token is OKTOPK_JOB_TOKEN when set — then the rendezvous itself is
// authenticated — otherwise rank 0 draws one and publishes it in the store.
// Every error names the launcher and the rendezvous address it used.
func InitFromEnv(ctx context.Context, opts ZMQOptions) (*ZMQ, error) {
	return initFromLaunch(ctx, opts, Getenv)
}

func initFromLaunch(ctx context.Context, opts ZMQOptions, getenv func(string) string) (*ZMQ, error) {
	launch, err := detectLaunch(getenv)
	if err != nil {
		return nil, err
	}
	addr, port, storeToken := launch.host, launch.port, launch.token
	opts = routeToRendezvous(ctx, opts, addr, port, getenv)
	var srv *StoreServer
	if launch.rank == 0 {
		if srv, err = ServeStore(addr, port, storeToken); err != nil {
			return nil, fmt.Errorf("%w (%s)", err, launch)
		}
	}
	z, err := func() (*ZMQ, error) {
		store, err := DialStore(ctx, net.JoinHostPort(addr, strconv.Itoa(port)), storeToken)
		if err != nil {
			// Rank 0 serves the store: a store that never answers means rank 0
			// has not started, has exited, or cannot be reached from here.
			return nil, fmt.Errorf("%w; rank 0 serves it and never answered: it has not started, has exited, or is unreachable from this host", err)
		}
		defer store.(*tcpStore).Close()
		token := storeToken
		if token == "" {
			if launch.rank == 0 {
				if err := store.Set(ctx, "oktopk/token", []byte(NewToken())); err != nil {
					return nil, err
				}
			}
			v, err := store.Get(ctx, "oktopk/token")
			if err != nil {
				return nil, err
			}
			token = string(v)
		}
		opts.Rank, opts.Size, opts.Token = launch.rank, launch.size, token
		return RendezvousZMQ(ctx, store, opts)
	}()
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return nil, fmt.Errorf("%w (%s)", err, launch)
	}
	if srv != nil {
		z.onClose = func() { srv.Close() }
	}
	return z, nil
}
