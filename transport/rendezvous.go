package transport

// Three ways for P processes to find each other, all ending in Connect with
// the full list of endpoints:
//   - a Store shared by the job (RendezvousZMQ): each rank publishes its
//     endpoint and reads everyone else's;
//   - an NCCL-style unique id (NewUniqueID on rank 0, passed to the other
//     ranks by the caller's own means): it names rank 0's StoreServer and
//     carries the job token;
//   - the torchrun-style environment (InitFromEnv): MASTER_ADDR, MASTER_PORT,
//     RANK, WORLD_SIZE.
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
		return nil, err
	}
	defer store.(*tcpStore).Close()
	opts.Rank, opts.Size, opts.Token = rank, size, id.Token
	return RendezvousZMQ(ctx, store, opts)
}

// InitFromEnv joins a job launched torchrun-style: MASTER_ADDR, MASTER_PORT,
// RANK and WORLD_SIZE. Rank 0 serves rendezvous on MASTER_PORT+1, or on
// OKTOPK_RENDEZVOUS_PORT when set (torchrun's own store holds MASTER_PORT).
// The job token is OKTOPK_JOB_TOKEN when set — then the rendezvous itself is
// authenticated — otherwise rank 0 draws one and publishes it in the store.
func InitFromEnv(ctx context.Context, opts ZMQOptions) (*ZMQ, error) {
	env := func(k string) (int, error) {
		v, err := strconv.Atoi(Getenv(k))
		if err != nil {
			return 0, fmt.Errorf("%w: environment %s=%q is not an integer", ErrRendezvous, k, Getenv(k))
		}
		return v, nil
	}
	addr := Getenv("MASTER_ADDR")
	if addr == "" {
		return nil, fmt.Errorf("%w: MASTER_ADDR is not set", ErrRendezvous)
	}
	rank, err := env("RANK")
	if err != nil {
		return nil, err
	}
	size, err := env("WORLD_SIZE")
	if err != nil {
		return nil, err
	}
	port, err := env("MASTER_PORT")
	if err != nil {
		return nil, err
	}
	port++
	if Getenv("OKTOPK_RENDEZVOUS_PORT") != "" {
		if port, err = env("OKTOPK_RENDEZVOUS_PORT"); err != nil {
			return nil, err
		}
	}
	storeToken := Getenv("OKTOPK_JOB_TOKEN")
	var srv *StoreServer
	if rank == 0 {
		if srv, err = ServeStore(addr, port, storeToken); err != nil {
			return nil, err
		}
	}
	z, err := func() (*ZMQ, error) {
		store, err := DialStore(ctx, net.JoinHostPort(addr, strconv.Itoa(port)), storeToken)
		if err != nil {
			return nil, err
		}
		defer store.(*tcpStore).Close()
		token := storeToken
		if token == "" {
			if rank == 0 {
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
		opts.Rank, opts.Size, opts.Token = rank, size, token
		return RendezvousZMQ(ctx, store, opts)
	}()
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return nil, err
	}
	if srv != nil {
		z.onClose = func() { srv.Close() }
	}
	return z, nil
}
