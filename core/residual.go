package core

// Error feedback (Ok-Topk Algorithm 2, and every sparse baseline): each call
// works on acc = grad + residual; afterwards the residual is acc with exactly
// the entries zeroed that this rank selected AND that made it into the global
// result. Everything else — never selected, or selected but dropped by the
// global selection — waits in the residual for a later call. Values sent in
// reduced precision leave their rounding error there instead of zero. gTopk
// differs (gtopk.go, step 4): partial sums its tree drops on the way up
// belong to no one sender, so every entry a rank sent leaves its residual
// and the rank that dropped a sum takes it into its own.

import (
	"fmt"
	"math"
	"sort"
)

// Accumulate writes acc = grad + residual and reports how many entries are
// not finite, so the caller can skip the step on every rank before anything
// non-finite reaches the residual or the wire.
func Accumulate(acc, grad, residual []float32) (nonFinite int) {
	acc = acc[:len(grad)]
	residual = residual[:len(grad)]
	for i, g := range grad {
		v := g + residual[i]
		acc[i] = v
		// v-v is 0 for finite v and NaN for NaN and ±Inf.
		if v-v != 0 {
			nonFinite++
		}
	}
	return nonFinite
}

// UpdateResidual sets residual = acc, then, for the entries in both the
// local selection and the global result (both ascending by index), subtracts
// the value this rank sent: zero for float32 values, which are acc itself,
// and the rounding error for values rounded to float16 or bfloat16. A NaN or
// ±Inf in acc becomes 0: the residual never keeps a non-finite value, which
// would otherwise poison every later call (callers skip the step when
// Accumulate counts one, so this is the last line of defence).
func UpdateResidual(residual, acc []float32, local, global Sparse) {
	residual = residual[:len(acc)]
	for i, v := range acc {
		if v-v != 0 { // NaN and ±Inf; v-v is 0 for every finite v
			v = 0
		}
		residual[i] = v
	}
	zeroSent(residual, local, global)
}

// zeroSent zeroes the residual's entries that are in both local and global.
func zeroSent(residual []float32, local, global Sparse) {
	g := 0
	for j, i := range local.Idx {
		for g < len(global.Idx) && global.Idx[g] < i {
			g++
		}
		if g < len(global.Idx) && global.Idx[g] == i {
			v := residual[i] - local.Val[j]
			if v-v != 0 {
				v = 0
			}
			residual[i] = v
		}
	}
}

func finiteOr0(v float32) float32 {
	if v-v != 0 { // NaN and ±Inf
		return 0
	}
	return v
}

// ScatterAverage writes the global sparse sum, divided by p, into out as a
// dense vector (zeros elsewhere).
func ScatterAverage(out []float32, global Sparse, p int) {
	clear(out)
	writeAverage(out, global, p)
}

// writeAverage writes the global sparse sum, divided by p, into out's
// entries at its indices (out is zero elsewhere already).
func writeAverage(out []float32, global Sparse, p int) {
	fp := float32(p)
	for j, i := range global.Idx {
		if p == 1 {
			out[i] = global.Val[j]
		} else {
			out[i] = global.Val[j] / fp
		}
	}
}

// foldOutput ends a call that never stored acc = grad + residual (vec.go),
// in one pass over memory after its last message: it forms acc a last time,
// in place, to become the residual, less what this rank sent of the global
// result (zeroSent), plus an owner's rounding errors of its sums (ownerErr,
// ascending; empty for float32 values); and it writes the global result,
// divided by p, into grad, zero elsewhere (writeAverage). It goes tile by
// tile, and each tile's sparse updates are made while the tile is still in
// the cache: made after the pass, each was a cache miss, about 2k of them
// per call. Residual and grad end bitwise as UpdateResidual, the errors
// added, and ScatterAverage leave them, the sums being those the selection
// saw.
//
// acc must be finite: a call reaches its end only when every rank found no
// NaN or ±Inf in its acc (the step is skipped on every rank otherwise), so
// the pass does not look again (looking cost a sixth of its time). Large
// vectors are cut into chunks folded in parallel, as the selection is
// (parallel.go).
func foldOutput(residual, grad []float32, local, global, ownerErr Sparse, p int) {
	foldOutputIn(residual, grad, local, global, global, ownerErr, p, selectionChunks(len(grad)))
}

