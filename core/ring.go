package core

// Dense ring allreduce: every rank ends with the element-wise sum of every
// rank's vector, bitwise identical everywhere.
//
// The ring algorithm works as follows. The vector of n elements is cut into
// P chunks of n/P or n/P+1 elements (n need not divide by P). Rank r sends
// only to its right neighbour r+1 and receives only from its left neighbour
// r−1 (mod P).
//
//  1. Reduce-scatter, steps i = 0…P−2: rank r sends chunk (r−i) mod P to the
//     right and receives chunk (r−i−1) mod P from the left, adding it into
//     its own copy of that chunk. The partial sum of a chunk travels once
//     around the ring, one more rank's values added at each hop, so after
//     P−1 steps rank r holds the full sum of chunk (r+1) mod P. Every element
//     is summed exactly once, by one chain of ranks.
//  2. Allgather, steps i = 0…P−2: rank r sends chunk (r+1−i) mod P to the
//     right and receives chunk (r−i) mod P from the left, overwriting its
//     copy. The finished chunks are copied, never re-added, which is why
//     every rank ends with the same bits.
//
// Cost: 2(P−1)α + 2n(P−1)/P β per rank — optimal bandwidth, latency linear
// in P (Rabenseifner trades the latency down to 2 log P α).

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/transport"
)

func init() { registerDense(DenseRing, RingAllreduce) }

// RingAllreduce sums data over every rank of call, in place. data is
// written only after the last message has arrived, so a call that fails
// leaves it as it was: the partial sums live in the received buffers, which
// this rank owns, and each is forwarded from there at the next step.
func RingAllreduce(ctx context.Context, call *Call, data []float32) error {
	p, r := call.Size(), call.Rank()
	if p == 1 {
		return nil
	}
	n := len(data)
	index := func(c int) int { return ((c % p) + p) % p }
	chunk := func(c int) []float32 { return data[chunkStart(n, p, c):chunkStart(n, p, c+1)] }
	right, left := (r+1)%p, (r-1+p)%p
	// final[c] is chunk c's sum once it is known here.
	final := make([][]float32, p)

	// Step 1: reduce-scatter; afterwards chunk r+1 is complete here. At step
	// i > 0 the chunk sent is the partial sum received at step i−1 plus this
	// rank's own values, kept in that received buffer.
	call.Phase(PhaseReduce)
	send := chunk(index(r))
	for i := 0; i < p-1; i++ {
		c := index(r - i - 1)
		m, err := call.SendRecv(ctx, right, uint32(i), transport.DtypeFloat32, uint64(len(send)), float32Bytes(send), left)
		if err != nil {
			return fmt.Errorf("oktopk: ring reduce-scatter step %d: %w", i, err)
		}
		partial, err := receivedFloatsOwned(m, len(chunk(c)))
		if err != nil {
			return fmt.Errorf("oktopk: ring reduce-scatter step %d from rank %d: %w", i, left, err)
		}
		addInto(partial, chunk(c)) // own + received, commutative: the same bits as received + own
		send = partial
	}
	final[index(r+1)] = send

	// Step 2: allgather of the complete chunks, each forwarded as received.
	call.Phase(PhaseAllgather)
	for i := 0; i < p-1; i++ {
		c := index(r - i)
		step := uint32(p - 1 + i)
		m, err := call.SendRecv(ctx, right, step, transport.DtypeFloat32, uint64(len(send)), float32Bytes(send), left)
		if err != nil {
			return fmt.Errorf("oktopk: ring allgather step %d: %w", i, err)
		}
		if send, err = receivedFloatsOwned(m, len(chunk(c))); err != nil {
			return fmt.Errorf("oktopk: ring allgather step %d from rank %d: %w", i, left, err)
		}
		final[c] = send
	}
	call.Phase(PhaseOutput)
	for c, sum := range final {
		copy(chunk(c), sum)
	}
	return nil
}
