package core

// Tests of the caller-selected call: bitwise the dense-input call's result
// and residual over refresh and reuse calls, repartitions and 16-bit
// values; a skipped step and bad input change nothing; checkpoints carry the
// caller's residual in the format either form resumes.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// callerStep is a caller's side of one caller-selected call: it forms acc,
// selects by the plan's rules (the library's own selection, as a GPU caller
// ports it), calls, and applies step 6's terms to its residual and output.
func callerStep(ctx context.Context, c *Communicator, id uint64, grad, residual []float32, cfg Config) ([]float32, error) {
	n := len(grad)
	plan := c.SelectionPlan(id, n, cfg)
	acc := make([]float32, n)
	nonFinite := Accumulate(acc, grad, residual) > 0
	th := plan.Threshold
	var sel Sparse
	var err error
	if !nonFinite {
		if sel, err = SelectByThreshold(Sparse{}, acc, plan.K, &th, plan.Exact); err != nil {
			return nil, err
		}
	}
	out, _, err := c.SparseAllreduceSelected(ctx, id, n, sel, th, nonFinite, cfg, CallOptions{})
	if err != nil {
		return nil, err
	}
	copy(residual, acc)
	for j, i := range out.Consumed.Idx {
		residual[i] = finiteOr0(residual[i] - out.Consumed.Val[j])
	}
	for j, i := range out.OwnerErr.Idx {
		residual[i] = finiteOr0(residual[i] + out.OwnerErr.Val[j])
	}
	result := make([]float32, n)
	for j, i := range out.Result.Idx {
		result[i] = out.Result.Val[j]
	}
	return result, nil
}

func TestSelectedEqualsDenseInput(t *testing.T) {
	for _, values := range []ValueType{ValuesFloat32, ValuesFloat16, ValuesBFloat16, ValuesInt8, ValuesInt4} {
		for _, p := range []int{1, 3} {
			t.Run(fmt.Sprintf("%v/P=%d", values, p), func(t *testing.T) {
				const n, steps = 5000, 14
				cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 3, TauPrime: 4, Values: values}
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					rng := rand.New(rand.NewPCG(uint64(rank), 9))
					residual := make([]float32, n)
					for step := 0; step < steps; step++ {
						grad := make([]float32, n)
						scale := float32(1 + step%5) // the scale moves: reuse calls raise, nudge and fall back
						for i := range grad {
							grad[i] = float32(rng.NormFloat64()) * scale
						}
						dense := append([]float32(nil), grad...)
						if _, err := c.SparseAllreduce(ctx, 1, dense, cfg); err != nil {
							return fmt.Errorf("step %d dense input: %w", step, err)
						}
						got, err := callerStep(ctx, c, 2, grad, residual, cfg)
						if err != nil {
							return fmt.Errorf("step %d selected: %w", step, err)
						}
						want, wantRes := dense, c.TensorStateOf(1).Residual
						for i := range got {
							if math.Float32bits(got[i]) != math.Float32bits(want[i]) || math.Float32bits(residual[i]) != math.Float32bits(wantRes[i]) {
								return fmt.Errorf("rank %d step %d entry %d: result %v residual %v, dense input's %v and %v",
									rank, step, i, got[i], residual[i], want[i], wantRes[i])
							}
						}
						a, b := c.TensorStateOf(1), c.TensorStateOf(2)
						if a.LocalThreshold != b.LocalThreshold || a.GlobalThreshold != b.GlobalThreshold || a.Iter != b.Iter ||
							fmt.Sprint(a.Boundaries) != fmt.Sprint(b.Boundaries) {
							return fmt.Errorf("step %d: states differ: %+v against %+v", step, *b, *a)
						}
					}
					return nil
				})
			})
		}
	}
}

// A NaN on one rank skips the step on every rank and leaves the state (and
// so the caller's residual, which it must then keep) as it was; the next
// step goes on as if the skipped one had not been.
func TestSelectedNonFiniteSkipsEverywhere(t *testing.T) {
	const n = 3000
	cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 2, TauPrime: 3}
	runInProc(t, 3, func(ctx context.Context, rank int, c *Communicator) error {
		residual := make([]float32, n)
		grad := make([]float32, n)
		for i := range grad {
			grad[i] = float32((i*7+rank*13)%101) - 50
		}
		if _, err := callerStep(ctx, c, 5, grad, residual, cfg); err != nil {
			return err
		}
		before := *c.TensorStateOf(5)
		kept := append([]float32(nil), residual...)
		bad := append([]float32(nil), grad...)
		if rank == 1 {
			bad[17] = float32(math.NaN())
		}
		if _, err := callerStep(ctx, c, 5, bad, residual, cfg); !errors.Is(err, ErrNonFinite) {
			return fmt.Errorf("rank %d: a NaN on rank 1 gave %v, want ErrNonFinite", rank, err)
		}
		after := *c.TensorStateOf(5)
		if after.Iter != before.Iter || after.LocalThreshold != before.LocalThreshold || after.GlobalThreshold != before.GlobalThreshold {
			return fmt.Errorf("rank %d: the skipped step changed the state: %+v, was %+v", rank, after, before)
		}
		for i := range residual {
			if residual[i] != kept[i] {
				return fmt.Errorf("rank %d: the caller's residual changed at %d", rank, i)
			}
		}
		_, err := callerStep(ctx, c, 5, grad, residual, cfg)
		return err
	})
}

