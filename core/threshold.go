package core

// Threshold reuse (Ok-Topk step 1 and step 4). Finding the exact k-th largest
// magnitude costs more than a pass over memory, so it is done only every τ′
// calls; in between the last threshold is reused: select |x| > th in one
// pass, raise th a little when far more than k entries pass, and nudge it
// after selecting so the next call lands closer to k.

import (
	"fmt"
	"math"
)

const (
	thresholdTooMany   = 4.0 / 3.0 // more than 4k/3 passed: raise and reselect
	thresholdRaise     = 1.03      // factor per raise
	thresholdMaxRaises = 4
	thresholdTooFew    = 1.0 / 2.0 // fewer than k/2 passed: select exactly instead
	nudgeLowCount      = 4.0 / 5.0 // fewer than 4k/5 passed: lower th for next call
	nudgeHighCount     = 5.0 / 4.0 // more than 5k/4 passed: raise th for next call
	nudgeDown          = 0.97
	nudgeUp            = 1.03
)

// SelectionRules are the constants of the selection rules, for a caller
// that selects by them elsewhere (a GPU: core/oktopk_selected.go).
type SelectionRules struct {
	TooMany   float64 // more than TooMany·k passed: raise the threshold and reselect
	Raise     float32 // the factor of a raise
	MaxRaises int     // raises at most, then the exact selection
	TooFew    float64 // fewer than TooFew·k passed: the exact selection
	NudgeLow  float64 // fewer than NudgeLow·k passed: threshold ·= NudgeDown for the next call
	NudgeDown float32
	NudgeHigh float64 // more than NudgeHigh·k passed: threshold ·= NudgeUp
	NudgeUp   float32
}

// Rules returns the selection rules' constants.
func Rules() SelectionRules {
	return SelectionRules{TooMany: thresholdTooMany, Raise: thresholdRaise, MaxRaises: thresholdMaxRaises, TooFew: thresholdTooFew,
		NudgeLow: nudgeLowCount, NudgeDown: nudgeDown, NudgeHigh: nudgeHighCount, NudgeUp: nudgeUp}
}

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
	return selectByThresholdOf(dst, plainVec(x), k, th, exact, chunks)
}

// selectByThresholdOf is selectByThreshold on a vec (vec.go).
func selectByThresholdOf(dst Sparse, x vec, k int, th *float32, exact bool, chunks int) (Sparse, bool, error) {
	dst.Reset()
	n := x.len()
	if k == 0 || n == 0 {
		return dst, false, nil
	}
	if exact || *th <= 0 {
		return selectExact(dst, x, k, th, chunks)
	}
	// More than 4k/3 entries above th make reuseThreshold raise it, at most
	// thresholdMaxRaises times; so beyond that many no entry needs storing
	// (a scale change could pass all of x), only the counts above th's
	// raises, which tell which raise reuseThreshold would stop at.
	var ths [raisedCount]float32
	ths[0] = *th
	for j := 1; j < raisedCount; j++ {
		ths[j] = ths[j-1] * thresholdRaise
	}
	dst, nonFinite, counts := selectAboveCapped(dst, x, &ths, thresholdTooMany*float64(k), chunks)
	if nonFinite > 0 || counts == nil {
		return reuseThreshold(dst, x, k, th, nonFinite, chunks)
	}
	// The selection overflowed: take the raise reuseThreshold would have
	// stopped at, and select above it with a pass of its own (rare: the
	// gradient's scale moved), or go exact when no raise is enough.
	for j := 1; j < raisedCount; j++ {
		if float64(counts[j]) <= thresholdTooMany*float64(k) {
			*th = ths[j]
			dst, nonFinite = selectAboveOf(dst, x, *th, chunks)
			return reuseThreshold(dst, x, k, th, nonFinite, chunks)
		}
	}
	*th = ths[raisedCount-1]
	return selectExact(dst, x, k, th, chunks)
}

// reuseThreshold finishes a reuse call once dst holds the entries of x with
// |x| > *th (nonFinite of x's entries being NaN or ±Inf): raise the
// threshold while far too many passed, fall back to an exact selection when
// it has drifted too far, and nudge it for the next call.
func reuseThreshold(dst Sparse, x vec, k int, th *float32, nonFinite, chunks int) (Sparse, bool, error) {
	if nonFinite > 0 {
		dst.Reset()
		return dst, false, fmt.Errorf("%w: %d entries", ErrNonFinite, nonFinite)
	}
	for tries := 0; float64(dst.Len()) > thresholdTooMany*float64(k) && tries < thresholdMaxRaises; tries++ {
		*th *= thresholdRaise
		dst = keepAbove(dst, *th)
	}
	// The reused threshold has drifted too far for small corrections (the
	// gradient's scale changed): pay for one exact selection rather than
	// send far more, or far fewer, than k entries.
	if c := float64(dst.Len()); c > thresholdTooMany*float64(k) || c < thresholdTooFew*float64(k) {
		return selectExact(dst, x, k, th, chunks)
	}
	switch c := float64(dst.Len()); {
	case c < nudgeLowCount*float64(k):
		*th *= nudgeDown
	case c > nudgeHighCount*float64(k):
		*th *= nudgeUp
	}
	return dst, false, nil
}

// selectExact selects the exact top-k into dst and sets *th to the (k+1)-th
// largest magnitude (0 when k = n), both from the same two passes. ±Inf are
// ErrNonFinite here too: the threshold path must agree with the reuse path.
func selectExact(dst Sparse, x vec, k int, th *float32, chunks int) (Sparse, bool, error) {
	dst, next, infinities, err := topKOf(dst, x, k, chunks)
	switch {
	case err != nil:
		dst.Reset()
		return dst, true, err
	case infinities > 0:
		dst.Reset()
		return dst, true, fmt.Errorf("%w: %d entries are ±Inf", ErrNonFinite, infinities)
	case k < x.len():
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
