package core

// Tests that no gradient mass is lost: over many calls, every rank's
// outputs plus its final residual equal the sum of its gradients, exactly,
// for reduced-precision values and for every sparse algorithm.

import (
	"context"
	"fmt"
	"math"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
)

// massRun runs iters calls of cfg on P ranks with drifting gradients (and,
// every seventh call, a value beyond float16's range on rank 0) and returns
// every rank's outputs per call and final residual.
func massRun(t *testing.T, p, n, iters int, cfg Config, hold func(rank, it int) []Span) (grads, outs [][][]float32, residuals [][]float32, stats []Stats) {
	gen := newDriftingGradients(p, n, uint64(7+p))
	grads = make([][][]float32, iters)
	for it := range grads {
		grads[it] = gen.next()
		if it%7 == 3 {
			grads[it][0][it] = 9e4
		}
	}
	outs, residuals, stats = runCalls(t, p, cfg, grads, hold)
	return grads, outs, residuals, stats
}

// runCalls runs one call of cfg per grads[it] (grads[it][rank] is rank's
// gradient) on one tensor, its residual carried from call to call, and
// returns every rank's outputs per call, final residual and summed stats.
func runCalls(t *testing.T, p int, cfg Config, grads [][][]float32, hold func(rank, it int) []Span) (outs [][][]float32, residuals [][]float32, stats []Stats) {
	t.Helper()
	outs = make([][][]float32, len(grads))
	for it := range outs {
		outs[it] = make([][]float32, p)
	}
	residuals = make([][]float32, p)
	stats = make([]Stats, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := range grads {
			g := append([]float32(nil), grads[it][rank]...)
			var h []Span
			if hold != nil {
				h = hold(rank, it)
			}
			st, err := c.SparseAllreduceHolding(ctx, 5, g, cfg, h)
			if err != nil {
				return fmt.Errorf("call %d: %w", it, err)
			}
			stats[rank].Add(st)
			outs[it][rank] = g
		}
		residuals[rank] = append([]float32(nil), c.TensorStateOf(5).Residual...)
		return nil
	})
	return outs, residuals, stats
}

// checkMass asserts that, for every entry, the sum over ranks and calls of
// the gradients equals P × the sum of the outputs plus the sum of the final
// residuals (which started at zero), up to float32 rounding of the
// additions: relative to the magnitudes involved, far below what one
// float16 or bfloat16 rounding (2^-11, 2^-8) would leave.
func checkMass(t *testing.T, grads, outs [][][]float32, residuals [][]float32) {
	t.Helper()
	p, n := len(residuals), len(residuals[0])
	worst, worstAt := 0.0, 0
	for i := 0; i < n; i++ {
		var in, applied, left, scale float64
		for it := range grads {
			for r := 0; r < p; r++ {
				in += float64(grads[it][r][i])
				scale += math.Abs(float64(grads[it][r][i]))
			}
			applied += float64(p) * float64(outs[it][0][i])
		}
		for r := 0; r < p; r++ {
			left += float64(residuals[r][i])
		}
		if d := math.Abs(in-applied-left) / (scale + 1e-30); d > worst {
			worst, worstAt = d, i
		}
	}
	if worst > 1e-6 {
		t.Errorf("mass not conserved: entry %d is off by %.3g of the gradient mass through it", worstAt, worst)
	}
}

func TestReducedPrecisionMassIsExact(t *testing.T) {
	n, iters := 3000, 50
	if raceEnabled {
		iters = 20 // still crosses τ = 16 and two τ′ = 8 refreshes; make test's non-race pass runs 50
	}
	for _, p := range []int{3, 4} {
		for _, alg := range []Algorithm{OkTopk, TopkA, Gaussiank} {
			for _, v := range []ValueType{ValuesFloat16, ValuesBFloat16, ValuesInt8, ValuesInt4} {
				for _, stochastic := range []bool{false, true} {
					if stochastic && !v.half() {
						continue // 8-bit and 4-bit values are rounded to nearest only
					}
					t.Run(fmt.Sprintf("P=%d/%v/%v/stochastic=%v", p, alg, v, stochastic), func(t *testing.T) {
						cfg := Config{Algorithm: alg, Density: 0.02, Tau: 16, TauPrime: 8, Values: v, Stochastic: stochastic}
						grads, outs, residuals, _ := massRun(t, p, n, iters, cfg, nil)
						checkMass(t, grads, outs, residuals)
						// Every rank ends with the same bits, and with Ok-Topk
						// at P = 4 (division exact) every output × P is a
						// value of v: the owner's rounded sum, which every
						// rank uses. (TopkA and Gaussiank sum the rounded
						// contributions in float32 on every rank.)
						for it := range outs {
							for r := 1; r < p; r++ {
								if hashFloats(outs[it][r]) != hashFloats(outs[it][0]) {
									t.Fatalf("call %d: rank %d's output differs from rank 0's", it, r)
								}
							}
							for i, o := range outs[it][0] {
								if s := o * float32(p); alg == OkTopk && p == 4 && v.Nearest(s) != s {
									t.Fatalf("call %d entry %d: output × P = %v is not a %v value", it, i, s, v)
								}
							}
						}
					})
				}
			}
		}
	}
}

// Every sparse algorithm with float32 values, over calls with the residual
// carried: the gradients equal P × the outputs plus the final residuals, up
// to float32 rounding (checkMass), and every rank's output is the same bits.
// Ok-Topk's τ′ is small, so its calls that reuse thresholds are in the mix.
// For gTopk the first call's data must make the case its tree's truncations
// once lost: a partial sum cut below the root at an index that reaches the
// root through another subtree (impossible at P = 2, whose only truncation
// is the root's).
func TestSparseAlgorithmsKeepMass(t *testing.T) {
	n, iters := 2000, 20
	if raceEnabled { // the same property, at a size the race detector gets through in seconds
		n, iters = 1000, 6
	}
	for _, alg := range Algorithms() {
		if alg.Dense() || alg == Auto {
			continue
		}
		for _, p := range []int{2, 3, 5, 8} {
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				cfg := Config{Algorithm: alg, Density: 0.02, Tau: 8, TauPrime: 4}
				grads, outs, residuals, _ := massRun(t, p, n, iters, cfg, nil)
				if alg == GTopk && p > 2 {
					if global, _, cut := testref.GTopk(grads[0], cfg.K(n)); cutButKept(global, cut) == 0 {
						t.Fatal("no partial sum was cut below the root at an index the root kept")
					}
				}
				checkMass(t, grads, outs, residuals)
				for it := range outs {
					for r := 1; r < p; r++ {
						if hashFloats(outs[it][r]) != hashFloats(outs[it][0]) {
							t.Fatalf("call %d: rank %d's output differs from rank 0's", it, r)
						}
					}
				}
			})
		}
	}
}
