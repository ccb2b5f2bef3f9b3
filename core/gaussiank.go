package core

// Gaussiank (Shi et al., 2019): a selection threshold estimated from the mean
// and standard deviation of acc, as if its entries were normally distributed,
// instead of an exact top-k; then an allgather as in TopkA.
//
// The algorithm works as follows.
//
//  1. Estimate: each rank forms acc = grad + residual, its mean μ and
//     standard deviation σ, and the threshold th = μ + |Φ⁻¹(density/2)|·σ:
//     for normal entries, a fraction density of them has |x − μ| above
//     |Φ⁻¹(density/2)|·σ.
//  2. Correct: select |acc| > th; while the count misses k by more than 25%
//     (a few tries), scale th by a small factor towards k. k is only
//     estimated: each rank sends what its threshold selects, which differs
//     from rank to rank.
//  3. Allgather and sum: as TopkA (Bruck's allgather of the selections, sum
//     in rank order on every rank).
//  4. Residual: every locally selected entry is in the result, so the
//     residual is acc with the local selection zeroed.
//
// Cost: 2 log P α in the table (an allgather of the counts and one of the
// entries; the counts travel in the frames of the one allgather here,
// ⌈log P⌉α); 2k̂(P−1) words per rank, k̂ the count the threshold selected —
// about k, within the 25% the correction allows unless it runs out of tries.
// Selection is two passes over acc (μ and σ together, then |acc| > th)
// plus one per correction that lowers th; no sort.

import (
	"context"
	"fmt"
	"math"
)

const (
	gaussiankTolerance = 0.25 // a count within k·(1 ± 0.25) is accepted
	gaussiankTries     = 4    // corrections of the threshold at most
	gaussiankRaise     = 1.1  // too many selected: th ×= 1.1
	gaussiankLower     = 0.9  // too few selected: th ×= 0.9
)

// gaussiankAllreduce is Gaussiank with error feedback: the Gaussian
// threshold's selection, allgathered and summed.
func gaussiankAllreduce(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
	return reduceWithErrorFeedback(ctx, call, st, grad,
		func(dst Sparse, acc vec, k int) (Sparse, error) {
			s, th, nonFinite := gaussianSelectOf(dst, acc, k, st.Config.Density, selectionChunks(acc.len()))
			if nonFinite > 0 {
				return s, fmt.Errorf("%w: %d entries", ErrNonFinite, nonFinite)
			}
			call.Stats.LocalThreshold = th
			st.LocalThreshold = th
			return s, nil
		},
		func(ctx context.Context, call *Call, n int, local Sparse, _ int) (Sparse, error) {
			return allgatherSparseSum(ctx, call, 0, n, local)
		})
}

// normalQuantile is Φ⁻¹(q), the standard normal quantile, for 0 < q < 1:
// Φ⁻¹(q) = −√2·erfcinv(2q), exact to float64 through math.Erfcinv.
func normalQuantile(q float64) float64 { return -math.Sqrt2 * math.Erfcinv(2*q) }

// gaussianSelect returns the entries of acc with |acc| > th for the
// Gaussian estimate th of the k-th largest magnitude, corrected a few times
// when the count misses k by more than the tolerance; and th. acc must be
// finite. With k ≥ len(acc) every entry is selected (th = −1).
func gaussianSelect(acc []float32, k int, density float64) (Sparse, float32) {
	return gaussianSelectInto(Sparse{}, acc, k, density, selectionChunks(len(acc)))
}

// gaussianSelectInto is gaussianSelect writing into dst's storage (reset
// first), on the given number of chunks. Its passes over acc: one for μ and
// σ, one selection, and one more per correction that lowers th (a raise only
// filters the entries already selected).
func gaussianSelectInto(dst Sparse, acc []float32, k int, density float64, chunks int) (Sparse, float32) {
	dst, th, _ := gaussianSelectOf(dst, plainVec(acc), k, density, chunks)
	return dst, th
}

