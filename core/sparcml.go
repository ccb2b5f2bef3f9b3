package core

// SparCML (Renggli et al., SC'19): sparse allreduce on sparse streams —
// (index, value) pairs that are summed where indices meet. Three variants:
//
// SSAR_Recursive_double (small data) works as follows.
//
//  1. Fold (only when P is not a power of two, as in Rabenseifner): with
//     P' = 2^⌊log P⌋ and e = P − P', each odd rank among the first 2e sends
//     its stream to the even rank below it, which adds it in, and waits for
//     the result; the P' ranks left take virtual ranks v = 0…P'−1.
//  2. Recursive doubling, rounds i = 0…log P'−1: rank v swaps its partial
//     sum with v xor 2^i and merges; both partners add lower virtual rank
//     first, so both get the same bits. After round i a partial sum covers
//     2^(i+1) ranks.
//  3. Unfold: each even rank of the first 2e sends the result up.
//
// Cost: log P' α (+2α to fold); round i sends at most 2^i·k pairs, so at
// most 2k(P'−1) words per rank (+2k and the result's size to fold).
//
// SSAR_Split_allgather (large data) works as follows.
//
//  1. Split: the index space is cut into P equal regions; rank j owns region
//     j. In step i = 1…P−1 rank r sends its entries of region (r+i) mod P to
//     that rank and receives region r's entries of rank (r−i) mod P.
//  2. Reduce: the owner sums the P parts of its region in rank order.
//  3. Allgather: the reduced regions are gathered on every rank by Bruck's
//     algorithm (AllgathervBruck, ⌈log₂ P⌉ rounds), indices region-relative,
//     always as pairs.
//
// Cost: (P−1+⌈log P⌉)α; 2k(P−1)/P words to split (for evenly spread
// entries) and 2K(P−1)/P to gather, where K, between k and kP, is the size
// of the sum (Bruck's words per rank vary with the regions' sizes; their
// mean is the ring's).
//
// DSAR_Split_allgather is SSAR_Split_allgather with SparCML's dense switch
// on every stream: a region whose values would be no larger than its pairs
// travels dense (nnz ≥ length/2 for 32-bit indices and values; with coded
// indices, nnz·(4 + an index's bytes) ≥ 4·length, about 97% of the region
// set: denseIsNoLarger), so the gather costs at most min(2K, n)(P−1)/P
// words and a dense stream stands for every index of its region.
//
// As a reduction of dense gradients: exact local top-k first, then one of the
// three; there is no global re-selection, so the result is the exact sum of
// the selections, every locally selected entry is in it, and the residual is
// acc with the local selection zeroed. The sparse-input forms return the
// exact sum of the inputs as given.

import (
	"context"
	"fmt"
	"math/bits"

	"github.com/oktopk/oktopk/transport"
)

// ssarRecursiveDouble sums the ranks' sparse inputs by recursive doubling.
func ssarRecursiveDouble(ctx context.Context, call *Call, n int, in Sparse, _ int) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	call.Phase(PhaseReduce) // recursive doubling reduces and gathers at once
	if p == 1 {
		return sparseSumInRankOrder([]Sparse{in}), nil // a copy: never hand back the caller's storage
	}
	rounds := bits.Len(uint(p)) - 1
	pow2 := 1 << rounds
	extra := p - pow2
	foldStep, firstRound, unfoldStep := uint32(0), uint32(1), uint32(1+rounds)

	send := func(peer int, step uint32, s Sparse, what string) error {
		b := regionBlock(s, 0, uint32(n), false)
		if err := call.Send(ctx, peer, step, b.Dtype, b.Count, b.Payload); err != nil {
			return fmt.Errorf("oktopk: ssar_recursive_double %s to rank %d: %w", what, peer, err)
		}
		return nil
	}
	decode := func(m transport.Message, peer int, what string) (Sparse, error) {
		s, err := decodeRegionBlock(m.Dtype, m.Count, m.Payload, 0, uint32(n))
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: ssar_recursive_double %s from rank %d: %w", what, peer, err)
		}
		return s, nil
	}
	recv := func(peer int, step uint32, what string) (Sparse, error) {
		m, err := call.Recv(ctx, peer, step)
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: ssar_recursive_double %s from rank %d: %w", what, peer, err)
		}
		return decode(m, peer, what)
	}

	// Step 1: fold the extra ranks into their even neighbours.
	partial := in
	var v int
	switch {
	case r < 2*extra && r%2 == 1:
		if err := send(r-1, foldStep, in, "fold"); err != nil {
			return Sparse{}, err
		}
		call.Phase(PhaseAllgather)
		return recv(r-1, unfoldStep, "unfold")
	case r < 2*extra:
		odd, err := recv(r+1, foldStep, "fold")
		if err != nil {
			return Sparse{}, err
		}
		partial = sparseAdd(in, odd)
		v = r / 2
	default:
		v = r - extra
	}

	// Step 2: recursive doubling of the partial sums.
	for i, d := 0, 1; d < pow2; i, d = i+1, 2*d {
		peer := foldedRank(v^d, extra)
		b := regionBlock(partial, 0, uint32(n), false)
		m, err := call.SendRecv(ctx, peer, firstRound+uint32(i), b.Dtype, b.Count, b.Payload, peer)
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: ssar_recursive_double round %d with rank %d: %w", i, peer, err)
		}
		other, err := decode(m, peer, fmt.Sprintf("round %d", i))
		if err != nil {
			return Sparse{}, err
		}
		if v&d == 0 {
			partial = sparseAdd(partial, other)
		} else {
			partial = sparseAdd(other, partial)
		}
	}

	// Step 3: hand the result to the folded-in neighbour.
	call.Phase(PhaseAllgather)
	if r < 2*extra {
		if err := send(r+1, unfoldStep, partial, "unfold"); err != nil {
			return Sparse{}, err
		}
	}
	return partial, nil
}

