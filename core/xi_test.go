package core

// Tests of ξ (MeasureXi), the selection error against the sum's exact
// top-k: zero where it must be, a hand-computed case, no effect on the call,
// a mismatch when ranks disagree, and its traffic counted apart.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"testing"
)

// xiRun runs calls[c][rank] on tensor 1 with MeasureXi and returns each
// rank's Stats per call.
func xiRun(t *testing.T, cfg Config, calls [][][]float32) [][]Stats {
	t.Helper()
	p := len(calls[0])
	out := make([][]Stats, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for i := range calls {
			g := slices.Clone(calls[i][rank])
			st, err := c.SparseAllreduceWith(ctx, 1, g, cfg, CallOptions{MeasureXi: true})
			if err != nil {
				return fmt.Errorf("call %d: %w", i, err)
			}
			out[rank] = append(out[rank], st)
		}
		return nil
	})
	return out
}

// At density 1 the result is the whole sum, which is its own top-k: ξ = 0,
// and every rank reports it.
func TestXiZeroAtDensityOne(t *testing.T) {
	calls := [][][]float32{{{1, -2, 3, 4, 0, 6}, {3, 2, -1, 0, 5, 2}}}
	for _, alg := range []Algorithm{OkTopk, TopkA, GTopk} {
		cfg := okTopkConfig(1)
		cfg.Algorithm = alg
		for rank, st := range xiRun(t, cfg, calls) {
			if !st[0].XiMeasured || st[0].Xi != 0 {
				t.Errorf("%v rank %d: measured %v, xi %v; want 0", alg, rank, st[0].XiMeasured, st[0].Xi)
			}
		}
	}
}

// When every rank's top-k entries sit at the same indices and dominate the
// rest, the sum's exact top-k is what the algorithms produce: ξ = 0.
func TestXiZeroWhenTheRanksTopkCoincide(t *testing.T) {
	calls := [][][]float32{{
		{0.5, 8, 0.25, -0.5, 0, -6, 0.125, 0.25},
		{0.25, 4, -0.5, 0.125, 0.5, -10, 0, 0.5},
	}}
	for _, alg := range []Algorithm{OkTopk, TopkA, GTopk} {
		cfg := okTopkConfig(0.25) // k = 2
		cfg.Algorithm = alg
		for rank, st := range xiRun(t, cfg, calls) {
			if !st[0].XiMeasured || st[0].Xi != 0 || st[0].K != 2 {
				t.Errorf("%v rank %d: measured %v, k %d, xi %v; want k 2, xi 0", alg, rank, st[0].XiMeasured, st[0].K, st[0].Xi)
			}
		}
	}
}

// A constructed case worked by hand, over two calls so that the second
// one's acc includes the residual (TopkA, P = 2, n = 4, k = 1):
//
//	call 1: grad0 = [4 0 3 0], grad1 = [0 0 3 1]; residuals 0.
//	  Σacc = [4 0 6 1], its top-1 = [0 0 6 0]. Rank 0 sends index 0 (4),
//	  rank 1 index 2 (3): result [4 0 3 0]. ‖[−4 0 3 0]‖ = 5,
//	  ‖Σgrad‖ = √53: ξ = 5/√53. Residuals left: [0 0 3 0], [0 0 0 1].
//	call 2: grad0 = [1 0 0 0], grad1 = [0 0 0 1].
//	  acc0 = [1 0 3 0], acc1 = [0 0 0 2]; Σacc = [1 0 3 2], top-1 =
//	  [0 0 3 0]. Rank 0 sends index 2 (3), rank 1 index 3 (2): result
//	  [0 0 3 2]. ‖[0 0 0 −2]‖ = 2, ‖Σgrad‖ = √2: ξ = √2 (with grad in place
//	  of acc it would be √14/√2).
func TestXiHandComputed(t *testing.T) {
	calls := [][][]float32{
		{{4, 0, 3, 0}, {0, 0, 3, 1}},
		{{1, 0, 0, 0}, {0, 0, 0, 1}},
	}
	cfg := okTopkConfig(0.25)
	cfg.Algorithm = TopkA
	want := []struct{ xi, norm float64 }{{5 / math.Sqrt(53), math.Sqrt(53)}, {math.Sqrt(2), math.Sqrt(2)}}
	for rank, sts := range xiRun(t, cfg, calls) {
		for i, st := range sts {
			if !st.XiMeasured || math.Abs(st.Xi-want[i].xi) > 1e-12 || math.Abs(st.XiGradNorm-want[i].norm) > 1e-12 {
				t.Errorf("rank %d call %d: measured %v, xi %v, norm %v; want xi %v, norm %v",
					rank, i, st.XiMeasured, st.Xi, st.XiGradNorm, want[i].xi, want[i].norm)
			}
		}
	}
}

