package core

// Threshold reuse (Ok-Topk step 1 and step 4). Finding the exact k-th largest
// magnitude costs more than a pass over memory, so it is done only every τ′
// calls; in between the last threshold is reused: select |x| > th in one
// pass, raise th a little when far more than k entries pass, and nudge it
// after selecting so the next call lands closer to k.

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

// SelectByThreshold selects about k entries of x into dst (ascending by
// index) and updates *th for the next call. With exact set (a refresh call,
// or no threshold known yet) it selects the exact top-k and sets *th to the
// magnitude just below the selection; otherwise it reuses *th.
func SelectByThreshold(dst Sparse, x []float32, k int, th *float32, exact bool) (Sparse, error) {
	dst.Reset()
	n := len(x)
	if k == 0 || n == 0 {
		return dst, nil
	}
	if exact || *th <= 0 {
		top, err := TopK(x, k)
		if err != nil {
			return dst, err
		}
		dst.Idx = append(dst.Idx, top.Idx...)
		dst.Val = append(dst.Val, top.Val...)
		if k < n {
			*th = KthLargestAbs(x, k+1)
		} else {
			*th = 0
		}
		return dst, nil
	}
	dst = SelectAbove(dst, x, *th)
	for tries := 0; float64(dst.Len()) > thresholdTooMany*float64(k) && tries < thresholdMaxRaises; tries++ {
		*th *= thresholdRaise
		dst = keepAbove(dst, *th)
	}
	// The reused threshold has drifted too far for small corrections (the
	// gradient's scale changed): pay for one exact selection rather than
	// send far more, or far fewer, than k entries.
	if c := float64(dst.Len()); c > thresholdTooMany*float64(k) || c < thresholdTooFew*float64(k) {
		return SelectByThreshold(dst, x, k, th, true)
	}
	switch c := float64(dst.Len()); {
	case c < nudgeLowCount*float64(k):
		*th *= nudgeDown
	case c > nudgeHighCount*float64(k):
		*th *= nudgeUp
	}
	return dst, nil
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
