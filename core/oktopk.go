package core

// Ok-Topk sparse allreduce (Li & Hoefler, PPoPP'22, Algorithms 1 and 2).
//
// One call works on acc = grad + residual, on every rank at once:
//
//  1. Local threshold. Select about k entries of acc by |acc| > local
//     threshold. Every τ′ calls the threshold is recomputed exactly (the k-th
//     largest |acc|, and the selection is the exact top-k); in between it is
//     reused and nudged (SelectByThreshold).
//  2. Space repartition, every τ calls. Each rank takes the P-quantile
//     positions of its selected indices; the boundaries are averaged over
//     the ranks, so each of the P regions holds about k/P selected entries
//     of every rank. In between the boundaries are reused.
//  3. Split and reduce. Rank r owns region r. In step i = 1…P−1 rank r sends
//     its selected entries of region (r+i) mod P to that rank and receives
//     region r's entries from rank (r−i) mod P; the rotation spreads the
//     traffic so no rank is every sender's target at once. Up to
//     min(4, P) exchanges are in flight, and the owner reduces arrived
//     contributions (in rank order, so the sum is reproducible) while later
//     ones are still on the wire. Indices travel region-relative as integers.
//  4. Global threshold. Every τ′ calls the owners' reduced entries are
//     gathered and every rank takes the exact global top-k (ties to the lower
//     index, as TopK), so all ranks already hold the result. In between each
//     owner keeps its reduced entries with |v| > global threshold, which is
//     nudged (identically on every rank) from the global count.
//  5. Balance, then allgatherv. The per-owner counts are allgathered; the
//     kept entries, in index order, are cut into P equal shares and moved to
//     the rank holding that share; the balanced blocks are allgathered. Every
//     rank now has the same sparse global result, divided by P and written
//     densely into the caller's buffer.
//  6. Residual (error feedback). residual = acc with exactly the entries
//     zeroed that were selected locally and are in the global result.
//
// NaN or Inf in acc on any rank is caught in step 1 and announced in step 4's
// count exchange, which every rank makes anyway: then every rank skips the
// step, leaving its gradient, residual and thresholds as they were.
//
// Cost per call, in reuse iterations: step 3 moves the k selected entries
// (2 words each) once, 2k(P−1)/P; step 5's balance at most the same again
// and its allgatherv 2k(P−1)/P, so at most 6k(P−1)/P words per rank, with
// latency (2P + 2 log P)α in the paper's (P−1)α ring terms. The lower bound
// of any sparse allreduce is 2k(P−1)/P. The repartition (every τ calls) adds
// P−1 words per rank and message, the exact global selection (every τ′
// calls) an allgather of at most k entries per owner, and the count exchange
// 2(P−1) words per call.

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/oktopk/oktopk/transport"
	"golang.org/x/sync/errgroup"
)

func init() {
	registerSparse(OkTopk, okTopkAllreduce)
	registerSparseInput(OkTopk, okTopkSparseInput)
}

// Step numbers of the phases of one call; each phase uses steps from its
// base up, so phases never share a tag.
const (
	stepRepartition uint32 = 0 << 20
	stepSplit       uint32 = 1 << 20
	stepCounts      uint32 = 2 << 20
	stepExactGather uint32 = 3 << 20
	stepBalance     uint32 = 4 << 20
	stepAllgather   uint32 = 5 << 20
)

// maxExchangesInFlight bounds step 3's concurrent exchanges, as the
// reference does, so memory for arrived contributions stays bounded.
const maxExchangesInFlight = 4

// okTopkScratch is reused across calls on one tensor: no per-call
// allocation proportional to n in steady state.
type okTopkScratch struct {
	acc       []float32
	local     Sparse
	regionSum []float32
	touched   []bool
}

// errStepSkipped marks ErrNonFinite when every rank agreed to skip the step:
// the communicator stays usable.
var errStepSkipped = fmt.Errorf("every rank skipped this step")

