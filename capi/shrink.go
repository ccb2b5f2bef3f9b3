package main

// oktopk_comm_shrink: the survivors of a lost rank make a communicator of
// their own, as ULFM's MPI_Comm_shrink does, and go on without it; and
// oktopk_comm_join and oktopk_comm_admit: a process that comes back as a
// lost rank asks to join, and the members take it in.
//
// The survivors meet again in the store they first met through (rank 0's
// rendezvous server, or the unique id's), which must still be up:
//  1. each adds itself to the round's count and writes its rank in the
//     original communicator;
//  2. it waits until all but one of the communicator's ranks have come (one
//     rank lost: no wait past the slowest survivor) or the timeout passes;
//  3. the first to propose (the store's counter decides) writes the ranks it
//     sees, and that is the new communicator for everyone. A survivor that
//     came after it is left out and told so.
// The new communicator has its own token and generation (frames of the old
// one are refused), the survivors numbered in their old order, and every
// tensor's state regrouped: each rank's residual whole, boundaries and
// thresholds measured afresh (core.TensorState.Regroup).
//
// A join: the process that comes back adds a request to the store (its
// rank in the original communicator) and waits for the answer. The members
// call oktopk_comm_admit at a point of their choosing, all at the same
// one: the first to come (the store's counter again) takes the requests
// not yet handled and writes them down for everyone, so every member admits
// the same ones. The joiners that name a lost rank are answered with their
// place, and every one meets in a communicator of the next generation,
// the members' residuals regrouped, the joiners' empty.

/*
#include "const_types.h"
*/
import "C"

import (
	"context"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// shrinkPoll is how often a survivor looks at the round's count.
const shrinkPoll = 20 * time.Millisecond

//export go_oktopk_comm_shrink
func go_oktopk_comm_shrink(comm C.oktopk_comm_t, newcomm *C.oktopk_comm_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if newcomm == nil {
			return invalidArgument("newcomm is NULL")
		}
		n, err := c.shrink()
		if err != nil {
			return err
		}
		*newcomm = C.oktopk_comm_t(register(n))
		return nil
	})
}

//export go_oktopk_comm_admit
func go_oktopk_comm_admit(comm C.oktopk_comm_t, newcomm *C.oktopk_comm_t) C.oktopk_result_t {
	return callOn(comm, func(c *communicator) error {
		if newcomm == nil {
			return invalidArgument("newcomm is NULL")
		}
		n, err := c.admit()
		if err != nil {
			return err
		}
		*newcomm = 0
		if n != nil {
			*newcomm = C.oktopk_comm_t(register(n))
		}
		return nil
	})
}

//export go_oktopk_comm_join
func go_oktopk_comm_join(comm *C.oktopk_comm_t, config *C.oktopk_const_config) C.oktopk_result_t {
	return call(0, func() error {
		if comm == nil {
			return invalidArgument("comm is NULL")
		}
		s, err := readConfig((*C.oktopk_config_t)(config))
		if err != nil {
			return err
		}
		c, err := join(s)
		if err != nil {
			return err
		}
		*comm = C.oktopk_comm_t(register(c))
		return nil
	})
}

// origins is the original communicator's ranks in this one, ascending.
func (c *communicator) origins() []int {
	if c.members != nil {
		return c.members
	}
	all := make([]int, c.Size)
	for r := range all {
		all[r] = r
	}
	return all
}

func (c *communicator) shrink() (*communicator, error) {
	addr, storeToken, ok := c.Net.MetThrough()
	if !ok {
		return nil, invalidUsage("this communicator was connected through the caller's own rendezvous (oktopk_comm_bind and " +
			"oktopk_comm_connect), so there is no store to meet the survivors in: agree on them through your framework and make a new one")
	}
	if !c.IsConnected() {
		return nil, invalidUsage("communicator is not connected")
	}
	// Nothing more runs on this one: a call still waiting on the lost rank
	// ends now rather than at its timeout.
	c.Abort(fmt.Errorf("%w: the survivors are shrinking it", transport.ErrAborted))
	ctx, cancel := initContext(c.settings)
	defer cancel()
	store, err := transport.DialStore(ctx, addr, storeToken)
	if err != nil {
		return nil, fmt.Errorf("%w; the survivors meet where the ranks first met, and its host (rank 0, or the process that "+
			"made the unique id) is gone or unreachable", err)
	}
	defer store.(interface{ Close() error }).Close()
	before, origin := c.origins(), c.origins()[c.Rank]
	round := c.round + 1
	survivors, err := agreeOnSurvivors(ctx, store, fmt.Sprintf("oktopk/shrink/%d/", round), origin, len(before), c.settings.timeout)
	if err != nil {
		return nil, err
	}
	rank := sort.SearchInts(survivors, origin)
	if rank == len(survivors) || survivors[rank] != origin {
		return nil, fmt.Errorf("%w: this rank (%d of the original %d) reached the survivors' agreement after it closed: they went "+
			"on as ranks %v without it", transport.ErrRemote, origin, len(before), survivors)
	}
	if rank == 0 {
		if err := store.Set(ctx, fmt.Sprintf("oktopk/shrink/%d/token", round), []byte(transport.NewToken())); err != nil {
			return nil, err
		}
	}
	return c.regroupInto(ctx, store, survivors, round)
}

