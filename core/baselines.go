package core

// Pieces the sparse baselines (TopkA, TopkDSA, SparCML, gTopk, Gaussiank)
// share: error feedback around a sparse reduction, the agreement on skipping
// a step with NaN/Inf, sparse sums in a fixed order, the equal split of the
// index space, and the two forms a region takes on the wire (sparse pairs,
// or dense values once those are no larger).

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/oktopk/oktopk/transport"
)

// exactLocalTopK is the local selection of the top-k baselines: the exact
// top-k of acc, with the threshold that reselects it by |acc| > threshold
// (the (k+1)-th largest magnitude) recorded in the call's statistics, both
// from the selection's own passes, in dst's storage. NaN or ±Inf in acc is
// ErrNonFinite.
func exactLocalTopK(call *Call) func(dst Sparse, acc vec, k int) (Sparse, error) {
	return func(dst Sparse, acc vec, k int) (Sparse, error) {
		var th float32
		local, _, err := selectByThresholdOf(dst, acc, k, &th, true, selectionChunks(acc.len()))
		call.Stats.LocalThreshold = th
		return local, err
	}
}

// withExactTopK is reduce's dense-gradient form over the exact local top-k:
// the entry point of the baselines that differ only in their reduction.
func withExactTopK(reduce sparseInputFunc) sparseAllreduceFunc {
	return func(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
		return reduceWithErrorFeedback(ctx, call, st, grad, exactLocalTopK(call), reduce)
	}
}

// reduceWithErrorFeedback is the dense-gradient form of a baseline: it
// selects this rank's entries of acc = grad + residual with selectLocal
// (acc is never stored: the selection's passes form it as they read, see
// vec.go), agrees with every rank that all of them are finite (else every
// rank skips the step), reduces the entries with reduce (which returns the
// summed global result, identical on every rank), and only then — once
// nothing can fail any more — writes the averaged result into grad and the
// new residual into st (for the entries selected here and present in the
// global result, acc less the value sent: zero, or the rounding error of a
// 16-bit value; the rest, held entries included, wait for a later call).
// Such a reduce sums every contribution to an index it keeps, so a value
// sent but left out of the result is still whole in the sender's residual.
func reduceWithErrorFeedback(ctx context.Context, call *Call, st *TensorState, grad []float32,
	selectLocal func(dst Sparse, acc vec, k int) (Sparse, error), reduce sparseInputFunc) error {
	return reduceWithFeedback(ctx, call, st, grad, selectLocal, func(ctx context.Context, call *Call, n int, local Sparse, k int) (Sparse, Sparse, Sparse, error) {
		global, err := reduce(ctx, call, n, local, k)
		return global, global, Sparse{}, err
	})
}

// feedbackReduceFunc reduces this rank's selected entries local, like a
// sparseInputFunc, for error feedback: beside the summed global result it
// returns consumed, the indices where the value this rank sent is now
// accounted for elsewhere (the residual loses it), and back, sums the
// reduction dropped on this rank, which this rank's residual takes in (both
// ascending by index). A reduction that drops partial sums on the way
// (gTopk's truncations) reports them in back, so no mass is lost.
type feedbackReduceFunc func(ctx context.Context, call *Call, n int, local Sparse, k int) (global, consumed, back Sparse, err error)

