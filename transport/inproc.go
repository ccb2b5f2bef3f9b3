package transport

import (
	"context"
	"fmt"
)

// InProc is a group of ranks in one process connected by memory. It exists
// for unit tests of the algorithms: same matching and failure semantics as
// the ZeroMQ transport, no sockets.
type InProc struct {
	ranks []*inprocRank
}

type inprocRank struct {
	group *InProc
	rank  int
	box   *mailbox
}

// NewInProc returns size connected transports, one per rank.
func NewInProc(size int) []Transport {
	g := &InProc{}
	ts := make([]Transport, size)
	for r := 0; r < size; r++ {
		ir := &inprocRank{group: g, rank: r, box: newMailbox()}
		g.ranks = append(g.ranks, ir)
		ts[r] = ir
	}
	return ts
}

func (t *inprocRank) Rank() int { return t.rank }
func (t *inprocRank) Size() int { return len(t.group.ranks) }

func (t *inprocRank) Send(ctx context.Context, peer int, tag Tag, dtype Dtype, count uint64, payload []byte) error {
	if err := checkPeer(t, peer); err != nil {
		return err
	}
	if err := t.box.err(); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ContextError(ctx, fmt.Sprintf("sending %s to peer %d", tag, peer))
	}
	// Copy: the sender may reuse its buffer once Send returns, as with TCP.
	p := append([]byte(nil), payload...)
	t.group.ranks[peer].box.deliver(t.rank, Message{Tag: tag, Dtype: dtype, Count: count, Payload: p})
	return nil
}

func (t *inprocRank) Recv(ctx context.Context, peer int, tag Tag) (Message, error) {
	if err := checkPeer(t, peer); err != nil {
		return Message{}, err
	}
	return t.box.receive(ctx, peer, tag)
}

func (t *inprocRank) Abort(cause error) {
	t.box.fail(fmt.Errorf("%w: %w", ErrAborted, cause))
}

func (t *inprocRank) Close() error {
	t.box.fail(ErrClosed)
	return nil
}
