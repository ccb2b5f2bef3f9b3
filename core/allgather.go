package core

// Allgathers: every rank contributes one block; every rank ends with all P
// blocks, in rank order. Allgatherv (ring, blocks of any size) is for the
// payload, where bandwidth counts; AllgatherEqual (Bruck, blocks of one
// size, ⌈log₂ P⌉ rounds) is for small control messages, where latency does.
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

// AllgatherSteps is how many step numbers Allgatherv uses.
func AllgatherSteps(p int) uint32 { return uint32(p) }

// AllgatherEqual gathers a block of the same size from every rank by
// Bruck's algorithm, for the small control messages (histograms, region
// boundaries) whose cost is latency, not bandwidth.
//
// Rank r keeps the blocks it has in relative order: slot i holds rank
// (r+i) mod P's block, its own in slot 0. In round j, distance d = 2^j,
// rank r sends its first min(d, P−d) slots to rank r−d and receives as many
// from rank r+d into slots d, d+1, …; after round j it holds min(2d, P)
// slots, so ⌈log₂ P⌉ rounds finish for any P, not only powers of two.
//
// Cost: ⌈log₂ P⌉α + (P−1)mβ for blocks of m words — the ring's bandwidth in
// ⌈log₂ P⌉ rounds instead of P−1.
//
// It returns the blocks in rank order (own block included, not copied). A
// rank whose block has another size makes its receiver fail with
// ErrMismatch. Steps are numbered from firstStep; it uses at most
// AllgatherSteps(P) of them.
func AllgatherEqual(ctx context.Context, call *Call, firstStep uint32, own []byte) ([][]byte, error) {
	p, r := call.Size(), call.Rank()
	m := len(own)
	slots := make([]byte, m, p*m)
	copy(slots, own)
	for round, d := uint32(0), 1; d < p; round, d = round+1, 2*d {
		cnt := min(d, p-d)
		to, from := (r-d+p)%p, (r+d)%p
		msg, err := call.SendRecv(ctx, to, firstStep+round, transport.DtypeBytes, uint64(cnt*m), slots[:cnt*m], from)
		if err != nil {
			return nil, err
		}
		if msg.Count != uint64(cnt*m) || len(msg.Payload) != cnt*m {
			return nil, fmt.Errorf("%w: rank %d sent %d bytes in allgather round %d, where %d blocks of this rank's size make %d: the ranks' blocks differ in size",
				ErrMismatch, from, len(msg.Payload), round, cnt, cnt*m)
		}
		slots = append(slots, msg.Payload...)
	}
	blocks := make([][]byte, p)
	blocks[r] = own
	for i := 1; i < p; i++ {
		blocks[(r+i)%p] = slots[i*m : (i+1)*m : (i+1)*m]
	}
	return blocks, nil
}
