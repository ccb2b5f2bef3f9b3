package core

// Ok-Topk step 4, the global selection: the owners' histograms of their
// reduced magnitudes are summed — allgathered and summed by every rank up
// to okTopkGatheredControlMaxP ranks, summed by an allreduce beyond — and
// every rank cuts the summed histogram where it keeps closest to k
// entries, refining the boundary bin when the coarse cut keeps too few or
// too many (and on exact calls until exactly k stay, ties split in index
// order). Every rank computes the same cut from the same sums (integers:
// exact in any order), so every owner keeps what the others expect. Step
// 5 needs every owner's count: from the gathered histograms, or, when they
// were summed, from an allgather of the counts (with each owner's ties
// when the cut splits them). Step 4's costs are in oktopk.go's opening
// comment.

import (
	"context"
	"encoding/binary"
	"math"
)

// globalSelection is steps 4 and 5. It returns the global sparse sum
// (identical on every rank), or skip when some rank saw a non-finite value.
func globalSelection(ctx context.Context, call *Call, st *TensorState, reduced Sparse, k int, exact, nonFinite bool) (Sparse, bool, error) {
	// Every owner announces a magnitude histogram of its reduced entries
	// (and whether it saw NaN/Inf); every rank sums them identically.
	call.Phase(PhaseGlobalSelect)
	sc := call.okTopkScratch(st)
	base := histogramBase(st.GlobalThreshold)
	summed := okTopkSumsControl(call.Size())
	hists, anyNonFinite, err := exchangeHistograms(ctx, call, reduced, base, nonFinite, summed)
	if err != nil {
		return Sparse{}, false, err
	}
	if anyNonFinite {
		return Sparse{}, true, nil
	}

	// Cut the summed histograms where closest to k entries stay, refining
	// the boundary bin when that is far from k (a reuse call), or until
	// exactly the k largest stay (an exact call: the exact global top-k,
	// ties to the lower index, for a few histogram rounds instead of
	// gathering every owner's candidates). Every rank computes the same
	// cut, and every owner's count, from the same histograms; summed
	// histograms leave the counts to an exchange of their own.
	cut, err := chooseGlobalCut(ctx, call, reduced, hists, base, k, exact, summed)
	if err != nil {
		return Sparse{}, false, err
	}
	if summed {
		if cut, err = exchangeCounts(ctx, call, reduced, cut, k); err != nil {
			return Sparse{}, false, err
		}
	}
	sc.kept = cut.keep(sc.kept, reduced, call.Rank())
	call.Stats.Kept = sc.kept.Len()
	// Each owner rounds its sums once to the wire's precision; every rank,
	// this one too, uses the rounded sums, and this owner's residual takes
	// the rounding errors (values.go).
	sc.ownerErr.Reset()
	if call.Values.half() { // 8-bit sums are rounded as they are moved (balance, int8values.go)
		sc.ownerErr = roundingOf(call, st.Config, st.Iter, roundOwnerSum).applyKeepingErrors(sc.kept, sc.ownerErr)
	}
	call.Phase(PhaseBalance)
	balanced, err := balance(ctx, call, sc.kept, cut.counts, sc)
	if err != nil {
		return Sparse{}, false, err
	}
	call.Phase(PhaseAllgather)
	global, err := gatherSparse(ctx, call, stepAllgather, balanced, uint32(st.N), sc)
	if err != nil {
		return Sparse{}, false, err
	}
	st.GlobalThreshold = reusableThreshold(cut.threshold(), global)
	return global, false, nil
}

// reusableThreshold is th, or, when th is 0 (nothing was left out, as when
// every rank selected the same entries), one step below the smallest
// nonzero magnitude kept: a zero threshold would centre the next call's
// histogram on nothing. It stays 0 only for a result without a nonzero
// entry; then the next call's histogram starts at 0 and is refined.
func reusableThreshold(th float32, global Sparse) float32 {
	if th > 0 {
		return th
	}
	smallest := float32(math.Inf(1))
	for _, v := range global.Val {
		if a := abs32(v); a > 0 && a < smallest {
			smallest = a
		}
	}
	if math.IsInf(float64(smallest), 1) {
		return 0
	}
	return math.Nextafter32(smallest, 0)
}

// Magnitudes are compared as keys: the bits of |v|, which order like |v|
// for every non-NaN float (non-finite values never reach step 4).
const keyLimit = 1 << 31 // above every key

