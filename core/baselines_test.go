package core

import (
	"context"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"sort"
	"testing"
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
						if i, bad := firstBitwiseDifference(grads[r], want); bad {
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
						if i, bad := firstBitwiseDifference(out[c][r], out[c][0]); bad {
							t.Fatalf("call %d rank %d element %d: %v, rank 0 has %v", c, r, i, out[c][r][i], out[c][0][i])
						}
					}
				}
			})
		}
	}
}

// randomSparse draws an integer-valued sparse vector holding each index with
// probability density (values in ±1…±50, never 0).
func randomSparse(rng *rand.Rand, n int, density float64) Sparse {
	var s Sparse
	for i := 0; i < n; i++ {
		if rng.Float64() < density {
			v := float32(rng.IntN(50) + 1)
			if rng.IntN(2) == 0 {
				v = -v
			}
			s.Append(uint32(i), v)
		}
	}
	return s
}

// The sparse-input forms of SparCML return the exact sum of the inputs: the
// test checks the index set (the union of the inputs, or whole regions where
// a stream went dense, with zeros there) and every value, bitwise, after the
// communicator's division by P.
func TestSparCMLSparseInputEqualsExactSum(t *testing.T) {
	for _, alg := range sparCMLVariants {
		for _, p := range []int{1, 2, 3, 5, 8} {
			for _, n := range []int{1000, 4099} {
				// 0.8 makes DSAR's streams go dense; 0.01 keeps them sparse.
				for _, density := range []float64{0.01, 0.3, 0.8} {
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

// referenceTopK picks the k largest |x[i]| among the indices present,
// ties to the lower index, by sorting (independent of TopK).
func referenceTopK(x map[uint32]float32, k int) map[uint32]float32 {
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

// serialGTopk is the gTopk tree written out over all ranks at once: rank r
// absorbs rank r+d (own values first) for d = 1, 2, 4, … and keeps the top k.
// cut[r] sums, per index, the partial sums rank r's truncations dropped (in
// the order they were dropped).
func serialGTopk(in [][]float32, k int) (global map[uint32]float32, local, cut []map[uint32]float32) {
	p := len(in)
	partial := make([]map[uint32]float32, p)
	local = make([]map[uint32]float32, p)
	cut = make([]map[uint32]float32, p)
	for r, x := range in {
		all := make(map[uint32]float32, len(x))
		for i, v := range x {
			all[uint32(i)] = v
		}
		local[r] = referenceTopK(all, k)
		partial[r] = local[r]
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
			partial[r] = referenceTopK(merged, k)
			for i, v := range merged {
				if _, kept := partial[r][i]; !kept {
					cut[r][i] += v
				}
			}
		}
	}
	return partial[0], local, cut
}

// cutButKept counts the indices in global of which some rank's truncation
// dropped a nonzero partial sum: the contributions the paper's residual
// rule loses.
func cutButKept(global map[uint32]float32, cut []map[uint32]float32) int {
	count := 0
	for i := range global {
		for _, c := range cut {
			if c[i] != 0 {
				count++
				break
			}
		}
	}
	return count
}

// gTopk against the serial tree, with many magnitude ties (integer values in
// ±100) so the tie rule is exercised; the residual loses every entry sent
// from here and takes the partial sums this rank's truncations dropped.
func TestGTopkEqualsSerialTreeReference(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 8} {
		for _, n := range []int{1000, 4099} {
			for _, density := range []float64{0.01, 0.1} {
				t.Run(fmt.Sprintf("P=%d/n=%d/density=%v", p, n, density), func(t *testing.T) {
					in := integerInputs(p, n)
					for r := range in { // decorrelate the ranks' selections
						rng := rand.New(rand.NewPCG(uint64(r), uint64(n)))
						rng.Shuffle(n, func(a, b int) { in[r][a], in[r][b] = in[r][b], in[r][a] })
					}
					cfg := baselineConfig(GTopk, density)
					k := cfg.K(n)
					global, local, cut := serialGTopk(in, k)
					if len(global) != k {
						t.Fatalf("reference kept %d entries, want k=%d", len(global), k)
					}
					grads := cloneAll(in)
					residuals := make([][]float32, p)
					runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
						st, err := c.SparseAllreduce(ctx, 3, grads[r], cfg)
						if err == nil && st.GlobalSelected != k {
							err = fmt.Errorf("rank %d: global result of %d entries, want k=%d", r, st.GlobalSelected, k)
						}
						residuals[r] = c.TensorStateOf(3).Residual
						return err
					})
					for r := 0; r < p; r++ {
						for i := 0; i < n; i++ {
							want := float32(0)
							if v, ok := global[uint32(i)]; ok {
								want = v / float32(p)
							}
							if math.Float32bits(grads[r][i]) != math.Float32bits(want) {
								t.Fatalf("rank %d index %d: got %v, serial tree %v", r, i, grads[r][i], want)
							}
							_, sent := local[r][uint32(i)]
							wantRes := in[r][i]
							if sent {
								wantRes = 0
							}
							wantRes += cut[r][uint32(i)]
							if math.Float32bits(residuals[r][i]) != math.Float32bits(wantRes) {
								t.Fatalf("rank %d residual[%d] = %v, want %v (sent %v, cut here %v)", r, i, residuals[r][i], wantRes, sent, cut[r][uint32(i)])
							}
						}
					}
				})
			}
		}
	}
}

// gTopk keeps the gradient mass where a partial sum is cut below the root
// while its index reaches the root through another subtree. P = 4, k = 2:
// ranks 0 and 1 hold 1000 at index 0, ranks 2 and 3 hold 1 there; rank 2
// merges rank 3 and keeps indices 5 and 6 (100, 90), cutting the sum 2 at
// index 0, while rank 0's 2000 at index 0 is kept at the root. The paper's
// rule zeroes index 0 on ranks 2 and 3 (both selected it, and it is in the
// result): the 2 is in no output and no residual. Over three calls with the
// residual carried, the gradients must equal P × the outputs plus the
// residuals, and after the first call rank 2, which cut the 2, holds it.
func TestGTopkKeepsMassOfPartialSumCutBelowRoot(t *testing.T) {
	const p, n, calls = 4, 8, 3
	cfg := baselineConfig(GTopk, 0.25)
	if k := cfg.K(n); k != 2 {
		t.Fatalf("k = %d, the case needs 2", k)
	}
	grad := [][]float32{
		{0: 1000, 1: 50, 7: 0},
		{0: 1000, 2: 40, 7: 0},
		{0: 1, 5: 100, 7: 0},
		{0: 1, 6: 90, 7: 0},
	}
	global, _, cut := serialGTopk(grad, 2)
	if _, kept := global[0]; !kept || cut[2][0] != 2 || cutButKept(global, cut) == 0 {
		t.Fatalf("the data do not make the case: global %v, rank 2 cut %v", global, cut[2])
	}
	grads := make([][][]float32, calls)
	for c := range grads {
		grads[c] = cloneAll(grad)
	}
	outs, residuals, _ := runCalls(t, p, cfg, grads, nil)
	checkMass(t, grads, outs, residuals)
	_, first, _ := runCalls(t, p, cfg, grads[:1], nil)
	wantAfter := [][]float32{
		{1: 50, 2: 40, 6: 90, 7: 0}, // own 50 cut at the root; rank 1's 40 at d = 1; rank 3's 90 at the root
		{7: 0},
		{0: 2, 7: 0}, // the sum of ranks 2 and 3 at index 0, cut at d = 1
		{7: 0},
	}
	for r := range wantAfter {
		if i, bad := firstBitwiseDifference(first[r], wantAfter[r]); bad {
			t.Errorf("rank %d: residual after the first call is %v at %d, want %v", r, first[r][i], i, wantAfter[r])
		}
	}
}

// The sparse-input form of gTopk cuts each input to its top k and follows
// the same tree.
func TestGTopkSparseInputEqualsSerialTreeReference(t *testing.T) {
	for _, p := range []int{2, 3, 5, 8} {
		const n = 1000
		t.Run(fmt.Sprintf("P=%d", p), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(p), 5))
			ins := make([]Sparse, p)
			dense := make([][]float32, p)
			for r := range ins {
				ins[r] = randomSparse(rng, n, 0.2)
				dense[r] = make([]float32, n)
			}
			cfg := baselineConfig(GTopk, 0.05)
			k := cfg.K(n)
			// The reference takes top-k over the present entries only (an
			// absent index is not a zero candidate), so build it from maps.
			partial := make([]map[uint32]float32, p)
			for r, s := range ins {
				m := make(map[uint32]float32)
				for j, i := range s.Idx {
					m[i] = s.Val[j]
				}
				partial[r] = referenceTopK(m, k)
			}
			for d := 1; d < p; d *= 2 {
				for r := 0; r+d < p; r += 2 * d {
					merged := make(map[uint32]float32)
					for i, v := range partial[r] {
						merged[i] = v
					}
					for i, v := range partial[r+d] {
						merged[i] += v
					}
					partial[r] = referenceTopK(merged, k)
				}
			}
			outs := make([]Sparse, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				var err error
				outs[r], _, err = c.SparseAllreduceSparse(ctx, n, ins[r], cfg)
				return err
			})
			for r, out := range outs {
				if out.Len() != len(partial[0]) {
					t.Fatalf("rank %d: %d entries, reference %d", r, out.Len(), len(partial[0]))
				}
				for j, i := range out.Idx {
					want, ok := partial[0][i]
					if !ok || math.Float32bits(out.Val[j]) != math.Float32bits(want/float32(p)) {
						t.Fatalf("rank %d index %d: got %v, reference %v (present %v)", r, i, out.Val[j], want/float32(p), ok)
					}
				}
			}
		})
	}
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
						selected = referenceTopK(all, k)
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

