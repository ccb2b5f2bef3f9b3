package core

// gTopk (Shi et al., ICDCS'19): a tree reduction that keeps only k entries at
// every step, so no message ever grows past k pairs.
//
// The algorithm works as follows.
//
//  1. Select: each rank takes the exact top-k of acc = grad + residual.
//  2. Tree reduce, rounds d = 1, 2, 4, … < P (a binomial tree rooted at rank
//     0): a rank r with r mod 2d = d sends its current k-sparse vector to
//     r − d and is done; a rank with r mod 2d = 0 and r + d < P receives it,
//     adds it to its own (own value first) and re-truncates the sum to the k
//     entries of largest magnitude (ties → lower index). Any P works: a rank
//     whose partner r + d does not exist simply waits out the round.
//  3. Broadcast: rank 0's final k entries go down the same tree in reverse
//     (rounds d = …, 2, 1: r mod 2d = 0 sends to r + d), the encoded bytes
//     forwarded unchanged, so every rank holds the same bits. A rank sends
//     one message at a time: it sends to its next child only once the one
//     before has acknowledged receiving (an empty message). Send only
//     queues, so without the acknowledgement a rank's ⌈log P⌉ messages would
//     share its link at once, the first child — the root of the largest
//     subtree — would get its copy only when the last one did, and the
//     broadcast's critical path would grow from ⌈log P⌉ to about
//     ⌈log P⌉(⌈log P⌉+1)/2 message times.
//  4. Residual: every entry a rank sent up leaves its residual, and a rank
//     that truncates a sum on the way up puts the partial sums it dropped
//     into its own residual; entries never selected stay where they were.
//     Only the rank that cut a partial sum knows of it: the sum combines
//     several ranks' contributions, and its index may still reach the root
//     through another subtree, so the paper's rule (zero the entries
//     selected here and kept in the result) loses it. With this rule, in
//     every call the ranks' residuals after plus the summed result equal
//     the ranks' grad + residual before, up to float32 rounding; mass only
//     moves between ranks' residuals, which error feedback allows (Ok-Topk's
//     owners keep other ranks' rounding errors too). The sparse-input form
//     keeps no residual: what its truncations drop is gone, as in the paper.
//
// Cost: 2⌈log P⌉α, plus ⌈log P⌉α for the broadcast's acknowledgements;
// every message is at most k pairs (2k words) and the critical path is
// ⌈log P⌉ messages up and ⌈log P⌉ down, 4k⌈log P⌉ words in a row, the
// paper's bound. A rank sends once on the way up and at most ⌈log P⌉ times
// on the way down, at most 2k(⌈log P⌉+1) ≤ 4k log P words.

import (
	"context"
	"fmt"
	"math/bits"

	"github.com/oktopk/oktopk/transport"
)

// gTopkAllreduce is gTopk with error feedback: the exact local top-k goes
// up the tree, and what the tree's truncations dropped on this rank goes
// back into its residual.
func gTopkAllreduce(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
	return reduceWithFeedback(ctx, call, st, grad, exactLocalTopK(call),
		func(ctx context.Context, call *Call, n int, local Sparse, k int) (Sparse, Sparse, Sparse, error) {
			var dropped Sparse
			global, err := gTopkTree(ctx, call, n, local, k, &dropped)
			return global, local, dropped, err // step 4: all of local went up the tree
		})
}

// gTopkSparseInput is gTopk's sparse-input form: the tree alone.
func gTopkSparseInput(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error) {
	return gTopkTree(ctx, call, n, in, k, nil)
}

