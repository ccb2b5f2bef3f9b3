package core

// UndoCall: taking back a tensor's latest completed sparse call, for a
// caller whose step turned out void after the call succeeded. A framework
// reduces a step's gradient as several tensors (PyTorch DDP's buckets), one
// call each; a NaN or Inf in one of them skips that call on every rank, and
// the caller then skips the whole step (AMP's GradScaler does). The step's
// other calls had completed: their residuals, thresholds, region boundaries
// and call counts moved on a step that never happened, and what they sent
// is lost with it. UndoCall puts each back as it was before its call, so
// the skipped step leaves no trace in any tensor's state, on every rank.
//
// Opt-in (CallOptions.Undoable), because of what a call keeps for it. A
// caller that reduces each step as one call never needs it (a NaN skips
// that call itself), and a copy kept for every tensor would double the
// memory that stays allocated between calls. A call made without it keeps
// nothing, and UndoCall refuses it with ErrInvalidUsage rather than take
// back nothing in silence. Caller-selected calls keep their few words
// always.
//
// What a call keeps for it, and why a copy of the residual. The residual
// after a call is, entry by entry, fl(grad + residual) less what was sent;
// float32 addition is not invertible (a residual entry far below its
// gradient's is absorbed by the sum), so no record of the sent entries or
// of the gradient gives the old residual back bitwise, and a record of the
// gradient would cost the same n values as the residual itself. So the
// call copies the residual before it starts (callState: one buffer of n
// float32 values per tensor, allocated once and reused from call to call), on
// every core for a large tensor; everything else it changes (thresholds,
// boundaries, call count, settings) is the few words of tensorSnapshot the
// call already takes to put back after a failure. A caller-selected call
// (oktopk_selected.go) keeps its residual in the caller's memory and copies
// nothing: the caller puts its own residual back.

import "fmt"

// callRecord is what UndoCall needs to take back a tensor's latest
// completed call.
type callRecord struct {
	kept      bool           // the latest call completed, and nothing since took its record
	unkept    bool           // the latest call completed without CallOptions.Undoable: nothing to take it back with
	suspended bool           // a FoldResidual since holds the residual: only its UnfoldResidual gives the record back
	created   bool           // the call created the state: taking it back removes it
	before    tensorSnapshot // settings, call count, thresholds, region boundaries before the call
	residual  []float32      // the residual before the call (reused from call to call); unused for a caller's residual
}

// keepForUndo starts the record of a call about to run on st, whose state
// before it is before; created says the call made st, undoable that the
// caller asked for the record (CallOptions.Undoable; a caller-selected
// call's costs nothing and is always kept). The record holds until the
// call fails (dropUndo) or another call, a load or UndoCall replaces or
// drops it.
func (st *TensorState) keepForUndo(before tensorSnapshot, created, undoable bool) {
	rec := &st.lastCall
	if !undoable && !st.CallerResidual {
		rec.kept, rec.unkept, rec.suspended = false, true, false
		rec.residual = nil // a tensor no longer reduced undoably keeps no copy
		return
	}
	rec.kept, rec.unkept, rec.suspended, rec.created, rec.before = true, false, false, created, before
	if created || st.CallerResidual {
		// Nothing to copy: a new state's residual is zero, and taking the
		// call back removes the state; a caller's residual is the caller's.
		rec.residual = rec.residual[:0]
		return
	}
	if cap(rec.residual) < len(st.Residual) {
		rec.residual = make([]float32, len(st.Residual))
	}
	rec.residual = rec.residual[:len(st.Residual)]
	copyParallel(rec.residual, st.Residual)
}

// dropUndo forgets the record: the call failed (and left the state as it
// was before it, so there is nothing to take back), or it was taken back.
func (st *TensorState) dropUndo() {
	st.lastCall.kept, st.lastCall.unkept, st.lastCall.suspended = false, false, false
}

// copyParallel is copy(dst, src) on as many goroutines as a selection over
// len(src) elements uses: one pass over memory, split so that a large
// tensor's copy takes the machine's bandwidth rather than one core's.
func copyParallel(dst, src []float32) {
	n := len(src)
	forEachChunk(n, selectionChunks(n), func(_, lo, hi int) { copy(dst[lo:hi], src[lo:hi]) })
}

// UndoCall takes back tensor id's latest sparse call, made with
// CallOptions.Undoable (or caller-selected), which completed on every rank
// but whose step the caller skips (a NaN or Inf in another tensor of the
// same step): the residual, the thresholds, the region
// boundaries, the settings and the call count are again what they were
// before that call, bitwise, and a tensor that call created has no state
// again. The calls that follow behave as if it never happened. Local (no
// communication): every rank takes back the same calls, since every rank
// sees the same skip. Nothing to take back (oktopk returns success and
// changes nothing) when the latest call failed (it left the state as it
// was), when a load came after it, after an UndoCall already took it back,
// after a FoldResidual not undone by UnfoldResidual (the fold handed the
// residual to the caller), or for a tensor without state. A latest call
// that completed without CallOptions.Undoable is ErrInvalidUsage, and
// nothing changes. Taking a call back also forgets the fold record of the
// latest FoldResidual: there is no fold left to undo.
func (c *Communicator) UndoCall(id uint64) error {
	st := c.TensorStateOf(id)
	if st != nil && st.lastCall.unkept {
		return fmt.Errorf("%w: tensor %d's latest call was made without the undoable option (OKTOPK_CALL_UNDOABLE): "+
			"it kept nothing to be taken back with", ErrInvalidUsage, id)
	}
	if st == nil || !st.lastCall.kept || st.lastCall.suspended {
		return nil
	}
	rec := &st.lastCall
	st.dropUndo()
	st.beforeFold = nil
	if rec.created {
		c.mu.Lock()
		if c.states[id] == st {
			delete(c.states, id)
		}
		c.mu.Unlock()
		return nil
	}
	rec.before.restore(st)
	if !st.CallerResidual && len(rec.residual) == len(st.Residual) {
		copyParallel(st.Residual, rec.residual)
	}
	return nil
}

// suspendUndo: a fold took the residual after the call; the call can be
// taken back again only once UnfoldResidual gives the residual back.
func (st *TensorState) suspendUndo() {
	if st.lastCall.kept {
		st.lastCall.suspended = true
	}
}

// resumeUndo: UnfoldResidual gave the residual back as it was after the call.
func (st *TensorState) resumeUndo() { st.lastCall.suspended = false }