// wordsBound is the cost model's words per rank for one call, as written in
// each algorithm's opening comment (from its paper's cost analysis), and
// the slack the comparison allows. The equal-split formulas assume the
// selections spread evenly over the P regions; random ones do within 2%.
// The sparse baselines add the ⌈log P⌉ words of the agreement on NaN/Inf
// before any data moves (agreeOnInput).
func wordsBound(alg Algorithm, p, n, k int) (formula string, words, slack float64) {
	formula, words, slack = costModelWords(alg, p, n, k)
	if !alg.Dense() && alg != OkTopk {
		formula += "+log P"
		words += float64(bits.Len(uint(p - 1)))
	}
	return formula, words, slack
}

func costModelWords(alg Algorithm, p, n, k int) (formula string, words, slack float64) {
	P, N, K := float64(p), float64(n), float64(k)
	logP := float64(bits.Len(uint(p - 1)))
	switch alg {
	case DenseRing:
		return "2n(P-1)/P", 2 * N * (P - 1) / P, 2
	case DenseRabenseifner:
		return "2n(P-1)/P", 2 * N * (P - 1) / P, 2 * logP
	case TopkA:
		return "2k(P-1)", 2 * K * (P - 1), 0
	case TopkDSA:
		return "(2k+n)(P-1)/P", (2*K + N) * (P - 1) / P, 0
	case SSARRecursiveDouble:
		return "2k(P-1)", 2 * K * (P - 1), 0
	case SSARSplitAllgather:
		w := 2*K*(P-1)/P + 2*K*P*(P-1)/P
		return "2k(P-1)/P+2kP(P-1)/P", w, 0.02 * w
	case DSARSplitAllgather:
		w := 2*K*(P-1)/P + math.Min(2*K*P, N)*(P-1)/P
		return "2k(P-1)/P+min(2kP,n)(P-1)/P", w, 0.02 * w
	case GTopk:
		return "4k log P", 4 * K * logP, 0
	case Gaussiank:
		// k is only estimated: the correction accepts counts up to 1.25k.
		return "2k(P-1), k up to 1.25k", 2 * 1.25 * K * (P - 1), 0
	}
	panic("no cost model for " + alg.String())
}

