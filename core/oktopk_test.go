package core

// Tests of Ok-Topk's results: bitwise equal to the dense average at density
// one and to the serial reference on exact iterations, ranks bitwise
// identical over many calls, the residual rule, non-finite input, degenerate
// shapes and the sparse-input form.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// At density 1 every entry is selected and kept, so Ok-Topk must give what
// the dense allreduce gives (Communicator.Allreduce, averaged): bitwise on
// integer-valued inputs, where every summation order is exact. The serial
// average is checked too, and the residual stays zero.
func TestOkTopkDensityOneEqualsDenseAverageBitwise(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 8} {
		for _, n := range []int{0, 1, 7, 1000, 4099} {
			t.Run(fmt.Sprintf("P=%d/n=%d", p, n), func(t *testing.T) {
				in := integerInputsOkTopk(p, n, uint64(p*n+1))
				want := make([]float32, n)
				for i := range want {
					var s float32
					for r := 0; r < p; r++ {
						s += in[r][i]
					}
					want[i] = s / float32(p)
				}
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					for _, alg := range []Algorithm{DenseRing, DenseRabenseifner} {
						dense := append([]float32(nil), in[rank]...)
						if _, err := c.Allreduce(ctx, dense, true, alg); err != nil {
							return err
						}
						for it := 0; it < 3; it++ {
							g := append([]float32(nil), in[rank]...)
							if _, err := c.SparseAllreduce(ctx, uint64(alg), g, okTopkConfig(1.0)); err != nil {
								return err
							}
							for i := range g {
								if math.Float32bits(g[i]) != math.Float32bits(dense[i]) {
									return fmt.Errorf("call %d element %d: %v, %v gives %v", it, i, g[i], alg, dense[i])
								}
								if g[i] != want[i] {
									return fmt.Errorf("call %d element %d: %v, want %v", it, i, g[i], want[i])
								}
							}
							for i, v := range c.TensorStateOf(uint64(alg)).Residual {
								if v != 0 {
									return fmt.Errorf("residual[%d] = %v at density 1", i, v)
								}
							}
						}
					}
					return nil
				})
			})
		}
	}
}

func TestOkTopkFirstCallEqualsSerialReferenceBitwise(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4, 7} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			const n, density = 5003, 0.02
			k := okTopkConfig(density).K(n)
			in := newDriftingGradients(p, n, uint64(p)).next()
			want, _ := serialExactOkTopk(in, k, nil)
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				g := append([]float32(nil), in[rank]...)
				st, err := c.SparseAllreduce(ctx, 7, g, okTopkConfig(density))
				if err != nil {
					return err
				}
				for i := range g {
					if math.Float32bits(g[i]) != math.Float32bits(want[i]) {
						return fmt.Errorf("element %d: %v, want %v", i, g[i], want[i])
					}
				}
				if st.GlobalSelected != k {
					return fmt.Errorf("global result has %d entries, want k=%d", st.GlobalSelected, k)
				}
				return nil
			})
		})
	}
}

// The exact iteration at call τ′, with the residuals of τ′ calls of error
// feedback behind it: the result and every rank's residual equal, bitwise,
// the serial reference on every rank's acc of that call — with the regions
// of call 0 still in force (τ = 64) or repartitioned in that call (τ = 16),
// on drifting float gradients (where the summation order shows in the bits)
// and on small integers (ties everywhere).
func TestOkTopkExactIterationAfterReuseEqualsSerialReferenceBitwise(t *testing.T) {
	n := 5003
	if raceEnabled {
		n = 1201
	}
	const density, tauPrime = 0.02, 32
	for _, p := range []int{1, 2, 3, 4, 7} {
		for _, tau := range []int{64, 16} {
			for _, kind := range []string{"drifting", "integer"} {
				t.Run(fmt.Sprintf("P=%d/tau=%d/%s", p, tau, kind), func(t *testing.T) {
					cfg := Config{Algorithm: OkTopk, Density: density, Tau: tau, TauPrime: tauPrime}
					k := cfg.K(n)
					var inputs [][][]float32
					if kind == "integer" {
						inputs = integerGradients(p, n, tauPrime+1, uint64(p))
					} else {
						gen := newDriftingGradients(p, n, uint64(10+p))
						for range tauPrime + 1 {
							inputs = append(inputs, gen.next())
						}
					}
					acc := make([][]float32, p)
					got := make([][]float32, p)
					gotResidual := make([][]float32, p)
					runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
						for it := 0; it <= tauPrime; it++ {
							g := append([]float32(nil), inputs[it][rank]...)
							if it == tauPrime {
								acc[rank] = append([]float32(nil), g...)
								for i, v := range c.TensorStateOf(1).Residual {
									acc[rank][i] += v
								}
							}
							if _, err := c.SparseAllreduce(ctx, 1, g, cfg); err != nil {
								return fmt.Errorf("call %d: %w", it, err)
							}
							got[rank] = g
						}
						gotResidual[rank] = append([]float32(nil), c.TensorStateOf(1).Residual...)
						return nil
					})
					var bounds []uint32 // τ = 16 repartitions in call 32 itself
					if tau > tauPrime {
						// The regions of call 0 (acc = grad, exact selection).
						sel := make([][]int, p)
						for r := range sel {
							sel[r] = serialLocalTopK(inputs[0][r], k)
						}
						bounds = serialBoundaries(sel, n)
					}
					want, wantResidual := serialExactOkTopk(acc, k, bounds)
					for r := 0; r < p; r++ {
						for i := range want {
							if math.Float32bits(got[r][i]) != math.Float32bits(want[i]) {
								t.Fatalf("rank %d element %d: %v, want %v", r, i, got[r][i], want[i])
							}
							if math.Float32bits(gotResidual[r][i]) != math.Float32bits(wantResidual[r][i]) {
								t.Fatalf("rank %d residual[%d]: %v, want %v", r, i, gotResidual[r][i], wantResidual[r][i])
							}
						}
					}
				})
			}
		}
	}
}

