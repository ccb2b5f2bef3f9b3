package core

import (
	"fmt"
	"math"
	"sort"
)

// This file is the reference selection: simple and obviously correct. The
// fast engine (histogram select, fused error feedback, parallel passes)
// replaces these bodies but keeps their exact results.

// TopK returns the k entries of x with the largest |x|, ascending by index.
// Ties in magnitude go to the lower index, so every rank and every run agrees.
// NaN is never selected silently: it is ErrNonFinite.
func TopK(x []float32, k int) (Sparse, error) {
	if k < 0 || k > len(x) {
		return Sparse{}, fmt.Errorf("%w: k=%d with n=%d", ErrInvalidArgument, k, len(x))
	}
	order := make([]int, len(x))
	for i := range order {
		if math.IsNaN(float64(x[i])) {
			return Sparse{}, fmt.Errorf("%w: NaN at index %d", ErrNonFinite, i)
		}
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		return abs32(x[order[a]]) > abs32(x[order[b]])
	})
	sel := order[:k]
	sort.Ints(sel)
	out := Sparse{Idx: make([]uint32, 0, k), Val: make([]float32, 0, k)}
	for _, i := range sel {
		out.Append(uint32(i), x[i])
	}
	return out, nil
}

// KthLargestAbs is the k-th largest |x| (1-based), the exact threshold: the
// entries with |x| > KthLargestAbs(x, k+1) are at most k. k must be in 1..n.
func KthLargestAbs(x []float32, k int) float32 {
	a := make([]float32, len(x))
	for i, v := range x {
		a[i] = abs32(v)
	}
	sort.Slice(a, func(i, j int) bool { return a[i] > a[j] })
	return a[k-1]
}

// SelectAbove appends to dst every entry with |x| > th, ascending by index.
func SelectAbove(dst Sparse, x []float32, th float32) Sparse {
	for i, v := range x {
		if abs32(v) > th {
			dst.Append(uint32(i), v)
		}
	}
	return dst
}

func abs32(v float32) float32 { return math.Float32frombits(math.Float32bits(v) &^ (1 << 31)) }
