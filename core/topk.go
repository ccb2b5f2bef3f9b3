package core

// Exact top-k selection by magnitude (TopK, TopKInto, KthLargestAbs): a
// radix select on the bits of |x|, ties to the lower index, NaN refused.

import (
	"fmt"
	"math"
)

// Exact selection by magnitude without sorting: a radix select on the bits
// of |x|. For finite and infinite floats the IEEE-754 bit pattern of |x|
// (its key), read as an unsigned integer, orders like |x| itself; a NaN's key
// is above +Inf's.
//
// The exact top-k works as follows.
//
//  1. Histogram: one pass counts the keys' top 16 bits (2^16 buckets). NaN
//     and ±Inf land in the buckets from +Inf's up, so they are detected
//     here, without a pass of their own; a NaN fails the call.
//  2. Bucket: walking down from the largest bucket finds the bucket b that
//     holds the (k+1)-th largest key, and how many keys lie above it.
//  3. Candidates: when b holds few keys, a second pass copies every entry
//     with key ≥ b·2^16 (the top k+1 and the rest of bucket b, in index
//     order) into dst; a histogram of the low 16 bits of those in b orders
//     them, and dst is compacted in place to the top k. When b holds many
//     keys (all-equal or mostly-zero inputs), a second pass histograms their
//     low 16 bits instead and a third collects the top k from x.
//  4. Ties: keys equal to the k-th largest go to the lowest indices, so every
//     rank and every run agrees.
//
// For k ≥ 512 a sample usually spares step 1: see topKBySample, which
// finds the same top k with one pass over x.
//
// Cost: one read of x on the sampled path, two (three when bucket b is
// heavy) on the histogram path; no sort, and no allocation once dst and the
// kept histograms are large enough (topk_histogram.go). Large vectors are
// split into chunks (parallel.go): per-chunk histograms give every chunk its
// exact offset in dst, so the chunks fill dst in parallel and the result does
// not depend on how many there are.

const (
	signBit = 1 << 31
	infKey  = 0x7f800000 // the key of ±Inf; NaN keys are larger
	// Bucket b is light (step 3) when it holds at most k + n/candidateSlack
	// keys: copying them costs less than another read of x, and dst grows
	// to at most 2k + n/64.
	candidateSlack = 64
)

// TopK returns the k entries of x with the largest |x|, ascending by index.
// Ties in magnitude go to the lower index, so every rank and every run agrees.
// NaN is never selected silently: it is ErrNonFinite. ±Inf are the largest
// magnitudes.
func TopK(x []float32, k int) (Sparse, error) {
	return TopKInto(Sparse{}, x, k)
}

// TopKInto is TopK writing into dst's storage (dst is reset first), growing
// it only when it is too small: a caller that passes the previous result
// back in allocates nothing in the steady state. dst may grow to about
// k + (the keys sharing the k-th largest key's top 16 bits).
func TopKInto(dst Sparse, x []float32, k int) (Sparse, error) {
	dst, _, _, err := topK(dst, x, k, selectionChunks(len(x)))
	return dst, err
}

// topK is TopKInto on the given number of chunks; it also returns the key of
// the (k+1)-th largest |x| (0 when k = 0 or k = n), the exact threshold
// below the selection, and how many entries are ±Inf (found by the histogram).
func topK(dst Sparse, x []float32, k, chunks int) (_ Sparse, next uint32, infinities int, _ error) {
	return topKOf(dst, plainVec(x), k, chunks)
}

