package core

// Tests of FoldResidual: switching between sparse calls and a caller's own
// dense allreduce keeps every rank's gradient mass exactly.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
)

// Sparse, fold + dense, sparse, fold + dense...: with integer-valued
// gradients every sum is exact, so P × (sum of the averaged results) + the
// residuals equals the sum of every rank's gradients bitwise. Each fold
// empties the residual outside the held range, which keeps its entries.
func TestFoldResidualKeepsMassAcrossDenseSteps(t *testing.T) {
	const p, n, steps = 2, 64, 6
	cfg := okTopkConfig(0.1)
	grads := make([][][]float32, steps)
	for s := range grads {
		grads[s] = integerInputsOkTopk(p, n, uint64(100+s))
	}
	hold := []Span{{Start: 10, End: 14}}
	var results [p][steps][]float32
	var residuals [p][]float32
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for s := 0; s < steps; s++ {
			g := append([]float32(nil), grads[s][rank]...)
			if s%2 == 0 {
				if _, err := c.SparseAllreduce(ctx, 1, g, cfg); err != nil {
					return err
				}
			} else {
				before := append([]float32(nil), c.TensorStateOf(1).Residual...)
				if err := c.FoldResidual(1, g, hold, ValuesFloat32); err != nil {
					return err
				}
				res := c.TensorStateOf(1).Residual
				for i := range g {
					held := i >= 10 && i < 14
					want, wantRes := grads[s][rank][i]+before[i], float32(0)
					if held {
						want, wantRes = grads[s][rank][i], before[i]
					}
					if g[i] != want || res[i] != wantRes {
						return fmt.Errorf("rank %d step %d entry %d: fold gave %v and residual %v, want %v and %v", rank, s, i, g[i], res[i], want, wantRes)
					}
				}
				if _, err := c.Allreduce(ctx, g, true, DenseRing); err != nil {
					return err
				}
			}
			results[rank][s] = g
		}
		residuals[rank] = append([]float32(nil), c.TensorStateOf(1).Residual...)
		return nil
	})
	for i := 0; i < n; i++ {
		var sent, kept, total float32
		for s := 0; s < steps; s++ {
			if results[0][s][i] != results[1][s][i] {
				t.Fatalf("step %d entry %d: ranks differ (%v, %v)", s, i, results[0][s][i], results[1][s][i])
			}
			sent += p * results[0][s][i]
			for r := 0; r < p; r++ {
				total += grads[s][r][i]
			}
		}
		for r := 0; r < p; r++ {
			kept += residuals[r][i]
		}
		if sent+kept != total {
			t.Errorf("entry %d: P × results %v + residuals %v != gradients %v", i, sent, kept, total)
		}
	}
}

// Folding into float16 keeps the rounding error in the residual; NaN leaves
// both as they were; a tensor without state folds nothing; a wrong size or
// hold is refused.
func TestFoldResidualRoundingNonFiniteAndBadInput(t *testing.T) {
	c := &Communicator{states: map[uint64]*TensorState{}}
	st := NewTensorState(3, okTopkConfig(0.5))
	copy(st.Residual, []float32{1e-4, 0.5, -2})
	c.SetTensorState(7, st)

	x := []float32{1, 2, 3}
	if err := c.FoldResidual(7, x, nil, ValuesFloat16); err != nil {
		t.Fatal(err)
	}
	for i, sum := range []float32{1 + 1e-4, 2.5, 1} {
		if x[i] != ValuesFloat16.Nearest(sum) || x[i]+st.Residual[i] != sum {
			t.Errorf("entry %d: %v + residual %v, want float16 of %v with its error kept", i, x[i], st.Residual[i], sum)
		}
	}
	if st.Residual[0] == 0 {
		t.Errorf("1 + 1e-4 is not a float16, its error must stay in the residual")
	}

	copy(st.Residual, []float32{1, 2, 3})
	y := []float32{0, float32(math.NaN()), 0}
	if err := c.FoldResidual(7, y, nil, ValuesFloat32); err != nil {
		t.Fatal(err)
	}
	if y[0] != 0 || st.Residual[0] != 1 || st.Residual[2] != 3 {
		t.Errorf("a NaN sum must leave buffer and residual unchanged: %v, %v", y, st.Residual)
	}

	z := []float32{5}
	if err := c.FoldResidual(8, z, nil, ValuesFloat32); err != nil || z[0] != 5 {
		t.Errorf("no state: %v, %v", z, err)
	}
	if err := c.FoldResidual(7, make([]float32, 4), nil, ValuesFloat32); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("wrong size: %v", err)
	}
	if err := c.FoldResidual(7, make([]float32, 3), []Span{{Start: 2, End: 5}}, ValuesFloat32); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("hold past the end: %v", err)
	}
}

