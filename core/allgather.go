package core

// Allgathers: every rank contributes one block; every rank ends with all P
// blocks, in rank order. Allgatherv (ring, blocks of any size) suits large
// blocks of different sizes, where bandwidth counts; AllgathervBruck
// (⌈log₂ P⌉ rounds) blocks of about one size; AllgatherEqual (Bruck, blocks
// of one size, one message per round) small control messages, where latency
// counts. AllgatherDirect (and AllgatherEqualDirect, blocks of one size)
// sends every block straight to every rank: one round, P−1 messages per
// rank.
//
// The ring algorithm works as follows. Rank r sends to r+1 and receives from
// r−1 (mod P). In step i = 0…P−2 rank r forwards block (r−i) mod P — its own
// in step 0, afterwards the one it received in the step before — and
// receives block (r−i−1) mod P. After P−1 steps every block has visited every
// rank once.
//
// Cost: (P−1)α + β·(Σ block sizes − own block) words per rank; with equal
// blocks of m words that is (P−1)α + (P−1)mβ, which no allgather can beat in
// bandwidth.

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/transport"
)

// Block is one rank's contribution to Allgatherv.
type Block struct {
	Dtype   transport.Dtype
	Count   uint64
	Payload []byte
}

// Allgatherv gathers every rank's block; steps are numbered from firstStep
// so that one call can run several collectives without crossing messages.
// It returns the blocks in rank order (own block included, not copied).
func Allgatherv(ctx context.Context, call *Call, firstStep uint32, own Block) ([]Block, error) {
	p, r := call.Size(), call.Rank()
	blocks := make([]Block, p)
	blocks[r] = own
	right, left := (r+1)%p, (r-1+p)%p
	for i := 0; i < p-1; i++ {
		send := blocks[(r-i+p)%p]
		m, err := call.SendRecv(ctx, right, firstStep+uint32(i), send.Dtype, send.Count, send.Payload, left)
		if err != nil {
			return nil, err
		}
		blocks[(r-i-1+p)%p] = Block{Dtype: m.Dtype, Count: m.Count, Payload: m.Payload}
	}
	return blocks, nil
}

// AllgatherSteps is how many step numbers any of the allgathers uses.
func AllgatherSteps(p int) uint32 { return uint32(p) }

// Bruck's algorithm, for any P: rank r keeps the blocks it has in relative
// order, slot i holding rank (r+i) mod P's block (its own in slot 0). In
// round j, distance d = 2^j, it sends its first min(d, P−d) slots to rank
// r−d and receives as many from rank r+d into slots d, d+1, …; after round j
// it holds min(2d, P) slots, so ⌈log₂ P⌉ rounds finish.
//
// Cost: ⌈log₂ P⌉α + (P−1)mβ for blocks of m words — the ring's bandwidth in
// ⌈log₂ P⌉ rounds instead of P−1. With blocks of different sizes a rank
// sends its own block in every round, so the words per rank vary more than
// the ring's; the average over the ranks is the same.
func bruckRounds(p, r int, round func(j uint32, d, cnt, to, from int) error) error {
	for j, d := uint32(0), 1; d < p; j, d = j+1, 2*d {
		if err := round(j, d, min(d, p-d), (r-d+p)%p, (r+d)%p); err != nil {
			return err
		}
	}
	return nil
}

// AllgatherEqual gathers a block of the same size from every rank by
// Bruck's algorithm (bruckRounds), each round's blocks in one message: for
// the small control messages (Ok-Topk's histograms and region boundaries,
// or beyond okTopkGatheredControlMaxP ranks, where those are summed by
// SumAllreduce, its owners' counts) whose cost is latency, not bandwidth.
//
// It returns the blocks in rank order (own block included, not copied). A
// rank whose block has another size makes the call fail with ErrMismatch.
// Steps are numbered from firstStep; it uses at most AllgatherSteps(P) of
// them.
func AllgatherEqual(ctx context.Context, call *Call, firstStep uint32, own []byte) ([][]byte, error) {
	p, r := call.Size(), call.Rank()
	m := len(own)
	slots := make([]byte, m, p*m)
	copy(slots, own)
	err := bruckRounds(p, r, func(j uint32, d, cnt, to, from int) error {
		msg, err := call.SendRecv(ctx, to, firstStep+j, transport.DtypeBytes, uint64(cnt*m), slots[:cnt*m], from)
		if err != nil {
			return err
		}
		if msg.Count != uint64(cnt*m) || len(msg.Payload) != cnt*m {
			return fmt.Errorf("%w: rank %d sent %d bytes in allgather round %d, where rank %d (this rank) expects %d, %d blocks of its size: the ranks' blocks differ in size",
				ErrMismatch, from, len(msg.Payload), j, r, cnt*m, cnt)
		}
		slots = append(slots, msg.Payload...)
		return nil
	})
	if err != nil {
		return nil, err
	}
	blocks := make([][]byte, p)
	blocks[r] = own
	for i := 1; i < p; i++ {
		blocks[(r+i)%p] = slots[i*m : (i+1)*m : (i+1)*m]
	}
	return blocks, nil
}

