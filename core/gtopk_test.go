package core

// Tests of gTopk against a serial tree reference: the same global top-k,
// dense and sparse input, and the mass of partial sums cut below the root
// kept in the residuals.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
)

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
					global, local, cut := testref.GTopk(in, k)
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
	global, _, cut := testref.GTopk(grad, 2)
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
		if i, bad := testref.FirstBitwiseDifference(first[r], wantAfter[r]); bad {
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
			local := make([]map[uint32]float32, p)
			for r, s := range ins {
				m := make(map[uint32]float32)
				for j, i := range s.Idx {
					m[i] = s.Val[j]
				}
				local[r] = testref.TopK(m, k)
			}
			global, _ := testref.GTopkTree(local, k)
			outs := make([]Sparse, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				var err error
				outs[r], _, err = c.SparseAllreduceSparse(ctx, n, ins[r], cfg)
				return err
			})
			for r, out := range outs {
				if out.Len() != len(global) {
					t.Fatalf("rank %d: %d entries, reference %d", r, out.Len(), len(global))
				}
				for j, i := range out.Idx {
					want, ok := global[i]
					if !ok || math.Float32bits(out.Val[j]) != math.Float32bits(want/float32(p)) {
						t.Fatalf("rank %d index %d: got %v, reference %v (present %v)", r, i, out.Val[j], want/float32(p), ok)
					}
				}
			}
		})
	}
}
