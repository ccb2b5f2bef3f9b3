package core

// Dense Rabenseifner allreduce (recursive halving, then recursive doubling):
// every rank ends with the element-wise sum of every rank's vector, bitwise
// identical everywhere, for any number of ranks P.
//
// The algorithm works as follows. Let P' be the largest power of two not
// above P and e = P − P' the extra ranks.
//
//  1. Fold (only when P is not a power of two): among the first 2e ranks,
//     each odd rank sends its whole vector to the even rank below it, which
//     adds it in; the odd ranks then sit out and wait. The P' ranks left (the
//     even ones of the first 2e, and every rank from 2e on) take virtual
//     ranks v = 0…P'−1.
//  2. Reduce-scatter by recursive halving: the vector is cut into P' chunks
//     of n/P' or n/P'+1 elements. In round j = 1…log P' each rank pairs with
//     v xor P'/2^j, keeps the half of its current range on its own side
//     (lower half if its bit is 0), sends the other half to the partner and
//     adds the partner's copy of the kept half into its own. The range halves
//     every round; at the end rank v holds the full sum of chunk v, and every
//     element was summed once, by one rank per round.
//  3. Allgather by recursive doubling: the rounds run backwards, distance
//     1, 2, …, P'/2; partners swap their complete ranges and copy, so the
//     complete range doubles every round until it is the whole vector.
//     Copying, never re-adding, is why every rank ends with the same bits.
//  4. Unfold: each even rank of the first 2e sends the result to the odd rank
//     above it.
//
// Ranges longer than densePiece values (1 MiB) travel as several messages
// (dense.go), each added or copied in place as it arrives. In each round of
// steps 2 and 3 a rank sends its first piece, then the rest only once the
// partner's first piece has come: the partner has then received all of its
// previous round. Why: ranks finish a round at different times, and a rank
// still receiving round i from one partner would otherwise have all of
// round i+1 arriving from another on the same link. On links limited to
// 200 Mbit/s (bench/cluster.sh, P = 8, n = 2^22) the allgather took 1,417
// ms so, against 738 ms for the ring's, which only ever receives from one
// neighbour. The wait overlaps the first piece's own transfer, and a range
// of one piece does not wait at all: no latency is added.
//
// Cost: 2 log P' α + 2n(P'−1)/P' β per rank, plus (when P is not a power of
// two) 2α and n β for the fold and the unfold: the latency of a tree with the
// bandwidth of the ring.

import (
	"context"
	"fmt"
	"math/bits"
)

