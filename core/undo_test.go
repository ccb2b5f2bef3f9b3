package core

// Tests of UndoCall: a call taken back leaves the tensor's state bitwise as
// it was before it, and the calls after it give the outputs and residuals
// of a run that never made it (P = 2 and 3, every algorithm that keeps a
// residual, Auto's dense choice and caller-selected calls included); what
// leaves nothing to take back (a second undo, a failed call, a load, a fold
// not undone); and what the residual's copy costs on a large tensor.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"testing"
	"time"
)

// blobOf is tensor id's checkpoint, nil when it has no state.
func blobOf(t testing.TB, c *Communicator, id uint64) []byte {
	st := c.TensorStateOf(id)
	if st == nil {
		return nil
	}
	b, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// undoRun is one rank's outputs of the calls that count and its final
// checkpoint.
type undoRun struct {
	outputs [][]float32
	algs    []Algorithm
	final   []byte
}

// runWithUndo makes one call per step on tensor 1 with grads[step][rank];
// the steps in undone are taken back right after their call (and checked:
// the checkpoint is the one before the call, and a second undo changes
// nothing); skip leaves them out altogether, the run without them.
func runWithUndo(t *testing.T, p int, cfg Config, link *LinkModel, grads [][][]float32, undone map[int]bool, skip bool) []undoRun {
	t.Helper()
	runs := make([]undoRun, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		if link != nil {
			if err := c.SetLinkModel(*link); err != nil {
				return err
			}
		}
		for s, g := range grads {
			if skip && undone[s] {
				continue
			}
			before := blobOf(t, c, 1)
			out := append([]float32(nil), g[rank]...)
			// The run without the undone calls makes no call undoable:
			// the option changes nothing of a call but what it keeps.
			st, err := c.SparseAllreduceWith(ctx, 1, out, cfg, CallOptions{Undoable: !skip})
			if err != nil {
				return fmt.Errorf("step %d: %w", s, err)
			}
			if !undone[s] {
				runs[rank].outputs = append(runs[rank].outputs, out)
				runs[rank].algs = append(runs[rank].algs, st.Algorithm)
				continue
			}
			for try := 0; try < 2; try++ { // the second finds nothing to take back
				if err := c.UndoCall(1); err != nil {
					return err
				}
				if after := blobOf(t, c, 1); !bytes.Equal(after, before) {
					return fmt.Errorf("rank %d step %d (undo %d): state after the undo differs from the state before the call (%d bytes, %d before)",
						rank, s, try+1, len(after), len(before))
				}
			}
		}
		runs[rank].final = blobOf(t, c, 1)
		return nil
	})
	return runs
}