func TestOkTopkRanksBitwiseIdenticalOverIterations(t *testing.T) {
	n, iters := 20000, 100
	if testing.Short() || raceEnabled {
		n, iters = 5000, 40 // still crosses a τ′ = 32 refresh
	}
	for _, p := range []int{2, 3, 4, 7, 8} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			gen := newDriftingGradients(p, n, uint64(100+p))
			inputs := make([][][]float32, iters)
			for it := range inputs {
				inputs[it] = gen.next()
			}
			hashes := make([][]uint64, p)
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				for it := 0; it < iters; it++ {
					g := append([]float32(nil), inputs[it][rank]...)
					if _, err := c.SparseAllreduce(ctx, 3, g, okTopkConfig(0.01)); err != nil {
						return fmt.Errorf("iteration %d: %w", it, err)
					}
					hashes[rank] = append(hashes[rank], hashFloats(g))
				}
				return nil
			})
			for r := 1; r < p; r++ {
				for it := range hashes[0] {
					if hashes[r][it] != hashes[0][it] {
						t.Fatalf("iteration %d: rank %d's output differs from rank 0's", it, r)
					}
				}
			}
		})
	}
}

// A hand-built 2-rank case: k = 2 of n = 6. Rank 0 selects {0, 1}, rank 1
// selects {1, 4}; the sums are {0: 9, 1: 3, 4: -8}, so the global top-2 is
// {0, 4}. Residuals keep what each rank did not get through: rank 0 keeps
// index 1 (selected, not kept globally) and its unselected entries; rank 1
// keeps index 1 too and index 4 is zeroed.
func TestOkTopkResidualRuleTwoRanks(t *testing.T) {
	in := [][]float32{
		{9, 4, 0.5, -0.25, 0, 1},
		{0, -1, 0.5, 0, -8, 0.75},
	}
	wantOut := []float32{4.5, 0, 0, 0, -4, 0}
	wantResidual := [][]float32{
		{0, 4, 0.5, -0.25, 0, 1},
		{0, -1, 0.5, 0, 0, 0.75},
	}
	checkTwoRankCall(t, Config{Algorithm: OkTopk, Density: 2.0 / 6.0, Tau: 1, TauPrime: 1}, in, wantOut, wantResidual)
}

func TestOkTopkNonFiniteOnOneRankSkipsStepEverywhere(t *testing.T) {
	const p, n = 3, 500
	in := integerInputsOkTopk(p, n, 3)
	for _, where := range []string{"above threshold", "below threshold"} {
		t.Run(where, func(t *testing.T) {
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				cfg := okTopkConfig(0.05)
				g := append([]float32(nil), in[rank]...)
				if _, err := c.SparseAllreduce(ctx, 1, g, cfg); err != nil {
					return err
				}
				before := append([]float32(nil), c.TensorStateOf(1).Residual...)
				g = append([]float32(nil), in[rank]...)
				if rank == 1 {
					if where == "above threshold" {
						g[10] = float32(math.Inf(1))
					} else {
						g[11] = float32(math.NaN())
					}
				}
				orig := append([]float32(nil), g...)
				_, err := c.SparseAllreduce(ctx, 1, g, cfg)
				if !errors.Is(err, ErrNonFinite) {
					return fmt.Errorf("rank %d: %v, want ErrNonFinite on every rank", rank, err)
				}
				for i := range g {
					if math.Float32bits(g[i]) != math.Float32bits(orig[i]) {
						return fmt.Errorf("rank %d: gradient changed at %d by a skipped step", rank, i)
					}
					if c.TensorStateOf(1).Residual[i] != before[i] {
						return fmt.Errorf("rank %d: residual changed at %d by a skipped step", rank, i)
					}
				}
				// The communicator is still usable: the next step works.
				g = append([]float32(nil), in[rank]...)
				_, err = c.SparseAllreduce(ctx, 1, g, cfg)
				return err
			})
		})
	}
}

