package core

// Tests of exact top-k selection (TopK, TopKInto) against a sorting
// reference: ties, every chunking, the sampled path, bad input, storage
// reuse, and a fuzz target.

import (
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"testing"
)

// sortOrder is the oracle's ranking: indices by |x| descending (compared as
// float64, independently of the key bits), ties to the lower index.
func sortOrder(x []float32) []int {
	order := make([]int, len(x))
	mag := make([]float64, len(x))
	for i, v := range x {
		order[i], mag[i] = i, math.Abs(float64(v))
	}
	slices.SortFunc(order, func(a, b int) int {
		switch {
		case mag[a] > mag[b]:
			return -1
		case mag[a] < mag[b]:
			return 1
		}
		return a - b
	})
	return order
}

// topKFromOrder is the top k of x by the oracle's ranking, ascending by index.
func topKFromOrder(x []float32, order []int, k int) Sparse {
	selected := make([]bool, len(x))
	for _, i := range order[:k] {
		selected[i] = true
	}
	var out Sparse
	for i, s := range selected {
		if s {
			out.Append(uint32(i), x[i])
		}
	}
	return out
}

func sortTopK(x []float32, k int) Sparse { return topKFromOrder(x, sortOrder(x), k) }

func topKInputs(n int, rng *rand.Rand) map[string][]float32 {
	fill := func(f func(i int) float32) []float32 {
		x := make([]float32, n)
		for i := range x {
			x[i] = f(i)
		}
		return x
	}
	return map[string][]float32{
		"random":    fill(func(int) float32 { return float32(rng.NormFloat64()) }),
		"all-equal": fill(func(int) float32 { return 0.5 }),
		"all-zero":  fill(func(int) float32 { return 0 }),
		"signs":     fill(func(i int) float32 { return float32(i%5) * float32(1-2*(i%2)) }),
		"negative":  fill(func(int) float32 { return -float32(rng.ExpFloat64()) }),
		"denormal":  fill(func(int) float32 { return math.Float32frombits(uint32(rng.IntN(1 << 23))) }),
		"infinite": fill(func(i int) float32 {
			if i%7 == 3 {
				return float32(math.Inf(1 - 2*(i%2)))
			}
			return float32(rng.NormFloat64())
		}),
		"nan": fill(func(i int) float32 {
			if i == n/2 {
				return float32(math.NaN())
			}
			return float32(rng.NormFloat64())
		}),
	}
}

// largeN is the big size of the exact-selection tests: 2^20+7 (uneven, above
// the parallel cutoff), smaller under the race detector, which adds nothing
// at this size but time.
func largeN() int {
	if raceEnabled {
		return 1<<15 + 7
	}
	return 1<<20 + 7
}