// gTopkTree returns the tree-reduced top-k of the ranks' inputs (each cut
// to its own top k first). Unless dropped is nil, it also sums there what
// this rank's truncations left out, its own cut to k included (step 4).
func gTopkTree(ctx context.Context, call *Call, n int, in Sparse, k int, dropped *Sparse) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	truncate := func(s Sparse) (Sparse, error) {
		if dropped == nil {
			return sparseTopK(s, k)
		}
		kept, cut, err := sparseTopKSplit(s, k)
		if cut.Len() > 0 {
			*dropped = sparseAdd(*dropped, cut)
		}
		return kept, err
	}
	call.Phase(PhaseSelect)
	partial, err := truncate(in)
	if err != nil {
		return Sparse{}, err
	}
	if p == 1 {
		return sparseSumInRankOrder([]Sparse{partial}), nil // a copy: never hand back the caller's storage
	}
	rounds := bits.Len(uint(p - 1)) // ⌈log P⌉
	decode := func(m transport.Message, from int, what string) (Sparse, error) {
		s, err := decodeRegionBlock(m.Dtype, m.Count, m.Payload, 0, uint32(n))
		if err == nil && s.Len() > k {
			err = fmt.Errorf("%w: %d entries, more than k=%d", ErrMismatch, s.Len(), k)
		}
		if err != nil {
			return Sparse{}, fmt.Errorf("oktopk: gtopk %s from rank %d: %w", what, from, err)
		}
		return s, nil
	}

	// Step 2: binomial tree reduce towards rank 0, truncating at every merge.
	call.Phase(PhaseReduce)
	for j, d := 0, 1; d < p; j, d = j+1, 2*d {
		switch {
		case r%(2*d) == d:
			b := regionBlock(partial, 0, uint32(n), false)
			if err := call.Send(ctx, r-d, uint32(j), b.Dtype, b.Count, b.Payload); err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk reduce to rank %d: %w", r-d, err)
			}
		case r%(2*d) == 0 && r+d < p:
			m, err := call.Recv(ctx, r+d, uint32(j))
			if err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk reduce from rank %d: %w", r+d, err)
			}
			child, err := decode(m, r+d, "reduce")
			if err != nil {
				return Sparse{}, err
			}
			if partial, err = truncate(sparseAdd(partial, child)); err != nil {
				return Sparse{}, err
			}
		}
		if r%(2*d) != 0 {
			break // sent up: this rank's part of the reduce is over
		}
	}

	// Step 3: broadcast rank 0's result down the same tree.
	call.Phase(PhaseAllgather)
	var result []byte
	var count uint64
	if r == 0 {
		b := regionBlock(partial, 0, uint32(n), false)
		result, count = b.Payload, b.Count
	}
	for j, d := rounds-1, 1<<(rounds-1); d >= 1; j, d = j-1, d/2 {
		step, ack := uint32(rounds+j), uint32(2*rounds+j)
		switch {
		case r%(2*d) == d:
			m, err := call.Recv(ctx, r-d, step)
			if err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk broadcast from rank %d: %w", r-d, err)
			}
			if m.Dtype != transport.DtypeSparseF32 {
				return Sparse{}, fmt.Errorf("oktopk: gtopk broadcast from rank %d: %w: dtype %v", r-d, transport.ErrBadFrame, m.Dtype)
			}
			result, count = m.Payload, m.Count
			// Acknowledged at once, so the parent goes on to its next
			// child while this rank forwards to its own.
			if err := call.Send(ctx, r-d, ack, transport.DtypeBytes, 0, nil); err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk broadcast acknowledgement to rank %d: %w", r-d, err)
			}
		case r%(2*d) == 0 && r+d < p:
			if err := call.Send(ctx, r+d, step, transport.DtypeSparseF32, count, result); err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk broadcast to rank %d: %w", r+d, err)
			}
			m, err := call.Recv(ctx, r+d, ack)
			if err == nil && (m.Count != 0 || len(m.Payload) != 0) {
				err = fmt.Errorf("%w: acknowledgement of %d bytes", ErrMismatch, len(m.Payload))
			}
			if err != nil {
				return Sparse{}, fmt.Errorf("oktopk: gtopk broadcast acknowledgement from rank %d: %w", r+d, err)
			}
		}
	}
	global, err := DecodeSparse(Sparse{}, result, count, 0, uint32(n))
	if err == nil && global.Len() > k {
		err = fmt.Errorf("%w: %d entries, more than k=%d", ErrMismatch, global.Len(), k)
	}
	if err != nil {
		return Sparse{}, fmt.Errorf("oktopk: gtopk result: %w", err)
	}
	return global, nil
}

// gTopkCost is gTopk's cost under Auto's model (auto.go): the agreement,
// then a binomial tree up and down; the root receives and sends k pairs in
// each of ⌈log₂ P⌉ rounds.
func gTopkCost(s callShape, _ Config, _ bool) costTerms {
	return costTerms{rounds: 3 * s.L, bytes: mul(mul(2*s.K, pairBytes(s.K/s.N, ValuesFloat32)), s.L), passes: exactSelectPasses, entries: mul(4*s.K, s.L)}
}
