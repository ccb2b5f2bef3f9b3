package main

// oktopk_comm_shrink: the survivors of a lost rank make a communicator of
// their own, as ULFM's MPI_Comm_shrink does, and go on without it.
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
	prefix := fmt.Sprintf("oktopk/shrink/%d/", round)
	if rank == 0 {
		if err := store.Set(ctx, prefix+"token", []byte(transport.NewToken())); err != nil {
			return nil, err
		}
	}
	token, err := store.Get(ctx, prefix+"token")
	if err != nil {
		return nil, err
	}
	opts := zmqOptions(rank, len(survivors), string(token), c.settings)
	opts.Generation = uint32(round)
	net, err := zmq.Rendezvous(ctx, store, opts)
	if err != nil {
		return nil, err
	}
	states := map[uint64]*core.TensorState{}
	if _, err := c.do(true, func(_ context.Context, cc *core.Communicator) (core.Stats, error) {
		for _, id := range cc.TensorIDs() {
			states[id] = cc.TensorStateOf(id).RegroupedCopy(rank, len(survivors))
		}
		return core.Stats{}, nil
	}); err != nil {
		net.Close()
		return nil, err
	}
	c.Net.HandOver(net) // the rendezvous server this rank serves goes on with the new one
	n := newCommunicator(rank, len(survivors), c.settings, net, c.TakeStore())
	n.members, n.round = survivors, round
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
	var survivors []int
	for _, f := range strings.Split(string(view), ",") {
		r, err := strconv.Atoi(f)
		if err != nil {
			return nil, fmt.Errorf("%w: the survivors' view %q is malformed", transport.ErrRendezvous, view)
		}
		survivors = append(survivors, r)
	}
	sort.Ints(survivors)
	return survivors, nil
}
