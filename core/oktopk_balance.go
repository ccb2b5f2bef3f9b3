package core

// Ok-Topk step 5, balance and allgatherv: the kept entries of all owners,
// in index order, are cut into P equal shares, moved to the rank holding
// each share, and the balanced shares are allgathered, so every rank ends
// with the same global result and no rank sends more than its share.

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/transport"
	"golang.org/x/sync/errgroup"
)

// balance is step 5's first half: the kept entries of all owners, taken in
// index order, are cut into P equal shares; rank j receives share j. Each
// owner sends the parts of its entries that fall in other ranks' shares.
// The result is in sc's storage.
func balance(ctx context.Context, call *Call, kept Sparse, counts []int, sc *okTopkScratch) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	total := 0
	starts := make([]int, p+1) // global position of each owner's first entry
	for o, c := range counts {
		starts[o] = total
		total += c
	}
	starts[p] = total
	share := func(j int) int { return j * total / p }
	overlap := func(aLo, aHi, bLo, bHi int) (int, int) { return max(aLo, bLo), min(aHi, bHi) }

	g, gctx := errgroup.WithContext(ctx)
	// Send my entries that belong to other ranks' shares, each part encoded
	// into its own place in one buffer (the parts never overlap).
	if need := sparseSlotsBytes(call.Values, kept.Len(), p); cap(sc.sends) < need {
		sc.sends = make([]byte, need)
	}
	for j := 0; j < p; j++ {
		lo, hi := overlap(starts[r], starts[r+1], share(j), share(j+1))
		if j == r || lo >= hi {
			continue
		}
		a, b := lo-starts[r], hi-starts[r]
		part := Sparse{Idx: kept.Idx[a:b], Val: kept.Val[a:b]}
		if call.Values.scaled() {
			call.Values.quantize(part, &sc.ownerErr) // this owner's residual takes the errors, ascending with the parts
		}
		payload := encodeSparseAs(sparseSlot(sc.sends, call.Values, a, b, j), part, 0, call.Values)
		goSafe(g, func() error {
			return call.Send(gctx, j, stepBalance, call.Values.sparseDtype(), uint64(part.Len()), payload)
		})
	}
	// Receive the parts of my share that other owners hold, in owner order.
	for len(sc.parts) < p {
		sc.parts = append(sc.parts, Sparse{})
	}
	parts := make([]Sparse, p)
	for o := 0; o < p; o++ {
		lo, hi := overlap(starts[o], starts[o+1], share(r), share(r+1))
		if lo >= hi {
			continue
		}
		if o == r {
			parts[o] = Sparse{Idx: kept.Idx[lo-starts[r] : hi-starts[r]], Val: kept.Val[lo-starts[r] : hi-starts[r]]}
			continue
		}
		goSafe(g, func() error {
			m, err := call.Recv(gctx, o, stepBalance)
			if err != nil {
				return err
			}
			if m.Count != uint64(hi-lo) || m.Dtype != call.Values.sparseDtype() {
				return fmt.Errorf("%w: rank %d moved %d entries of %s, want %d of %s", ErrMismatch, o, m.Count, m.Dtype, hi-lo, call.Values.sparseDtype())
			}
			s, err := decodeSparseAs(sc.parts[o], m.Payload, m.Count, 0, ^uint32(0), call.Values)
			sc.parts[o], parts[o] = s, s
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	sc.balanced = concatSparse(sc.balanced, parts)
	return sc.balanced, nil
}

// concatSparse returns the parts one after the other in dst's storage
// (reset first, grown when too small).
func concatSparse(dst Sparse, parts []Sparse) Sparse {
	total := 0
	for _, s := range parts {
		total += s.Len()
	}
	dst = reserveSparse(Sparse{Idx: dst.Idx[:0], Val: dst.Val[:0]}, total)
	dst.Reset()
	for _, s := range parts {
		dst.Idx = append(dst.Idx, s.Idx...)
		dst.Val = append(dst.Val, s.Val...)
	}
	return dst
}

// gatherSparse allgathers every rank's sparse block (Bruck's algorithm: the
// balanced shares are of about one size) and concatenates them in rank
// order; blocks must be disjoint and ascending across ranks, which
// DecodeSparse and the order check enforce.
func gatherSparse(ctx context.Context, call *Call, step uint32, mine Sparse, n uint32, sc *okTopkScratch) (Sparse, error) {
	dtype := call.Values.sparseDtype()
	if call.Values.scaled() {
		// This rank's residual takes its share's errors beside those of
		// the sums it moved away in balance: other indices, both ascending.
		sc.shareErr.Reset()
		call.Values.quantize(mine, &sc.shareErr)
		sc.ownerErr, sc.errSpare = mergeSparse(sc.errSpare, sc.ownerErr, sc.shareErr), sc.ownerErr
	}
	sc.share = encodeSparseAs(sc.share, mine, 0, call.Values)
	blocks, err := okTopkGather(ctx, call, step, Block{Dtype: dtype, Count: uint64(mine.Len()), Payload: sc.share})
	if err != nil {
		return Sparse{}, err
	}
	for len(sc.blocks) < len(blocks) {
		sc.blocks = append(sc.blocks, Sparse{})
	}
	parts := make([]Sparse, len(blocks))
	var last int64 = -1 // the largest index so far
	for r, b := range blocks {
		if b.Dtype != dtype {
			return Sparse{}, fmt.Errorf("%w: rank %d sent %s in the allgather, this rank %s", ErrMismatch, r, b.Dtype, dtype)
		}
		s, err := decodeSparseAs(sc.blocks[r], b.Payload, b.Count, 0, n, call.Values)
		sc.blocks[r] = s
		if err != nil {
			return Sparse{}, fmt.Errorf("from rank %d: %w", r, err)
		}
		if s.Len() > 0 {
			if int64(s.Idx[0]) <= last {
				return Sparse{}, fmt.Errorf("%w: rank %d's block overlaps the one before", transport.ErrBadFrame, r)
			}
			last = int64(s.Idx[s.Len()-1])
		}
		parts[r] = s
	}
	sc.global = concatSparse(sc.global, parts)
	return sc.global, nil
}