// admit is oktopk_comm_admit: nil when nobody asked to join since the
// last admit.
func (c *communicator) admit() (*communicator, error) {
	addr, storeToken, ok := c.Net.MetThrough()
	if !ok {
		return nil, invalidUsage("this communicator was connected through the caller's own rendezvous: it has no store " +
			"where a rank that comes back could ask to join")
	}
	ctx, cancel := initContext(c.settings)
	defer cancel()
	store, err := transport.DialStore(ctx, addr, storeToken)
	if err != nil {
		return nil, err
	}
	defer store.(interface{ Close() error }).Close()
	prefix := fmt.Sprintf("oktopk/admit/%d/%d/", c.round, c.admits)
	c.admits++
	first, err := store.Add(ctx, prefix+"first", 1)
	if err != nil {
		return nil, err
	}
	if first == 1 {
		asked, err := store.Add(ctx, "oktopk/join/count", 0)
		if err != nil {
			return nil, err
		}
		handled, err := store.Add(ctx, "oktopk/join/handled", 0)
		if err != nil {
			return nil, err
		}
		if _, err := store.Add(ctx, "oktopk/join/handled", asked-handled); err != nil {
			return nil, err
		}
		if err := store.Set(ctx, prefix+"slots", []byte(fmt.Sprintf("%d %d", handled, asked))); err != nil {
			return nil, err
		}
	}
	v, err := store.Get(ctx, prefix+"slots")
	if err != nil {
		return nil, err
	}
	var from, to int64
	if _, err := fmt.Sscanf(string(v), "%d %d", &from, &to); err != nil {
		return nil, fmt.Errorf("%w: the admission's slots %q are malformed", transport.ErrRendezvous, v)
	}
	if from == to {
		return nil, nil
	}
	members := c.origins()
	joining, answers := []int{}, map[int64]string{}
	world := c.world()
	for slot := from; slot < to; slot++ {
		v, err := store.Get(ctx, "oktopk/join/"+strconv.FormatInt(slot, 10))
		if err != nil {
			return nil, err
		}
		origin, err := strconv.Atoi(string(v))
		switch {
		case err != nil || origin < 0 || origin >= world:
			answers[slot] = fmt.Sprintf("refused: rank %q is not a rank of the original %d", v, world)
		case sort.SearchInts(members, origin) < len(members) && members[sort.SearchInts(members, origin)] == origin:
			answers[slot] = fmt.Sprintf("refused: rank %d is not lost: the communicator's ranks now are %v", origin, members)
		case containsInt(joining, origin):
			answers[slot] = fmt.Sprintf("refused: rank %d asked twice", origin)
		default:
			joining = append(joining, origin)
			answers[slot] = ""
		}
	}
	if len(joining) == 0 {
		if c.Rank == 0 {
			for slot, said := range answers {
				if err := store.Set(ctx, "oktopk/join/"+strconv.FormatInt(slot, 10)+"/answer", []byte(said)); err != nil {
					return nil, err
				}
			}
		}
		return nil, nil
	}
	grown := append(append([]int(nil), members...), joining...)
	sort.Ints(grown)
	round := c.round + 1
	rank := sort.SearchInts(grown, members[c.Rank])
	if rank == 0 {
		if err := store.Set(ctx, fmt.Sprintf("oktopk/shrink/%d/token", round), []byte(transport.NewToken())); err != nil {
			return nil, err
		}
		for slot, said := range answers {
			if said == "" {
				said = fmt.Sprintf("round %d members %s world %d", round, joinInts(grown), world)
			}
			if err := store.Set(ctx, "oktopk/join/"+strconv.FormatInt(slot, 10)+"/answer", []byte(said)); err != nil {
				return nil, err
			}
		}
	}
	return c.regroupInto(ctx, store, grown, round)
}

// regroupInto makes this rank's communicator of the original ranks
// members (ascending) at generation round, met through store, with every
// tensor's state regrouped.
func (c *communicator) regroupInto(ctx context.Context, store transport.Store, members []int, round int) (*communicator, error) {
	origin := c.origins()[c.Rank]
	rank := sort.SearchInts(members, origin)
	token, err := store.Get(ctx, fmt.Sprintf("oktopk/shrink/%d/token", round))
	if err != nil {
		return nil, err
	}
	opts := zmqOptions(rank, len(members), string(token), c.settings)
	opts.Generation = uint32(round)
	net, err := zmq.Rendezvous(ctx, store, opts)
	if err != nil {
		return nil, err
	}
	states := map[uint64]*core.TensorState{}
	if _, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
		for _, id := range cc.TensorIDs() {
			states[id] = cc.TensorStateOf(id).RegroupedCopy(rank, len(members))
		}
		return core.Stats{}, nil
	}); err != nil {
		net.Close()
		return nil, err
	}
	c.Net.HandOver(net) // the rendezvous server this rank serves goes on with the new one
	n := newCommunicator(rank, len(members), c.settings, net, c.TakeStore())
	n.members, n.round, n.originalSize = members, round, c.world()
	n.Connected()
	if _, err := n.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
		for id, st := range states {
			cc.SetTensorState(id, st)
		}
		return core.Stats{}, nil
	}); err != nil {
		n.Destroy()
		return nil, err
	}
	return n, nil
}

