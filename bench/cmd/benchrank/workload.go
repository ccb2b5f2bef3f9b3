package main

// The benchmark's gradient workload (described in main.go) and the cost
// model's word counts a row reports beside the measured ones.

import (
	"math"
	"math/rand/v2"

	"github.com/oktopk/oktopk/core"
)

type workload struct {
	sigma, shared []float32
	normals       []float32 // a table of standard normal draws
	shared64      uint64    // LCG states: the shared signal's and this rank's
	rank64        uint64
}

// Drawing 2n normals per iteration would cost more than the allreduce being
// measured, so draws come from a table of 2^16 normals indexed by an LCG.
func newWorkload(n, rank int) *workload {
	rng := rand.New(rand.NewPCG(1, 2))
	w := &workload{sigma: make([]float32, n), shared: make([]float32, n), normals: make([]float32, 1<<16),
		shared64: 7, rank64: uint64(rank)*0x9e3779b97f4a7c15 + 1}
	for i := range w.normals {
		w.normals[i] = float32(rng.NormFloat64())
	}
	for i := range w.sigma {
		w.sigma[i] = float32(math.Exp(1.5 * rng.NormFloat64()))
		w.shared[i] = w.sigma[i] * float32(rng.NormFloat64())
	}
	return w
}

func (w *workload) draw(state *uint64) float32 {
	*state = *state*6364136223846793005 + 1442695040888963407
	return w.normals[*state>>48]
}

func (w *workload) next(dst []float32) {
	for i, s := range w.shared {
		s = 0.9*s + 0.44*w.sigma[i]*w.draw(&w.shared64)
		w.shared[i] = s
		dst[i] = s + 0.5*w.sigma[i]*w.draw(&w.rank64)
	}
}

// formula is the words-per-rank bound each algorithm's file states (from its
// paper's cost analysis).
func formula(alg core.Algorithm, p, n, k int) float64 {
	P, N, K := float64(p), float64(n), float64(k)
	switch alg {
	case core.DenseRing, core.DenseRabenseifner:
		return 2 * N * (P - 1) / P
	case core.OkTopk:
		return 6 * K * (P - 1) / P
	case core.TopkA, core.SSARRecursiveDouble:
		return 2 * K * (P - 1)
	case core.Gaussiank:
		return 2 * 1.25 * K * (P - 1)
	case core.TopkDSA, core.DSARSplitAllgather:
		return (2*K + N) * (P - 1) / P
	case core.SSARSplitAllgather:
		return 2*K*(P-1)/P + 2*K*(P-1)
	case core.GTopk:
		return 4 * K * math.Ceil(math.Log2(P))
	}
	return math.NaN()
}

// reuseCall reports whether call c (0-based, per tensor) reuses Ok-Topk's
// thresholds and boundaries: neither an exact threshold (c mod τ′ = 0) nor a
// repartition (c mod τ = 0). The other algorithms are averaged over the same
// calls, so their columns compare like for like.
func reuseCall(c, tau, tauPrime int) bool { return c%tau != 0 && c%tauPrime != 0 }