// AllgathervBruck is Allgatherv by Bruck's algorithm (bruckRounds): blocks
// of any size, each its own message (so its dtype and count travel in the
// frame header, as in the ring), a round's messages sent back to back. For
// blocks of about equal size, as Ok-Topk's balanced shares, it moves the
// ring's words in ⌈log₂ P⌉ rounds instead of P−1. Steps are numbered from
// firstStep (the receiver's slot number is the step); it uses at most
// AllgatherSteps(P) of them.
func AllgathervBruck(ctx context.Context, call *Call, firstStep uint32, own Block) ([]Block, error) {
	p, r := call.Size(), call.Rank()
	slots := make([]Block, 1, p)
	slots[0] = own
	err := bruckRounds(p, r, func(_ uint32, d, cnt, to, from int) error {
		for i, b := range slots[:cnt] {
			if err := call.Send(ctx, to, firstStep+uint32(d+i), b.Dtype, b.Count, b.Payload); err != nil {
				return err
			}
		}
		for i := range cnt {
			m, err := call.Recv(ctx, from, firstStep+uint32(d+i))
			if err != nil {
				return err
			}
			slots = append(slots, Block{Dtype: m.Dtype, Count: m.Count, Payload: m.Payload})
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	blocks := make([]Block, p)
	for i, b := range slots {
		blocks[(r+i)%p] = b
	}
	return blocks, nil
}

// AllgatherDirect gathers every rank's block in one round: each rank sends
// its block to every other rank at once — to r+1, r+2, … (mod P), so that
// no rank is every sender's first target — and then receives theirs. Each
// block is its own message (its dtype and count travel in the frame
// header). Words per rank are the ring's and Bruck's, (P−1)m for blocks of
// m words; the latency is one message's instead of ⌈log₂ P⌉ rounds in a row,
// for P−1 messages per rank instead of ⌈log₂ P⌉ (Bruck) — the better trade
// for the few dozen ranks of a data-parallel job, where a round costs a
// network latency and scheduling delays on both ends, and a message little
// more than its bytes. The blocks come back in rank order (own block
// included, not copied). It uses the one step number step.
func AllgatherDirect(ctx context.Context, call *Call, step uint32, own Block) ([]Block, error) {
	p, r := call.Size(), call.Rank()
	for i := 1; i < p; i++ {
		if err := call.Send(ctx, (r+i)%p, step, own.Dtype, own.Count, own.Payload); err != nil {
			return nil, err
		}
	}
	blocks := make([]Block, p)
	blocks[r] = own
	for i := 1; i < p; i++ {
		from := (r - i + p) % p
		m, err := call.Recv(ctx, from, step)
		if err != nil {
			return nil, err
		}
		blocks[from] = Block{Dtype: m.Dtype, Count: m.Count, Payload: m.Payload}
	}
	return blocks, nil
}

// AllgatherEqualDirect is AllgatherDirect for blocks of one size (the small
// control messages: histograms, region boundaries), as AllgatherEqual is
// for Bruck's algorithm: a rank whose block has another size makes the
// call fail with ErrMismatch.
func AllgatherEqualDirect(ctx context.Context, call *Call, step uint32, own []byte) ([][]byte, error) {
	blocks, err := AllgatherDirect(ctx, call, step, Block{Dtype: transport.DtypeBytes, Count: uint64(len(own)), Payload: own})
	if err != nil {
		return nil, err
	}
	out := make([][]byte, len(blocks))
	for r, b := range blocks {
		if b.Count != uint64(len(own)) || len(b.Payload) != len(own) || b.Dtype != transport.DtypeBytes {
			return nil, fmt.Errorf("%w: rank %d sent %d bytes (%s) in the allgather, where rank %d (this rank) expects %d, its block's size: the ranks' blocks differ in size",
				ErrMismatch, r, len(b.Payload), b.Dtype, call.Rank(), len(own))
		}
		out[r] = b.Payload
	}
	return out, nil
}