// reduceWithFeedback is reduceWithErrorFeedback for a feedbackReduceFunc:
// the new residual is acc less the values sent at consumed's indices, plus
// back.
//
// selectLocal writes into the storage it is given (the communicator's,
// kept for the next call) and reports NaN or ±Inf in acc as ErrNonFinite;
// they are then counted for the agreement, in a pass of their own only on
// that rare path.
func reduceWithFeedback(ctx context.Context, call *Call, st *TensorState, grad []float32,
	selectLocal func(dst Sparse, acc vec, k int) (Sparse, error), reduce feedbackReduceFunc) error {
	n := len(grad)
	if len(st.Residual) != n {
		return fmt.Errorf("%w: residual holds %d elements, gradient %d", ErrInvalidArgument, len(st.Residual), n)
	}
	// acc = grad + residual, never stored: the selection's passes form it.
	call.Phase(PhaseSelect)
	acc := sumVec(grad, st.Residual)
	k := st.Config.K(n)
	storage := call.selection(st)
	sc := call.okTopkScratch(st)
	var local Sparse
	var err error
	bad := 0
	if k == 0 {
		bad = acc.countNonFinite() // nothing is selected, so nothing else looks
		local = *storage
		local.Reset()
	} else {
		local, sc.held, err = selectHolding(acc, call.Hold, sc.held, func() (Sparse, error) { return selectLocal(*storage, acc, k) })
		*storage = local
		if errors.Is(err, ErrNonFinite) {
			bad, err = acc.countNonFinite(), nil
		}
		if err != nil {
			return err
		}
	}
	// The values leave this rank in the wire's precision; foldOutput
	// keeps what the rounding took off.
	roundingOf(call, st.Config, st.Iter, roundContribution).apply(local)
	call.Phase(PhaseAgree)
	if err := agreeOnInput(ctx, call, bad, nil); err != nil {
		return err
	}
	call.Stats.LocalSelected = local.Len()
	global, consumed, back, err := reduce(ctx, call, n, local, k) // it times its own phases
	if err != nil {
		return err
	}
	call.Phase(PhaseOutput)
	call.Stats.GlobalSelected = global.Len()
	foldOutputConsumed(st.Residual, grad, local, consumed, global, back, call.Size())
	st.Iter++
	return nil
}

// Input problems every rank must learn of, as bits of the agreement word.
const (
	inputNonFinite uint32 = 1 << iota // NaN or Inf in some rank's input
	inputInvalid                      // some rank's sparse input is malformed
)

// stepAgreement is the first step number of the agreement, far above every
// algorithm's own steps, so it never shares a tag with them.
const stepAgreement uint32 = 0xffff0000

// agreeOnInput tells every rank whether any rank's input was bad, before any
// data moves: then every rank returns the same status for the call and the
// ranks stay in step (the communicator remains usable). nonFinite counts this
// rank's NaN/Inf entries; invalid, when not nil, is why its input is
// malformed. A malformed input anywhere is ErrInvalidArgument on every rank,
// else NaN/Inf anywhere is ErrNonFinite; either is marked as skipped
// everywhere.
//
// The flags are OR-ed by dissemination: in round i = 0…⌈log P⌉−1 rank r sends
// what it knows to r+2^i and ORs in what r−2^i knows, so after the last
// round every rank has heard, directly or not, from all P. Cost: ⌈log P⌉α and
// one word per round.
func agreeOnInput(ctx context.Context, call *Call, nonFinite int, invalid error) error {
	var mine uint32
	if nonFinite > 0 {
		mine |= inputNonFinite
	}
	if invalid != nil {
		mine |= inputInvalid
	}
	p, r := call.Size(), call.Rank()
	all := mine
	for i, d := 0, 1; d < p; i, d = i+1, 2*d {
		word := binary.LittleEndian.AppendUint32(nil, all)
		to, from := (r+d)%p, (r-d+p)%p
		m, err := call.SendRecv(ctx, to, stepAgreement+uint32(i), transport.DtypeBytes, 4, word, from)
		if err != nil {
			return fmt.Errorf("oktopk: agreement on the input, round %d: %w", i, err)
		}
		if len(m.Payload) != 4 || m.Count != 4 {
			return fmt.Errorf("%w: agreement word of %d bytes from rank %d", ErrMismatch, len(m.Payload), from)
		}
		all |= binary.LittleEndian.Uint32(m.Payload)
	}
	switch {
	case invalid != nil:
		return fmt.Errorf("%w (%w)", invalid, errStepSkipped)
	case all&inputInvalid != 0:
		return fmt.Errorf("%w: another rank's sparse input is malformed (%w)", ErrInvalidArgument, errStepSkipped)
	case nonFinite > 0:
		return fmt.Errorf("%w: %d entries here: %w", ErrNonFinite, nonFinite, errStepSkipped)
	case all&inputNonFinite != 0:
		return fmt.Errorf("%w: on another rank: %w", ErrNonFinite, errStepSkipped)
	}
	return nil
}