// Measuring ξ changes nothing of the call: over calls that repartition and
// reuse thresholds, the outputs and residuals are bitwise those of the same
// run without ξ, and a call without MeasureXi reports none.
func TestXiLeavesTheCallBitwiseUnchanged(t *testing.T) {
	const p, n, iters = 4, 1000, 12
	inputs := scaledGradients(p, n, iters, 7, func(int) float64 { return 1 })
	for _, alg := range []Algorithm{OkTopk, TopkA, GTopk, TopkDSA} {
		cfg := okTopkConfig(0.02)
		cfg.Algorithm, cfg.Tau, cfg.TauPrime = alg, 4, 3
		type seen struct {
			out, residual []float32
			st            Stats
		}
		run := func(measure bool) [][]seen {
			res := make([][]seen, p)
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				for it := range inputs {
					g := slices.Clone(inputs[it][rank])
					st, err := c.SparseAllreduceWith(ctx, 1, g, cfg, CallOptions{MeasureXi: measure && it%2 == 1})
					if err != nil {
						return fmt.Errorf("call %d: %w", it, err)
					}
					res[rank] = append(res[rank], seen{g, slices.Clone(c.TensorStateOf(1).Residual), st})
				}
				return nil
			})
			return res
		}
		with, without := run(true), run(false)
		for r := range p {
			for it := range iters {
				a, b := with[r][it], without[r][it]
				if !bitwiseEqual(a.out, b.out) || !bitwiseEqual(a.residual, b.residual) {
					t.Fatalf("%v rank %d call %d: output or residual differs with xi measured", alg, r, it)
				}
				if a.st.XiMeasured != (it%2 == 1) || b.st.XiMeasured {
					t.Fatalf("%v rank %d call %d: measured %v with, %v without", alg, r, it, a.st.XiMeasured, b.st.XiMeasured)
				}
				if a.st.XiMeasured && (a.st.Xi != with[0][it].st.Xi || !(a.st.Xi >= 0) || math.IsInf(a.st.Xi, 0)) {
					t.Fatalf("%v rank %d call %d: xi %v, rank 0's %v", alg, r, it, a.st.Xi, with[0][it].st.Xi)
				}
			}
		}
	}
}

func bitwiseEqual(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			return false
		}
	}
	return true
}

// A call that one rank asks to measure ξ and another does not fails with
// ErrMismatch on both, leaving each rank's buffer and residual as they were.
func TestXiAskedByOneRankOnlyIsMismatch(t *testing.T) {
	const n = 64
	cfg := okTopkConfig(0.1)
	errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
		g := make([]float32, n)
		for i := range g {
			g[i] = float32((i*7+rank*3)%11) - 5
		}
		if _, err := c.SparseAllreduce(ctx, 1, slices.Clone(g), cfg); err != nil {
			return fmt.Errorf("first call: %w", err)
		}
		residual := slices.Clone(c.TensorStateOf(1).Residual)
		iter := c.TensorStateOf(1).Iter
		buf := slices.Clone(g)
		_, err := c.SparseAllreduceWith(ctx, 1, buf, cfg, CallOptions{MeasureXi: rank == 0})
		st := c.TensorStateOf(1)
		if !bitwiseEqual(buf, g) || !bitwiseEqual(st.Residual, residual) || st.Iter != iter {
			return fmt.Errorf("the failed call changed the buffer or the state (call: %v)", err)
		}
		return err
	})
	for rank, err := range errs {
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("rank %d: got %v, want ErrMismatch", rank, err)
		}
	}
}

// ξ's dense allreduce of 2n values is counted in XiBytesSent and
// XiBytesReceived, apart from the algorithm's own bytes, which stay what
// they are without ξ: over the ranks, the ring sends every one of the 2n
// values P−1 times to reduce and P−1 times to gather, 2(P−1)·2n·4 bytes.
func TestXiTrafficIsCountedApartFromTheAlgorithms(t *testing.T) {
	const p, n, iters = 3, 1000, 4
	inputs := scaledGradients(p, n, iters, 5, func(int) float64 { return 1 })
	for _, alg := range []Algorithm{OkTopk, TopkA} {
		cfg := okTopkConfig(0.02)
		cfg.Algorithm = alg
		run := func(measure bool) [][]Stats {
			out := make([][]Stats, p)
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				for it := range inputs {
					st, err := c.SparseAllreduceWith(ctx, 1, slices.Clone(inputs[it][rank]), cfg, CallOptions{MeasureXi: measure})
					if err != nil {
						return fmt.Errorf("call %d: %w", it, err)
					}
					out[rank] = append(out[rank], st)
				}
				return nil
			})
			return out
		}
		with, without := run(true), run(false)
		for it := range iters {
			var sent, received uint64
			for r := range p {
				a, b := with[r][it], without[r][it]
				if a.BytesSent != b.BytesSent || a.BytesReceived != b.BytesReceived {
					t.Errorf("%v rank %d call %d: the algorithm's bytes %d/%d with xi, %d/%d without", alg, r, it,
						a.BytesSent, a.BytesReceived, b.BytesSent, b.BytesReceived)
				}
				if b.XiBytesSent != 0 || b.XiBytesReceived != 0 {
					t.Errorf("%v rank %d call %d: xi bytes %d/%d in a call that did not measure xi", alg, r, it, b.XiBytesSent, b.XiBytesReceived)
				}
				sent += a.XiBytesSent
				received += a.XiBytesReceived
			}
			if want := uint64(2 * (p - 1) * 2 * n * 4); sent != want || received != want {
				t.Errorf("%v call %d: the ranks' xi bytes sent %d, received %d; want %d each", alg, it, sent, received, want)
			}
		}
	}
}