func TestUndoCallIsAsIfTheCallNeverHappened(t *testing.T) {
	const n, steps = 3000, 12
	// The first call (it creates the state), two in a row, one on a
	// repartition (Tau 3) or threshold refresh (TauPrime 2), and the last.
	undone := map[int]bool{0: true, 3: true, 4: true, 6: true, steps - 1: true}
	denseLink := LinkModel{Alpha: 500e-6, Beta: 1e-9, Gamma: 0.6e-9}
	cases := []struct {
		name string
		cfg  Config
		link *LinkModel
	}{
		{"oktopk", Config{Algorithm: OkTopk, Density: 0.02, Tau: 3, TauPrime: 2}, nil},
		{"oktopk/float16/stochastic", Config{Algorithm: OkTopk, Density: 0.02, Tau: 3, TauPrime: 2, Values: ValuesFloat16, Stochastic: true}, nil},
		{"topka/bfloat16", Config{Algorithm: TopkA, Density: 0.02, Tau: 3, TauPrime: 2, Values: ValuesBFloat16}, nil},
		{"topkdsa", Config{Algorithm: TopkDSA, Density: 0.02, Tau: 3, TauPrime: 2}, nil},
		{"gtopk", Config{Algorithm: GTopk, Density: 0.02, Tau: 3, TauPrime: 2}, nil},
		{"gaussiank", Config{Algorithm: Gaussiank, Density: 0.02, Tau: 3, TauPrime: 2}, nil},
		{"ssar_split_allgather", Config{Algorithm: SSARSplitAllgather, Density: 0.02, Tau: 3, TauPrime: 2}, nil},
		{"auto/dense", Config{Algorithm: Auto, Density: 0.6, Tau: 3, TauPrime: 2}, &denseLink},
	}
	for _, tc := range cases {
		for _, p := range []int{2, 3} {
			t.Run(fmt.Sprintf("%s/P=%d", tc.name, p), func(t *testing.T) {
				d := newDriftingGradients(p, n, 17)
				grads := make([][][]float32, steps)
				for s := range grads {
					grads[s] = d.next()
				}
				with := runWithUndo(t, p, tc.cfg, tc.link, grads, undone, false)
				without := runWithUndo(t, p, tc.cfg, tc.link, grads, undone, true)
				for r := 0; r < p; r++ {
					if len(with[r].outputs) != len(without[r].outputs) {
						t.Fatalf("rank %d: %d calls counted, %d without the undone ones", r, len(with[r].outputs), len(without[r].outputs))
					}
					for s := range with[r].outputs {
						if !bytes.Equal(float32Bytes(with[r].outputs[s]), float32Bytes(without[r].outputs[s])) {
							t.Fatalf("rank %d, call %d after the undone ones: output differs from the run without them", r, s)
						}
					}
					if !bytes.Equal(with[r].final, without[r].final) {
						t.Errorf("rank %d: final state (residual, thresholds, boundaries, call count) differs from the run without the undone calls", r)
					}
				}
				if tc.link != nil {
					dense := 0
					for _, a := range with[0].algs {
						if a.Dense() {
							dense++
						}
					}
					if dense == 0 {
						t.Fatalf("auto chose %v: the case needs its dense choice", with[0].algs)
					}
				}
			})
		}
	}
}

// What leaves nothing to take back: a second undo, a failed call (a NaN:
// it left the state as it was, and the call before it stays), a load, a
// fold not undone by its unfold; a tensor without state. A fold undone by
// its unfold (momentum masking reads the residual so) leaves the call's
// undo in place.
func TestUndoCallNothingToTakeBack(t *testing.T) {
	const p, n = 2, 400
	cfg := Config{Algorithm: OkTopk, Density: 0.05, Tau: 2, TauPrime: 2}
	// Every rank's gradients, made before the ranks run (the generator is
	// not theirs to share).
	d, steps := newDriftingGradients(p, n, 3), make([][][]float32, 6)
	for s := range steps {
		steps[s] = d.next()
	}
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		at := 0
		next := func() []float32 { at++; return steps[at-1][rank] }
		call := func(g []float32) error {
			_, err := c.SparseAllreduceWith(ctx, 1, append([]float32(nil), g...), cfg, CallOptions{Undoable: true})
			return err
		}
		check := func(what string, want []byte) error {
			if got := blobOf(t, c, 1); !bytes.Equal(got, want) {
				return fmt.Errorf("rank %d: %s: the state changed", rank, what)
			}
			return nil
		}
		if err := c.UndoCall(1); err != nil { // no state
			return err
		}
		if err := call(next()); err != nil {
			return err
		}
		afterFirst := blobOf(t, c, 1)

		// A NaN on rank 1: every rank skips the call, and the undo that
		// follows leaves the first call in place.
		g := next()
		if rank == 1 {
			g[7] = float32(math.NaN())
		}
		if err := call(g); !errors.Is(err, ErrNonFinite) {
			return fmt.Errorf("rank %d: a NaN call returned %v", rank, err)
		}
		if err := c.UndoCall(1); err != nil {
			return err
		}
		if err := check("undo after a skipped call", afterFirst); err != nil {
			return err
		}

		// A fold and its unfold (a peek at the residual) keep the undo;
		// a fold alone suspends it.
		if err := call(next()); err != nil {
			return err
		}
		afterSecond := blobOf(t, c, 1)
		peek := make([]float32, n)
		if err := c.FoldResidual(1, peek, nil, ValuesFloat32); err != nil {
			return err
		}
		if err := c.UndoCall(1); err != nil {
			return err
		}
		folded := blobOf(t, c, 1)
		if err := c.UnfoldResidual(1); err != nil {
			return err
		}
		if err := check("fold and unfold", afterSecond); err != nil {
			return err
		}
		if bytes.Equal(folded, afterSecond) {
			return fmt.Errorf("rank %d: the fold moved nothing: the test checks nothing", rank)
		}
		if err := c.UndoCall(1); err != nil {
			return err
		}
		if err := check("undo after a fold and its unfold", afterFirst); err != nil {
			return err
		}
		if err := c.UnfoldResidual(1); err != nil { // the undo forgot the fold
			return err
		}
		if err := check("unfold after the undo", afterFirst); err != nil {
			return err
		}

		// A load: nothing to take back.
		if err := call(next()); err != nil {
			return err
		}
		saved := blobOf(t, c, 1)
		loaded := new(TensorState)
		if err := loaded.UnmarshalBinary(saved); err != nil {
			return err
		}
		c.SetTensorState(1, loaded)
		if err := c.UndoCall(1); err != nil {
			return err
		}
		if err := check("undo after a load", saved); err != nil {
			return err
		}

		// A call made without the option kept nothing: refused, and
		// nothing changes; a failed call after it clears the refusal.
		if _, err := c.SparseAllreduce(ctx, 1, next(), cfg); err != nil {
			return err
		}
		plain := blobOf(t, c, 1)
		if err := c.UndoCall(1); !errors.Is(err, ErrInvalidUsage) {
			return fmt.Errorf("rank %d: undo of a call made without the option returned %v", rank, err)
		}
		if err := check("undo refused", plain); err != nil {
			return err
		}
		if st := c.TensorStateOf(1); st.lastCall.residual != nil {
			return fmt.Errorf("rank %d: a tensor reduced without the option still keeps a copy of its residual", rank)
		}
		g = next()
		if rank == 0 {
			g[3] = float32(math.Inf(1))
		}
		if err := call(g); !errors.Is(err, ErrNonFinite) {
			return fmt.Errorf("rank %d: an Inf call returned %v", rank, err)
		}
		if err := c.UndoCall(1); err != nil {
			return err
		}
		return check("undo after a skipped call", plain)
	})
}

