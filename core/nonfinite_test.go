package core

// Tests of NaN and Inf in inputs: for every sparse algorithm, one rank's
// non-finite gradient skips the step on every rank and changes nothing, and
// bad sparse inputs on one rank fail every rank alike.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
)

var sparseAlgorithmsUnderTest = append([]Algorithm{OkTopk}, sparseBaselines...)

// stateCopy is a deep copy of what a call may change in a TensorState.
type stateCopy struct {
	iter          int
	local, global float32
	boundaries    []uint32
	residual      []float32
}

func copyState(st *TensorState) stateCopy {
	return stateCopy{st.Iter, st.LocalThreshold, st.GlobalThreshold,
		slices.Clone(st.Boundaries), slices.Clone(st.Residual)}
}

// sameState reports the first difference between st and c, bitwise.
func sameState(st *TensorState, c stateCopy) error {
	switch {
	case st.Iter != c.iter:
		return fmt.Errorf("iteration %d, was %d", st.Iter, c.iter)
	case math.Float32bits(st.LocalThreshold) != math.Float32bits(c.local):
		return fmt.Errorf("local threshold %v, was %v", st.LocalThreshold, c.local)
	case math.Float32bits(st.GlobalThreshold) != math.Float32bits(c.global):
		return fmt.Errorf("global threshold %v, was %v", st.GlobalThreshold, c.global)
	case !slices.Equal(st.Boundaries, c.boundaries):
		return fmt.Errorf("region boundaries %v, were %v", st.Boundaries, c.boundaries)
	}
	if i, bad := testref.FirstBitwiseDifference(st.Residual, c.residual); bad {
		return fmt.Errorf("residual[%d] = %v, was %v", i, st.Residual[i], c.residual[i])
	}
	return nil
}

// isSkip is the status every rank must get for a step with NaN/Inf anywhere.
func isSkip(err error) bool { return errors.Is(err, ErrNonFinite) && errors.Is(err, errStepSkipped) }

// For every sparse algorithm: one rank's gradient holds NaN (where it would
// be selected, or where it would not) or Inf. Every rank must return the
// same skip status, leave its gradient and tensor state bitwise as they
// were, and the next call must work and give exactly what it gives when the
// skipped step never happened — identical on every rank.
func TestSparseNonFiniteOnOneRankSkipsStepOnEveryRank(t *testing.T) {
	const n = 600
	cases := []struct {
		name  string
		value float32
		index int // into a gradient whose large entries sit at multiples of 50
	}{
		{"NaN above threshold", float32(math.NaN()), 100},
		{"NaN below threshold", float32(math.NaN()), 101},
		{"+Inf", float32(math.Inf(1)), 7},
		{"-Inf below threshold", float32(math.Inf(-1)), 203},
	}
	grad := func(p, rank, call int) []float32 {
		g := gaussianInputs(p, n, uint64(100+call))[rank]
		for i := 0; i < n; i += 50 {
			g[i] = 1000 + float32(i) // selected on every rank at density 0.05
		}
		return g
	}
	for _, alg := range sparseAlgorithmsUnderTest {
		for _, p := range []int{2, 3, 5} {
			cfg := Config{Algorithm: alg, Density: 0.05, Tau: 2, TauPrime: 2}
			// The control run: calls 0 and 2 without the step in between.
			control := make([][]float32, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				for _, call := range []int{0, 2} {
					control[r] = grad(p, r, call)
					if _, err := c.SparseAllreduce(ctx, 1, control[r], cfg); err != nil {
						return err
					}
				}
				return nil
			})
			for _, tc := range cases {
				bad := p - 1 - p/2 // a middle or last rank, never only rank 0
				t.Run(fmt.Sprintf("%v/P=%d/%s", alg, p, tc.name), func(t *testing.T) {
					after := make([][]float32, p)
					runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
						if _, err := c.SparseAllreduce(ctx, 1, grad(p, r, 0), cfg); err != nil {
							return err
						}
						before := copyState(c.TensorStateOf(1))
						g := grad(p, r, 1)
						if r == bad {
							g[tc.index] = tc.value
						}
						orig := slices.Clone(g)
						if _, err := c.SparseAllreduce(ctx, 1, g, cfg); !isSkip(err) {
							return fmt.Errorf("rank %d: %v, want the skip status (ErrNonFinite, every rank skipped)", r, err)
						}
						if i, differs := testref.FirstBitwiseDifference(g, orig); differs {
							return fmt.Errorf("rank %d: gradient[%d] changed to %v by a skipped step", r, i, g[i])
						}
						if err := sameState(c.TensorStateOf(1), before); err != nil {
							return fmt.Errorf("rank %d after a skipped step: %w", r, err)
						}
						after[r] = grad(p, r, 2)
						_, err := c.SparseAllreduce(ctx, 1, after[r], cfg)
						return err
					})
					for r := range after {
						if i, differs := testref.FirstBitwiseDifference(after[r], control[r]); differs {
							t.Fatalf("rank %d element %d: %v after the skipped step, %v without it", r, i, after[r][i], control[r][i])
						}
						if i, differs := testref.FirstBitwiseDifference(after[r], after[0]); differs {
							t.Fatalf("rank %d element %d: %v, rank 0 has %v", r, i, after[r][i], after[0][i])
						}
					}
				})
			}
		}
	}
}

// The sparse-input form: NaN or Inf among one rank's values is the skip
// status on every rank, a malformed input on one rank ErrInvalidArgument on
// every rank; neither poisons the communicator.
func TestSparseInputBadValuesOrIndicesOnOneRankFailEveryRankAlike(t *testing.T) {
	const n = 1000
	cases := []struct {
		name  string
		spoil func(s *Sparse)
		want  func(error) bool
	}{
		{"NaN", func(s *Sparse) { s.Val[3] = float32(math.NaN()) }, isSkip},
		{"Inf", func(s *Sparse) { s.Val[0] = float32(math.Inf(-1)) }, isSkip},
		{"indices out of order", func(s *Sparse) { s.Idx[1], s.Idx[2] = s.Idx[2], s.Idx[1] }, func(err error) bool {
			return errors.Is(err, ErrInvalidArgument)
		}},
		{"index not below n", func(s *Sparse) { s.Idx[s.Len()-1] = n }, func(err error) bool {
			return errors.Is(err, ErrInvalidArgument)
		}},
	}
	for _, alg := range sparseInputAlgorithms() {
		for _, p := range []int{2, 3, 5} {
			for _, tc := range cases {
				t.Run(fmt.Sprintf("%v/P=%d/%s", alg, p, tc.name), func(t *testing.T) {
					cfg := Config{Algorithm: alg, Density: 0.05, Tau: 1, TauPrime: 1}
					outs := make([]Sparse, p)
					runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
						in := randomSparse(rand.New(rand.NewPCG(uint64(r), 11)), n, 0.05)
						spoilt := Sparse{Idx: slices.Clone(in.Idx), Val: slices.Clone(in.Val)}
						if r == p/2 {
							tc.spoil(&spoilt)
						}
						if _, _, err := c.SparseAllreduceSparse(ctx, n, spoilt, cfg); !tc.want(err) {
							return fmt.Errorf("rank %d: %v", r, err)
						}
						var err error
						outs[r], _, err = c.SparseAllreduceSparse(ctx, n, in, cfg)
						return err
					})
					for r := range outs {
						if !sparseBitwiseEqual(outs[r], outs[0]) || outs[r].Len() == 0 {
							t.Fatalf("rank %d: the call after the failed one gave %d entries, rank 0 %d (or differs)", r, outs[r].Len(), outs[0].Len())
						}
					}
				})
			}
		}
	}
}
