package core

// Selection above a threshold: every entry with |x| > th, ascending by
// index, split over chunks that run in parallel; the capped variant also
// counts the entries above a few raised thresholds in the same pass, so a
// reused threshold that lets far too many through costs no second pass.

import "slices"

// SelectAbove appends to dst every entry with |x| > th, ascending by index.
// NaN entries are never above any threshold; SelectAboveChecked reports
// them.
func SelectAbove(dst Sparse, x []float32, th float32) Sparse {
	dst, _ = selectAbove(dst, x, th, selectionChunks(len(x)))
	return dst
}

// SelectAboveChecked is SelectAbove that also returns how many entries of x
// are NaN or ±Inf, counted in the same pass (a caller that must not send
// them skips the step when the count is not 0). NaN entries are not
// selected; ±Inf are when th < +Inf.
func SelectAboveChecked(dst Sparse, x []float32, th float32) (Sparse, int) {
	return selectAbove(dst, x, th, selectionChunks(len(x)))
}

// minKeyAbove is the smallest key of a magnitude > th.
func minKeyAbove(th float32) uint32 {
	switch {
	case th != th:
		return infKey + 1 // nothing is above NaN
	case th < 0:
		return 0
	default:
		return key(th) + 1 // +Inf: infKey+1, above every non-NaN key
	}
}

func selectAbove(dst Sparse, x []float32, th float32, chunks int) (Sparse, int) {
	return selectAboveOf(dst, plainVec(x), th, chunks)
}

// selectAboveOf is selectAbove on a vec. On a sum (error feedback's grad +
// residual) it is the accumulation fused with the selection: one read of
// both, each tile of sums scanned while in the L1 cache, nothing stored.
func selectAboveOf(dst Sparse, x vec, th float32, chunks int) (Sparse, int) {
	minKey := minKeyAbove(th)
	chunks = max(1, min(chunks, x.len()))
	sc := getScratch()
	defer putScratch(sc)
	tiles := sc.tilesFor(x, chunks)
	return selectInChunks(sc, dst, x.len(), chunks, func(c int, part Sparse, lo, hi int) (Sparse, int) {
		bad := 0
		x.each(lo, hi, tiles[c], func(span []float32, base int) {
			var b int
			part, b = appendAbove(part, span, base, minKey)
			bad += b
		})
		return part, bad
	})
}

// raisedCount is how many thresholds selectAboveCapped counts for: the
// reused one and its raises.
const raisedCount = thresholdMaxRaises + 1

// selectAboveCapped is selectAboveOf for a reused threshold, whose selection
// may be far larger than k when the gradient's scale has moved (all of x,
// at worst), with storage that never grows past about limit entries per
// chunk: once a chunk has stored more than limit entries it stores no more
// and, for the rest of its part of x, counts instead the entries above each
// of ths (ths[0] the threshold selected by, ths[1:] its raises). Then
// counts is not nil and holds, per threshold, the entries of all of x above
// it; dst holds nothing. The non-finite count is complete either way.
func selectAboveCapped(dst Sparse, x vec, ths *[raisedCount]float32, limit float64, chunks int) (_ Sparse, nonFinite int, counts *[raisedCount]int) {
	var minKeys [raisedCount]uint32
	for j, th := range ths {
		minKeys[j] = minKeyAbove(th)
	}
	chunks = max(1, min(chunks, x.len()))
	sc := getScratch()
	defer putScratch(sc)
	tiles := sc.tilesFor(x, chunks)
	over := make([]bool, chunks)
	counted := make([][raisedCount]int, chunks)
	dst, nonFinite = selectInChunks(sc, dst, x.len(), chunks, func(c int, part Sparse, lo, hi int) (Sparse, int) {
		bad := 0
		x.tiles(lo, hi, tiles[c], func(span []float32, base int) {
			if over[c] {
				bad += countAboveKeys(span, &minKeys, &counted[c])
				return
			}
			var b int
			part, b = appendAbove(part, span, base, minKeys[0])
			bad += b
			if float64(part.Len()) > limit {
				// Count what is stored, and store nothing more.
				over[c] = true
				for _, v := range part.Val {
					addAboveKeys(key(v), &minKeys, &counted[c])
				}
				part.Reset()
			}
		})
		return part, bad
	})
	if !slices.Contains(over, true) {
		return dst, nonFinite, nil
	}
	// Some chunk stopped storing: the others' entries are counted here.
	counts = new([raisedCount]int)
	for _, v := range dst.Val {
		addAboveKeys(key(v), &minKeys, counts)
	}
	for c := range counted {
		for j := range counts {
			counts[j] += counted[c][j]
		}
	}
	dst.Reset()
	return dst, nonFinite, counts
}