// Bad input is refused on the rank that made it and a mismatch on its
// peers (which then stop, as after any refusal on one rank); nothing is
// installed.
func TestSelectedRefusesBadInput(t *testing.T) {
	const n = 1000
	cfg := Config{Algorithm: OkTopk, Density: 0.01, Tau: 2, TauPrime: 2} // k = 10: at most 13 selected
	seq := func(m int) Sparse {
		s := Sparse{}
		for i := 0; i < m; i++ {
			s.Append(uint32(3*i), 1)
		}
		return s
	}
	cases := []struct {
		name      string
		sel       Sparse
		threshold float32
		nonFinite bool
		cfg       Config
	}{
		{"more than 4k/3", seq(14), 0, false, cfg},
		{"out of order", Sparse{Idx: []uint32{5, 2}, Val: []float32{1, 1}}, 0, false, cfg},
		{"index past n", Sparse{Idx: []uint32{n}, Val: []float32{1}}, 0, false, cfg},
		{"NaN value", Sparse{Idx: []uint32{1}, Val: []float32{float32(math.NaN())}}, 0, false, cfg},
		{"non-finite with entries", seq(1), 0, true, cfg},
		{"negative threshold", seq(1), -1, false, cfg},
		{"another algorithm", seq(1), 0, false, Config{Algorithm: TopkA, Density: 0.01, Tau: 2, TauPrime: 2}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
				sel, th, nf, cc := seq(1), float32(0), false, cfg
				if rank == 0 {
					sel, th, nf, cc = tc.sel, tc.threshold, tc.nonFinite, tc.cfg
				}
				_, _, err := c.SparseAllreduceSelected(ctx, 9, n, sel, th, nf, cc, CallOptions{})
				if c.TensorStateOf(9) != nil {
					return fmt.Errorf("rank %d: a refused call installed a state", rank)
				}
				want := ErrInvalidArgument
				if rank == 1 {
					want = ErrMismatch
				}
				if !errors.Is(err, want) {
					return fmt.Errorf("rank %d: %v, want %v", rank, err, want)
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A tensor's residual is either the library's or the caller's: the other
// form of the call is refused, and a fold of a caller-residual state too.
func TestSelectedAndDenseInputStatesDoNotMix(t *testing.T) {
	cfg := Config{Algorithm: OkTopk, Density: 0.1, Tau: 2, TauPrime: 2}
	runInProc(t, 1, func(ctx context.Context, rank int, c *Communicator) error {
		if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 100), cfg); err != nil {
			return err
		}
		if _, _, err := c.SparseAllreduceSelected(ctx, 1, 100, Sparse{}, 0, false, cfg, CallOptions{}); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("selected call on a dense-input tensor: %v", err)
		}
		if _, _, err := c.SparseAllreduceSelected(ctx, 2, 100, Sparse{}, 0, false, cfg, CallOptions{}); err != nil {
			return err
		}
		if _, err := c.SparseAllreduce(ctx, 2, make([]float32, 100), cfg); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("dense-input call on a caller-residual tensor: %v", err)
		}
		if err := c.FoldResidual(2, make([]float32, 100), nil, ValuesFloat32); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("fold of a caller-residual tensor: %v", err)
		}
		if _, err := c.TensorStateOf(2).MarshalBinary(); !errors.Is(err, ErrInvalidArgument) {
			return fmt.Errorf("saving a caller-residual state without its residual: %v", err)
		}
		return nil
	})
}

// A checkpoint of a caller-residual state is the usual format: loaded and
// given its residual back, or loaded as a dense-input state, either form of
// the call continues with the same bits as the run that never stopped.
func TestSelectedCheckpointResumesEitherForm(t *testing.T) {
	const n, steps, cut = 4000, 9, 5
	cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 3, TauPrime: 4, Values: ValuesFloat16}
	grads := func(rank, step int) []float32 {
		rng := rand.New(rand.NewPCG(uint64(rank*100+step), 3))
		g := make([]float32, n)
		for i := range g {
			g[i] = float32(rng.NormFloat64())
		}
		return g
	}
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		residual := make([]float32, n)
		var blob []byte
		var full []float32
		for step := 0; step < steps; step++ {
			out, err := callerStep(ctx, c, 1, grads(rank, step), residual, cfg)
			if err != nil {
				return err
			}
			if step == cut-1 {
				if blob, err = c.TensorStateOf(1).MarshalWithResidual(residual); err != nil {
					return err
				}
			}
			full = out
		}
		// Resumed as caller-selected (tensor 2) and as dense input (tensor 3).
		st := new(TensorState)
		if err := st.UnmarshalBinary(blob); err != nil {
			return err
		}
		resumedResidual := st.TakeResidual()
		c.SetTensorState(2, st)
		dense := new(TensorState)
		if err := dense.UnmarshalBinary(blob); err != nil {
			return err
		}
		c.SetTensorState(3, dense)
		var viaSelected, viaDense []float32
		for step := cut; step < steps; step++ {
			out, err := callerStep(ctx, c, 2, grads(rank, step), resumedResidual, cfg)
			if err != nil {
				return err
			}
			viaSelected = out
			viaDense = grads(rank, step)
			if _, err := c.SparseAllreduce(ctx, 3, viaDense, cfg); err != nil {
				return err
			}
		}
		for i := range full {
			if full[i] != viaSelected[i] || full[i] != viaDense[i] || residual[i] != resumedResidual[i] || residual[i] != c.TensorStateOf(3).Residual[i] {
				return fmt.Errorf("rank %d entry %d: uninterrupted %v/%v, resumed selected %v/%v, resumed dense %v/%v", rank, i,
					full[i], residual[i], viaSelected[i], resumedResidual[i], viaDense[i], c.TensorStateOf(3).Residual[i])
			}
		}
		return nil
	})
}
