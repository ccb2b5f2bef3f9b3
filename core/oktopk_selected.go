package core

// Ok-Topk on a caller's own selection, with state: the form for callers
// whose gradient and residual live where the library does not read them (a
// GPU's memory). Only the selected pairs cross to the library, and only the
// result and what the residual needs come back.
//
// The caller takes over steps 1 and 6 of okTopkAllreduce (oktopk.go) and
// the library keeps everything else:
//
//  1. The caller asks SelectionPlan for this call's k, whether it is an
//     exact call (every τ′ calls, as for a dense input) and the local
//     threshold to reuse; forms acc = grad + residual; and selects by the
//     library's rules (SelectByThreshold: exact top-k on an exact call or
//     with no threshold yet, else |acc| > threshold, raised while more than
//     4k/3 pass, exact when fewer than k/2 do, nudged for the next call).
//  2. SparseAllreduceSelected takes the selection and the threshold the
//     rules left, rounds the values to the wire's precision as step 1 does,
//     and runs steps 2–5 (repartition every τ calls, split and reduce with
//     the merged sums of the sparse-input call, the global selection —
//     exact every τ′ calls — balance and allgatherv).
//  3. It returns step 6's terms: the averaged global result; the caller's
//     entries that are in it (consumed), with the values that left; and an
//     owner's rounding errors of its sums. The caller's residual becomes
//     acc, less the consumed values, plus the errors, in that order, each
//     sum that is not finite becoming 0, exactly as foldOutput forms it.
//
// The same selection, residual and threshold then give the same bits as
// the dense-input call, which TestSelectedEqualsDenseInput checks over
// refresh and reuse calls, repartitions and 16-bit values. The tensor's
// state is a TensorState with CallerResidual set: thresholds, boundaries
// and the call count here, the residual with the caller; a checkpoint
// carries the caller's residual in the usual format (MarshalWithResidual),
// so either form of the call can resume it.

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// SelectionPlan is what a caller needs to select a tensor's entries for
// its next caller-selected call.
type SelectionPlan struct {
	K         int     // entries to select: ⌈density · n⌉
	Exact     bool    // an exact call: select the exact top-k
	Threshold float32 // the local threshold to reuse (0: none yet, select exactly)
}

// SelectedOutput is what SparseAllreduceSelected returns: step 6's terms.
type SelectedOutput struct {
	Result   Sparse // the global result, averaged over the ranks, ascending
	Consumed Sparse // this rank's selected entries in the result, with the values sent (rounded), ascending
	OwnerErr Sparse // this rank's rounding errors of its sums as owner (and of its share, 8-bit values), ascending; none for float32
}

// maxSelected is the most entries the selection rules pass for k: a reuse
// call keeps at most 4k/3 (else it selects exactly, k). The global result
// is at most P times that.
func maxSelected(k, n int) int {
	return min(n, int(math.Floor(thresholdTooMany*float64(k))))
}

// SelectedCapacity is the most entries a caller-selected call of a tensor
// of n elements with k selected can return in Result or OwnerErr on a
// communicator of p ranks: every rank's selection counted whole.
func SelectedCapacity(n, k, p int) int {
	return min(n, p*maxSelected(k, n))
}

// SelectionPlan returns the plan of tensor id's next caller-selected call
// with settings cfg (density and τ′ as that call will pass them). It never
// refuses: settings or an n the call will refuse get an exact plan, and
// the call then refuses on every rank (a plan refused here would leave the
// peers waiting for a call this rank never makes).
func (c *Communicator) SelectionPlan(id uint64, n int, cfg Config) SelectionPlan {
	c.mu.Lock()
	st := c.states[id]
	c.mu.Unlock()
	k := max(0, min(cfg.K(n), n))
	if st == nil || cfg.Validate() != nil || st.checkSelected(id, n) != nil {
		return SelectionPlan{K: k, Exact: true}
	}
	return SelectionPlan{K: k, Exact: st.Iter%cfg.TauPrime == 0 || k == n, Threshold: st.LocalThreshold}
}

