package core

// Allgatherv: every rank contributes one block of any size; every rank ends
// with all P blocks, in rank order.
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