// topKOf is topK on a vec (a sum is never stored; vec.go).
func topKOf(dst Sparse, x vec, k, chunks int) (_ Sparse, next uint32, infinities int, _ error) {
	n := x.len()
	dst.Reset()
	if k < 0 || k > n {
		return dst, 0, 0, fmt.Errorf("%w: k=%d with n=%d", ErrInvalidArgument, k, n)
	}
	if n == 0 {
		return dst, 0, 0, nil
	}
	chunks = max(1, min(chunks, n))
	if k >= sampledTopKMinK && k <= n/8 {
		if out, next, ok := topKBySample(dst, x, k, chunks, sampledTopKMargin); ok {
			return out, next, 0, nil
		}
	}
	sc := getScratch()
	defer putScratch(sc)

	// Step 1: histogram of the top 16 bits, NaN and ±Inf detected with it.
	high := sc.highHistograms(x, chunks)
	if infinities = high.nonFiniteInBuckets(); infinities > 0 {
		// ±Inf or NaN are present; only a NaN is an error (±Inf are the
		// largest magnitudes), and only then does x get a second look.
		if i := x.firstNaN(); i >= 0 {
			return dst, 0, 0, fmt.Errorf("%w: NaN at index %d", ErrNonFinite, i)
		}
	}
	if k == 0 {
		return dst, 0, infinities, nil
	}
	if k == n {
		dst = growSparse(dst, n)
		for i := range dst.Idx {
			dst.Idx[i] = uint32(i)
		}
		x.copyTo(dst.Val)
		return dst, 0, infinities, nil
	}

	// Step 2: the bucket of the (k+1)-th largest key.
	b, above := high.digitOfRank(infKey>>16, k+1, 0) // no NaN by now
	counts := sc.countsFor(chunks)
	if inB := high.count(b); inB <= k+n/candidateSlack {
		// Step 3, light bucket: every key ≥ b·2^16 into dst (no NaN is
		// left, so no bucket above +Inf's counts), ...
		want := 0
		for c, h := range high {
			counts[c] = 0
			for _, m := range h[b : infKey>>16+1] {
				counts[c] += int(m)
			}
			want += counts[c]
		}
		dst = growSparse(dst, want)
		collectChunks(sc, dst, x, chunks, counts, b<<16, nil)
		// ... ordered within bucket b by their low 16 bits, ...
		low := sc.candidateLow
		clear(low[:])
		for _, v := range dst.Val {
			if u := key(v); u>>16 == b {
				low[u&0xffff]++
			}
		}
		next, kth, ties := resolveBucket(sc.candidateSet, b, above, k)
		// ... and compacted in place to the top k (step 4: the first ties
		// keys equal to the k-th are the lowest indices).
		j := 0
		for i, v := range dst.Val {
			if u := key(v); u > kth || (u == kth && ties > 0) {
				if u == kth {
					ties--
				}
				dst.Idx[j], dst.Val[j] = dst.Idx[i], v
				j++
			}
		}
		dst.Idx, dst.Val = dst.Idx[:j], dst.Val[:j]
		return dst, next, infinities, nil
	}

	// Step 3, heavy bucket: its low 16 bits from x, then the top k from x.
	lowPer := sc.lowHistograms(x, chunks, b)
	next, kth, ties := resolveBucket(lowPer, b, above, k)
	// Per chunk: the keys above kth, and its share of the ties in index
	// order (step 4).
	tieCounts := sc.tiesFor(chunks)
	for c := range counts {
		greater := 0
		for _, m := range high[c][b+1 : infKey>>16+1] {
			greater += int(m)
		}
		for _, m := range lowPer[c][kth&0xffff+1:] {
			greater += int(m)
		}
		tieCounts[c] = min(int(lowPer[c][kth&0xffff]), ties)
		ties -= tieCounts[c]
		counts[c] = greater + tieCounts[c]
	}
	dst = growSparse(dst, k)
	collectChunks(sc, dst, x, chunks, counts, kth, tieCounts)
	return dst, next, infinities, nil
}

// The exact top-k in one pass over x, for k large enough to sample (the
// usual case: k = density·n). A sample gives a key t safely below the
// (k+1)-th largest; one pass copies every entry with key ≥ t (about
// (1 + margin)·k of them, in index order) into dst, and when at least k+1
// did, the top k+1 are among them: the radix select above, run on those
// values alone, picks the exact top k. The result does not depend on the
// sample — it is the exact top-k either way — only the cost does; when the
// sample misleads (fewer than k+1 pass, or ties would copy far too many), or
// x holds NaN or ±Inf, topK falls back to its two histogram passes.
const (
	sampledTopKMinK   = 512            // below it the sample would be large or its rank small
	sampledTopKMargin = 4              // standard deviations of the sample rank kept below it
	sampledTopKSeed   = 0x6f6b746f706b // any fixed seed: results never depend on it
)

// topKBySample is the sampled path of topK; ok is false when topK must take
// its histogram path instead (dst's contents are then undefined).
func topKBySample(dst Sparse, x vec, k, chunks int, margin float64) (_ Sparse, next uint32, ok bool) {
	n := x.len()
	// A sample rank r = k·s/n of at least 64, on at most n/8 entries.
	s := min(n/8, max(n/1024, 64*n/k))
	sc := getScratch()
	defer putScratch(sc)
	sample := sc.drawSample(x, s, sampledTopKSeed)
	r := float64(k+1) * float64(s) / float64(n)
	rank := min(s, int(math.Ceil(r+margin*math.Sqrt(r)))+1)
	if rank < 1 || firstNaN(sample) >= 0 {
		return dst, 0, false
	}
	t := kthLargestKey(sample, rank, 1)
	if t == 0 || t >= infKey {
		return dst, 0, false // everything, or nothing finite, would pass
	}
	// Ties at t in the sample predict as many copies: give up when they
	// would be far more than k.
	passing := 0
	for _, v := range sample {
		if key(v) >= t {
			passing++
		}
	}
	if passing > 2*rank {
		return dst, 0, false
	}
	dst.Reset()
	dst, nonFinite := selectAboveOf(dst, x, math.Float32frombits(t-1), chunks)
	if nonFinite > 0 || dst.Len() <= k {
		return dst, 0, false
	}
	// The exact top k (and the (k+1)-th key) of the copied values; their
	// positions in dst ascend with the indices, so ties still go to the
	// lower index.
	top, next, _, err := topK(sc.positions, dst.Val, k, 1)
	sc.positions = top
	if err != nil {
		return dst, 0, false
	}
	for j, p := range top.Idx { // p ≥ j: in place, front to back
		dst.Idx[j], dst.Val[j] = dst.Idx[p], top.Val[j]
	}
	dst.Idx, dst.Val = dst.Idx[:k], dst.Val[:k]
	return dst, next, true
}