// Exact top-k equals a sort of |x| on every input kind, n and k of the
// issue, bitwise; the (k+1)-th key it reports is the sort's (k+1)-th
// magnitude; and one chunk and several give the same bits.
func TestTopKEqualsSortReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 2, 1000, largeN()} {
		for name, x := range topKInputs(n, rng) {
			var order []int
			hasNaN := firstNaN(x) >= 0
			if !hasNaN {
				order = sortOrder(x)
			}
			for _, k := range []int{0, 1, n - 1, n, n / 3, n / 20} {
				if k < 0 || k > n {
					continue
				}
				got, err := TopK(x, k)
				if hasNaN {
					if !errors.Is(err, ErrNonFinite) {
						t.Fatalf("%s n=%d k=%d: %v, want ErrNonFinite", name, n, k, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("%s n=%d k=%d: %v", name, n, k, err)
				}
				want := topKFromOrder(x, order, k)
				if !sparseBitwiseEqual(got, want) {
					t.Fatalf("%s n=%d k=%d: radix select differs from the sort reference", name, n, k)
				}
				if k >= 1 {
					if th, w := KthLargestAbs(x, k), abs32(x[order[k-1]]); math.Float32bits(th) != math.Float32bits(w) {
						t.Fatalf("%s n=%d k=%d: KthLargestAbs %v, want %v", name, n, k, th, w)
					}
				}
				for _, chunks := range []int{1, 3, 8} {
					par, next, _, err := topK(Sparse{}, x, k, chunks)
					if err != nil || !sparseBitwiseEqual(par, want) {
						t.Fatalf("%s n=%d k=%d chunks=%d: differs from the reference (%v)", name, n, k, chunks, err)
					}
					if 0 < k && k < n && next != key(x[order[k]]) {
						t.Fatalf("%s n=%d k=%d chunks=%d: (k+1)-th key %#x, want %#x", name, n, k, chunks, next, key(x[order[k]]))
					}
				}
			}
		}
	}
}

// Ties at the k-th magnitude go to the lowest indices on both paths of step
// 3 (a light bucket, and a heavy one holding most keys), split across
// chunks that each hold some of the ties.
func TestTopKTiesGoToLowerIndexInEveryChunking(t *testing.T) {
	const n = 3000
	for _, heavy := range []bool{false, true} {
		x := make([]float32, n)
		rng := rand.New(rand.NewPCG(5, 6))
		for i := range x {
			x[i] = float32(rng.NormFloat64())
			if heavy || i%97 == 0 {
				x[i] = 1.25 * float32(1-2*(i%2))
			}
		}
		order := sortOrder(x)
		for _, k := range []int{1, 30, 700, n - 2} {
			want := topKFromOrder(x, order, k)
			for chunks := 1; chunks <= 9; chunks++ {
				got, _, _, err := topK(Sparse{}, x, k, chunks)
				if err != nil || !sparseBitwiseEqual(got, want) {
					t.Fatalf("heavy=%v k=%d chunks=%d: differs from the reference (%v)", heavy, k, chunks, err)
				}
			}
		}
	}
}

// The sampled path of the exact top-k equals the sort reference when it
// runs, and declines (so topK falls back to its histograms) when its margin
// is too thin for the sample to bound the (k+1)-th largest from below.
func TestTopKBySampleIsExactOrDeclines(t *testing.T) {
	n := 1<<18 + 3
	if raceEnabled {
		n = 1<<15 + 3
	}
	rng := rand.New(rand.NewPCG(13, 14))
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	order := sortOrder(x)
	for _, k := range []int{sampledTopKMinK, n / 100, n / 8} {
		want := topKFromOrder(x, order, k)
		for _, chunks := range []int{1, 3} {
			got, next, ok := topKBySample(Sparse{}, plainVec(x), k, chunks, sampledTopKMargin)
			if !ok {
				t.Fatalf("k=%d chunks=%d: the sampled path declined a normal input", k, chunks)
			}
			if !sparseBitwiseEqual(got, want) || next != key(x[order[k]]) {
				t.Fatalf("k=%d chunks=%d: the sampled path differs from the sort reference", k, chunks)
			}
		}
		// A margin of −3σ puts the sample's key above the (k+1)-th largest
		// almost surely: too few entries pass and the path must decline.
		if _, _, ok := topKBySample(Sparse{}, plainVec(x), k, 1, -3); ok {
			t.Fatalf("k=%d: the sampled path accepted a sample key above the (k+1)-th largest", k)
		}
	}
}

func TestTopKRejectsNaNAndBadK(t *testing.T) {
	x := []float32{1, 2, float32(math.NaN()), 3}
	if _, err := TopK(x, 2); !errors.Is(err, ErrNonFinite) {
		t.Fatalf("NaN: %v, want ErrNonFinite", err)
	}
	for _, k := range []int{-1, 5} {
		if _, err := TopK([]float32{1, 2, 3, 4}, k); !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("k=%d: %v, want ErrInvalidArgument", k, err)
		}
	}
}

// TopKInto and SelectByThreshold's exact path write into the storage passed
// in: the second call on the same input moves nothing.
func TestTopKIntoReusesStorage(t *testing.T) {
	n := 1 << 18
	x := make([]float32, n)
	rng := rand.New(rand.NewPCG(3, 4))
	for i := range x {
		x[i] = float32(rng.NormFloat64())
	}
	k := n / 100
	dst, err := TopKInto(Sparse{}, x, k)
	if err != nil {
		t.Fatal(err)
	}
	idx, val := &dst.Idx[:1][0], &dst.Val[:1][0]
	var th float32
	for call := 0; call < 3; call++ {
		if dst, err = TopKInto(dst, x, k); err != nil || dst.Len() != k {
			t.Fatalf("TopKInto: %d entries, %v", dst.Len(), err)
		}
		if dst, err = SelectByThreshold(dst, x, k, &th, true); err != nil || dst.Len() != k {
			t.Fatalf("SelectByThreshold: %d entries, %v", dst.Len(), err)
		}
		if &dst.Idx[0] != idx || &dst.Val[0] != val {
			t.Fatalf("call %d: the selection moved to new storage", call)
		}
	}
	if raceEnabled {
		return // the race detector's own allocations
	}
	// What remains is a few closures and goroutines of fixed size, not
	// storage for entries: the k = 2621 entries alone would be 21 KB.
	if perCall := bytesAllocatedPerCall(5, func() { dst, _ = TopKInto(dst, x, k) }); perCall > 4096 {
		t.Fatalf("TopKInto allocates %d bytes per call, want at most 4096", perCall)
	}
}