func okTopkAllreduce(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
	n, p := len(grad), call.Size()
	k := st.Config.K(n)
	sc := &st.scratch
	if cap(sc.acc) < n {
		sc.acc = make([]float32, n)
	}
	acc := sc.acc[:n]
	// With k = n every entry is kept, which only the exact path does
	// without a threshold (a zero sum is still a selected entry).
	exact := st.Iter%st.Config.TauPrime == 0 || k == n
	savedLocal, savedGlobal := st.LocalThreshold, st.GlobalThreshold

	// Step 1: local threshold and selection.
	start := time.Now()
	nonFinite := Accumulate(acc, grad, st.Residual) > 0
	local := sc.local
	local.Reset()
	if !nonFinite {
		var err error
		if k == n {
			local = selectAll(local, acc) // density 1: everything is selected
		} else if local, err = SelectByThreshold(local, acc, k, &st.LocalThreshold, exact); err != nil {
			return err
		}
	}
	sc.local = local
	call.Stats.LocalSelected = local.Len()
	call.Stats.Select = time.Since(start)

	// Step 2: space repartition.
	start = time.Now()
	if st.Iter%st.Config.Tau == 0 || len(st.Boundaries) != p+1 {
		b, err := repartition(ctx, call, local, n)
		if err != nil {
			return err
		}
		st.Boundaries = b
	}

	// Step 3: split and reduce my region.
	reduced, err := splitAndReduce(ctx, call, st.Boundaries, local, sc)
	if err != nil {
		return err
	}
	call.Stats.Reduce = time.Since(start)

	// Step 4 and 5: global selection, balance and allgatherv.
	start = time.Now()
	global, skip, err := globalSelection(ctx, call, st, reduced, k, exact, nonFinite)
	call.Stats.Allgather = time.Since(start)
	if err != nil {
		return err
	}
	if skip {
		st.LocalThreshold, st.GlobalThreshold = savedLocal, savedGlobal
		return fmt.Errorf("%w: %w", ErrNonFinite, errStepSkipped)
	}
	call.Stats.GlobalSelected = global.Len()
	call.Stats.LocalThreshold, call.Stats.GlobalThreshold = st.LocalThreshold, st.GlobalThreshold

	// Step 6: residual, then the averaged result into the caller's buffer.
	UpdateResidual(st.Residual, acc, local, global)
	ScatterAverage(grad, global, p)
	st.Iter++
	return nil
}

func selectAll(dst Sparse, x []float32) Sparse {
	for i, v := range x {
		dst.Append(uint32(i), v)
	}
	return dst
}

// repartition computes region boundaries from the P-quantile positions of
// every rank's selected indices, averaged over the ranks with integer
// arithmetic so that every rank gets the same boundaries.
func repartition(ctx context.Context, call *Call, local Sparse, n int) ([]uint32, error) {
	p := call.Size()
	quantiles := make([]uint64, p+1)
	for j := 0; j <= p; j++ {
		switch {
		case j == p:
			quantiles[j] = uint64(n)
		case local.Len() == 0:
			quantiles[j] = uint64(j) * uint64(n) / uint64(p) // nothing selected: equal split
		case j > 0:
			quantiles[j] = uint64(local.Idx[j*local.Len()/p])
		}
	}
	payload := make([]byte, 8*(p+1))
	for j, q := range quantiles {
		binary.LittleEndian.PutUint64(payload[8*j:], q)
	}
	blocks, err := Allgatherv(ctx, call, stepRepartition, Block{Dtype: transport.DtypeUint64, Count: uint64(p + 1), Payload: payload})
	if err != nil {
		return nil, err
	}
	sum := make([]uint64, p+1)
	for r, b := range blocks {
		if len(b.Payload) != len(payload) {
			return nil, fmt.Errorf("%w: rank %d sent %d region quantiles, want %d", ErrMismatch, r, len(b.Payload)/8, p+1)
		}
		for j := range sum {
			q := binary.LittleEndian.Uint64(b.Payload[8*j:])
			if q > uint64(n) {
				return nil, fmt.Errorf("%w: rank %d's region boundary %d exceeds n=%d (different tensor sizes?)", ErrMismatch, r, q, n)
			}
			sum[j] += q
		}
	}
	bounds := make([]uint32, p+1)
	for j := range bounds {
		bounds[j] = uint32(sum[j] / uint64(p))
	}
	bounds[0], bounds[p] = 0, uint32(n)
	return bounds, nil
}