func magnitudeKey(v float32) uint64 { return uint64(math.Float32bits(v) &^ signBit) }

// The global threshold's histogram: bins an eighth of an octave wide (the
// float's exponent and top three mantissa bits), from 3 octaves below the
// previous threshold to 7 above, so one call follows even a fast change of
// scale. Bin 0 also holds everything smaller, the last bin everything
// larger.
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

// binLow is the smallest key in bin b (b = histogramBins: keyLimit, as the
// last bin holds everything larger).
func binLow(base, b int) uint64 {
	switch {
	case b == 0:
		return 0
	case b >= histogramBins:
		return keyLimit
	}
	return min(uint64(base+b)<<histogramShift, keyLimit)
}

// A reuse call's cut should keep close to k entries. The coarse histogram
// alone is accepted when its best cut keeps within this window (eighth-
// octave bins usually land there); otherwise the boundary bin is refined.
// The upper end keeps the volume of step 5 within the paper's bound.
const (
	globalAcceptLow  = 3.0 / 4.0
	globalAcceptHigh = 5.0 / 4.0
	refineBins       = 64 // sub-bins per refinement round
)

// globalCut is a reuse call's global selection, the same on every rank:
// every reduced entry with key ≥ edge and, when quota is set, the first
// quota[o] entries (in index order) of owner o with key edge−1 — ties split
// toward the lower index, as TopK splits them.
type globalCut struct {
	edge   uint64
	quota  []int
	counts []int // entries each owner keeps

	// From summed histograms (counts nil until exchangeCounts): the cut
	// keeps key edge−1's ties up to k in owner order, quota unknown yet.
	splitsTies bool
}

// keep returns the entries of reduced the cut keeps on owner, in dst's
// storage (reset first).
func (c globalCut) keep(dst, reduced Sparse, owner int) Sparse {
	kept := dst
	kept.Reset()
	ties := 0
	if c.quota != nil {
		ties = c.quota[owner]
	}
	for j, v := range reduced.Val {
		key := magnitudeKey(v)
		if key >= c.edge {
			kept.Append(reduced.Idx[j], v)
		} else if ties > 0 && key+1 == c.edge {
			kept.Append(reduced.Idx[j], v)
			ties--
		}
	}
	return kept
}

// threshold is the t with |v| > t exactly for keys ≥ edge (0 when every
// entry is kept).
func (c globalCut) threshold() float32 {
	if c.edge == 0 {
		return 0
	}
	return math.Float32frombits(uint32(min(c.edge, keyLimit) - 1))
}

// chooseGlobalCut finds the reuse call's cut. The coarse histograms give
// the edge keeping closest to k entries; when that is outside the accepted
// window (many entries piled in the one bin the k-th largest falls in), the
// ranks narrow that bin with further rounds of refineBins sub-bins each,
// down to a single key if need be, whose ties are then split by owner
// order. So a reuse call keeps within the window or exactly k entries,
// unless fewer than k were reduced at all (then it keeps them all).
//
// With summed (hists and every refinement round one row, the sum over the
// owners) the decisions are the same, as they depend on the totals only,
// but the owners' counts and tie quotas are left to exchangeCounts.
func chooseGlobalCut(ctx context.Context, call *Call, reduced Sparse, hists [][histogramBins]uint32, base, k int, exact, summed bool) (globalCut, error) {
	p := len(hists)
	acceptable := func(total, k int) bool { return total == k || !exact && acceptableCount(total, k) }
	cutAt := func(edge uint64, counts []int) globalCut {
		if summed {
			return globalCut{edge: edge}
		}
		return globalCut{edge: edge, counts: counts}
	}
	coarse := func(o, b int) int { return int(hists[o][b]) }
	above := make([]int, p) // per owner (summed: in all), entries above the bin being refined
	totals := cumulativeTotals(coarse, p, histogramBins, 0)
	best := closestTo(totals, k)
	if acceptable(totals[best], k) || totals[0] < k {
		return cutAt(binLow(base, best), ownerCounts(above, coarse, best, histogramBins)), nil
	}
	// The k-th largest lies in the highest bin from which on at least k
	// entries are reduced; narrow it.
	b := boundary(totals, k)
	above = ownerCounts(above, coarse, b+1, histogramBins)
	lo, hi := binLow(base, b), binLow(base, b+1)
	for round := uint32(0); ; round++ {
		sub, err := exchangeRefinement(ctx, call, stepRefine+round*refineSteps(call.Size(), summed), reduced, lo, hi, summed)
		if err != nil {
			return globalCut{}, err
		}
		fine := func(o, s int) int { return int(sub[o][s]) }
		aboveTotal := 0
		for _, a := range above {
			aboveTotal += a
		}
		totals := cumulativeTotals(fine, p, refineBins, aboveTotal)
		best := closestTo(totals, k)
		if acceptable(totals[best], k) {
			return cutAt(subLow(lo, hi, best), ownerCounts(above, fine, best, refineBins)), nil
		}
		s := boundary(totals, k)
		above = ownerCounts(above, fine, s+1, refineBins)
		lo, hi = subLow(lo, hi, s), subLow(lo, hi, s+1)
		if hi-lo == 1 {
			// One key left: keep everything above it and split its
			// ties by owner order, so exactly k are kept.
			if summed {
				return globalCut{edge: lo + 1, splitsTies: true}, nil
			}
			ties := make([]int, p)
			for o := range ties {
				ties[o] = fine(o, s)
			}
			return splitTies(lo, above, ties, k), nil
		}
	}
}