// bytesAllocatedPerCall is the heap memory f allocates per call, averaged
// over runs calls after a first one.
func bytesAllocatedPerCall(runs int, f func()) uint64 {
	f()
	var before, after runtime.MemStats
	runtime.ReadMemStats(&before)
	for i := 0; i < runs; i++ {
		f()
	}
	runtime.ReadMemStats(&after)
	return (after.TotalAlloc - before.TotalAlloc) / uint64(runs)
}

func FuzzTopK(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, uint8(1), uint16(0x3f00), false)
	f.Add([]byte{0, 0, 0x80, 0x7f, 0, 0, 0x80, 0xff, 1, 0, 0, 0}, uint8(2), uint16(0), true)
	f.Add([]byte{0, 0, 0x80, 0x3f, 0, 0, 0x80, 0xbf, 0, 0, 0x80, 0x3f, 0, 0, 0, 0x40, 0, 0, 0, 0}, uint8(2), uint16(0x3f00), false)
	f.Fuzz(func(t *testing.T, raw []byte, kb uint8, thBits uint16, exact bool) {
		x := make([]float32, len(raw)/4)
		for i := range x {
			x[i] = math.Float32frombits(uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24)
		}
		k := int(kb) % (len(x) + 1)
		nonFinite := 0
		for _, v := range x {
			if !IsFinite(v) {
				nonFinite++
			}
		}
		got, err := TopK(x, k)
		if firstNaN(x) >= 0 {
			if !errors.Is(err, ErrNonFinite) {
				t.Fatalf("NaN input: %v", err)
			}
		} else {
			if err != nil {
				t.Fatal(err)
			}
			if want := sortTopK(x, k); !sparseBitwiseEqual(got, want) {
				t.Fatalf("x=%v k=%d: got %v want %v", x, k, got, want)
			}
			th := float32(math.Inf(1))
			if k < len(x) && k > 0 {
				th = KthLargestAbs(x, k+1)
			}
			if above := SelectAbove(Sparse{}, x, th); above.Len() > k {
				t.Fatalf("more than k entries above the (k+1)-th magnitude")
			}
		}

		// SelectByThreshold: k exactly on the exact path, within the
		// policy's [k/2, 4k/3] otherwise, ascending indices holding x's
		// values, every one above the threshold it used; the same on
		// several chunks; NaN and ±Inf are ErrNonFinite.
		th0 := math.Float32frombits(uint32(thBits) << 16) // a positive magnitude
		th, thPar := th0, th0
		sel, ranExact, err := selectByThreshold(Sparse{}, x, k, &th, exact, 1)
		par, _, errPar := selectByThreshold(Sparse{}, x, k, &thPar, exact, 3)
		if (err == nil) != (errPar == nil) || !sparseBitwiseEqual(sel, par) || math.Float32bits(th) != math.Float32bits(thPar) {
			t.Fatalf("x=%v k=%d: 3 chunks differ from 1 (%v, %v)", x, k, err, errPar)
		}
		if nonFinite > 0 && k > 0 {
			if !errors.Is(err, ErrNonFinite) || sel.Len() != 0 {
				t.Fatalf("non-finite input: %d entries, %v", sel.Len(), err)
			}
			return
		}
		if err != nil {
			t.Fatal(err)
		}
		c := sel.Len()
		if ranExact && c != k || !ranExact && (float64(c) < float64(k)/2 || float64(c) > 4*float64(k)/3) {
			t.Fatalf("x=%v k=%d th=%v exact=%v: %d entries (ran exact: %v)", x, k, th0, exact, c, ranExact)
		}
		for j, i := range sel.Idx {
			if j > 0 && i <= sel.Idx[j-1] || int(i) >= len(x) || math.Float32bits(sel.Val[j]) != math.Float32bits(x[i]) {
				t.Fatalf("entry %d: index %d value %v out of order or not x's", j, i, sel.Val[j])
			}
		}
	})
}
