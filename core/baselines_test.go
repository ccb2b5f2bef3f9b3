package core

// Tests of the sparse baselines (TopkA, TopkDSA, gTopk, Gaussiank, SparCML):
// density one equals the dense average, ranks bitwise identical, SparCML's
// sparse input summed exactly, the residual rule, Gaussiank's threshold and
// the reported local threshold.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
)

var sparseBaselines = []Algorithm{TopkA, TopkDSA, SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather, GTopk, Gaussiank}

var sparCMLVariants = []Algorithm{SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather}

func baselineConfig(alg Algorithm, density float64) Config {
	return Config{Algorithm: alg, Density: density, Tau: 64, TauPrime: 32}
}

// gaussianInputs gives every rank n normally distributed floats (not
// integer-valued: sums depend on order, so only cross-rank identity holds).
func gaussianInputs(p, n int, seed uint64) [][]float32 {
	rng := rand.New(rand.NewPCG(seed, 99))
	in := make([][]float32, p)
	for r := range in {
		in[r] = make([]float32, n)
		for i := range in[r] {
			in[r][i] = float32(rng.NormFloat64())
		}
	}
	return in
}

func TestSparseBaselinesDensityOneEqualsDenseAverage(t *testing.T) {
	for _, alg := range sparseBaselines {
		for _, p := range []int{1, 2, 3, 5, 8} {
			for _, n := range []int{1000, 4099} {
				t.Run(fmt.Sprintf("%v/P=%d/n=%d", alg, p, n), func(t *testing.T) {
					in := integerInputs(p, n)
					want := serialSum(in, n)
					for i := range want {
						want[i] /= float32(p)
					}
					grads := cloneAll(in)
					comms := make([]*Communicator, p)
					runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
						comms[r] = c
						_, err := c.SparseAllreduce(ctx, 1, grads[r], baselineConfig(alg, 1.0))
						return err
					})
					for r := range grads {
						if i, bad := testref.FirstBitwiseDifference(grads[r], want); bad {
							t.Fatalf("rank %d element %d: got %v, dense average %v", r, i, grads[r][i], want[i])
						}
						for i, v := range comms[r].TensorStateOf(1).Residual {
							if v != 0 {
								t.Fatalf("rank %d: residual[%d] = %v, want 0 (everything was sent)", r, i, v)
							}
						}
					}
				})
			}
		}
	}
}

// Three calls with error feedback on arbitrary floats: after every call all
// ranks must hold the same bits, whatever order the sums took.
func TestSparseBaselinesRanksBitwiseIdentical(t *testing.T) {
	for _, alg := range sparseBaselines {
		for _, p := range []int{2, 3, 5, 8} {
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				const n, calls = 4099, 3
				out := make([][][]float32, calls)
				for c := range out {
					out[c] = make([][]float32, p)
				}
				runInProc(t, p, func(ctx context.Context, r int, comm *Communicator) error {
					for c := 0; c < calls; c++ {
						grad := gaussianInputs(p, n, uint64(c))[r]
						if _, err := comm.SparseAllreduce(ctx, 7, grad, baselineConfig(alg, 0.05)); err != nil {
							return err
						}
						out[c][r] = grad
					}
					return nil
				})
				for c := range out {
					nonzero := 0
					for _, v := range out[c][0] {
						if v != 0 {
							nonzero++
						}
					}
					if nonzero == 0 {
						t.Fatalf("call %d: empty result", c)
					}
					for r := 1; r < p; r++ {
						if i, bad := testref.FirstBitwiseDifference(out[c][r], out[c][0]); bad {
							t.Fatalf("call %d rank %d element %d: %v, rank 0 has %v", c, r, i, out[c][r][i], out[c][0][i])
						}
					}
				}
			})
		}
	}
}

// The sparse-input forms of SparCML return the exact sum of the inputs: the
// test checks the index set (the union of the inputs, or whole regions where
// a stream went dense, with zeros there) and every value, bitwise, after the
// communicator's division by P.
func TestSparCMLSparseInputEqualsExactSum(t *testing.T) {
	for _, alg := range sparCMLVariants {
		for _, p := range []int{1, 2, 3, 5, 8} {
			for _, n := range []int{1000, 4099} {
				// 0.99 makes DSAR's streams go dense (priced with coded
				// indices, pairs cost less than dense values up to about
				// 97% of a region set); 0.01 keeps them sparse.
				for _, density := range []float64{0.01, 0.3, 0.99} {
					t.Run(fmt.Sprintf("%v/P=%d/n=%d/density=%v", alg, p, n, density), func(t *testing.T) {
						rng := rand.New(rand.NewPCG(uint64(p*n), uint64(1000*density)))
						ins := make([]Sparse, p)
						sum := make([]float32, n)
						inUnion := make([]bool, n)
						for r := range ins {
							ins[r] = randomSparse(rng, n, density)
							for j, i := range ins[r].Idx {
								sum[i] += ins[r].Val[j]
								inUnion[i] = true
							}
						}
						outs := make([]Sparse, p)
						runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
							var err error
							outs[r], _, err = c.SparseAllreduceSparse(ctx, n, ins[r], baselineConfig(alg, density))
							return err
						})
						for r, out := range outs {
							if err := checkSparse(out, n); err != nil {
								t.Fatalf("rank %d: result not a valid sparse vector: %v", r, err)
							}
							got := make([]float32, n)
							present := make([]bool, n)
							for j, i := range out.Idx {
								got[i], present[i] = out.Val[j], true
							}
							for i := 0; i < n; i++ {
								if inUnion[i] && !present[i] {
									t.Fatalf("rank %d: index %d of the inputs missing from the result", r, i)
								}
								if alg == SSARRecursiveDouble || alg == SSARSplitAllgather {
									if present[i] && !inUnion[i] {
										t.Fatalf("rank %d: index %d in the sparse result but in no input", r, i)
									}
								}
								if want := sum[i] / float32(p); math.Float32bits(got[i]) != math.Float32bits(want) {
									t.Fatalf("rank %d index %d: got %v, exact sum/P %v", r, i, got[i], want)
								}
							}
							if r > 0 && !sparseBitwiseEqual(out, outs[0]) {
								t.Fatalf("rank %d's result differs from rank 0's", r)
							}
						}
					})
				}
			}
		}
	}
}