// checkSelected refuses a state that is not for caller-selected calls on n
// elements.
func (st *TensorState) checkSelected(id uint64, n int) error {
	switch {
	case st.N != n:
		return fmt.Errorf("%w: tensor %d has %d elements, earlier calls had %d", ErrInvalidArgument, id, n, st.N)
	case !st.CallerResidual:
		return fmt.Errorf("%w: tensor %d keeps its residual in the library (dense-input calls); a caller-selected call needs "+
			"the residual with the caller (a new tensor id, or its checkpoint loaded with the caller's residual)", ErrInvalidArgument, id)
	}
	return nil
}

// SparseAllreduceSelected runs Ok-Topk's steps 2–5 on this rank's
// selection sel (ascending, finite, at most 4k/3 entries of a tensor of n),
// made by SelectionPlan's rules; threshold is the local threshold those
// rules left for the next call. nonFinite says this rank's acc holds NaN or
// Inf (sel is then empty): every rank skips the step with ErrNonFinite, as
// for a dense input. cfg.Algorithm is OkTopk, or Auto, which is OkTopk here.
// A failed call changes nothing of the tensor's state; the caller's
// residual must then stay as it was.
func (c *Communicator) SparseAllreduceSelected(ctx context.Context, id uint64, n int, sel Sparse, threshold float32, nonFinite bool,
	cfg Config, opts CallOptions) (SelectedOutput, Stats, error) {
	var stats Stats
	seq, err := c.begin()
	if err != nil {
		return SelectedOutput{}, stats, err
	}
	if cfg.Algorithm == Auto {
		cfg.Algorithm = OkTopk
	}
	if err := c.checkSelectedCall(n, sel, threshold, nonFinite, cfg); err != nil {
		return SelectedOutput{}, stats, c.refuse(ctx, seq, err)
	}
	st, undo, err := c.selectedState(id, n, cfg)
	if err != nil {
		return SelectedOutput{}, stats, c.refuse(ctx, seq, err)
	}
	start := time.Now()
	stats.Algorithm = OkTopk
	stats.K = cfg.K(n)
	exact := st.okTopkExact(stats.K, n)
	desc := DescribeCall(opts.Dtype, id, n, stats.K)
	desc.Completed, desc.Exact, desc.Values = uint32(st.Iter), exact, transport.ValueFormat(st.Config.Values)
	call := NewCall(c.T, OkTopk.Op(), seq, &stats, WithDesc(desc), withScratch(&c.scratch))
	call.Values = st.Config.Values
	out, err := okTopkSelected(ctx, call, st, sel, threshold, nonFinite, exact)
	call.EndPhases()
	if err != nil {
		undo()
	}
	stats.Total = time.Since(start)
	return out, stats, c.end(err)
}

func (c *Communicator) checkSelectedCall(n int, sel Sparse, threshold float32, nonFinite bool, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	if cfg.Algorithm != OkTopk {
		return fmt.Errorf("%w: %v: a caller-selected call runs Ok-Topk (or auto, which is Ok-Topk here)", ErrInvalidArgument, cfg.Algorithm)
	}
	if n < 1 || uint64(n) > MaxElements {
		return fmt.Errorf("%w: n=%d not in 1…2^32-1", ErrInvalidArgument, n)
	}
	if err := checkSparse(sel, n); err != nil {
		return err
	}
	if most := maxSelected(cfg.K(n), n); sel.Len() > most {
		return fmt.Errorf("%w: %d entries selected; the selection rules pass at most %d for k=%d", ErrInvalidArgument, sel.Len(), most, cfg.K(n))
	}
	if nonFinite && sel.Len() > 0 {
		return fmt.Errorf("%w: a non-finite acc selects nothing, and %d entries came", ErrInvalidArgument, sel.Len())
	}
	if bad := countNonFinite(sel.Val); bad > 0 {
		return fmt.Errorf("%w: %d selected values are NaN or Inf (say so with the non-finite flag and select nothing)", ErrInvalidArgument, bad)
	}
	if !(threshold >= 0) || math.IsInf(float64(threshold), 0) {
		return fmt.Errorf("%w: local threshold %v is not a finite magnitude", ErrInvalidArgument, threshold)
	}
	return nil
}

