package core

// Tests of the sparse-input call: memory follows the pairs, not n, with an
// exact result, and Ok-Topk's merged region sums equal its dense ones
// bitwise.

import (
	"context"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// A sparse-in, sparse-out call costs memory in proportion to its pairs, not
// to n: with 4 pairs per rank and the largest n allowed, every algorithm
// with a sparse-input form allocates well under 1 MiB for the whole call on
// all 3 ranks (an array over n, or over one rank's region of it, would be
// gigabytes), and returns the exact sum of the inputs divided by P. The
// pairs sit at both ends of the index space and on the ranks' region
// boundaries, and overlap between ranks so that sums are formed.
func TestSparseInputCostFollowsPairsNotN(t *testing.T) {
	const p, n = 3, MaxElements
	third := uint32(n / 3)
	inputs := []Sparse{
		{Idx: []uint32{0, third - 1, third, n - 1}, Val: []float32{1, 2, 3, 4}},
		{Idx: []uint32{0, 7, 2 * third, n - 2}, Val: []float32{-5, 6, 7, 8}},
		{Idx: []uint32{third, 2*third - 1, n - 2, n - 1}, Val: []float32{9, -10, 11, 12}},
	}
	sums := map[uint32]float32{}
	for _, in := range inputs {
		for j, i := range in.Idx {
			sums[i] += in.Val[j] // small integers: exact in any order
		}
	}
	var want Sparse
	for _, i := range slices.Sorted(func(yield func(uint32) bool) {
		for i := range sums {
			if !yield(i) {
				return
			}
		}
	}) {
		want.Append(i, sums[i]/p)
	}
	// k = ⌈density·n⌉ = 43 is above the 12 pairs: no algorithm truncates.
	const density = 1e-8
	algs := sparseInputAlgorithms()
	for _, alg := range algs {
		t.Run(alg.String(), func(t *testing.T) {
			cfg := Config{Algorithm: alg, Density: density, Tau: 1, TauPrime: 1}
			outs := make([]Sparse, p)
			perCall := bytesAllocatedPerCall(1, func() {
				runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
					out, _, err := c.SparseAllreduceSparse(ctx, n, inputs[r], cfg)
					outs[r] = out
					return err
				})
			})
			if perCall > 1<<20 {
				t.Errorf("the call on %d ranks allocated %d bytes for 4 pairs each at n=%d, want at most 1 MiB", p, perCall, uint64(n))
			}
			for r, out := range outs {
				if !sparseBitwiseEqual(out, want) {
					t.Errorf("rank %d: %v, want %v", r, out, want)
				}
			}
		})
	}
}

// The two ways Ok-Topk's owner keeps its region's sum — a dense array over
// the region (the dense-gradient call) and a merge of sorted index lists (the
// sparse-input call) — give the same indices and the same bits for the same
// contributions in the same order: a zero that is −0 in every contribution
// sums to +0 in both (0 + (−0)), a sum that cancels keeps its index, and
// values whose rounding depends on the order of addition are added in the
// one order.
func TestOkTopkRegionSumsMergedEqualDenseBitwise(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 8))
	values := []float32{float32(math.Copysign(0, -1)), 0, 1, -1, 1e8, -1e8, 3.25e-3, 0.1, -0.7}
	for trial := 0; trial < 200; trial++ {
		lo := uint32(rng.IntN(1000))
		width := 1 + rng.IntN(60)
		parts := make([]Sparse, 1+rng.IntN(6))
		for c := range parts {
			for i := 0; i < width; i++ {
				if rng.IntN(3) == 0 {
					v := values[rng.IntN(len(values))]
					if rng.IntN(4) == 0 {
						v = float32(rng.NormFloat64())
					}
					parts[c].Append(lo+uint32(i), v)
				}
			}
		}
		var sc okTopkScratch
		dense := sc.denseRegionSum(lo, lo+uint32(width))
		merged := &mergedRegionSum{}
		for _, c := range parts {
			dense.add(c)
			merged.add(c)
		}
		d, m := dense.result(), merged.result()
		if !sparseBitwiseEqual(d, m) {
			t.Fatalf("trial %d, contributions %v: merged %v, dense %v", trial, parts, m, d)
		}
	}
	// And −0 alone: the dense sum starts from +0.
	merged := &mergedRegionSum{}
	merged.add(Sparse{Idx: []uint32{3}, Val: []float32{float32(math.Copysign(0, -1))}})
	if got := merged.result(); got.Len() != 1 || math.Float32bits(got.Val[0]) != 0 {
		t.Fatalf("−0 alone summed to %v (bits %#x), want +0", got.Val, math.Float32bits(got.Val[0]))
	}
}

// sparseInputAlgorithms lists, in enum order, the algorithms with a
// sparse-input form.
func sparseInputAlgorithms() []Algorithm {
	var out []Algorithm
	for _, a := range Algorithms() {
		if a.row().sparseInput != nil {
			out = append(out, a)
		}
	}
	return out
}