// resolveBucket orders bucket b by the histograms low of its low 16 bits,
// with above keys known to lie above b (above ≤ k < above + |b|). It returns
// the (k+1)-th largest key, and the rule for the top k: keys > kth, and the
// first ties keys equal to kth.
func resolveBucket(low chunkHistograms, b uint32, above, k int) (next, kth uint32, ties int) {
	d, _ := low.digitOfRank(0xffff, k+1, above)
	next = b<<16 | d
	if above == k {
		// The top k are exactly the keys above bucket b.
		return next, b<<16 | 0xffff, 0
	}
	d, larger := low.digitOfRank(0xffff, k, above)
	return next, b<<16 | d, k - larger
}

// collectChunks fills dst (sized to the sum of counts) from the chunks of x
// in parallel, chunk c writing its counts[c] entries after those of the
// chunks before it: keys > kth, and the first ties[c] keys equal to kth (all
// of them when ties is nil).
func collectChunks(sc *selectionScratch, dst Sparse, x vec, chunks int, counts []int, kth uint32, ties []int) {
	tiles := sc.tilesFor(x, chunks)
	forEachChunk(x.len(), chunks, func(c, lo, hi int) {
		at := 0
		for _, m := range counts[:c] {
			at += m
		}
		t := math.MaxInt
		if ties != nil {
			t = ties[c]
		}
		idx, val, j := dst.Idx[at:at+counts[c]], dst.Val[at:at+counts[c]], 0
		x.each(lo, hi, tiles[c], func(span []float32, base int) {
			j, t = collect(idx, val, j, span, base, kth, t)
		})
	})
}

// collect writes the entries of x (x[0] at index base) with key > kth, and
// the first ties with key = kth, into idx and val from position j on, and
// returns the next position and the ties left.
func collect(idx []uint32, val []float32, j int, x []float32, base int, kth uint32, ties int) (int, int) {
	// Keys ≥ kth are rare (about k of n): a blockScan finds the blocks that
	// hold one, and collectSome looks at those alone.
	s := newBlockScan(x, kth) // kth ≤ infKey: x holds no NaN here
	j, ties = collectSome(idx, val, j, x[:s.from], base, kth, ties)
	var found [tileBlocks]int
	for hits := s.nextTile(&found); hits != nil; hits = s.nextTile(&found) {
		for _, lo := range hits {
			j, ties = collectSome(idx, val, j, x[lo:lo+scanBlock], base+lo, kth, ties)
		}
	}
	return collectSome(idx, val, j, x[s.end:], base+s.end, kth, ties)
}

func collectSome(idx []uint32, val []float32, j int, x []float32, base int, kth uint32, ties int) (int, int) {
	for i, v := range x {
		if u := key(v); u >= kth {
			if u == kth {
				if ties == 0 {
					continue
				}
				ties--
			}
			idx[j], val[j] = uint32(base+i), v
			j++
		}
	}
	return j, ties
}

// growSparse returns s with length n, its storage reused when large enough;
// the contents are not kept.
func growSparse(s Sparse, n int) Sparse {
	if cap(s.Idx) < n || cap(s.Val) < n {
		return Sparse{Idx: make([]uint32, n), Val: make([]float32, n)}
	}
	return Sparse{Idx: s.Idx[:n], Val: s.Val[:n]}
}

// KthLargestAbs is the k-th largest |x| (1-based), the exact threshold: the
// entries with |x| > KthLargestAbs(x, k+1) are at most k. k must be in 1..n
// and x must hold no NaN.
func KthLargestAbs(x []float32, k int) float32 {
	return math.Float32frombits(kthLargestKey(x, k, selectionChunks(len(x))))
}

// kthLargestKey is the key of the k-th largest |x| (1 ≤ k ≤ n): two
// histogram passes, the top 16 bits and then the low 16 bits of the one
// bucket that holds it.
func kthLargestKey(x []float32, k, chunks int) uint32 {
	chunks = max(1, min(chunks, len(x)))
	sc := getScratch()
	defer putScratch(sc)
	b, above := sc.highHistograms(plainVec(x), chunks).digitOfRank(0xffff, k, 0) // NaN, if any, sorts above +Inf
	d, _ := sc.lowHistograms(plainVec(x), chunks, b).digitOfRank(0xffff, k, above)
	return b<<16 | d
}

func abs32(v float32) float32 { return math.Float32frombits(math.Float32bits(v) &^ (1 << 31)) }
