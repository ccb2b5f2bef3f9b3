package transport

// Three ways for P processes to find each other, all ending in a
// transport's Connect with the full list of endpoints (package zmq's
// Rendezvous, InitFromUniqueID and InitFromEnv are built on them):
//   - a Store shared by the job (ExchangeEndpoints): each rank publishes its
//     endpoint and reads everyone else's;
//   - an NCCL-style unique id (a UniqueID made on rank 0, passed to the other
//     ranks by the caller's own means): it names rank 0's StoreServer and
//     carries the job token (JoinUniqueID);
//   - a launcher's environment (JoinLaunch): torchrun's MASTER_ADDR,
//     MASTER_PORT, RANK, WORLD_SIZE, or mpirun's or srun's variables
//     (launchers.go).
// A caller that did its own rendezvous binds and connects a transport
// directly (zmq.Listen, then Connect).

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"net"
	"strconv"
	"strings"
)

// NewToken returns a random job token (32 bytes of entropy, hex).
func NewToken() string {
	b := make([]byte, 32)
	if _, err := rand.Read(b); err != nil {
		panic("oktopk: no randomness: " + err.Error())
	}
	return hex.EncodeToString(b)
}

// ExchangeEndpoints publishes endpoint in store as rank's, under the
// communicator generation, and returns the endpoints of all size ranks in
// rank order, waiting (as store.Get does) until every rank has published.
//
// It also refuses, at once and saying which, the two mistakes that would
// otherwise wait for a peer that never comes and time out naming only an
// unreached address: a second process claiming a rank already taken, and
// a rank started with another rank count than rank 0 (every rank compares
// its own with each rank's, rank 0's first).
func ExchangeEndpoints(ctx context.Context, store Store, generation uint32, rank, size int, endpoint string) ([]string, error) {
	prefix := fmt.Sprintf("oktopk/g%d/", generation)
	claims, err := store.Add(ctx, prefix+"claim/"+strconv.Itoa(rank), 1)
	if err != nil {
		return nil, err
	}
	if claims > 1 {
		return nil, fmt.Errorf("%w: rank %d of %d is already taken by another process of this job: two processes were started "+
			"with the same rank (check the launcher's rank variables)", ErrRendezvous, rank, size)
	}
	mine := strconv.Itoa(size)
	if err := store.Set(ctx, prefix+"size/"+strconv.Itoa(rank), []byte(mine)); err != nil {
		return nil, err
	}
	if err := store.Set(ctx, prefix+"ep/"+strconv.Itoa(rank), []byte(endpoint)); err != nil {
		return nil, err
	}
	endpoints := make([]string, size)
	for r := range endpoints {
		theirs, err := store.Get(ctx, prefix+"size/"+strconv.Itoa(r))
		if err != nil {
			return nil, fmt.Errorf("endpoint of rank %d: %w", r, err)
		}
		if string(theirs) != mine {
			return nil, fmt.Errorf("%w: rank %d joined a job of %s ranks, this rank (%d) was started with %d: every rank must be "+
				"started with the same rank count", ErrMismatch, r, theirs, rank, size)
		}
		v, err := store.Get(ctx, prefix+"ep/"+strconv.Itoa(r))
		if err != nil {
			return nil, fmt.Errorf("endpoint of rank %d: %w", r, err)
		}
		endpoints[r] = string(v)
	}
	return endpoints, nil
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

// ServeUniqueID starts a StoreServer on host (rank 0's bind host) and returns
// its id, with token as the job token (a new one when ""). The caller keeps
// the server running until every rank has connected (the C ABI closes it
// with the communicator made from this id).
func ServeUniqueID(host, token string) (UniqueID, *StoreServer, error) {
	if token == "" {
		token = NewToken()
	}
	srv, err := ServeStore(host, 0, token)
	if err != nil {
		return UniqueID{}, nil, err
	}
	return UniqueID{Addr: srv.Addr(), Token: token}, srv, nil
}

// Placement is what a rendezvous has settled about a rank when it hands
// over to the transport: its rank, the job's size and the job token.
type Placement struct {
	Rank, Size int
	Token      string
	// Where the ranks met: the store's address and its own token (empty
	// when the store is unauthenticated). A shrink meets the survivors
	// there again.
	StoreAddr, StoreToken string
}

// RouteFunc is told the rendezvous host's address as soon as it is known,
// before the rank binds, so that a rank with no configured address can
// bind the one on the route to it (RouteSourceAddress).
type RouteFunc func(ctx context.Context, host string, port int)

// JoinFunc binds this rank's transport as p says and connects it to the
// job's other ranks through store (package zmq's Rendezvous does both).
type JoinFunc[T any] func(ctx context.Context, store Store, p Placement) (T, error)

// JoinUniqueID joins the job named by id as rank of size: it dials the
// StoreServer that id names, tells route its address, and has join bind
// and connect through it.
func JoinUniqueID[T any](ctx context.Context, id UniqueID, rank, size int, route RouteFunc, join JoinFunc[T]) (T, error) {
	var none T
	store, err := DialStore(ctx, id.Addr, id.Token)
	if err != nil {
		return none, fmt.Errorf("%w; the process that made the unique ID (usually rank 0) serves it and never answered: it has exited or is unreachable from this host", err)
	}
	defer store.(*tcpStore).Close()
	if host, port, err := net.SplitHostPort(id.Addr); err == nil {
		p, _ := strconv.Atoi(port)
		route(ctx, host, p)
	}
	return join(ctx, store, Placement{Rank: rank, Size: size, Token: id.Token, StoreAddr: id.Addr, StoreToken: id.Token})
}

// LaunchStore returns the store a launched job's ranks meet through (its
// address and token, as JoinLaunch finds them) and this process's rank in
// the launch: what a process that comes back to a running job as that rank
// needs to ask to join it.
func LaunchStore(getenv func(string) string) (addr, token string, rank int, err error) {
	launch, err := detectLaunch(getenv)
	if err != nil {
		return "", "", 0, err
	}
	return net.JoinHostPort(launch.host, strconv.Itoa(launch.port)), launch.token, launch.rank, nil
}

// JoinLaunch joins a job started by a launcher: torchrun (MASTER_ADDR,
// MASTER_PORT, RANK, WORLD_SIZE), Open MPI's or MPICH's mpirun, or Slurm's
// srun, whose variables it reads through getenv; launchers.go says which
// variables each sets and how the rendezvous address is chosen. It tells
// route that address; rank 0 serves rendezvous there (by default on
// MASTER_PORT+1, since torchrun's own store holds MASTER_PORT). The job
// token is OKTOPK_JOB_TOKEN when set — then the rendezvous itself is
// authenticated — otherwise rank 0 draws one and publishes it in the store.
// Then join binds and connects through the store. Every error names the
// launcher and the rendezvous address it used.
//
// On rank 0 it also returns the StoreServer, which must outlive the
// transport join made (peers may still be reading the store): the caller
// closes it with the transport. Other ranks get nil.
func JoinLaunch[T any](ctx context.Context, getenv func(string) string, route RouteFunc, join JoinFunc[T]) (T, *StoreServer, error) {
	var none T
	launch, err := detectLaunch(getenv)
	if err != nil {
		return none, nil, err
	}
	addr, port, storeToken := launch.host, launch.port, launch.token
	route(ctx, addr, port)
	var srv *StoreServer
	if launch.rank == 0 {
		if srv, err = ServeStore(addr, port, storeToken); err != nil {
			return none, nil, fmt.Errorf("%w (%s)", err, launch)
		}
	}
	t, err := func() (T, error) {
		store, err := DialStore(ctx, net.JoinHostPort(addr, strconv.Itoa(port)), storeToken)
		if err != nil {
			// Rank 0 serves the store: a store that never answers means rank 0
			// has not started, has exited, or cannot be reached from here.
			return none, fmt.Errorf("%w; rank 0 serves it and never answered: it has not started, has exited, or is unreachable from this host", err)
		}
		defer store.(*tcpStore).Close()
		token := storeToken
		if token == "" {
			if launch.rank == 0 {
				if err := store.Set(ctx, "oktopk/token", []byte(NewToken())); err != nil {
					return none, err
				}
			}
			v, err := store.Get(ctx, "oktopk/token")
			if err != nil {
				return none, err
			}
			token = string(v)
		}
		return join(ctx, store, Placement{Rank: launch.rank, Size: launch.size, Token: token,
			StoreAddr: net.JoinHostPort(addr, strconv.Itoa(port)), StoreToken: storeToken})
	}()
	if err != nil {
		if srv != nil {
			srv.Close()
		}
		return none, nil, fmt.Errorf("%w (%s)", err, launch)
	}
	return t, srv, nil
}
