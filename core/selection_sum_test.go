package core

// Tests that every selection on acc = grad + residual formed on the fly
// equals the same selection on the stored sum, and that the selection
// scratch free list stays bounded.

import (
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// Error feedback never stores acc = grad + residual (vec.go): every pass
// forms the sums as it reads. Each selection on such a sum must give
// bitwise what it gives on the stored Accumulate — the threshold selection
// and its non-finite count, the exact top-k (sampled, light-bucket and
// heavy-bucket paths, ties included) with its next key, the Gaussian
// estimate — on one chunk or several; and foldOutput must leave the
// residual and the gradient as UpdateResidual (with an owner's rounding
// errors added) and ScatterAverage do, on one chunk or several, for a
// finite acc (the only one a call folds).
func TestSelectionsOnSumEqualStoredAccumulate(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	for _, n := range []int{0, 1, 7, 8, 9, 1000, 1 << 16, 3*tileLen + 5} {
		for _, shape := range []string{"normal", "ties", "nan", "+inf", "-inf"} {
			grad, residual := make([]float32, n), make([]float32, n)
			for i := range grad {
				grad[i], residual[i] = float32(rng.NormFloat64()), float32(rng.NormFloat64())*0.1
				if shape == "ties" { // a heavy bucket: most sums in one top-16-bit bucket
					grad[i], residual[i] = float32(1+rng.IntN(4))*0.25, 0
				}
			}
			if n > 0 {
				switch shape {
				case "nan":
					grad[rng.IntN(n)] = float32(math.NaN())
				case "+inf":
					grad[rng.IntN(n)] = float32(math.Inf(1))
				case "-inf":
					residual[rng.IntN(n)] = float32(math.Inf(-1))
				}
			}
			acc := make([]float32, n)
			Accumulate(acc, grad, residual)
			sum := sumVec(grad, residual)
			for _, chunks := range []int{1, 3} {
				where := fmt.Sprintf("n=%d %s chunks=%d", n, shape, chunks)
				th := float32(2.2)
				want, wantBad := selectAbove(Sparse{}, acc, th, chunks)
				got, bad := selectAboveOf(Sparse{}, sum, th, chunks)
				if bad != wantBad || !sameSparse(got, want) {
					t.Fatalf("%s: threshold selection differs (%d entries, %d non-finite; want %d, %d)", where, got.Len(), bad, want.Len(), wantBad)
				}
				for _, k := range []int{0, 1, n / 100, n / 3, n} {
					if k < 0 || k > n {
						continue
					}
					want, wantNext, wantInf, wantErr := topK(Sparse{}, acc, k, chunks)
					got, next, inf, err := topKOf(Sparse{}, sum, k, chunks)
					if (err == nil) != (wantErr == nil) || next != wantNext || inf != wantInf || !sameSparse(got, want) {
						t.Fatalf("%s k=%d: top-k differs (err %v, want %v; next %x, want %x)", where, k, err, wantErr, next, wantNext)
					}
				}
				if shape == "normal" && n > 0 {
					m, sd := meanStdOf(sum, chunks)
					wm, wsd := meanStd(acc, chunks)
					if m != wm || sd != wsd {
						t.Fatalf("%s: mean, std %v, %v; want %v, %v", where, m, sd, wm, wsd)
					}
					k := max(1, n/100)
					want, wantTh := gaussianSelectInto(Sparse{}, acc, k, 0.01, chunks)
					got, th, bad := gaussianSelectOf(Sparse{}, sum, k, 0.01, chunks)
					if bad != 0 || th != wantTh || !sameSparse(got, want) {
						t.Fatalf("%s: Gaussian selection differs", where)
					}
				}
			}
			if shape != "normal" && shape != "ties" {
				continue // a call never folds a non-finite acc: it is skipped
			}
			// The end of a call: the selection of the stored acc, sent
			// rounded (as 16-bit values are); a global result that keeps
			// some of it and adds other entries; the rounding errors of an
			// owner's sums on some of both.
			local, _ := selectAbove(Sparse{}, acc, 1.5, 1)
			var global, ownerErr Sparse
			for j, ix := range local.Idx {
				local.Val[j] = math.Float32frombits(math.Float32bits(local.Val[j]) &^ 0xff)
				if j%2 == 0 {
					global.Append(ix, local.Val[j]*3)
				}
				if j%3 == 0 {
					ownerErr.Append(ix, 0x1p-20)
				}
				if j%5 == 0 && ix+1 < uint32(n) && (j+1 == local.Len() || local.Idx[j+1] != ix+1) {
					global.Append(ix+1, 7) // kept from another rank's selection
				}
			}
			for _, p := range []int{1, 4} {
				for _, chunks := range []int{1, 3} {
					wantResidual, wantGrad := slices.Clone(residual), slices.Clone(grad)
					UpdateResidual(wantResidual, acc, local, global)
					for j, ix := range ownerErr.Idx {
						wantResidual[ix] += ownerErr.Val[j]
					}
					ScatterAverage(wantGrad, global, p)
					gotResidual, gotGrad := slices.Clone(residual), slices.Clone(grad)
					foldOutputIn(gotResidual, gotGrad, local, global, global, ownerErr, p, chunks)
					where := fmt.Sprintf("n=%d %s P=%d chunks=%d", n, shape, p, chunks)
					if i, differ := firstDifference(gotResidual, wantResidual); differ {
						t.Fatalf("%s: residual[%d] = %v, want %v", where, i, gotResidual[i], wantResidual[i])
					}
					if i, differ := firstDifference(gotGrad, wantGrad); differ {
						t.Fatalf("%s: grad[%d] = %v, want %v", where, i, gotGrad[i], wantGrad[i])
					}
				}
			}
		}
	}
}

func sameSparse(a, b Sparse) bool {
	return slices.Equal(a.Idx, b.Idx) && slices.Equal(float32Bytes(a.Val), float32Bytes(b.Val))
}

// firstDifference is the first index where a and b differ bitwise.
func firstDifference(a, b []float32) (int, bool) {
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return i, true
		}
	}
	return 0, false
}

// The free list of selection scratch keeps at most maxFreeScratches: a
// burst of concurrent selections leaves the rest to the garbage collector.
func TestScratchFreeListIsBounded(t *testing.T) {
	held := make([]*selectionScratch, 3*maxFreeScratches)
	for i := range held {
		held[i] = getScratch()
	}
	for _, sc := range held {
		putScratch(sc)
	}
	scratches.Lock()
	n := len(scratches.free)
	scratches.Unlock()
	if n > maxFreeScratches {
		t.Fatalf("%d scratches kept after a burst of %d, at most %d wanted", n, len(held), maxFreeScratches)
	}
}
