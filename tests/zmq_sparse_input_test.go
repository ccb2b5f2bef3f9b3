package tests

// Tests of the sparse-input baselines over real ZeroMQ sockets on loopback:
// SparCML against the exact sum of its sparse inputs and gTopk against a
// serial tree reference (internal/testref), both written out independently
// of core.

import (
	"context"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/internal/testref"
)

// randomSparse is testref.RandomSparse as a core.Sparse.
func randomSparse(rng *rand.Rand, n int, density float64) core.Sparse {
	idx, val := testref.RandomSparse(rng, n, density)
	return core.Sparse{Idx: idx, Val: val}
}

// The SparCML variants' sparse-input forms over ZeroMQ return the exact sum
// of the inputs (divided by P), bitwise, on every rank: every input index is
// in the result, the sparse-only variants add no other index, and DSAR's
// dense regions hold zeros where no input had an entry. Densities 0.01 and
// 0.99 keep DSAR's streams sparse and make them go dense (priced with coded
// indices, pairs cost less than dense values up to about 97% of a region
// set).
func TestSparCMLOverZMQEqualsExactSumOfSparseInputs(t *testing.T) {
	const n = 4099
	for _, p := range rankCounts {
		comms := zmqComms(t, p)
		for _, alg := range []core.Algorithm{core.SSARRecursiveDouble, core.SSARSplitAllgather, core.DSARSplitAllgather} {
			for _, density := range []float64{0.01, 0.3, 0.99} {
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
				global, _, _ := testref.GTopk(in, k)
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
					if i, bad := testref.FirstBitwiseDifference(g, want); bad {
						return fmt.Errorf("index %d: %v, serial tree %v", i, g[i], want[i])
					}
					return nil
				})
			})
		}
	}
}