// regionOf returns the slice of s (ascending) inside [lo, hi).
func regionOf(s Sparse, lo, hi uint32) Sparse {
	a := sort.Search(len(s.Idx), func(i int) bool { return s.Idx[i] >= lo })
	b := a + sort.Search(len(s.Idx)-a, func(i int) bool { return s.Idx[a+i] >= hi })
	return Sparse{Idx: s.Idx[a:b], Val: s.Val[a:b]}
}

// splitAndReduce is step 3: it returns the reduced entries of this rank's
// region (every index any rank contributed, ascending).
func splitAndReduce(ctx context.Context, call *Call, bounds []uint32, local Sparse, sc *okTopkScratch) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	lo, hi := bounds[r], bounds[r+1]
	width := int(hi - lo)
	if cap(sc.regionSum) < width {
		sc.regionSum = make([]float32, width)
		sc.touched = make([]bool, width)
	}
	sum, touched := sc.regionSum[:width], sc.touched[:width]
	clear(sum)
	clear(touched)

	contributions := make([]Sparse, p)
	arrived := make([]chan struct{}, p)
	for i := range arrived {
		arrived[i] = make(chan struct{})
	}
	contributions[r] = regionOf(local, lo, hi)
	close(arrived[r])

	g, gctx := errgroup.WithContext(ctx)
	slots := make(chan struct{}, min(maxExchangesInFlight, p))
	g.Go(func() error {
		for i := 1; i < p; i++ {
			to, from := (r+i)%p, (r-i+p)%p
			select {
			case slots <- struct{}{}:
			case <-gctx.Done():
				return transport.ContextError(gctx, "split and reduce")
			}
			g.Go(func() error {
				defer func() { <-slots }()
				out := regionOf(local, bounds[to], bounds[to+1])
				payload := EncodeSparse(nil, out, bounds[to])
				m, err := call.SendRecv(gctx, to, stepSplit, transport.DtypeSparseF32, uint64(out.Len()), payload, from)
				if err != nil {
					return err
				}
				if m.Dtype != transport.DtypeSparseF32 {
					return fmt.Errorf("%w: rank %d sent %s in split-and-reduce", ErrMismatch, from, m.Dtype)
				}
				in, err := DecodeSparse(Sparse{}, m.Payload, m.Count, lo, hi)
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
	// Reduce in rank order while later contributions are still arriving.
	g.Go(func() error {
		for src := 0; src < p; src++ {
			select {
			case <-arrived[src]:
			case <-gctx.Done():
				return nil // the failing exchange reports the error
			}
			c := contributions[src]
			for j, ix := range c.Idx {
				sum[ix-lo] += c.Val[j]
				touched[ix-lo] = true
			}
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	var reduced Sparse
	for j, t := range touched {
		if t {
			reduced.Append(lo+uint32(j), sum[j])
		}
	}
	return reduced, nil
}

// globalSelection is steps 4 and 5. It returns the global sparse sum
// (identical on every rank), or skip when some rank saw a non-finite value.
func globalSelection(ctx context.Context, call *Call, st *TensorState, reduced Sparse, k int, exact, nonFinite bool) (Sparse, bool, error) {
	// Every owner announces a magnitude histogram of its reduced entries
	// (and whether it saw NaN/Inf); every rank sums them identically.
	base := histogramBase(st.GlobalThreshold)
	hists, anyNonFinite, err := exchangeHistograms(ctx, call, reduced, base, nonFinite)
	if err != nil {
		return Sparse{}, false, err
	}
	if anyNonFinite {
		return Sparse{}, true, nil
	}

	if exact {
		// Every rank gathers the owners' candidates and takes the exact
		// global top-k itself: no balancing needed. An owner sends at most
		// its own top-k, all the global top-k can hold of its region.
		all, err := gatherSparse(ctx, call, stepExactGather, topKSparse(reduced, k), uint32(st.N))
		if err != nil {
			return Sparse{}, false, err
		}
		global := topKSparse(all, k)
		st.GlobalThreshold = largestExcluded(all, global)
		return global, false, nil
	}

	// Reuse iteration: the threshold moves to the histogram bin edge that
	// keeps closest to k entries in total. Every rank computes the same cut
	// from the same histograms, and from them every owner's count.
	cut := chooseCut(hists, k)
	counts := make([]int, len(hists))
	for o, h := range hists {
		for b := cut; b < histogramBins; b++ {
			counts[o] += int(h[b])
		}
	}
	var kept Sparse
	for j, v := range reduced.Val {
		if histogramBin(v, base) >= cut {
			kept.Append(reduced.Idx[j], v)
		}
	}
	st.GlobalThreshold = binEdgeThreshold(base, cut)
	balanced, err := balance(ctx, call, kept, counts)
	if err != nil {
		return Sparse{}, false, err
	}
	global, err := gatherSparse(ctx, call, stepAllgather, balanced, uint32(st.N))
	return global, false, err
}

// The global threshold's histogram: bins an eighth of an octave wide (the
// float's exponent and top three mantissa bits), from 3 octaves below the
// previous threshold to 7 above, so one call follows even a fast change of
// scale.
// Bin 0 also holds everything smaller, the last bin everything larger.
const (
	histogramBins  = 80
	histogramShift = 20 // float32 bits >> 20: exponent and 3 mantissa bits
	histogramBelow = 24 // bins below the previous threshold
)

func histogramKey(v float32) int { return int(math.Float32bits(abs32(v)) >> histogramShift) }

func histogramBase(threshold float32) int { return max(histogramKey(threshold)-histogramBelow, 0) }

func histogramBin(v float32, base int) int {
	return min(max(histogramKey(v)-base, 0), histogramBins-1)
}

// binEdgeThreshold is the threshold t with |v| > t exactly when v's bin is at
// least cut (cut 0: keep everything).
func binEdgeThreshold(base, cut int) float32 {
	if cut == 0 {
		return 0
	}
	edge := math.Float32frombits(uint32(base+cut) << histogramShift)
	return math.Nextafter32(edge, 0)
}

// chooseCut picks the bin from which on the summed histograms keep closest
// to k entries (ties toward keeping more).
func chooseCut(hists [][histogramBins]uint32, k int) int {
	var total [histogramBins + 1]int
	for b := histogramBins - 1; b >= 0; b-- {
		total[b] = total[b+1]
		for _, h := range hists {
			total[b] += int(h[b])
		}
	}
	best := 0
	for c := 0; c <= histogramBins; c++ {
		if abs(total[c]-k) < abs(total[best]-k) {
			best = c
		}
	}
	return min(best, histogramBins-1)
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// exchangeHistograms allgathers every owner's histogram and non-finite flag.
func exchangeHistograms(ctx context.Context, call *Call, reduced Sparse, base int, nonFinite bool) ([][histogramBins]uint32, bool, error) {
	var mine [histogramBins]uint32
	for _, v := range reduced.Val {
		mine[histogramBin(v, base)]++
	}
	payload := make([]byte, 4*(histogramBins+1))
	for b, c := range mine {
		binary.LittleEndian.PutUint32(payload[4*b:], c)
	}
	if nonFinite {
		payload[4*histogramBins] = 1
	}
	blocks, err := Allgatherv(ctx, call, stepCounts, Block{Dtype: transport.DtypeBytes, Count: uint64(len(payload)), Payload: payload})
	if err != nil {
		return nil, false, err
	}
	hists := make([][histogramBins]uint32, len(blocks))
	anyNonFinite := false
	for r, b := range blocks {
		if len(b.Payload) != len(payload) {
			return nil, false, fmt.Errorf("%w: rank %d sent a histogram of %d bytes", ErrMismatch, r, len(b.Payload))
		}
		for i := range hists[r] {
			hists[r][i] = binary.LittleEndian.Uint32(b.Payload[4*i:])
		}
		anyNonFinite = anyNonFinite || b.Payload[4*histogramBins] != 0
	}
	return hists, anyNonFinite, nil
}

// balance is step 5's first half: the kept entries of all owners, taken in
// index order, are cut into P equal shares; rank j receives share j. Each
// owner sends the parts of its entries that fall in other ranks' shares.
func balance(ctx context.Context, call *Call, kept Sparse, counts []int) (Sparse, error) {
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
	// Send my entries that belong to other ranks' shares.
	for j := 0; j < p; j++ {
		lo, hi := overlap(starts[r], starts[r+1], share(j), share(j+1))
		if j == r || lo >= hi {
			continue
		}
		part := Sparse{Idx: kept.Idx[lo-starts[r] : hi-starts[r]], Val: kept.Val[lo-starts[r] : hi-starts[r]]}
		g.Go(func() error {
			return call.Send(gctx, j, stepBalance, transport.DtypeSparseF32, uint64(part.Len()), EncodeSparse(nil, part, 0))
		})
	}
	// Receive the parts of my share that other owners hold, in owner order.
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
		g.Go(func() error {
			m, err := call.Recv(gctx, o, stepBalance)
			if err != nil {
				return err
			}
			if m.Count != uint64(hi-lo) {
				return fmt.Errorf("%w: rank %d moved %d entries, want %d", ErrMismatch, o, m.Count, hi-lo)
			}
			s, err := DecodeSparse(Sparse{}, m.Payload, m.Count, 0, ^uint32(0))
			parts[o] = s
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	var out Sparse
	for _, s := range parts {
		out.Idx = append(out.Idx, s.Idx...)
		out.Val = append(out.Val, s.Val...)
	}
	return out, nil
}

// gatherSparse allgathers every rank's sparse block and concatenates them in
// rank order; blocks must be disjoint and ascending across ranks, which
// DecodeSparse and the order check enforce.
func gatherSparse(ctx context.Context, call *Call, step uint32, mine Sparse, n uint32) (Sparse, error) {
	blocks, err := Allgatherv(ctx, call, step, Block{Dtype: transport.DtypeSparseF32, Count: uint64(mine.Len()), Payload: EncodeSparse(nil, mine, 0)})
	if err != nil {
		return Sparse{}, err
	}
	var out Sparse
	for r, b := range blocks {
		if b.Dtype != transport.DtypeSparseF32 {
			return Sparse{}, fmt.Errorf("%w: rank %d sent %s in the allgather", ErrMismatch, r, b.Dtype)
		}
		s, err := DecodeSparse(Sparse{}, b.Payload, b.Count, 0, n)
		if err != nil {
			return Sparse{}, fmt.Errorf("from rank %d: %w", r, err)
		}
		if len(out.Idx) > 0 && len(s.Idx) > 0 && s.Idx[0] <= out.Idx[len(out.Idx)-1] {
			return Sparse{}, fmt.Errorf("%w: rank %d's block overlaps the one before", transport.ErrBadFrame, r)
		}
		out.Idx = append(out.Idx, s.Idx...)
		out.Val = append(out.Val, s.Val...)
	}
	return out, nil
}

// topKSparse returns the k entries of s with the largest |v| (ties to the
// lower index, as TopK), ascending by index.
func topKSparse(s Sparse, k int) Sparse {
	if k >= s.Len() {
		return Sparse{Idx: append([]uint32(nil), s.Idx...), Val: append([]float32(nil), s.Val...)}
	}
	order := make([]int, s.Len())
	for i := range order {
		order[i] = i
	}
	sort.Slice(order, func(a, b int) bool {
		va, vb := abs32(s.Val[order[a]]), abs32(s.Val[order[b]])
		if va != vb {
			return va > vb
		}
		return order[a] < order[b]
	})
	sel := order[:k]
	sort.Ints(sel)
	var out Sparse
	for _, i := range sel {
		out.Append(s.Idx[i], s.Val[i])
	}
	return out
}

// largestExcluded is the largest |v| of all not in sel (both ascending by
// index, sel ⊆ all): the threshold that reselects sel by |v| > threshold.
func largestExcluded(all, sel Sparse) float32 {
	var th float32
	j := 0
	for i, ix := range all.Idx {
		if j < len(sel.Idx) && sel.Idx[j] == ix {
			j++
			continue
		}
		th = max(th, abs32(all.Val[i]))
	}
	return th
}

// okTopkSparseInput runs steps 3–5 on a caller's own selection (no state,
// exact global top-k): the lower-level call for callers who select
// themselves.
func okTopkSparseInput(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error) {
	st := NewTensorState(0, Config{Algorithm: OkTopk, Density: 1, Tau: 1, TauPrime: 1})
	st.N = n
	b, err := repartition(ctx, call, in, n)
	if err != nil {
		return Sparse{}, err
	}
	reduced, err := splitAndReduce(ctx, call, b, in, &st.scratch)
	if err != nil {
		return Sparse{}, err
	}
	global, _, err := globalSelection(ctx, call, st, reduced, k, true, false)
	return global, err
}