// One call of every algorithm at n = 2^20, density 1%, on normal data (run
// with -v for the table). Fails when any rank sends more words than its
// algorithm's formula allows. Under -short or -race it runs at n = 2^16:
// the same bounds, checked at a size the race detector gets through in
// seconds.
func TestBaselinesWordsSentWithinCostModel(t *testing.T) {
	n, density := 1<<20, 0.01
	if testing.Short() || raceEnabled {
		n = 1 << 16
	}
	algs := append([]Algorithm{DenseRing, DenseRabenseifner}, sparseBaselines...)
	t.Logf("%-22s %2s %10s %10s %12s  %s", "algorithm", "P", "k", "max words", "formula", "")
	for _, p := range []int{2, 4, 8} {
		in := gaussianInputs(p, n, 42)
		for _, alg := range algs {
			cfg := baselineConfig(alg, density)
			k := cfg.K(n)
			stats := make([]Stats, p)
			grads := cloneAll(in)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				var err error
				stats[r], err = c.SparseAllreduce(ctx, 1, grads[r], cfg)
				return err
			})
			var most uint64
			for _, st := range stats {
				most = max(most, st.WordsSent())
			}
			formula, bound, slack := wordsBound(alg, p, n, k)
			t.Logf("%-22v %2d %10d %10d %12.0f  %s", alg, p, k, most, bound, formula)
			if float64(most) > bound+slack {
				t.Errorf("%v at P=%d: a rank sent %d words, formula %s = %.0f (slack %.0f)", alg, p, most, formula, bound, slack)
			}
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
