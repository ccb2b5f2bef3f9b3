package core

// Ok-Topk step 3, split and reduce: each rank sends its selected entries
// of region j to rank j and sums the contributions to its own region, in
// the order the schedule delivers them, so every owner's sums have the same
// bits whatever the timing. The dense-gradient call sums into an array over
// the region; the sparse-input call merges sorted index lists instead.

import (
	"context"
	"fmt"
	mathbits "math/bits"
	"sort"

	"github.com/oktopk/oktopk/transport"
	"golang.org/x/sync/errgroup"
)

// regionSum adds the contributions to one region, in the order they are
// added: for every index, ((0 + first) + second) + … over the contributions
// holding it, so the bits depend on that order alone and not on how the sum
// is kept. Each contribution must be ascending and inside the region.
type regionSum interface {
	add(c Sparse)
	// result is every index any contribution held (a sum that cancels to 0
	// included), ascending, in storage of its own.
	result() Sparse
}

// denseRegionSum keeps the sum in a dense array over the region's width,
// the call's scratch: for the dense-gradient call, which makes passes over
// n elements anyway and keeps its scratch between calls.
type denseRegionSum struct {
	lo      uint32
	sum     []float32
	touched []uint64 // which entries some contribution held, a bit per entry
	count   int      // entries touched
	out     *Sparse  // the result's storage, kept for the next call
}

// denseRegionSum returns sc's dense sum over [lo, hi), emptied.
func (sc *okTopkScratch) denseRegionSum(lo, hi uint32) *denseRegionSum {
	width := int(hi - lo)
	// The region is summed densely, but only the entries some rank sent
	// are ever read or written: an entry's first contribution is added to
	// 0 (as if the sum had been cleared) and marks it in touched, a bit per
	// entry. Only the bits are cleared per call, n/(32P) words.
	// A repartition moves the boundaries, so the buffers are made with a
	// quarter's slack: not anew after every repartition that widens the
	// region a little. (Pages never written cost no memory.)
	if cap(sc.regionSum) < width {
		sc.regionSum = make([]float32, width+width/4)
	}
	words := (width + 63) / 64
	if cap(sc.touched) < words {
		sc.touched = make([]uint64, words+words/4)
	}
	sc.dense = denseRegionSum{lo: lo, sum: sc.regionSum[:width], touched: sc.touched[:words], out: &sc.reduced}
	clear(sc.dense.touched)
	return &sc.dense
}

func (d *denseRegionSum) add(c Sparse) {
	for j, ix := range c.Idx {
		e := ix - d.lo
		w, bit := e/64, uint64(1)<<(e%64)
		if d.touched[w]&bit == 0 {
			d.touched[w] |= bit
			d.sum[e] = 0 + c.Val[j] // the bits of adding to a cleared sum (−0 becomes +0)
			d.count++
		} else {
			d.sum[e] += c.Val[j]
		}
	}
}

func (d *denseRegionSum) result() Sparse {
	reduced := growSparse(*d.out, d.count)
	j := 0
	for w, bits := range d.touched {
		for ; bits != 0; bits &= bits - 1 {
			e := w*64 + mathbits.TrailingZeros64(bits)
			reduced.Idx[j], reduced.Val[j] = d.lo+uint32(e), d.sum[e]
			j++
		}
	}
	*d.out = reduced
	return reduced
}

// mergedRegionSum keeps the sum as a sparse vector and merges each
// contribution's sorted indices into it: memory and time follow the pairs
// (at most P merges over them), whatever the region's width. It is the
// sparse-input call's, whose n may be 2^32−1 with a handful of pairs.
type mergedRegionSum struct {
	sum, spare Sparse // spare is the previous sum's storage, reused by the next merge
}

