package core

// Tests that every baseline sends no more words than its cost model says.

import (
	"context"
	"math"
	"math/bits"
	"testing"
)

// wordsBound is the cost model's words per rank for one call, as written in
// each algorithm's opening comment (from its paper's cost analysis), and
// the slack the comparison allows. The equal-split formulas assume the
// selections spread evenly over the P regions; random ones do within 2%.
// The sparse baselines add the ⌈log P⌉ words of the agreement on NaN/Inf
// before any data moves (agreeOnInput).
func wordsBound(alg Algorithm, p, n, k int) (formula string, words, slack float64) {
	formula, words, slack = costModelWords(alg, p, n, k)
	if !alg.Dense() && alg != OkTopk {
		formula += "+log P"
		words += float64(bits.Len(uint(p - 1)))
	}
	return formula, words, slack
}

func costModelWords(alg Algorithm, p, n, k int) (formula string, words, slack float64) {
	P, N, K := float64(p), float64(n), float64(k)
	logP := float64(bits.Len(uint(p - 1)))
	switch alg {
	case DenseRing:
		return "2n(P-1)/P", 2 * N * (P - 1) / P, 2
	case DenseRabenseifner:
		return "2n(P-1)/P", 2 * N * (P - 1) / P, 2 * logP
	case TopkA:
		return "2k(P-1)", 2 * K * (P - 1), 0
	case TopkDSA:
		return "(2k+n)(P-1)/P", (2*K + N) * (P - 1) / P, 0
	case SSARRecursiveDouble:
		return "2k(P-1)", 2 * K * (P - 1), 0
	case SSARSplitAllgather:
		w := 2*K*(P-1)/P + 2*K*P*(P-1)/P
		return "2k(P-1)/P+2kP(P-1)/P", w, 0.02 * w
	case DSARSplitAllgather:
		w := 2*K*(P-1)/P + math.Min(2*K*P, N)*(P-1)/P
		return "2k(P-1)/P+min(2kP,n)(P-1)/P", w, 0.02 * w
	case GTopk:
		return "4k log P", 4 * K * logP, 0
	case Gaussiank:
		// k is only estimated: the correction accepts counts up to 1.25k.
		return "2k(P-1), k up to 1.25k", 2 * 1.25 * K * (P - 1), 0
	}
	panic("no cost model for " + alg.String())
}

// One call of every algorithm at n = 2^20, density 1%, on normal data (run
// with -v for the table). Fails when any rank sends more words than its
// algorithm's formula allows. Under -short or -race it runs at n = 2^16:
// the same bounds, checked at a size the race detector gets through in
// seconds.
func TestBaselinesWordsSentWithinCostModel(t *testing.T) {
	n, density := 1<<20, 0.01
	if testing.Short() || raceEnabled {
		n = 1 << 16
	}
	algs := append([]Algorithm{DenseRing, DenseRabenseifner}, sparseBaselines...)
	t.Logf("%-22s %2s %10s %10s %12s  %s", "algorithm", "P", "k", "max words", "formula", "")
	for _, p := range []int{2, 4, 8} {
		in := gaussianInputs(p, n, 42)
		for _, alg := range algs {
			cfg := baselineConfig(alg, density)
			k := cfg.K(n)
			stats := make([]Stats, p)
			grads := cloneAll(in)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				var err error
				stats[r], err = c.SparseAllreduce(ctx, 1, grads[r], cfg)
				return err
			})
			var most uint64
			for _, st := range stats {
				most = max(most, st.WordsSent())
			}
			formula, bound, slack := wordsBound(alg, p, n, k)
			t.Logf("%-22v %2d %10d %10d %12.0f  %s", alg, p, k, most, bound, formula)
			if float64(most) > bound+slack {
				t.Errorf("%v at P=%d: a rank sent %d words, formula %s = %.0f (slack %.0f)", alg, p, most, formula, bound, slack)
			}
		}
	}
}
