package core

// Threshold reuse (Ok-Topk step 1 and step 4). Finding the exact k-th largest
// magnitude costs more than a pass over memory, so it is done only every τ′
// calls; in between the last threshold is reused: select |x| > th in one
// pass. When more than k entries pass, the k largest of them are x's top-k,
// so the selection is cut to those from the selected entries alone and th
// moves up to the cut: the words sent never exceed k, however far the
// gradient's scale drifts up. When fewer pass, th is nudged down for the
// next call, or, far below k, an exact selection replaces the call.

import (
	"fmt"
	"math"
)

const (
	thresholdTooFew = 1.0 / 2.0 // fewer than k/2 passed: select exactly instead
	nudgeLowCount   = 4.0 / 5.0 // fewer than 4k/5 passed: lower th for next call
	nudgeDown       = 0.97
)

// SelectByThreshold selects about k entries of x into dst (ascending by
// index) and updates *th for the next call. With exact set (a refresh call,
// or no threshold known yet) it selects the exact top-k and sets *th to the
// magnitude just below the selection; otherwise it reuses *th. With k > 0, a
// NaN or ±Inf in x is ErrNonFinite (found in the selection's own pass), with
// dst empty.
func SelectByThreshold(dst Sparse, x []float32, k int, th *float32, exact bool) (Sparse, error) {
	dst, _, err := selectByThreshold(dst, x, k, th, exact, selectionChunks(len(x)))
	return dst, err
}

// selectByThreshold is SelectByThreshold on the given number of chunks; it
// also reports whether the exact selection ran, asked for or as the fallback
// when the reused threshold had drifted too far.
func selectByThreshold(dst Sparse, x []float32, k int, th *float32, exact bool, chunks int) (Sparse, bool, error) {
	dst.Reset()
	n := len(x)
	if k == 0 || n == 0 {
		return dst, false, nil
	}
	if exact || *th <= 0 {
		return selectExact(dst, x, k, th, chunks)
	}
	dst, nonFinite := selectAbove(dst, x, *th, chunks)
	return reuseThreshold(dst, x, k, th, nonFinite, chunks)
}

// reuseThreshold finishes a reuse call once dst holds the entries of x with
// |x| > *th (nonFinite of x's entries being NaN or ±Inf): cut it to the k
// largest when more passed, fall back to an exact selection when far too
// few did, and nudge the threshold down when somewhat too few did.
func reuseThreshold(dst Sparse, x []float32, k int, th *float32, nonFinite, chunks int) (Sparse, bool, error) {
	if nonFinite > 0 {
		dst.Reset()
		return dst, false, fmt.Errorf("%w: %d entries", ErrNonFinite, nonFinite)
	}
	if dst.Len() > k {
		// Every entry of x above *th is in dst, so the k largest in dst
		// are the k largest in x. The (k+1)-th largest magnitude costs two
		// histogram passes over the selected entries (about k), not over
		// x, and becomes the threshold, as an exact selection would set it.
		*th = math.Float32frombits(kthLargestKey(dst.Val, k+1, 1))
		dst = keepAbove(dst, *th)
	}
	// Far too few passed (the gradient's scale fell, or ties at the cut
	// left few above it): pay for one exact selection rather than send far
	// fewer than k entries.
	c := float64(dst.Len())
	if c < thresholdTooFew*float64(k) {
		return selectExact(dst, x, k, th, chunks)
	}
	if c < nudgeLowCount*float64(k) {
		*th *= nudgeDown
	}
	return dst, false, nil
}

// selectExact selects the exact top-k into dst and sets *th to the (k+1)-th
// largest magnitude (0 when k = n), both from the same two passes. ±Inf are
// ErrNonFinite here too: the threshold path must agree with the reuse path.
func selectExact(dst Sparse, x []float32, k int, th *float32, chunks int) (Sparse, bool, error) {
	dst, next, infinities, err := topK(dst, x, k, chunks)
	switch {
	case err != nil:
		dst.Reset()
		return dst, true, err
	case infinities > 0:
		dst.Reset()
		return dst, true, fmt.Errorf("%w: %d entries are ±Inf", ErrNonFinite, infinities)
	case k < len(x):
		*th = math.Float32frombits(next)
	default:
		*th = 0
	}
	return dst, true, nil
}

// keepAbove filters s in place to the entries with |v| > th.
func keepAbove(s Sparse, th float32) Sparse {
	j := 0
	for i, v := range s.Val {
		if abs32(v) > th {
			s.Idx[j], s.Val[j] = s.Idx[i], v
			j++
		}
	}
	s.Idx, s.Val = s.Idx[:j], s.Val[:j]
	return s
}