// foldOutputConsumed is foldOutput for a reduction that says itself which
// of the entries this rank sent are accounted for elsewhere (consumed,
// ascending; foldOutput's is the global result) and what its residual takes
// in (added, ascending: gTopk's partial sums dropped here, baselines.go).
func foldOutputConsumed(residual, grad []float32, local, consumed, global, added Sparse, p int) {
	foldOutputIn(residual, grad, local, consumed, global, added, p, selectionChunks(len(grad)))
}

func foldOutputIn(residual, grad []float32, local, consumed, global, added Sparse, p, chunks int) {
	n := len(grad)
	residual = residual[:n]
	fp := float32(p)
	forEachChunk(n, chunks, func(_, lo, hi int) {
		from := func(s Sparse) int {
			return sort.Search(len(s.Idx), func(j int) bool { return s.Idx[j] >= uint32(lo) })
		}
		jl, js, je, jg := from(local), from(consumed), from(added), from(global)
		for t := lo; t < hi; t += tileLen {
			end := min(hi, t+tileLen)
			foldTile(residual[t:end], grad[t:end])
			// The entries this rank sent that are consumed (kept in the
			// result) leave the residual (zeroSent).
			for ; jl < len(local.Idx) && int(local.Idx[jl]) < end; jl++ {
				i := local.Idx[jl]
				for js < len(consumed.Idx) && consumed.Idx[js] < i {
					js++
				}
				if js < len(consumed.Idx) && consumed.Idx[js] == i {
					residual[i] = finiteOr0(residual[i] - local.Val[jl])
				}
			}
			// An owner's rounding errors, or sums dropped here; a sum that
			// overflows becomes 0, as in UpdateResidual.
			for ; je < len(added.Idx) && int(added.Idx[je]) < end; je++ {
				residual[added.Idx[je]] = finiteOr0(residual[added.Idx[je]] + added.Val[je])
			}
			for ; jg < len(global.Idx) && int(global.Idx[jg]) < end; jg++ {
				if p == 1 {
					grad[global.Idx[jg]] = global.Val[jg]
				} else {
					grad[global.Idx[jg]] = global.Val[jg] / fp
				}
			}
		}
	})
}

// foldTile sets r = g + r and g = 0.
func foldTile(r, g []float32) {
	r = r[:len(g)]
	i := 0
	for ; i+4 <= len(g); i += 4 {
		g4, r4 := g[i:i+4:i+4], r[i:i+4:i+4]
		r4[0], r4[1], r4[2], r4[3] = g4[0]+r4[0], g4[1]+r4[1], g4[2]+r4[2], g4[3]+r4[3]
	}
	for ; i < len(g); i++ {
		r[i] += g[i]
	}
	clear(g)
}

// ReadResidual copies tensor id's residual into out (float32, the tensor's
// length), changing nothing: what a caller that masks its own momentum by
// what each call took (the entries whose residual is now 0) reads after a
// call, in one pass. A tensor without state (no sparse call or load yet)
// has a zero residual. Local, like FoldResidual.
func (c *Communicator) ReadResidual(id uint64, out []float32) error {
	st := c.TensorStateOf(id)
	if st == nil {
		clear(out)
		return nil
	}
	if st.CallerResidual {
		return fmt.Errorf("%w: tensor %d's residual is the caller's (caller-selected calls): read it there", ErrInvalidArgument, id)
	}
	if len(out) != st.N || len(st.Residual) != st.N {
		return fmt.Errorf("%w: tensor %d has %d elements, this read has %d", ErrInvalidArgument, id, st.N, len(out))
	}
	copy(out, st.Residual)
	return nil
}

// ResidualZeros marks, in zero, the entries of tensor id's residual that
// are exactly 0 (1; others 0): after a call, those it took from this rank
// (float32 values leave exactly 0) and those that have held nothing since.
// Given before, the marks of an earlier read, it also lists in became,
// ascending and as many as fit, the entries marked now and not then, and
// returns how many there are: those that left after waiting, about k of
// them, which DGC's momentum factor masking ("waited") stops. One pass,
// nothing allocated, where copying the residual out and comparing the copy
// took five (ReadResidual). It changes nothing. A tensor without state (no
// sparse call or load yet) has a zero residual. Local, like ReadResidual.
func (c *Communicator) ResidualZeros(id uint64, before, zero []byte, became []int64) (int, error) {
	n := len(zero)
	if before != nil && len(before) != n {
		return 0, fmt.Errorf("%w: the earlier marks have %d entries, this read has %d", ErrInvalidArgument, len(before), n)
	}
	st := c.TensorStateOf(id)
	var residual []float32
	switch {
	case st == nil:
	case st.CallerResidual:
		return 0, fmt.Errorf("%w: tensor %d's residual is the caller's (caller-selected calls): read it there", ErrInvalidArgument, id)
	case n != st.N || len(st.Residual) != st.N:
		return 0, fmt.Errorf("%w: tensor %d has %d elements, this read has %d", ErrInvalidArgument, id, st.N, n)
	default:
		residual = st.Residual
	}
	if residual == nil {
		residual = make([]float32, n)
	}
	if before == nil {
		for i, v := range residual[:n] {
			zero[i] = isZero(v)
		}
		return 0, nil
	}
	before = before[:n]
	count := 0
	for i, v := range residual[:n] {
		z := isZero(v)
		// Branch-free but for the about k entries that became zero: the
		// branch on every entry's comparison cost twice the pass.
		if z&^before[i] != 0 {
			if count < len(became) {
				became[count] = int64(i)
			}
			count++
		}
		zero[i] = z
	}
	return count, nil
}