func ssarSplitAllgather(ctx context.Context, call *Call, n int, in Sparse, _ int) (Sparse, error) {
	return splitReduceAllgather(ctx, call, n, in, neverDense, neverDense)
}

func dsarSplitAllgather(ctx context.Context, call *Call, n int, in Sparse, _ int) (Sparse, error) {
	return splitReduceAllgather(ctx, call, n, in, denseIsNoLarger, denseIsNoLarger)
}

func neverDense(nnz, length int) bool { return false }

// splitReduceAllgather is the split-allgather scheme of SparCML (and of
// TopkDSA): equal regions, rotated exchange to the owners, owner reduces in
// rank order, allgatherv of the reduced regions. denseSplit and denseResult
// say when a region travels dense in the exchange and in the gather.
func splitReduceAllgather(ctx context.Context, call *Call, n int, in Sparse, denseSplit, denseResult func(nnz, length int) bool) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	lo, hi := regionBounds(n, p, r)

	// Steps 1 and 2: rotated exchange of the regions, the owner reduces.
	call.Phase(PhaseReduce)
	parts := make([]Sparse, p)
	parts[r] = regionOf(in, lo, hi)
	for i := 1; i < p; i++ {
		to, from := (r+i)%p, (r-i+p)%p
		toLo, toHi := regionBounds(n, p, to)
		out := regionOf(in, toLo, toHi)
		b := regionBlock(out, toLo, toHi, denseSplit(out.Len(), int(toHi-toLo)))
		m, err := call.SendRecv(ctx, to, uint32(i-1), b.Dtype, b.Count, b.Payload, from)
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: split step %d (to rank %d, from rank %d): %w", i, to, from, err)
		}
		if parts[from], err = decodeRegionBlock(m.Dtype, m.Count, m.Payload, lo, hi); err != nil {
			return Sparse{}, fmt.Errorf("oktopk: region %d from rank %d: %w", r, from, err)
		}
	}
	reduced := sparseSumInRankOrder(parts)

	// Step 3: gather the reduced regions (Bruck: ⌈log₂ P⌉ rounds, as the
	// tree allgather of the cost tables). The owner reads its own block back
	// like everyone else, so a region sent dense means the same on every rank.
	call.Phase(PhaseAllgather)
	own := regionBlock(reduced, lo, hi, denseResult(reduced.Len(), int(hi-lo)))
	blocks, err := AllgathervBruck(ctx, call, uint32(p-1), own)
	if err != nil {
		return Sparse{}, fmt.Errorf("oktopk: allgather of reduced regions: %w", err)
	}
	var global Sparse
	for j, b := range blocks {
		jLo, jHi := regionBounds(n, p, j)
		s, err := decodeRegionBlock(b.Dtype, b.Count, b.Payload, jLo, jHi)
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: reduced region %d from rank %d: %w", j, j, err)
		}
		global.Idx = append(global.Idx, s.Idx...)
		global.Val = append(global.Val, s.Val...)
	}
	return global, nil
}

// ssarRecursiveDoubleCost is SSAR's recursive doubling under Auto's model
// (auto.go): the agreement, then round i sends the partial sum of 2^i
// ranks.
func ssarRecursiveDoubleCost(s callShape, _ Config, _ bool) costTerms {
	var rounds float64 // round i sends 2^i·k entries, at their density
	for m := s.K; m < mul(s.K, s.Pp); m *= 2 {
		rounds += mul(min(m, s.N), pairBytes(m/s.N, ValuesFloat32))
	}
	fold := mul(s.K, pairBytes(s.K/s.N, ValuesFloat32)) + mul(s.U, pairBytes(s.U/s.N, ValuesFloat32))
	return costTerms{rounds: s.L + s.Lp + 2*s.fold, bytes: rounds + mul(s.fold, fold), passes: exactSelectPasses,
		entries: mul(2*s.K, s.Pp)}
}

// splitAllgatherCost is the split-and-allgather schedules' cost under
// Auto's model (auto.go; TopkDSA's too): the agreement, the split (P−1
// exchanges of k/P pairs), then a ring allgather of the reduced regions, as
// pairs, or as dense values where the algorithm's switch (denseGather, on
// the sum's U entries over n) sends them so.
func splitAllgatherCost(denseGather func(nnz, length int) bool) costFunc {
	return func(s callShape, _ Config, _ bool) costTerms {
		gather := mul(mul(s.U, pairBytes(s.U/s.N, ValuesFloat32)), s.f)
		if denseGather(int(s.U), s.n) {
			gather = mul(4*s.N, s.f)
		}
		return costTerms{rounds: s.L + 2*(s.P-1), bytes: mul(mul(s.K, pairBytes(s.K/s.N, ValuesFloat32)), s.f) + gather, passes: exactSelectPasses, entries: mul(s.K, s.P) + s.U}
	}
}
