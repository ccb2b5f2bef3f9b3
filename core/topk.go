package core

import (
	"fmt"
	"math"
	"sync"
)

// Exact selection by magnitude without sorting: a radix select on the bits
// of |x|. For finite and infinite floats the IEEE-754 bit pattern of |x|,
// read as an unsigned integer, orders like |x| itself, so the k-th largest
// magnitude is found with two histogram passes (the top 16 bits, then the
// low 16 bits of the one bucket that holds it) and a third pass collects the
// selection in index order: O(n), about three reads of x.

// histogramPool recycles the 2^16-bucket histograms (256 KiB each).
var histogramPool = sync.Pool{New: func() any { return new([1 << 16]uint32) }}

// kthLargestKey returns the bit pattern of the k-th largest |x| (1 ≤ k ≤ n)
// and how many entries are strictly larger. x must hold no NaN.
func kthLargestKey(x []float32, k int) (key uint32, larger int) {
	h := histogramPool.Get().(*[1 << 16]uint32)
	defer histogramPool.Put(h)
	clear(h[:])
	for _, v := range x {
		h[(math.Float32bits(v)&^signBit)>>16]++
	}
	// Walk down from the largest bucket until k entries are covered.
	hi := 1<<16 - 1
	for ; hi > 0; hi-- {
		if larger+int(h[hi]) >= k {
			break
		}
		larger += int(h[hi])
	}
	clear(h[:])
	for _, v := range x {
		if u := math.Float32bits(v) &^ signBit; int(u>>16) == hi {
			h[u&0xffff]++
		}
	}
	lo := 1<<16 - 1
	for ; lo > 0; lo-- {
		if larger+int(h[lo]) >= k {
			break
		}
		larger += int(h[lo])
	}
	return uint32(hi)<<16 | uint32(lo), larger
}

const signBit = 1 << 31

// firstNaN returns the index of the first NaN in x, or -1.
func firstNaN(x []float32) int {
	for i, v := range x {
		if v != v {
			return i
		}
	}
	return -1
}

// TopK returns the k entries of x with the largest |x|, ascending by index.
// Ties in magnitude go to the lower index, so every rank and every run agrees.
// NaN is never selected silently: it is ErrNonFinite. ±Inf are the largest
// magnitudes.
func TopK(x []float32, k int) (Sparse, error) {
	if k < 0 || k > len(x) {
		return Sparse{}, fmt.Errorf("%w: k=%d with n=%d", ErrInvalidArgument, k, len(x))
	}
	if i := firstNaN(x); i >= 0 {
		return Sparse{}, fmt.Errorf("%w: NaN at index %d", ErrNonFinite, i)
	}
	out := Sparse{Idx: make([]uint32, 0, k), Val: make([]float32, 0, k)}
	if k == 0 {
		return out, nil
	}
	key, larger := kthLargestKey(x, k)
	ties := k - larger // entries equal to the k-th magnitude to keep, lowest index first
	for i, v := range x {
		u := math.Float32bits(v) &^ signBit
		if u > key || (u == key && ties > 0) {
			if u == key {
				ties--
			}
			out.Append(uint32(i), v)
		}
	}
	return out, nil
}

// KthLargestAbs is the k-th largest |x| (1-based), the exact threshold: the
// entries with |x| > KthLargestAbs(x, k+1) are at most k. k must be in 1..n
// and x must hold no NaN.
func KthLargestAbs(x []float32, k int) float32 {
	key, _ := kthLargestKey(x, k)
	return math.Float32frombits(key)
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