// Without the option a call copies nothing and keeps nothing more than
// before: the memory that stays allocated between calls is the residual's.
func TestUndoCallWithoutTheOptionKeepsNoCopy(t *testing.T) {
	const p, n = 2, 1 << 16
	cfg := Config{Algorithm: OkTopk, Density: 0.01, Tau: 2, TauPrime: 2}
	d, steps := newDriftingGradients(p, n, 9), make([][][]float32, 3)
	for s := range steps {
		steps[s] = d.next() // before the ranks run: the generator is not theirs to share
	}
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for s := 0; s < 3; s++ {
			undoable := s == 1
			if _, err := c.SparseAllreduceWith(ctx, 1, steps[s][rank], cfg, CallOptions{Undoable: undoable}); err != nil {
				return err
			}
			if kept := c.TensorStateOf(1).lastCall.residual != nil; kept != undoable {
				return fmt.Errorf("rank %d call %d (undoable %v): a copy of the residual kept: %v", rank, s, undoable, kept)
			}
		}
		return nil
	})
}

// A caller-selected call (the device path's): the undo puts back the
// thresholds, boundaries and call count (the caller puts back its own
// residual), and the calls after it are those of a run without it.
func TestUndoCallCallerSelected(t *testing.T) {
	const n, steps = 2000, 9
	undone := map[int]bool{0: true, 2: true, 5: true}
	for _, p := range []int{2, 3} {
		t.Run(fmt.Sprintf("P=%d", p), func(t *testing.T) {
			cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 3, TauPrime: 2}
			d := newDriftingGradients(p, n, 5)
			grads := make([][][]float32, steps)
			for s := range grads {
				grads[s] = d.next()
			}
			results := make([][2][][]float32, p)
			finals := make([][2][]byte, p)
			for run, skip := range []bool{false, true} {
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					residual := make([]float32, n)
					for s, g := range grads {
						if skip && undone[s] {
							continue
						}
						var before []byte
						if st := c.TensorStateOf(2); st != nil {
							var err error
							if before, err = st.MarshalWithResidual(residual); err != nil {
								return err
							}
						}
						kept := append([]float32(nil), residual...)
						out, err := callerStep(ctx, c, 2, g[rank], residual, cfg)
						if err != nil {
							return fmt.Errorf("step %d: %w", s, err)
						}
						if !undone[s] || skip {
							results[rank][run] = append(results[rank][run], out)
							continue
						}
						if err := c.UndoCall(2); err != nil {
							return err
						}
						copy(residual, kept)
						var after []byte
						if st := c.TensorStateOf(2); st != nil {
							if after, err = st.MarshalWithResidual(residual); err != nil {
								return err
							}
						}
						if !bytes.Equal(before, after) {
							return fmt.Errorf("rank %d step %d: state after the undo differs from the state before the call", rank, s)
						}
					}
					b, err := c.TensorStateOf(2).MarshalWithResidual(residual)
					finals[rank][run] = b
					return err
				})
			}
			for r := 0; r < p; r++ {
				for s := range results[r][1] {
					if !bytes.Equal(float32Bytes(results[r][0][s]), float32Bytes(results[r][1][s])) {
						t.Fatalf("rank %d call %d: output differs from the run without the undone calls", r, s)
					}
				}
				if !bytes.Equal(finals[r][0], finals[r][1]) {
					t.Errorf("rank %d: final state differs from the run without the undone calls", r)
				}
			}
		})
	}
}