// countAboveKeys adds to counts[j] the finite entries of x with key ≥
// minKeys[j] (ascending keys) and returns how many entries are NaN or ±Inf.
func countAboveKeys(x []float32, minKeys *[raisedCount]uint32, counts *[raisedCount]int) (nonFinite int) {
	for _, u := range floatBits(x) {
		u &^= signBit
		if u >= infKey {
			nonFinite++
		} else if u >= minKeys[0] {
			addAboveKeys(u, minKeys, counts)
		}
	}
	return nonFinite
}

func addAboveKeys(u uint32, minKeys *[raisedCount]uint32, counts *[raisedCount]int) {
	for j, m := range minKeys {
		if u < m {
			return
		}
		counts[j]++
	}
}

// selectInChunks runs a selection over [0, n) split into chunks, each chunk
// appending its entries (ascending) to its own part on its own goroutine,
// then places the parts in dst in order, in parallel again. It returns dst
// and the sum of the chunks' non-finite counts.
func selectInChunks(sc *selectionScratch, dst Sparse, n, chunks int, selectChunk func(c int, part Sparse, lo, hi int) (Sparse, int)) (Sparse, int) {
	chunks = max(1, min(chunks, n))
	if chunks == 1 {
		return selectChunk(0, dst, 0, n)
	}
	for len(sc.parts) < chunks {
		sc.parts = append(sc.parts, Sparse{})
	}
	parts, nonFinite := sc.parts[:chunks], sc.countsFor(chunks)
	forEachChunk(n, chunks, func(c, lo, hi int) {
		parts[c].Reset()
		parts[c], nonFinite[c] = selectChunk(c, parts[c], lo, hi)
	})
	start, total, bad := dst.Len(), 0, 0
	for c := range parts {
		total += parts[c].Len()
		bad += nonFinite[c]
	}
	dst = reserveSparse(dst, start+total)
	dst.Idx, dst.Val = dst.Idx[:start+total], dst.Val[:start+total]
	forEachChunk(n, chunks, func(c, _, _ int) {
		at := start
		for _, p := range parts[:c] {
			at += p.Len()
		}
		copy(dst.Idx[at:], parts[c].Idx)
		copy(dst.Val[at:], parts[c].Val)
	})
	return dst, bad
}

// appendAbove appends the entries of x (x[0] at index base) with key ≥
// minKey, never a NaN, and counts the non-finite entries.
func appendAbove(dst Sparse, x []float32, base int, minKey uint32) (Sparse, int) {
	// Every non-finite key is ≥ infKey, so with the comparison capped there
	// they all land in blocks that the scan reports, and counting them costs
	// nothing on finite entries.
	cmpKey := min(minKey, infKey)
	s := newBlockScan(x, cmpKey)
	dst, nonFinite := appendSome(dst, x[:s.from], base, minKey, 0)
	var found [tileBlocks]int
	for hits := s.nextTile(&found); hits != nil; hits = s.nextTile(&found) {
		// The hits are written by position into storage reserved for the
		// whole tile: a Sparse passed and returned per hit is spilled to
		// the stack and read back, which costs more than the hit.
		n := dst.Len()
		dst = reserveSparse(dst, n+len(hits)*scanBlock)
		idx, val := dst.Idx[:cap(dst.Idx)], dst.Val[:cap(dst.Val)]
		for _, lo := range hits {
			n, nonFinite = storeHits(idx, val, n, x[lo:lo+scanBlock], base+lo, minKey, nonFinite)
		}
		dst.Idx, dst.Val = idx[:n], val[:n]
	}
	return appendSome(dst, x[s.end:], base+s.end, minKey, nonFinite)
}

// reserveSparse returns s, its contents kept, with room for at least n
// entries, growing its storage geometrically.
func reserveSparse(s Sparse, n int) Sparse {
	if cap(s.Idx) >= n && cap(s.Val) >= n {
		return s
	}
	c := max(n, 2*cap(s.Idx), 64)
	grown := Sparse{Idx: make([]uint32, len(s.Idx), c), Val: make([]float32, len(s.Val), c)}
	copy(grown.Idx, s.Idx)
	copy(grown.Val, s.Val)
	return grown
}