// Tiny and degenerate shapes: n = 0, n < P, k = 0 (density 0), k = n. With
// every call exact (τ = τ′ = 1) each call, residuals carried, equals the
// serial reference bitwise; with the default periods the reuse calls run
// too and every rank ends with the same bits.
func TestOkTopkEdgeCases(t *testing.T) {
	for _, p := range []int{1, 2, 3, 4} {
		for _, n := range []int{0, 1, 2, 3, 5} {
			for _, density := range []float64{0, 0.01, 0.5, 1} {
				t.Run(fmt.Sprintf("P=%d/n=%d/density=%v", p, n, density), func(t *testing.T) {
					const iters = 4
					inputs := make([][][]float32, iters)
					for it := range inputs {
						inputs[it] = make([][]float32, p)
						for r := range inputs[it] {
							inputs[it][r] = make([]float32, n)
							for i := range inputs[it][r] {
								inputs[it][r][i] = float32((r+2*i+3*it)%7 - 3)
							}
						}
					}
					exactCfg := Config{Algorithm: OkTopk, Density: density, Tau: 1, TauPrime: 1}
					k := exactCfg.K(n)
					got := make([][][]float32, iters)
					reuse := make([][]uint64, iters) // output hashes with the default periods
					for it := range got {
						got[it] = make([][]float32, p)
						reuse[it] = make([]uint64, p)
					}
					runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
						for it := 0; it < iters; it++ {
							g := append([]float32(nil), inputs[it][rank]...)
							if _, err := c.SparseAllreduce(ctx, 1, g, exactCfg); err != nil {
								return fmt.Errorf("call %d: %w", it, err)
							}
							got[it][rank] = g
							h := append([]float32(nil), inputs[it][rank]...)
							if _, err := c.SparseAllreduce(ctx, 2, h, okTopkConfig(density)); err != nil {
								return fmt.Errorf("call %d with reuse: %w", it, err)
							}
							reuse[it][rank] = hashFloats(h)
						}
						return nil
					})
					for it := range reuse {
						for r := 1; r < p; r++ {
							if reuse[it][r] != reuse[it][0] {
								t.Fatalf("call %d with reuse: rank %d's output differs from rank 0's", it, r)
							}
						}
					}
					residual := make([][]float32, p)
					for r := range residual {
						residual[r] = make([]float32, n)
					}
					for it := 0; it < iters; it++ {
						acc := make([][]float32, p)
						for r := range acc {
							acc[r] = make([]float32, n)
							for i := range acc[r] {
								acc[r][i] = inputs[it][r][i] + residual[r][i]
							}
						}
						var want []float32
						want, residual = serialExactOkTopk(acc, k, nil)
						for r := 0; r < p; r++ {
							for i := range want {
								if math.Float32bits(got[it][r][i]) != math.Float32bits(want[i]) {
									t.Fatalf("call %d rank %d element %d: %v, want %v", it, r, i, got[it][r][i], want[i])
								}
							}
						}
					}
				})
			}
		}
	}
}

func TestOkTopkSparseInputEqualsExactTopKOfSumAndFillsStats(t *testing.T) {
	const p, n, k = 4, 3000, 40
	rng := rand.New(rand.NewPCG(1, 2))
	in := make([]Sparse, p)
	dense := make([][]float32, p)
	for r := range in {
		dense[r] = make([]float32, n)
		for i := 0; i < n; i++ {
			if rng.IntN(20) == 0 {
				v := float32(rng.IntN(2001) - 1000)
				in[r].Append(uint32(i), v)
				dense[r][i] = v
			}
		}
	}
	want, _ := serialExactOkTopk(dense, n, nil) // every input entry, summed
	// Keep the exact top-k of that sum.
	var all Sparse
	for i, v := range want {
		if v != 0 {
			all.Append(uint32(i), v*float32(p))
		}
	}
	top := topKSparse(all, k)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		cfg := Config{Algorithm: OkTopk, Density: float64(k) / n, Tau: 1, TauPrime: 1}
		out, st, err := c.SparseAllreduceSparse(ctx, n, in[rank], cfg)
		if err != nil {
			return err
		}
		if st.LocalSelected != in[rank].Len() || st.GlobalSelected != k || st.K != k {
			return fmt.Errorf("stats: local %d, global %d, k %d; want %d, %d, %d", st.LocalSelected, st.GlobalSelected, st.K, in[rank].Len(), k, k)
		}
		if st.Time(PhaseReduce) <= 0 || st.Time(PhaseAllgather) <= 0 || st.WordsSent() == 0 {
			return fmt.Errorf("stats: reduce %v, allgather %v, %d words sent", st.Time(PhaseReduce), st.Time(PhaseAllgather), st.WordsSent())
		}
		if out.Len() != top.Len() {
			return fmt.Errorf("%d entries, want %d", out.Len(), top.Len())
		}
		for j := range out.Idx {
			if out.Idx[j] != top.Idx[j] || out.Val[j] != top.Val[j]/float32(p) {
				return fmt.Errorf("entry %d: (%d, %v), want (%d, %v)", j, out.Idx[j], out.Val[j], top.Idx[j], top.Val[j]/float32(p))
			}
		}
		return nil
	})
}
