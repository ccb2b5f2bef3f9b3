package core

// Sampled threshold (Lin et al., Deep Gradient Compression, 2018): instead of
// the exact k-th largest |x| of all n entries, take the exact r-th largest of
// s entries drawn at random, r = ⌈k·s/n⌉ (DGC draws with replacement; here
// one entry from each of s equal strata, see SampledThreshold). A fraction r/s of the sample lies
// at or above it, so about k·(1 ± 1/√r) entries of x pass |x| > th: for
// k = 1% and s = 1% of n, r = n/10^4 and the count is within a few percent
// of k once n is in the millions.
//
// Cost: s reads of x in increasing order and a radix select over the sample (s ≪ n),
// then one selection pass over x; no allocation once the sample buffer
// kept for the next call is large enough. The draw is a PCG seeded by the caller, so every
// rank that passes the same seed samples the same positions.

import (
	"fmt"
	"math"
	"math/rand/v2"
)

// SampledThreshold estimates the threshold that about k entries of x exceed
// in magnitude: the ⌈k·s/n⌉-th largest |x| of s entries drawn at random by a
// PCG seeded with seed, one from each of s equal strata of x. With s ≥ n it is exact (the k-th
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
	sample := sc.drawSample(plainVec(x), s, seed)
	if firstNaN(sample) >= 0 {
		return 0, fmt.Errorf("%w: NaN in the sample", ErrNonFinite)
	}
	r := int((int64(k)*int64(s) + int64(n) - 1) / int64(n)) // ⌈k·s/n⌉, 1 ≤ r ≤ s
	return math.Float32frombits(kthLargestKey(sample, r, selectionChunks(s))), nil
}

// drawSample returns s entries of x drawn by drawStratified, in the
// scratch's own storage (valid until the scratch is put back).
func (sc *selectionScratch) drawSample(x vec, s int, seed uint64) []float32 {
	if cap(sc.sample) < s {
		sc.sample = make([]float32, s)
	}
	sample := sc.sample[:s]
	drawStratified(sample, x, seed)
	return sample
}

// drawStratified fills sample with one entry of x from each of len(sample)
// equal strata, its position drawn uniformly by a PCG seeded with seed.
// Still a random sample (no position is favoured, no stride to alias with a
// layer's shape), with lower variance than draws with replacement, and read
// in increasing address order: far fewer cache and TLB misses than as many
// scattered reads of a large x. len(sample) ≤ len(x) < 2^32.
func drawStratified(sample []float32, x vec, seed uint64) {
	n, s := x.len(), len(sample)
	rng := rand.New(rand.NewPCG(seed, uint64(n)))
	// Stratum j is [⌊j·n/s⌋, ⌊(j+1)·n/s⌋), stepped without a division:
	// each is n/s wide, one wider whenever the remainders add up past s.
	step, rem := n/s, n%s
	lo, carry := 0, 0
	for j := range sample {
		width := step
		if carry += rem; carry >= s {
			carry -= s
			width++
		}
		// The high half of a 32×32-bit product: uniform in [0, width) up to
		// a bias below width/2^32.
		sample[j] = x.at(lo + int((uint64(uint32(rng.Uint64()))*uint64(width))>>32))
		lo += width
	}
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