// RabenseifnerAllreduce sums data over every rank of call, in place.
func RabenseifnerAllreduce(ctx context.Context, call *Call, data []float32) error {
	p, r := call.Size(), call.Rank()
	if p == 1 {
		return nil
	}
	n := len(data)
	rounds := bits.Len(uint(p)) - 1
	pow2 := 1 << rounds
	extra := p - pow2
	foldStep, firstHalving, firstDoubling, unfoldStep := uint32(0), uint32(1), uint32(1+rounds), uint32(1+2*rounds)

	// place adds a received piece's values into into, or copies them.
	place := func(into []float32, add bool) func(lo int, vals []float32) {
		return func(lo int, vals []float32) {
			if add {
				addInto(into[lo:lo+len(vals)], vals)
			} else {
				copy(into[lo:], vals)
			}
		}
	}
	// recvInto receives len(into) values from peer (pieces of at most
	// densePiece values, dense.go) and adds them into into, or copies them.
	recvInto := func(peer int, step uint32, into []float32, add bool, what string) error {
		if err := recvPieces(ctx, call, peer, step, len(into), false, place(into, add)); err != nil {
			return fmt.Errorf("oktopk: rabenseifner %s from rank %d: %w", what, peer, err)
		}
		return nil
	}
	// exchange sends send to peer and receives the peer's values for into:
	// the first piece each way, then the rest (see the top).
	exchange := func(peer int, step uint32, send, into []float32, add bool, what string) error {
		var scratch []float32
		err := sendPiecesRange(ctx, call, peer, step, send, 0, 1)
		if err == nil {
			err = recvPiecesRange(ctx, call, peer, step, len(into), 0, 1, false, &scratch, place(into, add))
		}
		if err == nil {
			err = sendPiecesRange(ctx, call, peer, step, send, 1, pieceCount(len(send)))
		}
		if err == nil {
			err = recvPiecesRange(ctx, call, peer, step, len(into), 1, pieceCount(len(into)), false, &scratch, place(into, add))
		}
		if err != nil {
			return fmt.Errorf("oktopk: rabenseifner %s with rank %d: %w", what, peer, err)
		}
		return nil
	}

	// Step 1: fold the extra ranks into their even neighbours.
	call.Phase(PhaseReduce)
	var v int
	switch {
	case r < 2*extra && r%2 == 1:
		if err := sendPieces(ctx, call, r-1, foldStep, data); err != nil {
			return fmt.Errorf("oktopk: rabenseifner fold to rank %d: %w", r-1, err)
		}
		// The unfold's pieces are copied into data as they arrive: the
		// output phase is in the receive.
		call.Phase(PhaseAllgather)
		return recvInto(r-1, unfoldStep, data, false, "unfold")
	case r < 2*extra:
		if err := recvInto(r+1, foldStep, data, true, "fold"); err != nil {
			return err
		}
		v = r / 2
	default:
		v = r - extra
	}
	span := func(lo, hi int) []float32 { return data[chunkStart(n, pow2, lo):chunkStart(n, pow2, hi)] }

	// Step 2: recursive halving; [lo, hi) is the chunk range still being summed here.
	lo, hi := 0, pow2
	for j, d := 0, pow2/2; d >= 1; j, d = j+1, d/2 {
		mid := (lo + hi) / 2
		keep, send := span(lo, mid), span(mid, hi)
		if v&d != 0 {
			keep, send = send, keep
		}
		if err := exchange(foldedRank(v^d, extra), firstHalving+uint32(j), send, keep, true, "reduce-scatter"); err != nil {
			return err
		}
		if v&d != 0 {
			lo = mid
		} else {
			hi = mid
		}
	}

	// Step 3: recursive doubling; [lo, hi) is the chunk range complete here.
	call.Phase(PhaseAllgather)
	for j, d := 0, 1; d < pow2; j, d = j+1, d*2 {
		width := hi - lo
		sibLo, sibHi := hi, hi+width
		if v&d != 0 {
			sibLo, sibHi = lo-width, lo
		}
		into := span(sibLo, sibHi)
		if err := exchange(foldedRank(v^d, extra), firstDoubling+uint32(j), span(lo, hi), into, false, "allgather"); err != nil {
			return err
		}
		lo, hi = min(lo, sibLo), max(hi, sibHi)
	}

	// Step 4: hand the result to the folded-in neighbour.
	if r < 2*extra {
		if err := sendPieces(ctx, call, r+1, unfoldStep, data); err != nil {
			return fmt.Errorf("oktopk: rabenseifner unfold to rank %d: %w", r+1, err)
		}
	}
	return nil
}

// foldedRank is the real rank of virtual rank v after step 1's fold, with
// extra ranks folded in: the even rank 2v of the first 2·extra, then the
// ranks from 2·extra on. SparCML (sparcml.go) and the control sums
// (sumallreduce.go) fold the same way.
func foldedRank(v, extra int) int {
	if v < extra {
		return 2 * v
	}
	return v + extra
}

// rabenseifnerCost is Rabenseifner's cost under Auto's model (auto.go):
// 2 log₂ P′ rounds, the extra ranks folded in and out.
func rabenseifnerCost(s callShape, _ Config, _ bool) costTerms {
	return costTerms{rounds: 2*s.Lp + 2*s.fold, bytes: mul(8*s.N, (s.Pp-1)/s.Pp) + mul(8*s.N, s.fold), passes: denseAutoPasses + 5*s.f}
}
