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
// A chunk longer than densePiece values (1 MiB) travels as several messages
// (dense.go): the words do not change, and no buffer of ZeroMQ's or the
// receiver's is a chunk long.
//
// Cost: 2(P−1)α + 2n(P−1)/P β per rank — optimal bandwidth, latency linear
// in P (Rabenseifner trades the latency down to 2 log P α).

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/transport"
)

// RingAllreduce sums data over every rank of call, in place. data is
// written only after the last message has arrived, so a call that fails
// leaves it as it was: the partial sums live in the received buffers, which
// this rank owns, and each is forwarded from there at the next step. Those
// buffers, n values in all, are the only memory it needs.
func RingAllreduce(ctx context.Context, call *Call, data []float32) error {
	return ringAllreduce(ctx, call, data, nil, data)
}

// ringAllreduce is RingAllreduce of x + r (x alone when r is nil), never
// stored: each chunk's sums are formed as the reduce-scatter adds them (and
// the first chunk sent, a piece at a time, in a buffer of one piece). The
// result goes to out, which may be x, written only once every message has
// arrived. Chunks travel as pieces of at most densePiece values (dense.go),
// each kept as received: the chunk forwarded at the next step, or part of
// the result.
func ringAllreduce(ctx context.Context, call *Call, x, r []float32, out []float32) error {
	p, rank := call.Size(), call.Rank()
	if p == 1 {
		if r != nil {
			sumVec(x, r).copyTo(out)
		} else {
			copy(out, x)
		}
		return nil
	}
	n := len(x)
	index := func(c int) int { return ((c % p) + p) % p }
	span := func(c int) (int, int) { return chunkStart(n, p, c), chunkStart(n, p, c+1) }
	right, left := (rank+1)%p, (rank-1+p)%p
	// final[c] is chunk c's sum, as pieces, once it is known here.
	final := make([][][]float32, p)

	// Step 1: reduce-scatter; afterwards chunk r+1 is complete here. At step
	// i > 0 the chunk sent is the partial sum received at step i−1 plus this
	// rank's own values, kept in the pieces received.
	call.Phase(PhaseReduce)
	lo, hi := span(index(rank))
	var send [][]float32
	if r == nil {
		if err := sendPieces(ctx, call, right, 0, x[lo:hi]); err != nil {
			return fmt.Errorf("oktopk: ring reduce-scatter step 0: %w", err)
		}
	} else {
		// Each piece's sums in one buffer: Send has copied a piece when it
		// returns.
		buf := make([]float32, min(hi-lo, densePiece))
		for j := 0; j < pieceCount(hi-lo); j++ {
			a, b := lo+j*densePiece, min(hi, lo+(j+1)*densePiece)
			sumVec(x[a:b], r[a:b]).copyTo(buf[:b-a])
			if err := call.Send(ctx, right, pieceStep(0, j), transport.DtypeFloat32, uint64(b-a), float32Bytes(buf[:b-a])); err != nil {
				return fmt.Errorf("oktopk: ring reduce-scatter step 0: %w", err)
			}
		}
	}
	for i := 0; i < p-1; i++ {
		if i > 0 {
			if err := sendChunk(ctx, call, right, uint32(i), send); err != nil {
				return fmt.Errorf("oktopk: ring reduce-scatter step %d: %w", i, err)
			}
		}
		c := index(rank - i - 1)
		lo, hi := span(c)
		received := make([][]float32, 0, pieceCount(hi-lo))
		err := recvPieces(ctx, call, left, uint32(i), hi-lo, true, func(at int, partial []float32) {
			// own + received, commutative: the same bits as received + own
			a, b := lo+at, lo+at+len(partial)
			if r != nil {
				addSumInto(partial, x[a:b], r[a:b])
			} else {
				addInto(partial, x[a:b])
			}
			received = append(received, partial)
		})
		if err != nil {
			return fmt.Errorf("oktopk: ring reduce-scatter step %d from rank %d: %w", i, left, err)
		}
		send = received
	}
	final[index(rank+1)] = send

	// Step 2: allgather of the complete chunks, each forwarded as received.
	call.Phase(PhaseAllgather)
	for i := 0; i < p-1; i++ {
		step := uint32(p - 1 + i)
		if err := sendChunk(ctx, call, right, step, send); err != nil {
			return fmt.Errorf("oktopk: ring allgather step %d: %w", i, err)
		}
		c := index(rank - i)
		lo, hi := span(c)
		received := make([][]float32, 0, pieceCount(hi-lo))
		err := recvPieces(ctx, call, left, step, hi-lo, true, func(_ int, vals []float32) { received = append(received, vals) })
		if err != nil {
			return fmt.Errorf("oktopk: ring allgather step %d from rank %d: %w", i, left, err)
		}
		final[c], send = received, received
	}
	call.Phase(PhaseOutput)
	for c, pieces := range final {
		at, _ := span(c)
		for _, piece := range pieces {
			at += copy(out[at:], piece)
		}
	}
	return nil
}

// sendChunk sends a chunk held as the pieces it was received in.
func sendChunk(ctx context.Context, call *Call, peer int, step uint32, pieces [][]float32) error {
	for j, piece := range pieces {
		if err := call.Send(ctx, peer, pieceStep(step, j), transport.DtypeFloat32, uint64(len(piece)), float32Bytes(piece)); err != nil {
			return err
		}
	}
	return nil
}

// ringCost is the ring's cost under Auto's model (auto.go): 2(P−1)
// rounds of n/P values, 2n(P−1)/P words sent.
func ringCost(s callShape, _ Config, _ bool) costTerms {
	return costTerms{rounds: 2 * (s.P - 1), bytes: mul(8*s.N, s.f), passes: denseAutoPasses + 5*s.f}
}