// A NaN on one rank at the fold's step: that rank's fold keeps its
// residual, the other rank's folds, and the dense sum is NaN on both. After
// UnfoldResidual every rank's residual is bitwise what it was before the
// step, and the next step (finite) folds it all; without a fold since the
// tensor's last call, UnfoldResidual changes nothing.
func TestUnfoldResidualRestoresEveryRanksResidualAfterANonFiniteDenseSum(t *testing.T) {
	const p, n = 2, 64
	cfg := okTopkConfig(0.1)
	first, second, third := integerInputsOkTopk(p, n, 1), integerInputsOkTopk(p, n, 2), integerInputsOkTopk(p, n, 3)
	var before, restored, after [p][]float32
	var skipped [p]bool
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		if _, err := c.SparseAllreduce(ctx, 1, append([]float32(nil), first[rank]...), cfg); err != nil {
			return err
		}
		before[rank] = append([]float32(nil), c.TensorStateOf(1).Residual...)
		g := append([]float32(nil), second[rank]...)
		if rank == 1 {
			g[5] = float32(math.NaN())
		}
		if err := c.FoldResidual(1, g, nil, ValuesFloat32); err != nil {
			return err
		}
		if _, err := c.Allreduce(ctx, g, true, DenseRing); err != nil {
			return err
		}
		skipped[rank] = g[5] != g[5]
		if err := c.UnfoldResidual(1); err != nil {
			return err
		}
		restored[rank] = append([]float32(nil), c.TensorStateOf(1).Residual...)
		if err := c.UnfoldResidual(1); err != nil { // nothing left to undo
			return err
		}
		g = append([]float32(nil), third[rank]...)
		if err := c.FoldResidual(1, g, nil, ValuesFloat32); err != nil {
			return err
		}
		for i := range g {
			if g[i] != third[rank][i]+before[rank][i] {
				return fmt.Errorf("rank %d entry %d: the next fold gave %v, want %v", rank, i, g[i], third[rank][i]+before[rank][i])
			}
		}
		after[rank] = append([]float32(nil), c.TensorStateOf(1).Residual...)
		return nil
	})
	for r := 0; r < p; r++ {
		if !skipped[r] {
			t.Fatalf("rank %d: the dense sum is finite; the test needs it NaN", r)
		}
		held := 0
		for i := range before[r] {
			if math.Float32bits(restored[r][i]) != math.Float32bits(before[r][i]) {
				t.Errorf("rank %d entry %d: residual %v after the skipped step, %v before it", r, i, restored[r][i], before[r][i])
			}
			if before[r][i] != 0 {
				held++
			}
			if after[r][i] != 0 {
				t.Errorf("rank %d entry %d: residual %v after a finite fold, want 0", r, i, after[r][i])
			}
		}
		if held == 0 {
			t.Fatalf("rank %d held no residual: the test checks nothing", r)
		}
	}
}