// ownerCounts is above plus, per owner, its entries in bins from..nbins−1.
func ownerCounts(above []int, bins func(o, b int) int, from, nbins int) []int {
	c := append([]int(nil), above...)
	for o := range c {
		for b := from; b < nbins; b++ {
			c[o] += bins(o, b)
		}
	}
	return c
}

// splitTies keeps every entry with a key above key and, of the ties[o] at
// key on each owner, the first k − Σabove in owner order, which is index
// order.
func splitTies(key uint64, above, ties []int, k int) globalCut {
	need := k
	for _, a := range above {
		need -= a
	}
	cut := globalCut{edge: key + 1, quota: make([]int, len(above)), counts: append([]int(nil), above...)}
	for o, t := range ties {
		q := min(t, max(need, 0))
		cut.quota[o], cut.counts[o] = q, cut.counts[o]+q
		need -= q
	}
	return cut
}

// subLow is the smallest key of sub-bin s of [lo, hi) split refineBins ways:
// a key maps to sub-bin (key−lo)·refineBins/(hi−lo).
func subLow(lo, hi uint64, s int) uint64 {
	w := hi - lo
	return lo + (uint64(s)*w+refineBins-1)/refineBins
}

func subBin(key, lo, hi uint64) int { return int((key - lo) * refineBins / (hi - lo)) }

// cumulativeTotals[c] is how many entries (summed over owners) lie in bins
// ≥ c, plus above; the last element (c = nbins) is above alone.
func cumulativeTotals(bins func(o, b int) int, p, nbins, above int) []int {
	totals := make([]int, nbins+1)
	totals[nbins] = above
	for b := nbins - 1; b >= 0; b-- {
		totals[b] = totals[b+1]
		for o := 0; o < p; o++ {
			totals[b] += bins(o, b)
		}
	}
	return totals
}

// closestTo is the cut whose total is closest to k, ties toward keeping more.
func closestTo(totals []int, k int) int {
	best := 0
	for c := range totals {
		if abs(totals[c]-k) < abs(totals[best]-k) {
			best = c
		}
	}
	return best
}

// boundary is the highest bin from which on at least k entries lie (the bin
// holding the k-th largest); totals[0] ≥ k.
func boundary(totals []int, k int) int {
	b := 0
	for b+1 < len(totals)-1 && totals[b+1] >= k {
		b++
	}
	return b
}