// What the residual's copy costs against the call it precedes, on a
// tensor of 2^24 (16.8M) elements at density 0.01, two ranks in process
// (each rank copies its own residual): the copy alone, and calls on a
// tensor reduced undoably against calls on one reduced without the option,
// in turn (the best of each). Run it with OKTOPK_UNDO_COST=1 go test -run
// TestUndoSnapshotCost -v ./core/ (skipped otherwise: it takes seconds).
func TestUndoSnapshotCost(t *testing.T) {
	if testing.Short() || os.Getenv("OKTOPK_UNDO_COST") == "" {
		t.Skip("set OKTOPK_UNDO_COST=1 to measure")
	}
	const n, calls = 1 << 24, 8
	src, dst := make([]float32, n), make([]float32, n)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range src {
		src[i] = float32(rng.NormFloat64())
	}
	copyParallel(dst, src) // the pages faulted in, as a reused buffer's are
	var best time.Duration
	for i := 0; i < 3*calls; i++ {
		start := time.Now()
		copyParallel(dst, src)
		if d := time.Since(start); best == 0 || d < best {
			best = d
		}
	}
	cfg := Config{Algorithm: OkTopk, Density: 0.01, Tau: 64, TauPrime: 32}
	grads := [2][]float32{make([]float32, n), make([]float32, n)}
	var callBest [2][2]time.Duration // [rank][undoable]
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		g := grads[rank]
		for i := 0; i < 2*calls+2; i++ {
			undoable := i%2 == 1
			id := uint64(1 + i%2)
			for j := range g {
				g[j] = src[(j+rank*7919+i*104729)%n]
			}
			start := time.Now()
			if _, err := c.SparseAllreduceWith(ctx, id, g, cfg, CallOptions{Undoable: undoable}); err != nil {
				return err
			}
			// Each tensor's first call has no residual to copy, and the
			// copy's buffer is new at the second.
			if d, u := time.Since(start), map[bool]int{false: 0, true: 1}[undoable]; i >= 4 && (callBest[rank][u] == 0 || d < callBest[rank][u]) {
				callBest[rank][u] = d
			}
		}
		return nil
	})
	t.Logf("n=%d: residual copy %v (best of %d, GOMAXPROCS %d, %d chunks); Ok-Topk call, 2 ranks in process, best of %d: "+
		"undoable %v / %v, without the option %v / %v",
		n, best, 3*calls, runtime.GOMAXPROCS(0), selectionChunks(n), calls-1, callBest[0][1], callBest[1][1], callBest[0][0], callBest[1][0])
}