// gaussianSelectOf is gaussianSelectInto on a vec (vec.go); it also returns
// how many entries of acc are NaN or ±Inf, counted by its first selection
// pass (acc need not be finite; the caller skips the step when the count is
// not 0, and the selection is then meaningless). With k ≥ n the count
// takes a pass of its own.
func gaussianSelectOf(dst Sparse, acc vec, k int, density float64, chunks int) (Sparse, float32, int) {
	n := acc.len()
	dst.Reset()
	if k >= n {
		// Density 1: everything; a threshold from μ could drop entries near 0.
		dst = growSparse(dst, n)
		for i := range dst.Idx {
			dst.Idx[i] = uint32(i)
		}
		acc.copyTo(dst.Val)
		return dst, -1, countNonFinite(dst.Val)
	}
	mean, std := meanStdOf(acc, chunks)
	z := math.Abs(normalQuantile(density / 2))
	th := float32(mean + z*std)
	if th <= 0 {
		// A strongly negative mean: the scaling below needs a positive
		// threshold, and z·σ is the estimate for the magnitudes around it.
		th = float32(z * std)
	}

	lowCount, highCount := (1-gaussiankTolerance)*float64(k), (1+gaussiankTolerance)*float64(k)
	// Every NaN and ±Inf is counted whatever th is (even a NaN th from a
	// non-finite μ): selectAbove scans every block holding one.
	dst, nonFinite := selectAboveOf(dst, acc, th, chunks)
	if nonFinite > 0 {
		return dst, th, nonFinite
	}
	for try := 0; try < gaussiankTries; try++ {
		c := float64(dst.Len())
		if c > highCount {
			th *= gaussiankRaise
			dst = keepAbove(dst, th) // a subset of what is selected: no pass over acc
		} else if c < lowCount {
			th *= gaussiankLower
			dst.Reset()
			dst, _ = selectAboveOf(dst, acc, th, chunks)
		} else {
			break
		}
	}
	return dst, th, 0
}

// momentBlock is the block of entries whose sums are formed together: the
// blocks' sums are added in block order, so μ and σ do not depend on how
// many chunks computed them.
const momentBlock = 1 << 14

// meanStd is the mean and the (population) standard deviation of x in one
// pass: sums of x−s and (x−s)² in float64, s = x[0], which keeps the
// subtraction Σ(x−s)² − (Σ(x−s))²/n well conditioned when |μ| ≫ σ.
func meanStd(x []float32, chunks int) (mean, std float64) {
	return meanStdOf(plainVec(x), chunks)
}

// meanStdOf is meanStd on a vec (vec.go). A block of a sum is read a tile
// at a time, the accumulators carried from tile to tile: tiles hold a
// multiple of 4 entries, so the additions are the same as in one pass.
func meanStdOf(x vec, chunks int) (mean, std float64) {
	n := x.len()
	if n == 0 {
		return 0, 0
	}
	shift := float64(x.at(0))
	blocks := (n + momentBlock - 1) / momentBlock
	sc := getScratch()
	defer putScratch(sc)
	if cap(sc.moments) < 2*blocks {
		sc.moments = make([]float64, 2*blocks)
	}
	sums := sc.moments[:2*blocks]
	chunks = max(1, min(chunks, blocks))
	tiles := sc.tilesFor(x, chunks)
	forEachChunk(blocks, chunks, func(c, lo, hi int) {
		for b := lo; b < hi; b++ {
			var m moments
			x.each(b*momentBlock, min(n, (b+1)*momentBlock), tiles[c], func(span []float32, _ int) { m.add(span, shift) })
			sums[2*b], sums[2*b+1] = m.s0+m.s1, m.q0+m.q1
		}
	})
	var s, q float64
	for b := 0; b < blocks; b++ {
		s += sums[2*b]
		q += sums[2*b+1]
	}
	mean = shift + s/float64(n)
	return mean, math.Sqrt(max(0, (q-s*s/float64(n))/float64(n)))
}

// moments accumulates Σ(x−shift) and Σ(x−shift)² of a block: two
// accumulators each, fed a pair at a time, so the additions do not wait on
// one another and nothing spills out of registers.
type moments struct{ s0, s1, q0, q1 float64 }

// add takes in x; only the block's last span may hold a count that is not a
// multiple of 4.
func (m *moments) add(x []float32, shift float64) {
	s0, s1, q0, q1 := m.s0, m.s1, m.q0, m.q1
	i := 0
	for ; i+4 <= len(x); i += 4 {
		b := x[i : i+4 : i+4]
		d0, d1, d2, d3 := float64(b[0])-shift, float64(b[1])-shift, float64(b[2])-shift, float64(b[3])-shift
		s0 += d0 + d2
		s1 += d1 + d3
		q0 += d0*d0 + d2*d2
		q1 += d1*d1 + d3*d3
	}
	for _, v := range x[i:] {
		d := float64(v) - shift
		s0 += d
		q0 += d * d
	}
	m.s0, m.s1, m.q0, m.q1 = s0, s1, q0, q1
}

// gaussiankCost is Gaussiank's cost under Auto's model (auto.go): TopkA's
// exchange after its own selection passes.
func gaussiankCost(s callShape, cfg Config, sparseInput bool) costTerms {
	t := topkACost(s, cfg, sparseInput)
	t.passes = gaussianPasses
	return t
}
