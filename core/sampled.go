package core

// Sampled threshold (Lin et al., Deep Gradient Compression, 2018): instead of
// the exact k-th largest |x| of all n entries, take the exact r-th largest of
// s entries drawn at random, r = ⌈k·s/n⌉. A fraction r/s of the sample lies
// at or above it, so about k·(1 ± 1/√r) entries of x pass |x| > th: for
// k = 1% and s = 1% of n, r = n/10^4 and the count is within a few percent
// of k once n is in the millions.
//
// Cost: s random reads of x and a radix select over the sample (s ≪ n),
// then one selection pass over x; no allocation once the sample buffer
// kept for the next call is large enough. The draw is a PCG seeded by the caller, so every
// rank that passes the same seed samples the same positions.

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// SampledThreshold estimates the threshold that about k entries of x exceed
// in magnitude: the ⌈k·s/n⌉-th largest |x| of s entries drawn uniformly with
// replacement by a PCG seeded with seed. With s ≥ n it is exact (the k-th
// largest |x|). k = 0 gives +Inf (nothing passes), k = n gives −1
// (everything passes). A NaN in the sample is ErrNonFinite; ±Inf sort as the
// largest magnitudes.
func SampledThreshold(x []float32, k, s int, seed uint64) (float32, error) {
	n := len(x)
	switch {
	case k < 0 || k > n || s < 1 && n > 0:
		return 0, fmt.Errorf("%w: k=%d, s=%d with n=%d", ErrInvalidArgument, k, s, n)
	case k == 0:
		return float32(math.Inf(1)), nil
	case k == n:
		return -1, nil
	}
	if s >= n {
		if i := firstNaN(x); i >= 0 {
			return 0, fmt.Errorf("%w: NaN at index %d", ErrNonFinite, i)
		}
		return KthLargestAbs(x, k), nil
	}
	sc := getScratch()
	defer putScratch(sc)
	if cap(sc.sample) < s {
		sc.sample = make([]float32, s)
	}
	sample := sc.sample[:s]
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	for i := 0; i < s; i += 2 {
		// Two positions per 64-bit draw, each the high half of a 32×32-bit
		// product (n < 2^32: indices are uint32); the bias is below n/2^32.
		r := rng.Uint64()
		sample[i] = x[(r&0xffffffff)*uint64(n)>>32]
		if i+1 < s {
			sample[i+1] = x[(r>>32)*uint64(n)>>32]
		}
	}
	if firstNaN(sample) >= 0 {
		return 0, fmt.Errorf("%w: NaN in the sample", ErrNonFinite)
	}
	r := int((int64(k)*int64(s) + int64(n) - 1) / int64(n)) // ⌈k·s/n⌉, 1 ≤ r ≤ s
	return math.Float32frombits(kthLargestKey(sample, r, selectionChunks(s))), nil
}

// SelectSampled selects the entries of x with |x| > SampledThreshold(x, k,
// s, seed) into dst (reset first, ascending by index) and returns that
// threshold: about k entries, not exactly k. A NaN or ±Inf in x is
// ErrNonFinite (counted in the selection pass), with dst empty.
func SelectSampled(dst Sparse, x []float32, k, s int, seed uint64) (Sparse, float32, error) {
	dst.Reset()
	th, err := SampledThreshold(x, k, s, seed)
	if err != nil {
		return dst, th, err
	}
	dst, nonFinite := SelectAboveChecked(dst, x, th)
	if nonFinite > 0 {
		dst.Reset()
		return dst, th, fmt.Errorf("%w: %d entries", ErrNonFinite, nonFinite)
	}
	return dst, th, nil
}