// join is oktopk_comm_join: a process started as a lost rank of a launched
// job (its launcher's variables, as oktopk_comm_init_env reads them) asks
// to join and waits for the members' admission.
func join(s settings) (*communicator, error) {
	addr, storeToken, origin, err := transport.LaunchStore(transport.Getenv)
	if err != nil {
		return nil, err
	}
	ctx, cancel := initContext(s)
	defer cancel()
	store, err := transport.DialStore(ctx, addr, storeToken)
	if err != nil {
		return nil, fmt.Errorf("%w; rank 0 serves the store a rank that comes back asks in, and never answered", err)
	}
	defer store.(interface{ Close() error }).Close()
	slot, err := store.Add(ctx, "oktopk/join/count", 1)
	if err != nil {
		return nil, err
	}
	key := "oktopk/join/" + strconv.FormatInt(slot-1, 10)
	if err := store.Set(ctx, key, []byte(strconv.Itoa(origin))); err != nil {
		return nil, err
	}
	said, err := store.Get(ctx, key+"/answer")
	if err != nil {
		return nil, fmt.Errorf("%w (no member admitted this rank: they admit at each oktopk_comm_admit)", err)
	}
	var round, world int
	var list string
	if _, err := fmt.Sscanf(string(said), "round %d members %s world %d", &round, &list, &world); err != nil {
		return nil, invalidUsage("join: %s", said)
	}
	members, err := parseInts(list)
	if err != nil {
		return nil, err
	}
	rank := sort.SearchInts(members, origin)
	token, err := store.Get(ctx, fmt.Sprintf("oktopk/shrink/%d/token", round))
	if err != nil {
		return nil, err
	}
	opts := zmqOptions(rank, len(members), string(token), s)
	opts.Generation = uint32(round)
	net, err := zmq.Rendezvous(ctx, store, opts)
	if err != nil {
		return nil, err
	}
	net.MeetThrough(addr, storeToken)
	c := newCommunicator(rank, len(members), s, net, nil)
	c.members, c.round, c.originalSize = members, round, world
	c.Connected()
	return c, nil
}

func containsInt(xs []int, x int) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}

func joinInts(xs []int) string {
	parts := make([]string, len(xs))
	for i, x := range xs {
		parts[i] = strconv.Itoa(x)
	}
	return strings.Join(parts, ",")
}

func parseInts(list string) ([]int, error) {
	var xs []int
	for _, f := range strings.Split(list, ",") {
		x, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("%w: the ranks %q are malformed", transport.ErrRendezvous, list)
		}
		xs = append(xs, x)
	}
	return xs, nil
}

// agreeOnSurvivors runs steps 1 to 3 of the file's comment under prefix:
// the original ranks that go on, ascending.
func agreeOnSurvivors(ctx context.Context, store transport.Store, prefix string, origin, before int, timeout time.Duration) ([]int, error) {
	slot, err := store.Add(ctx, prefix+"count", 1)
	if err != nil {
		return nil, err
	}
	if err := store.Set(ctx, prefix+"m/"+strconv.FormatInt(slot-1, 10), []byte(strconv.Itoa(origin))); err != nil {
		return nil, err
	}
	if timeout <= 0 {
		timeout = defaultSettings().timeout
	}
	deadline := time.Now().Add(timeout)
	seen := slot
	for seen < int64(before-1) && time.Now().Before(deadline) {
		time.Sleep(shrinkPoll)
		if seen, err = store.Add(ctx, prefix+"count", 0); err != nil {
			return nil, err
		}
	}
	ranks := make([]string, 0, seen)
	for i := int64(0); i < seen; i++ {
		v, err := store.Get(ctx, prefix+"m/"+strconv.FormatInt(i, 10))
		if err != nil {
			return nil, err
		}
		ranks = append(ranks, string(v))
	}
	first, err := store.Add(ctx, prefix+"proposer", 1)
	if err != nil {
		return nil, err
	}
	if first == 1 {
		if err := store.Set(ctx, prefix+"view", []byte(strings.Join(ranks, ","))); err != nil {
			return nil, err
		}
	}
	view, err := store.Get(ctx, prefix+"view")
	if err != nil {
		return nil, err
	}
	survivors, err := parseInts(string(view))
	if err != nil {
		return nil, err
	}
	sort.Ints(survivors)
	return survivors, nil
}