// ReadResidual copies the residual bitwise and changes nothing; a tensor
// without state reads as zeros; a caller-selected tensor's residual and a
// buffer of another length are refused.
func TestReadResidualCopiesItAndChangesNothing(t *testing.T) {
	c := &Communicator{states: map[uint64]*TensorState{}}
	st := NewTensorState(3, okTopkConfig(0.5))
	want := []float32{1e-4, -0.5, float32(math.Inf(1))}
	copy(st.Residual, want)
	c.SetTensorState(7, st)
	before, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	out := []float32{9, 9, 9}
	if err := c.ReadResidual(7, out); err != nil {
		t.Fatal(err)
	}
	for i := range want {
		if math.Float32bits(out[i]) != math.Float32bits(want[i]) {
			t.Errorf("entry %d: read %v, residual %v", i, out[i], want[i])
		}
	}
	if after, err := st.MarshalBinary(); err != nil || string(after) != string(before) {
		t.Errorf("the read changed the state (%v)", err)
	}
	none := []float32{9, 9}
	if err := c.ReadResidual(8, none); err != nil || none[0] != 0 || none[1] != 0 {
		t.Errorf("no state: %v, %v", none, err)
	}
	if err := c.ReadResidual(7, make([]float32, 4)); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("wrong size: %v", err)
	}
	st.CallerResidual = true
	if err := c.ReadResidual(7, make([]float32, 3)); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a caller-selected tensor: %v", err)
	}
}

// ResidualZeros marks exactly the entries whose residual is 0 (-0 too),
// lists those not marked before, ascending, counting them even where became
// holds fewer, and changes nothing; a tensor without state is all zeros; a
// caller-selected tensor and lengths other than the tensor's are refused.
func TestResidualZerosMarksTheZeroEntriesAndListsThoseThatBecameZero(t *testing.T) {
	c := &Communicator{states: map[uint64]*TensorState{}}
	st := NewTensorState(7, okTopkConfig(0.5))
	copy(st.Residual, []float32{0, 1e-38, float32(math.Copysign(0, -1)), -2, 0, float32(math.NaN()), 0})
	c.SetTensorState(7, st)
	saved, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	zero := make([]byte, 7)
	became := make([]int64, 8)
	if n, err := c.ResidualZeros(7, nil, zero, became); err != nil || n != 0 || fmt.Sprint(zero) != "[1 0 1 0 1 0 1]" {
		t.Errorf("no earlier marks: %v, count %d, %v", zero, n, err)
	}
	before := []byte{0, 0, 1, 1, 0, 0, 0}
	n, err := c.ResidualZeros(7, before, zero, became)
	if err != nil || n != 3 || fmt.Sprint(became[:n]) != "[0 4 6]" || fmt.Sprint(zero) != "[1 0 1 0 1 0 1]" {
		t.Errorf("became zero: %v (count %d), marks %v, %v", became[:min(n, len(became))], n, zero, err)
	}
	short := []int64{-1, -1}
	if n, err := c.ResidualZeros(7, before, zero, short); err != nil || n != 3 || fmt.Sprint(short) != "[0 4]" {
		t.Errorf("a short list: %v (count %d), %v", short, n, err)
	}
	if after, err := st.MarshalBinary(); err != nil || string(after) != string(saved) || fmt.Sprint(before) != "[0 0 1 1 0 0 0]" {
		t.Errorf("the read changed the state or the earlier marks (%v)", err)
	}
	none := make([]byte, 3)
	if n, err := c.ResidualZeros(8, []byte{1, 0, 0}, none, became); err != nil || n != 2 || fmt.Sprint(none) != "[1 1 1]" {
		t.Errorf("no state: %v (count %d), %v", none, n, err)
	}
	if _, err := c.ResidualZeros(7, nil, make([]byte, 6), became); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("wrong size: %v", err)
	}
	if _, err := c.ResidualZeros(7, make([]byte, 6), zero, became); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("earlier marks of another size: %v", err)
	}
	st.CallerResidual = true
	if _, err := c.ResidualZeros(7, nil, zero, became); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("a caller-selected tensor: %v", err)
	}
}