func sparseBitwiseEqual(a, b Sparse) bool {
	if a.Len() != b.Len() {
		return false
	}
	for j := range a.Idx {
		if a.Idx[j] != b.Idx[j] || math.Float32bits(a.Val[j]) != math.Float32bits(b.Val[j]) {
			return false
		}
	}
	return true
}

// TopkA, TopkDSA, SparCML and Gaussiank never re-select globally, so the
// residual is acc with exactly the local selection zeroed. Two calls, so the
// second works on grad + the first residual.
func TestBaselinesResidualZeroesExactlyTheLocalSelection(t *testing.T) {
	for _, alg := range []Algorithm{TopkA, TopkDSA, SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather, Gaussiank} {
		t.Run(alg.String(), func(t *testing.T) {
			const p, n, calls = 3, 1000, 2
			cfg := baselineConfig(alg, 0.02)
			k := cfg.K(n)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				residual := make([]float32, n)
				for call := 0; call < calls; call++ {
					grad := gaussianInputs(p, n, uint64(10+call))[r]
					acc := make([]float32, n)
					for i := range acc {
						acc[i] = grad[i] + residual[i]
					}
					st, err := c.SparseAllreduce(ctx, 9, grad, cfg)
					if err != nil {
						return err
					}
					var selected map[uint32]float32
					if alg == Gaussiank {
						selected = make(map[uint32]float32)
						for i, v := range acc {
							if float32(math.Abs(float64(v))) > st.LocalThreshold {
								selected[uint32(i)] = v
							}
						}
					} else {
						all := make(map[uint32]float32, n)
						for i, v := range acc {
							all[uint32(i)] = v
						}
						selected = testref.TopK(all, k)
					}
					if len(selected) != st.LocalSelected || len(selected) == 0 {
						return fmt.Errorf("call %d: test selects %d, algorithm reports %d", call, len(selected), st.LocalSelected)
					}
					got := c.TensorStateOf(9).Residual
					for i, v := range acc {
						want := v
						if _, ok := selected[uint32(i)]; ok {
							want = 0
						}
						if math.Float32bits(got[i]) != math.Float32bits(want) {
							return fmt.Errorf("call %d residual[%d] = %v, want %v", call, i, got[i], want)
						}
					}
					copy(residual, got)
				}
				return nil
			})
		})
	}
}

// Gaussiank's threshold from μ and σ, corrected, lands within 25% of k on
// normal data (the case its estimate is built for).
func TestGaussiankSelectsAboutK(t *testing.T) {
	for _, density := range []float64{0.001, 0.01, 0.1} {
		acc := gaussianInputs(1, 1<<16, 3)[0]
		k := baselineConfig(Gaussiank, density).K(len(acc))
		s, th := gaussianSelect(acc, k, density)
		if c := float64(s.Len()); c < 0.75*float64(k) || c > 1.25*float64(k) {
			t.Errorf("density %v: selected %d, k=%d (threshold %v)", density, s.Len(), k, th)
		}
	}
}

func TestNormalQuantileMatchesKnownValues(t *testing.T) {
	for _, c := range []struct{ q, z float64 }{
		{0.5, 0}, {0.975, 1.959963984540054}, {0.005, -2.5758293035489004}, {0.0005, -3.2905267314918945},
	} {
		if got := normalQuantile(c.q); math.Abs(got-c.z) > 1e-9 {
			t.Errorf("Φ⁻¹(%v) = %v, want %v", c.q, got, c.z)
		}
	}
}

// The exact top-k baselines report the threshold their selection amounts
// to: the largest magnitude left out, so |acc| > LocalThreshold selects
// exactly the k entries (gaussian inputs have no ties).
func TestTopkBaselinesReportLocalThreshold(t *testing.T) {
	for _, alg := range []Algorithm{TopkA, TopkDSA, SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather, GTopk} {
		t.Run(alg.String(), func(t *testing.T) {
			const p, n = 2, 1000
			cfg := baselineConfig(alg, 0.03)
			in := gaussianInputs(p, n, 5)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				st, err := c.SparseAllreduce(ctx, 1, append([]float32(nil), in[r]...), cfg)
				if err != nil {
					return err
				}
				if want := KthLargestAbs(in[r], cfg.K(n)+1); st.LocalThreshold != want {
					return fmt.Errorf("rank %d: local threshold %v, the (k+1)-th largest |acc| is %v", r, st.LocalThreshold, want)
				}
				if st.WordsReceived() == 0 || st.WordsReceived() != st.BytesReceived/4 {
					return fmt.Errorf("rank %d: %d words received for %d bytes", r, st.WordsReceived(), st.BytesReceived)
				}
				return nil
			})
		})
	}
}