// isZero is 1 for ±0 and 0 for every other value, NaN included, without a
// branch: the bits less the sign are 0 exactly for ±0.
func isZero(v float32) byte {
	bits := math.Float32bits(v) << 1
	return byte(((bits | -bits) >> 31) ^ 1)
}

// FoldResidual hands tensor id's residual to a caller that reduces this step
// with a dense allreduce of its own (a framework's allreduce, NCCL's): x +=
// residual outside the held ranges, rounded to the caller's element type v,
// and the residual keeps only the held entries and what that rounding lost.
// So nothing waits any longer and no mass is lost: x + residual is the same
// sum before and after. A tensor without state (no sparse call or load yet)
// has nothing to fold. When some x + residual outside hold is NaN or ±Inf,
// neither changes: the caller's dense result is then non-finite on every
// rank, the step is skipped, and the residual waits for the next one. A
// NaN on another rank is seen only in the caller's dense sum, after this
// rank folded: the caller then calls UnfoldResidual, so that on every rank
// the skipped step's residual is what it was before it. It is local (no
// communication) and does not count as one of the tensor's calls.
func (c *Communicator) FoldResidual(id uint64, x []float32, hold []Span, v ValueType) error {
	st := c.TensorStateOf(id)
	if st == nil {
		return nil
	}
	if st.CallerResidual {
		return fmt.Errorf("%w: tensor %d's residual is the caller's (caller-selected calls): fold it there", ErrInvalidArgument, id)
	}
	if len(x) != st.N || len(st.Residual) != st.N {
		return fmt.Errorf("%w: tensor %d has %d elements, this fold has %d", ErrInvalidArgument, id, st.N, len(x))
	}
	if err := checkHold(hold, len(x)); err != nil {
		return err
	}
	if !v.Valid() {
		return fmt.Errorf("%w: value type %d", ErrInvalidArgument, int(v))
	}
	// Between the held spans: [from, to) ranges that fold.
	each := func(f func(from, to int) bool) bool {
		at := 0
		for _, h := range hold {
			if h.Start > at && !f(at, h.Start) {
				return false
			}
			at = h.End
		}
		return at >= len(x) || f(at, len(x))
	}
	finite := each(func(from, to int) bool {
		for i := from; i < to; i++ {
			if s := x[i] + st.Residual[i]; s-s != 0 {
				return false
			}
		}
		return true
	})
	if !finite {
		st.beforeFold = nil
		return nil
	}
	st.beforeFold = append(st.beforeFold[:0], st.Residual...)
	st.suspendUndo() // the residual is the caller's now: UndoCall waits for the unfold
	each(func(from, to int) bool {
		for i := from; i < to; i++ {
			sum := x[i] + st.Residual[i]
			x[i] = v.Nearest(sum)
			st.Residual[i] = sum - x[i]
		}
		return true
	})
	return nil
}

// UnfoldResidual undoes tensor id's latest FoldResidual, for a caller whose
// dense sum of the folded values came out NaN or ±Inf (a non-finite
// gradient on any rank) and so skips the step: the residual is again what
// it was before the fold, as after a sparse call skipped for the same
// reason. Without a fold since the tensor's last call (or load) there is
// nothing to undo. Local, like the fold.
func (c *Communicator) UnfoldResidual(id uint64) error {
	st := c.TensorStateOf(id)
	if st == nil || st.beforeFold == nil {
		return nil
	}
	copy(st.Residual, st.beforeFold)
	st.beforeFold = nil
	st.resumeUndo() // the residual is again the one the latest call left
	return nil
}
