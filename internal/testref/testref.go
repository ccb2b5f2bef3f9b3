// Package testref holds the serial references and test inputs that core's
// own tests and the multi-process tests in tests/ both check against. It
// imports nothing of the module, so every reference here is written out
// independently of core: a test that compares core's result with one of
// them checks core against a separate computation.
package testref

import (
	"math"
	"math/rand/v2"
	"sort"
)

// TopK keeps the k largest |x[i]| among the indices present (an absent
// index is not a zero candidate), ties to the lower index, by sorting.
func TopK(x map[uint32]float32, k int) map[uint32]float32 {
	idx := make([]uint32, 0, len(x))
	for i := range x {
		idx = append(idx, i)
	}
	sort.Slice(idx, func(a, b int) bool {
		ma, mb := math.Abs(float64(x[idx[a]])), math.Abs(float64(x[idx[b]]))
		if ma != mb {
			return ma > mb
		}
		return idx[a] < idx[b]
	})
	out := make(map[uint32]float32, k)
	for _, i := range idx[:min(k, len(idx))] {
		out[i] = x[i]
	}
	return out
}

// GTopk is gTopk's binomial tree written out over all ranks at once on
// dense inputs: every rank's exact local top k (local), then GTopkTree.
func GTopk(in [][]float32, k int) (global map[uint32]float32, local, cut []map[uint32]float32) {
	local = make([]map[uint32]float32, len(in))
	for r, x := range in {
		all := make(map[uint32]float32, len(x))
		for i, v := range x {
			all[uint32(i)] = v
		}
		local[r] = TopK(all, k)
	}
	global, cut = GTopkTree(local, k)
	return global, local, cut
}

// GTopkTree is gTopk's tree on every rank's local selection: rank r absorbs
// rank r+d (own values first) for d = 1, 2, 4, … and keeps the top k; the
// result is rank 0's. cut[r] sums, per index, the partial sums rank r's
// truncations dropped (in the order they were dropped).
func GTopkTree(local []map[uint32]float32, k int) (global map[uint32]float32, cut []map[uint32]float32) {
	p := len(local)
	partial := append([]map[uint32]float32(nil), local...)
	cut = make([]map[uint32]float32, p)
	for r := range cut {
		cut[r] = make(map[uint32]float32)
	}
	for d := 1; d < p; d *= 2 {
		for r := 0; r+d < p; r += 2 * d {
			merged := make(map[uint32]float32)
			for i, v := range partial[r] {
				merged[i] = v
			}
			for i, v := range partial[r+d] {
				merged[i] += v // own value first, then the child's
			}
			partial[r] = TopK(merged, k)
			for i, v := range merged {
				if _, kept := partial[r][i]; !kept {
					cut[r][i] += v
				}
			}
		}
	}
	return partial[0], cut
}

// RandomSparse draws an integer-valued sparse vector of length n holding
// each index with probability density (values ±1…±50, never 0), as
// ascending indices and their values.
func RandomSparse(rng *rand.Rand, n int, density float64) (idx []uint32, val []float32) {
	for i := 0; i < n; i++ {
		if rng.Float64() < density {
			v := float32(rng.IntN(50) + 1)
			if rng.IntN(2) == 0 {
				v = -v
			}
			idx = append(idx, uint32(i))
			val = append(val, v)
		}
	}
	return idx, val
}

// IntegerInputs gives each of p ranks n integer-valued floats in
// [-100, 100], drawn from rng: every partial sum of P ≤ 8 of them is exact
// in float32, so any summation order gives the same bits and a serial sum
// is the exact reference.
func IntegerInputs(rng *rand.Rand, p, n int) [][]float32 {
	in := make([][]float32, p)
	for r := range in {
		in[r] = make([]float32, n)
		for i := range in[r] {
			in[r][i] = float32(rng.IntN(201) - 100)
		}
	}
	return in
}

// FirstBitwiseDifference returns the first index at which got and want
// differ in any bit (-1 when their lengths differ), and whether they do.
func FirstBitwiseDifference(got, want []float32) (int, bool) {
	if len(got) != len(want) {
		return -1, true
	}
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			return i, true
		}
	}
	return 0, false
}
