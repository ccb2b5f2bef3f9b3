package transport

// InProc: ranks of one process connected by memory, a Transport for unit
// tests of the algorithms with the ZeroMQ transport's semantics.

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
	box   *Mailbox
}

// NewInProc returns size connected transports, one per rank, with the
// default diagnostics.
func NewInProc(size int) []Transport { return NewInProcDiagnostics(size, Diagnostics{}) }

// NewInProcDiagnostics is NewInProc with stall diagnostics configured.
func NewInProcDiagnostics(size int, diag Diagnostics) []Transport {
	g := &InProc{}
	ts := make([]Transport, size)
	for r := 0; r < size; r++ {
		ir := &inprocRank{group: g, rank: r, box: NewMailbox(r, size, diag)}
		g.ranks = append(g.ranks, ir)
		ts[r] = ir
	}
	return ts
}

func (t *inprocRank) Rank() int { return t.rank }
func (t *inprocRank) Size() int { return len(t.group.ranks) }

// StartCall tells every rank at once what heartbeats tell them over TCP.
func (t *inprocRank) StartCall(op Op, seq uint64, call CallDesc) {
	t.box.Start(op, seq, call)
	for _, peer := range t.group.ranks {
		if peer != t {
			peer.box.NoteStarted(t.rank, seq)
		}
	}
}

func (t *inprocRank) Send(ctx context.Context, peer int, tag Tag, dtype Dtype, count uint64, payload []byte) error {
	if err := CheckPeer(t, peer); err != nil {
		return err
	}
	if err := t.box.Err(); err != nil {
		return err
	}
	if ctx.Err() != nil {
		return ContextError(ctx, fmt.Sprintf("sending %s to peer %d", tag, peer))
	}
	// Copy: the sender may reuse its buffer once Send returns, as with TCP.
	p := append([]byte(nil), payload...)
	t.group.ranks[peer].box.Deliver(t.rank, Message{Tag: tag, Dtype: dtype, Count: count, Call: t.box.CallOf(tag.Seq), Payload: p})
	return nil
}

func (t *inprocRank) Recv(ctx context.Context, peer int, tag Tag) (Message, error) {
	if err := CheckPeer(t, peer); err != nil {
		return Message{}, err
	}
	return t.box.Receive(ctx, peer, tag)
}

// Abort fails this rank. A mismatch is passed on to the peers, as the abort
// frame does over TCP, so every rank reports it; other failures stay local
// (in-process tests abort every rank themselves).
func (t *inprocRank) Abort(cause error) {
	t.box.Fail(fmt.Errorf("%w: %w", ErrAborted, cause))
	if reason, text := t.box.AbortReason(); reason == AbortMismatch {
		for _, peer := range t.group.ranks {
			if peer != t {
				peer.box.PeerAborted(t.rank, reason, text)
			}
		}
	}
}

func (t *inprocRank) Close() error {
	t.box.Fail(ErrClosed)
	return nil
}
