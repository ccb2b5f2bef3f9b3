package core

// TopkDSA: the baseline of the Ok-Topk paper built on SparCML's
// split-allgather (DSAR_Split_allgather) with exact local top-k.
//
// The algorithm works as follows.
//
//  1. Select: each rank takes the exact top-k of acc = grad + residual.
//  2. Split and reduce: the index space is cut into P equal regions and rank
//     j owns region j. In step i = 1…P−1 rank r sends its selected entries
//     of region (r+i) mod P to that rank and receives its own region's
//     entries from rank (r−i) mod P — the rotation keeps every rank sending
//     to a different peer in each step. The owner sums the P parts of its
//     region in rank order.
//  3. Allgatherv: the reduced regions are gathered on every rank (Bruck's
//     algorithm, ⌈log₂ P⌉ rounds). A region whose pairs would take more
//     than two thirds of its dense bytes travels dense, otherwise as
//     region-relative pairs: the reference switches at n/3 (its 32-bit
//     pairs then take 2n/3 words), before the n/2 where pairs and values
//     cost the same. With coded indices that margin is kept: the switch
//     falls at about 60% of the region set (reducedRegionGoesDense). Unlike Ok-Topk the split
//     is fixed, so when the selections cluster one owner gets most of them.
//  4. Residual: the result is the exact sum of the selections (no global
//     re-selection), so the residual is acc with the local selection zeroed.
//
// Cost: (P−1+⌈log P⌉)α, the table's ≈(P + log P)α;
// 2k(P−1)/P words to split for evenly spread selections, then 2K(P−1)/P to
// gather the K reduced entries (k ≤ K ≤ kP), capped at n(P−1)/P by the dense
// switch: between 4k(P−1)/P and (2k+n)(P−1)/P words per rank.

import "context"

// topkDSAReduce sums the ranks' (at most k) selected entries; a sparse input
// with more than k entries is cut to its top k first.
func topkDSAReduce(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error) {
	call.Phase(PhaseSelect)
	local, err := sparseTopK(in, k)
	if err != nil {
		return Sparse{}, err
	}
	return splitReduceAllgather(ctx, call, n, local, neverDense, reducedRegionGoesDense)
}

// reducedRegionGoesDense is the reference's switch: dense once the pairs
// would take more than two thirds of the region's float32 values, which
// with 32-bit indices and values is more than a third of the region set
// (3·nnz > length). Pairs are priced at the region's density, as
// denseIsNoLarger prices them.
func reducedRegionGoesDense(nnz, length int) bool {
	return mul(3*float64(nnz), pairBytes(float64(nnz)/float64(max(length, 1)), ValuesFloat32)) > 8*float64(length)
}
