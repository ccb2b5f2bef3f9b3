package core

// Serial references and synthetic inputs shared by the Ok-Topk tests: exact
// local and global top-k written independently of the library, drifting and
// integer-valued gradient generators, and output hashing.

import (
	"hash/fnv"
	"math"
	"math/rand/v2"
	"sort"
)

func okTopkConfig(density float64) Config {
	return Config{Algorithm: OkTopk, Density: density, Tau: 64, TauPrime: 32}
}

// driftingGradients is a synthetic gradient process shaped like data-parallel
// training: every rank sees the same true gradient plus its own minibatch
// noise. Each coordinate i has a scale σ_i drawn log-normal (a few
// coordinates matter much more than most, as in real layers); the true
// gradient drifts as an AR(1) process s_t = 0.9·s_{t−1} + 0.44·σ_i·ε and
// rank r's gradient is s_t + 0.5·σ_i·ε_r, with ε occasionally ×5 (heavy
// tails). Scales therefore change slowly, and the set of large coordinates
// moves over tens of iterations.
type driftingGradients struct {
	sigma, shared []float64
	p             int
	rng           *rand.Rand
}

func newDriftingGradients(p, n int, seed uint64) *driftingGradients {
	d := &driftingGradients{sigma: make([]float64, n), shared: make([]float64, n), p: p, rng: rand.New(rand.NewPCG(seed, 99))}
	for i := range d.sigma {
		d.sigma[i] = math.Exp(1.5 * d.rng.NormFloat64())
		d.shared[i] = d.sigma[i] * d.rng.NormFloat64()
	}
	return d
}

func (d *driftingGradients) noise() float64 {
	e := d.rng.NormFloat64()
	if d.rng.IntN(50) == 0 {
		e *= 5
	}
	return e
}

func (d *driftingGradients) next() [][]float32 {
	for i := range d.shared {
		d.shared[i] = 0.9*d.shared[i] + 0.44*d.sigma[i]*d.noise()
	}
	out := make([][]float32, d.p)
	for r := range out {
		out[r] = make([]float32, len(d.shared))
		for i, s := range d.shared {
			out[r][i] = float32(s + 0.5*d.sigma[i]*d.noise())
		}
	}
	return out
}

func hashFloats(v []float32) uint64 {
	h := fnv.New64a()
	h.Write(Float32Bytes(v))
	return h.Sum64()
}

// serialLocalTopK is rank-local exact selection, written independently of
// TopK: the k largest |x|, ties to the lower index, ascending by index.
func serialLocalTopK(x []float32, k int) []int {
	order := make([]int, len(x))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool { return math.Abs(float64(x[order[a]])) > math.Abs(float64(x[order[b]])) })
	sel := append([]int(nil), order[:k]...)
	sort.Ints(sel)
	return sel
}

// serialBoundaries is step 2 on every rank's selection: each rank's
// P-quantile positions (an equal split when it selected nothing), averaged
// with integer division.
func serialBoundaries(selections [][]int, n int) []uint32 {
	p := len(selections)
	bounds := make([]uint32, p+1)
	for j := 1; j < p; j++ {
		var sum uint64
		for _, sel := range selections {
			if len(sel) == 0 {
				sum += uint64(j * n / p)
			} else {
				sum += uint64(sel[j*len(sel)/p])
			}
		}
		bounds[j] = uint32(sum / uint64(p))
	}
	bounds[p] = uint32(n)
	return bounds
}

// serialExactOkTopk is the independent reference of an exact iteration on
// every rank's acc = grad + residual: sum every rank's exact local top-k,
// each index in the order its region's owner receives the contributions
// (its own, then ranks owner−1, owner−2, … mod P), take the exact top-k of
// the sum (ties to the lower index), divide by P. bounds are the regions in
// force (nil: repartitioned in this call, from these selections). It
// returns the dense result and every rank's expected residual.
func serialExactOkTopk(acc [][]float32, k int, bounds []uint32) (out []float32, residual [][]float32) {
	p, n := len(acc), len(acc[0])
	selections := make([][]int, p)
	for r, x := range acc {
		selections[r] = serialLocalTopK(x, k)
	}
	if bounds == nil {
		bounds = serialBoundaries(selections, n)
	}
	selected := make([][]bool, p)
	for r, sel := range selections {
		selected[r] = make([]bool, n)
		for _, i := range sel {
			selected[r][i] = true
		}
	}
	sum := make([]float32, n)
	touched := make([]bool, n)
	for i := 0; i < n; i++ {
		owner := sort.Search(p, func(o int) bool { return bounds[o+1] > uint32(i) })
		for j := 0; j < p; j++ {
			if r := (owner - j + p) % p; selected[r][i] {
				sum[i] += acc[r][i]
				touched[i] = true
			}
		}
	}
	var cand []int
	for i := range sum {
		if touched[i] {
			cand = append(cand, i)
		}
	}
	sort.SliceStable(cand, func(a, b int) bool { return math.Abs(float64(sum[cand[a]])) > math.Abs(float64(sum[cand[b]])) })
	out = make([]float32, n)
	kept := make([]bool, n)
	for _, i := range cand[:min(k, len(cand))] {
		out[i] = sum[i] / float32(p)
		kept[i] = true
	}
	residual = make([][]float32, p)
	for r := range acc {
		residual[r] = append([]float32(nil), acc[r]...)
		for i := range residual[r] {
			if selected[r][i] && kept[i] {
				residual[r][i] = 0
			}
		}
	}
	return out, residual
}

// integerGradients draws every call's gradients from small integers, so
// magnitudes tie everywhere and every sum is exact.
func integerGradients(p, n, iters int, seed uint64) [][][]float32 {
	rng := rand.New(rand.NewPCG(seed, 17))
	out := make([][][]float32, iters)
	for it := range out {
		out[it] = make([][]float32, p)
		for r := range out[it] {
			out[it][r] = make([]float32, n)
			for i := range out[it][r] {
				out[it][r][i] = float32(rng.IntN(17) - 8)
			}
		}
	}
	return out
}

// topKSparse, the tests' serial reference, returns the k entries of s with the largest |v| (ties to the
// lower index, as TopK), ascending by index.
func topKSparse(s Sparse, k int) Sparse {
	if k >= s.Len() {
		return Sparse{Idx: append([]uint32(nil), s.Idx...), Val: append([]float32(nil), s.Val...)}
	}
	order := make([]int, s.Len())
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool {
		va, vb := abs32(s.Val[order[a]]), abs32(s.Val[order[b]])
		if va != vb {
			return va > vb
		}
		return order[a] < order[b]
	})
	sel := order[:k]
	sort.Ints(sel)
	var out Sparse
	for _, i := range sel {
		out.Append(s.Idx[i], s.Val[i])
	}
	return out
}
