// Tests of the sparse-input baselines over real ZeroMQ sockets on loopback:
// SparCML against the exact sum of its sparse inputs and gTopk against a
// serial tree reference, both written out independently of core.

package tests

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/oktopk/oktopk/core"
)

// randomSparse draws an integer-valued sparse vector holding each index with
// probability density (values ±1…±50, never 0).
func randomSparse(rng *rand.Rand, n int, density float64) core.Sparse {
	var s core.Sparse
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

// The SparCML variants' sparse-input forms over ZeroMQ return the exact sum
// of the inputs (divided by P), bitwise, on every rank: every input index is
// in the result, the sparse-only variants add no other index, and DSAR's
// dense regions hold zeros where no input had an entry. Densities 0.01 and
// 0.8 keep DSAR's streams sparse and make them go dense.
func TestSparCMLOverZMQEqualsExactSumOfSparseInputs(t *testing.T) {
	const n = 4099
	for _, p := range rankCounts {
		comms := zmqComms(t, p)
		for _, alg := range []core.Algorithm{core.SSARRecursiveDouble, core.SSARSplitAllgather, core.DSARSplitAllgather} {
			for _, density := range []float64{0.01, 0.3, 0.8} {
				t.Run(fmt.Sprintf("P=%d/%v/density=%v", p, alg, density), func(t *testing.T) {
					rng := rand.New(rand.NewPCG(uint64(p), uint64(100*density)))
					ins := make([]core.Sparse, p)
					sum := make([]float32, n)
					inUnion := make([]bool, n)
					for r := range ins {
						ins[r] = randomSparse(rng, n, density)
						for j, i := range ins[r].Idx {
							sum[i] += ins[r].Val[j]
							inUnion[i] = true
						}
					}
					runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
						out, _, err := c.SparseAllreduceSparse(ctx, n, ins[r], config(alg, density))
						if err != nil {
							return err
						}
						got := make([]float32, n)
						present := make([]bool, n)
						for j, i := range out.Idx {
							if i >= n || present[i] || (j > 0 && out.Idx[j-1] >= i) {
								return fmt.Errorf("result index %d (entry %d) out of order or range", i, j)
							}
							got[i], present[i] = out.Val[j], true
						}
						for i := 0; i < n; i++ {
							switch {
							case inUnion[i] && !present[i]:
								return fmt.Errorf("index %d of the inputs missing from the result", i)
							case present[i] && !inUnion[i] && alg != core.DSARSplitAllgather:
								return fmt.Errorf("index %d in the sparse result but in no input", i)
							}
							if want := sum[i] / float32(p); math.Float32bits(got[i]) != math.Float32bits(want) {
								return fmt.Errorf("index %d: %v, exact sum/P %v", i, got[i], want)
							}
						}
						return nil
					})
				})
			}
		}
	}
}

// referenceTopK keeps the k largest |x[i]| among the present indices, ties
// to the lower index, by sorting.
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

// serialGTopk is gTopk's binomial tree written out over all ranks at once:
// each rank takes its top k; rank r absorbs rank r+d (own values first) for
// d = 1, 2, 4, … and keeps the top k. It returns the final top k.
func serialGTopk(in [][]float32, k int) map[uint32]float32 {
	partial := make([]map[uint32]float32, len(in))
	for r, x := range in {
		all := make(map[uint32]float32, len(x))
		for i, v := range x {
			all[uint32(i)] = v
		}
		partial[r] = referenceTopK(all, k)
	}
	for d := 1; d < len(in); d *= 2 {
		for r := 0; r+d < len(in); r += 2 * d {
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
	return partial[0]
}

// gTopk over ZeroMQ against the serial tree, with many magnitude ties
// (integer values in ±100) so the tie rule is exercised: every rank holds
// exactly the tree's k entries divided by P, zeros elsewhere.
func TestGTopkOverZMQEqualsSerialTreeReference(t *testing.T) {
	const n = 4099
	for _, p := range rankCounts {
		comms := zmqComms(t, p)
		for _, density := range []float64{0.01, 0.1} {
			t.Run(fmt.Sprintf("P=%d/density=%v", p, density), func(t *testing.T) {
				in := integerInputs(p, n, uint64(p)+7)
				cfg := config(core.GTopk, density)
				k := cfg.K(n)
				global := serialGTopk(in, k)
				want := make([]float32, n)
				for i, v := range global {
					want[i] = v / float32(p)
				}
				runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
					g := append([]float32(nil), in[r]...)
					st, err := c.SparseAllreduce(ctx, uint64(1000*density), g, cfg)
					if err != nil {
						return err
					}
					if st.GlobalSelected != k {
						return fmt.Errorf("global result of %d entries, want k=%d", st.GlobalSelected, k)
					}
					if i, bad := firstBitwiseDifference(g, want); bad {
						return fmt.Errorf("index %d: %v, serial tree %v", i, g[i], want[i])
					}
					return nil
				})
			})
		}
	}
}