func (m *mergedRegionSum) add(c Sparse) {
	a := m.sum
	out := m.spare
	out.Reset()
	if need := a.Len() + c.Len(); cap(out.Idx) < need {
		// Room for the sums still to come, so the two buffers settle
		// after a few contributions instead of growing on each one.
		out.Idx, out.Val = make([]uint32, 0, 2*need), make([]float32, 0, 2*need)
	}
	var zero float32 // 0 + v, as the dense sum forms it: −0 becomes +0
	i, j := 0, 0
	for i < a.Len() && j < c.Len() {
		switch ai, cj := a.Idx[i], c.Idx[j]; {
		case ai < cj:
			out.Append(ai, a.Val[i])
			i++
		case cj < ai:
			out.Append(cj, zero+c.Val[j])
			j++
		default:
			out.Append(ai, a.Val[i]+c.Val[j])
			i++
			j++
		}
	}
	out.Idx = append(out.Idx, a.Idx[i:]...)
	out.Val = append(out.Val, a.Val[i:]...)
	for ; j < c.Len(); j++ {
		out.Append(c.Idx[j], zero+c.Val[j])
	}
	m.sum, m.spare = out, a
}

func (m *mergedRegionSum) result() Sparse { return m.sum }

// splitAndReduce is step 3: it returns the reduced entries of this rank's
// region (every index any rank contributed, ascending), summed into sum; the
// messages are encoded and decoded in sc's storage.
func splitAndReduce(ctx context.Context, call *Call, bounds []uint32, local Sparse, sum regionSum, sc *okTopkScratch) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	lo, hi := bounds[r], bounds[r+1]

	// Each region's entries of the selection, encoded for its owner into
	// its own part of one buffer (the parts never overlap, so the
	// exchanges in flight encode at once).
	at := make([]int, p+1) // region j is local[at[j]:at[j+1]]
	for j := 1; j < p; j++ {
		at[j] = at[j-1] + sort.Search(local.Len()-at[j-1], func(i int) bool { return local.Idx[at[j-1]+i] >= bounds[j] })
	}
	at[p] = local.Len()
	if need := sparseSlotsBytes(call.Values, local.Len(), p); cap(sc.encoded) < need {
		sc.encoded = make([]byte, need)
	}
	for len(sc.decoded) < p {
		sc.decoded = append(sc.decoded, Sparse{})
	}
	region := func(j int) Sparse { return Sparse{Idx: local.Idx[at[j]:at[j+1]], Val: local.Val[at[j]:at[j+1]]} }

	contributions := make([]Sparse, p)
	arrived := make([]chan struct{}, p)
	for i := range arrived {
		arrived[i] = make(chan struct{})
	}
	contributions[r] = region(r)
	close(arrived[r])

	g, gctx := errgroup.WithContext(ctx)
	slots := make(chan struct{}, min(maxExchangesInFlight, p))
	goSafe(g, func() error {
		for i := 1; i < p; i++ {
			to, from := (r+i)%p, (r-i+p)%p
			select {
			case slots <- struct{}{}:
			case <-gctx.Done():
				return transport.ContextError(gctx, "split and reduce")
			}
			goSafe(g, func() error {
				defer func() { <-slots }()
				out := region(to)
				if call.Values.scaled() {
					// Rounded in place as the frame is made: local keeps
					// what left, for this rank's residual (int8values.go).
					call.Values.quantize(out, nil)
				}
				payload := encodeSparseAs(sparseSlot(sc.encoded, call.Values, at[to], at[to+1], to), out, bounds[to], call.Values)
				m, err := call.SendRecv(gctx, to, stepSplit, call.Values.sparseDtype(), uint64(out.Len()), payload, from)
				if err != nil {
					return err
				}
				if m.Dtype != call.Values.sparseDtype() {
					return fmt.Errorf("%w: rank %d sent %s in split-and-reduce, this rank %s (another value type configured?)", ErrMismatch, from, m.Dtype, call.Values.sparseDtype())
				}
				in, err := decodeSparseAs(sc.decoded[from], m.Payload, m.Count, lo, hi, call.Values)
				sc.decoded[from] = in // kept for the next call, grown or not
				if err != nil {
					return fmt.Errorf("from rank %d: %w", from, err)
				}
				contributions[from] = in
				close(arrived[from])
				return nil
			})
		}
		return nil
	})
	// Reduce while later contributions are still arriving, in the order
	// the schedule delivers them: my own, then ranks r−1, r−2, … (mod P).
	// Only the owner sums its region, so the order is fixed per region and
	// every rank ends with the same bits.
	goSafe(g, func() error {
		for i := 0; i < p; i++ {
			src := (r - i + p) % p
			select {
			case <-arrived[src]:
			case <-gctx.Done():
				return nil // the failing exchange reports the error
			}
			sum.add(contributions[src])
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	return sum.result(), nil
}