func acceptableCount(total, k int) bool {
	return float64(total) >= globalAcceptLow*float64(k) && float64(total) <= globalAcceptHigh*float64(k)
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// refineSteps is the step numbers a refinement round uses, over p ranks.
func refineSteps(p int, summed bool) uint32 {
	if summed {
		return SumAllreduceSteps(p)
	}
	return AllgatherSteps(p)
}

// exchangeHistograms exchanges every owner's histogram and non-finite
// flag: gathered, one row per owner, or (summed) one row, their sum, from
// one SumAllreduce of 81 counts (the flags summed into the last).
func exchangeHistograms(ctx context.Context, call *Call, reduced Sparse, base int, nonFinite, summed bool) ([][histogramBins]uint32, bool, error) {
	var mine [histogramBins + 1]uint32
	for _, v := range reduced.Val {
		mine[histogramBin(v, base)]++
	}
	if nonFinite {
		mine[histogramBins] = 1
	}
	sent := call.Stats.BytesSent
	defer func() { call.Stats.histogramWords += int(call.Stats.BytesSent-sent) / 4 }()
	if summed {
		if err := SumAllreduce(ctx, call, stepHistograms, mine[:]); err != nil {
			return nil, false, err
		}
		return [][histogramBins]uint32{[histogramBins]uint32(mine[:histogramBins])}, mine[histogramBins] != 0, nil
	}
	payload := make([]byte, 4*(histogramBins+1))
	for b, c := range mine {
		binary.LittleEndian.PutUint32(payload[4*b:], c)
	}
	blocks, err := okTopkGatherEqual(ctx, call, stepHistograms, payload)
	if err != nil {
		return nil, false, err
	}
	hists := make([][histogramBins]uint32, len(blocks))
	anyNonFinite := false
	for r, b := range blocks {
		for i := range hists[r] {
			hists[r][i] = binary.LittleEndian.Uint32(b[4*i:])
		}
		anyNonFinite = anyNonFinite || b[4*histogramBins] != 0
	}
	return hists, anyNonFinite, nil
}

// exchangeRefinement exchanges every owner's histogram of its reduced
// entries with keys in [lo, hi), refineBins sub-bins: gathered, one row per
// owner, or (summed) their sum by SumAllreduce, one row.
func exchangeRefinement(ctx context.Context, call *Call, step uint32, reduced Sparse, lo, hi uint64, summed bool) ([][refineBins]uint32, error) {
	var mine [refineBins]uint32
	for _, v := range reduced.Val {
		if key := magnitudeKey(v); key >= lo && key < hi {
			mine[subBin(key, lo, hi)]++
		}
	}
	sent := call.Stats.BytesSent
	defer func() { call.Stats.histogramWords += int(call.Stats.BytesSent-sent) / 4 }()
	if summed {
		if err := SumAllreduce(ctx, call, step, mine[:]); err != nil {
			return nil, err
		}
		return [][refineBins]uint32{mine}, nil
	}
	payload := make([]byte, 4*refineBins)
	for b, c := range mine {
		binary.LittleEndian.PutUint32(payload[4*b:], c)
	}
	blocks, err := okTopkGatherEqual(ctx, call, step, payload)
	if err != nil {
		return nil, err
	}
	hists := make([][refineBins]uint32, len(blocks))
	for r, b := range blocks {
		for i := range hists[r] {
			hists[r][i] = binary.LittleEndian.Uint32(b[4*i:])
		}
	}
	return hists, nil
}

// exchangeCounts completes a cut chosen from summed histograms: every owner
// announces how many of its reduced entries the cut keeps (an allgather of
// one word per owner), or, when the cut splits the ties of key edge−1, how
// many lie above that key and how many at it (two words), from which every
// rank splits the ties in owner order as splitTies does for gathered
// histograms. Every rank gets every owner's count, which step 5 needs.
func exchangeCounts(ctx context.Context, call *Call, reduced Sparse, cut globalCut, k int) (globalCut, error) {
	above, ties := 0, 0
	for _, v := range reduced.Val {
		switch key := magnitudeKey(v); {
		case key >= cut.edge:
			above++
		case cut.splitsTies && key+1 == cut.edge:
			ties++
		}
	}
	width := 1
	if cut.splitsTies {
		width = 2
	}
	payload := binary.LittleEndian.AppendUint32(make([]byte, 0, 4*width), uint32(above))
	if cut.splitsTies {
		payload = binary.LittleEndian.AppendUint32(payload, uint32(ties))
	}
	sent := call.Stats.BytesSent
	blocks, err := okTopkGatherEqual(ctx, call, stepCounts, payload)
	call.Stats.histogramWords += int(call.Stats.BytesSent-sent) / 4
	if err != nil {
		return globalCut{}, err
	}
	aboves, tiesOf := make([]int, len(blocks)), make([]int, len(blocks))
	for o, b := range blocks {
		aboves[o] = int(binary.LittleEndian.Uint32(b))
		if cut.splitsTies {
			tiesOf[o] = int(binary.LittleEndian.Uint32(b[4:]))
		}
	}
	if cut.splitsTies {
		return splitTies(cut.edge-1, aboves, tiesOf, k), nil
	}
	cut.counts = aboves
	return cut, nil
}
