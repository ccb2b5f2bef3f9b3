package core

import (
	"errors"
	"math"
	"math/rand/v2"
	"sort"
	"testing"
)

// sortTopK is the oracle: sort indices by |x| descending, ties to the lower
// index, keep k, return them ascending by index.
func sortTopK(x []float32, k int) Sparse {
	order := make([]int, len(x))
	for i := range order {
		order[i] = i
	}
	sort.SliceStable(order, func(a, b int) bool {
		return math.Abs(float64(x[order[a]])) > math.Abs(float64(x[order[b]]))
	})
	sel := append([]int(nil), order[:k]...)
	sort.Ints(sel)
	var out Sparse
	for _, i := range sel {
		out.Append(uint32(i), x[i])
	}
	return out
}

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
	}
}

func TestTopKEqualsSortReference(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for _, n := range []int{0, 1, 2, 1000, 1<<20 + 7} {
		for name, x := range topKInputs(n, rng) {
			if n > 1000 && name != "random" && name != "signs" {
				continue
			}
			for _, k := range []int{0, 1, n - 1, n, n / 3} {
				if k < 0 || k > n {
					continue
				}
				got, err := TopK(x, k)
				if err != nil {
					t.Fatalf("%s n=%d k=%d: %v", name, n, k, err)
				}
				want := sortTopK(x, k)
				if !sparseBitwiseEqual(got, want) {
					t.Fatalf("%s n=%d k=%d: radix select differs from the sort reference", name, n, k)
				}
				if k >= 1 && k <= n {
					th := KthLargestAbs(x, k)
					if w := float32(math.Abs(float64(want.Val[indexOfMinAbs(want)]))); th != w {
						t.Fatalf("%s n=%d k=%d: KthLargestAbs %v, want %v", name, n, k, th, w)
					}
				}
			}
		}
	}
}

func indexOfMinAbs(s Sparse) int {
	best := 0
	for i, v := range s.Val {
		if abs32(v) < abs32(s.Val[best]) {
			best = i
		}
	}
	return best
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

// The threshold policy keeps the selected count within [k/2, 2k] on every
// one of 200 calls of a drifting gradient (the test process of oktopk_test:
// a shared AR(1) signal with log-normal coordinate scales and heavy-tailed
// noise), with error feedback feeding unselected mass back in.
func TestThresholdPolicyKeepsCountNearK(t *testing.T) {
	const n, k = 50000, 500
	gen := newDriftingGradients(1, n, 3)
	residual := make([]float32, n)
	acc := make([]float32, n)
	var th float32
	var sel Sparse
	for call := 0; call < 200; call++ {
		g := gen.next()[0]
		Accumulate(acc, g, residual)
		var err error
		sel, err = SelectByThreshold(sel, acc, k, &th, call%32 == 0)
		if err != nil {
			t.Fatal(err)
		}
		if c := sel.Len(); c < k/2 || c > 2*k {
			t.Fatalf("call %d selected %d entries, outside [k/2, 2k] for k=%d", call, c, k)
		}
		UpdateResidual(residual, acc, sel, sel)
	}
}

func FuzzTopK(f *testing.F) {
	f.Add([]byte{1, 2, 3, 4, 5, 6, 7, 8}, uint8(1))
	f.Add([]byte{0, 0, 0x80, 0x7f, 0, 0, 0x80, 0xff, 1, 0, 0, 0}, uint8(2))
	f.Fuzz(func(t *testing.T, raw []byte, kb uint8) {
		x := make([]float32, len(raw)/4)
		for i := range x {
			x[i] = math.Float32frombits(uint32(raw[4*i]) | uint32(raw[4*i+1])<<8 | uint32(raw[4*i+2])<<16 | uint32(raw[4*i+3])<<24)
		}
		k := int(kb) % (len(x) + 1)
		got, err := TopK(x, k)
		if firstNaN(x) >= 0 {
			if !errors.Is(err, ErrNonFinite) {
				t.Fatalf("NaN input: %v", err)
			}
			return
		}
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
		above := SelectAbove(Sparse{}, x, th)
		if above.Len() > k {
			t.Fatalf("more than k entries above the (k+1)-th magnitude")
		}
	})
}