// selectedState is callState for a caller-selected call: a new state keeps
// no residual.
func (c *Communicator) selectedState(id uint64, n int, cfg Config) (*TensorState, func(), error) {
	old, existed := c.states[id]
	if !existed {
		st := &TensorState{N: n, Config: cfg, CallerResidual: true, Rank: c.Rank(), Size: c.Size()}
		st.keepForUndo(tensorSnapshot{}, true, true) // UndoCall removes the state again
		c.states[id] = st
		return st, func() { delete(c.states, id) }, nil
	}
	if err := old.checkSelected(id, n); err != nil {
		return nil, nil, err
	}
	before := snapshotOf(old, old.Config)
	old.keepForUndo(before, false, true) // the caller's residual is the caller's to put back
	old.Config = cfg
	return old, func() { before.restore(old); old.dropUndo() }, nil
}

// okTopkSelected is okTopkAllreduce from its step 2 on, for a caller's
// selection (see the top of this file).
func okTopkSelected(ctx context.Context, call *Call, st *TensorState, sel Sparse, threshold float32, nonFinite bool, exact bool) (SelectedOutput, error) {
	p, k := call.Size(), st.Config.K(st.N)
	sc := call.okTopkScratch(st)
	// Step 1's end: the values leave in the wire's precision (the caller's
	// residual keeps what the rounding took off, through Consumed).
	local := sc.local
	local.Reset()
	for j, i := range sel.Idx {
		local.Append(i, sel.Val[j])
	}
	roundingOf(call, st.Config, st.Iter, roundContribution).apply(local)
	sc.local = local
	call.Stats.LocalSelected = local.Len()

	// Step 2: space repartition.
	call.Phase(PhaseReduce)
	if err := repartitionIfDue(ctx, call, st, local); err != nil {
		return SelectedOutput{}, err
	}
	// Step 3, with the merged sums of the sparse-input call: the same bits
	// as the dense region sum, in time and memory that follow the pairs.
	reduced, err := splitAndReduce(ctx, call, st.Boundaries, local, &mergedRegionSum{}, sc)
	if err != nil {
		return SelectedOutput{}, err
	}
	// Steps 4 and 5.
	global, skip, err := globalSelection(ctx, call, st, reduced, k, exact, nonFinite)
	if err != nil {
		return SelectedOutput{}, err
	}
	if skip {
		return SelectedOutput{}, fmt.Errorf("%w: %w", ErrNonFinite, errStepSkipped)
	}
	call.Stats.GlobalSelected = global.Len()
	st.LocalThreshold = threshold
	call.Stats.LocalThreshold, call.Stats.GlobalThreshold = st.LocalThreshold, st.GlobalThreshold

	// Step 6's terms, for the caller.
	call.Phase(PhaseOutput)
	var out SelectedOutput
	out.Result = Sparse{Idx: append([]uint32(nil), global.Idx...), Val: append([]float32(nil), global.Val...)}
	scale(out.Result.Val, p)
	g := 0
	for j, i := range local.Idx {
		for g < len(global.Idx) && global.Idx[g] < i {
			g++
		}
		if g < len(global.Idx) && global.Idx[g] == i {
			out.Consumed.Append(i, local.Val[j])
		}
	}
	out.OwnerErr = Sparse{Idx: append([]uint32(nil), sc.ownerErr.Idx...), Val: append([]float32(nil), sc.ownerErr.Val...)}
	st.Iter++
	return out, nil
}