// sparseAdd returns a+b as a new vector: the union of the indices, and where
// both hold an index, a's value plus b's. The operand order is part of the
// result's bits, so callers fix it (rank order, or lower rank first).
func sparseAdd(a, b Sparse) Sparse {
	out := Sparse{Idx: make([]uint32, 0, a.Len()+b.Len()), Val: make([]float32, 0, a.Len()+b.Len())}
	i, j := 0, 0
	for i < a.Len() && j < b.Len() {
		switch ai, bj := a.Idx[i], b.Idx[j]; {
		case ai < bj:
			out.Append(ai, a.Val[i])
			i++
		case bj < ai:
			out.Append(bj, b.Val[j])
			j++
		default:
			out.Append(ai, a.Val[i]+b.Val[j])
			i++
			j++
		}
	}
	out.Idx = append(out.Idx, a.Idx[i:]...)
	out.Val = append(out.Val, a.Val[i:]...)
	out.Idx = append(out.Idx, b.Idx[j:]...)
	out.Val = append(out.Val, b.Val[j:]...)
	return out
}

// sparseSumInRankOrder adds the parts as ((part0 + part1) + part2) + …, so
// every rank that sums the same parts gets the same bits.
func sparseSumInRankOrder(parts []Sparse) Sparse {
	var sum Sparse
	for r, s := range parts {
		if r == 0 {
			sum = Sparse{Idx: append([]uint32(nil), s.Idx...), Val: append([]float32(nil), s.Val...)}
			continue
		}
		sum = sparseAdd(sum, s)
	}
	return sum
}

// sparseTopK keeps the k entries of s with the largest magnitude (ties go to
// the lower index, as in TopK), ascending by index; s is not modified.
func sparseTopK(s Sparse, k int) (Sparse, error) {
	if s.Len() <= k {
		return s, nil
	}
	pos, err := TopK(s.Val, k)
	if err != nil {
		return Sparse{}, err
	}
	out := Sparse{Idx: make([]uint32, len(pos.Idx)), Val: pos.Val}
	for j, p := range pos.Idx {
		out.Idx[j] = s.Idx[p]
	}
	return out, nil
}

// sparseTopKSplit is sparseTopK that also returns the entries it leaves
// out (ascending by index, in new storage; empty when none are).
func sparseTopKSplit(s Sparse, k int) (kept, dropped Sparse, err error) {
	if s.Len() <= k {
		return s, Sparse{}, nil
	}
	pos, err := TopK(s.Val, k)
	if err != nil {
		return Sparse{}, Sparse{}, err
	}
	kept = Sparse{Idx: make([]uint32, len(pos.Idx)), Val: pos.Val}
	dropped = Sparse{Idx: make([]uint32, 0, s.Len()-len(pos.Idx)), Val: make([]float32, 0, s.Len()-len(pos.Idx))}
	next := 0 // pos.Idx is ascending: walk it beside s
	for j := range s.Idx {
		if next < len(pos.Idx) && int(pos.Idx[next]) == j {
			kept.Idx[next] = s.Idx[j]
			next++
			continue
		}
		dropped.Append(s.Idx[j], s.Val[j])
	}
	return kept, dropped, nil
}

// regionBounds is the equal split of n indices over p owners: rank j owns
// [start(j), start(j+1)), n/p or n/p+1 indices.
func regionBounds(n, p, j int) (lo, hi uint32) {
	return uint32(chunkStart(n, p, j)), uint32(chunkStart(n, p, j+1))
}

// regionBlock puts the entries of region [lo, hi) on the wire: as
// region-relative (index, value) pairs, or — when dense is set — as the
// region's hi−lo values with zeros where s has no entry.
func regionBlock(s Sparse, lo, hi uint32, dense bool) Block {
	if !dense {
		return Block{Dtype: transport.DtypeSparseF32, Count: uint64(s.Len()), Payload: EncodeSparse(nil, s, lo)}
	}
	vals := make([]float32, hi-lo)
	for j, i := range s.Idx {
		vals[i-lo] = s.Val[j]
	}
	return Block{Dtype: transport.DtypeFloat32, Count: uint64(len(vals)), Payload: float32Bytes(vals)}
}

