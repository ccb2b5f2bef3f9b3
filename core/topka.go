package core

// TopkA: every rank selects its own top-k and all of them are gathered.
//
// The algorithm works as follows.
//
//  1. Select: each rank forms acc = grad + residual and takes its exact local
//     top-k (k = ceil(density·n) largest |acc|).
//  2. Allgather: the P selections, k (index, value) pairs each, are gathered
//     on every rank by Bruck's algorithm (AllgathervBruck, ⌈log₂ P⌉ rounds).
//  3. Sum: every rank adds the P selections in rank order, so every rank gets
//     the same bits; the communicator divides by P. The global result holds
//     up to kP entries — the union of the selections — which is why TopkA's
//     traffic grows with P while Ok-Topk's does not.
//  4. Residual: everything selected locally is in the global result, so the
//     residual is acc with the local selection zeroed.
//
// Cost: ⌈log P⌉α + 2k(P−1)β per rank, as the paper's recursive-doubling
// allgather, for any P (a ring allgather moves the same words in P−1 rounds).

import "context"

// topkAReduce gathers every rank's (at most k) selected entries and returns
// their sum. A sparse input with more than k entries is cut to its top k
// first, as a dense gradient would be.
func topkAReduce(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error) {
	call.Phase(PhaseSelect)
	local, err := sparseTopK(in, k)
	if err != nil {
		return Sparse{}, err
	}
	return allgatherSparseSum(ctx, call, 0, n, local)
}

// topkACost is TopkA's cost under Auto's model (auto.go): the NaN
// agreement (⌈log₂ P⌉ rounds), then a ring allgather of k pairs per rank,
// summed in rank order: the running sum grows by k pairs per part.
func topkACost(s callShape, cfg Config, _ bool) costTerms {
	return costTerms{rounds: s.L + s.P - 1, bytes: mul(mul(s.K, pairBytes(s.K/s.N, cfg.Values)), s.P-1), passes: exactSelectPasses, entries: mul(s.K, (mul(s.P, s.P)+s.P-2)/2)}
}
