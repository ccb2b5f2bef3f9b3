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
//  3. Allgather and sum: as TopkA (ring Allgatherv of the selections, sum in
//     rank order on every rank).
//  4. Residual: every locally selected entry is in the result, so the
//     residual is acc with the local selection zeroed.
//
// Cost: 2 log P α in the table (an allgather of the counts and one of the
// entries; the ring Allgatherv used here carries the counts in its frames,
// (P−1)α); 2k̂(P−1) words per rank, k̂ the count the threshold selected —
// about k, within the 25% the correction allows unless it runs out of tries.
// Selection is two passes over acc plus one per correction, no sort.

import (
	"context"
	"math"
	"time"
)

const (
	gaussiankTolerance = 0.25 // a count within k·(1 ± 0.25) is accepted
	gaussiankTries     = 4    // corrections of the threshold at most
	gaussiankRaise     = 1.1  // too many selected: th ×= 1.1
	gaussiankLower     = 0.9  // too few selected: th ×= 0.9
)

func init() {
	registerSparse(Gaussiank, func(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
		return reduceWithErrorFeedback(ctx, call, st, grad,
			func(acc []float32, k int) (Sparse, error) {
				s, th := gaussianSelect(acc, k, st.Config.Density)
				call.Stats.LocalThreshold = th
				st.LocalThreshold = th
				return s, nil
			},
			func(ctx context.Context, call *Call, n int, local Sparse, _ int) (Sparse, error) {
				start := time.Now()
				global, err := allgatherSparseSum(ctx, call, 0, n, local)
				call.Stats.Allgather = time.Since(start)
				return global, err
			})
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
	n := len(acc)
	if k >= n {
		// Density 1: everything; a threshold from μ could drop entries near 0.
		out := Sparse{Idx: make([]uint32, n), Val: append([]float32(nil), acc...)}
		for i := range out.Idx {
			out.Idx[i] = uint32(i)
		}
		return out, -1
	}
	var sum, sumSq float64
	for _, v := range acc {
		sum += float64(v)
	}
	mean := sum / float64(n)
	for _, v := range acc {
		d := float64(v) - mean
		sumSq += d * d
	}
	std := math.Sqrt(sumSq / float64(n))
	z := math.Abs(normalQuantile(density / 2))
	th := float32(mean + z*std)
	if th <= 0 {
		// A strongly negative mean: the scaling below needs a positive
		// threshold, and z·σ is the estimate for the magnitudes around it.
		th = float32(z * std)
	}

	countAbove := func(th float32) int {
		c := 0
		for _, v := range acc {
			if abs32(v) > th {
				c++
			}
		}
		return c
	}
	lowCount, highCount := (1-gaussiankTolerance)*float64(k), (1+gaussiankTolerance)*float64(k)
	for try := 0; try < gaussiankTries; try++ {
		c := float64(countAbove(th))
		if c > highCount {
			th *= gaussiankRaise
		} else if c < lowCount {
			th *= gaussiankLower
		} else {
			break
		}
	}
	out := SelectAbove(Sparse{Idx: make([]uint32, 0, k), Val: make([]float32, 0, k)}, acc, th)
	return out, th
}