// denseIsNoLarger is SparCML's switch for a stream of nnz pairs over a
// region of length indices: dense once the pairs would take no fewer bytes
// than the region's float32 values; at equal size dense wins (it needs no
// index decoding). With 32-bit indices and values that was 2·nnz ≥ length.
// Pairs are priced as the cost model prices them, at the stream's density
// (pairBytes: about 4.4 bytes at a half, 4.1 at 97%, where the switch now
// falls), not by the stream's own gaps: which form a region takes changes
// the result's index set, and the results must depend on the counts alone.
func denseIsNoLarger(nnz, length int) bool {
	if length == 0 {
		return true
	}
	return mul(float64(nnz), pairBytes(float64(nnz)/float64(length), ValuesFloat32)) >= 4*float64(length)
}

// decodeRegionBlock reads a block made by regionBlock for region [lo, hi).
// A dense block stands for every index of the region (a value of zero
// included): a dense stream no longer says which indices were sent, and
// every one of them may have been.
func decodeRegionBlock(dtype transport.Dtype, count uint64, payload []byte, lo, hi uint32) (Sparse, error) {
	switch dtype {
	case transport.DtypeSparseF32:
		return DecodeSparse(Sparse{}, payload, count, lo, hi)
	case transport.DtypeFloat32:
		length := int(hi - lo)
		if count != uint64(length) || len(payload) != 4*length {
			return Sparse{}, fmt.Errorf("%w: dense region of %d values (%d bytes), expected %d", ErrMismatch, count, len(payload), length)
		}
		out := Sparse{Idx: make([]uint32, length), Val: bytesFloat32(payload)}
		for j := range out.Idx {
			out.Idx[j] = lo + uint32(j)
		}
		return out, nil
	default:
		return Sparse{}, fmt.Errorf("%w: region block of dtype %v", transport.ErrBadFrame, dtype)
	}
}

// allgatherSparseSum gathers every rank's sparse vector (indices below n)
// and sums them in rank order: the global result of TopkA and Gaussiank.
// The vectors are of about one size (k, or Gaussiank's estimate of it), so
// Bruck's allgather moves the ring's words in ⌈log₂ P⌉ rounds instead of
// P−1: the log P α of these algorithms' papers. The entries travel in the
// call's value type (local's values must already be of that type, but for
// 8-bit ones, which are rounded here, in place: int8values.go).
func allgatherSparseSum(ctx context.Context, call *Call, firstStep uint32, n int, local Sparse) (Sparse, error) {
	if call.Values.scaled() {
		call.Values.quantize(local, nil) // in place: the residual keeps what the rounding took off
	}
	own := Block{Dtype: call.Values.sparseDtype(), Count: uint64(local.Len()), Payload: encodeSparseAs(nil, local, 0, call.Values)}
	call.Phase(PhaseAllgather)
	blocks, err := AllgathervBruck(ctx, call, firstStep, own)
	if err != nil {
		return Sparse{}, fmt.Errorf("oktopk: allgather of selected entries: %w", err)
	}
	call.Phase(PhaseReduce) // the sum of the gathered selections
	parts := make([]Sparse, len(blocks))
	for r, b := range blocks {
		if r == call.Rank() {
			parts[r] = local
			continue
		}
		if b.Dtype != own.Dtype {
			return Sparse{}, fmt.Errorf("%w: rank %d sent %v entries, this rank %v (another value type configured?)", ErrMismatch, r, b.Dtype, own.Dtype)
		}
		if parts[r], err = decodeSparseAs(Sparse{}, b.Payload, b.Count, 0, uint32(n), call.Values); err != nil {
			return Sparse{}, fmt.Errorf("oktopk: entries from rank %d: %w", r, err)
		}
	}
	return sparseSumInRankOrder(parts), nil
}
