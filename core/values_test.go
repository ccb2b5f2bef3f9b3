package core

// Tests of reduced-precision values (float16, bfloat16, and 8-bit and
// 4-bit where they share a property) on the wire: rounding and saturation, the codec,
// reproducible stochastic rounding, fewer bytes, refusals and mismatches,
// and the residual keeping rounding errors; and of held entries staying in
// the residual.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

func TestValueTypeRoundingNearestStochasticAndSaturation(t *testing.T) {
	const f16Max, bf16Max = 65504, float32(3.3895314e38)
	rng := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 100000; i++ {
		x := float32(rng.NormFloat64() * math.Exp(rng.NormFloat64()*6))
		// Nearest is the RNE conversion, except that overflow saturates.
		var h [1]uint16
		Float32ToFloat16(h[:], []float32{x})
		want := float16ToFloat32(h[0])
		if math.IsInf(float64(want), 0) {
			want = float32(math.Copysign(f16Max, float64(x)))
		}
		if got := ValuesFloat16.Nearest(x); math.Float32bits(got) != math.Float32bits(want) {
			t.Fatalf("float16 nearest(%v) = %v, want %v", x, got, want)
		}
		Float32ToBFloat16(h[:], []float32{x})
		if got, want := ValuesBFloat16.Nearest(x), math.Float32frombits(uint32(h[0])<<16); got != want {
			t.Fatalf("bfloat16 nearest(%v) = %v, want %v", x, got, want)
		}
		// Stochastic gives one of the two neighbours: the value itself when
		// representable, else one on each side of x.
		for _, v := range []ValueType{ValuesFloat16, ValuesBFloat16} {
			s := v.Stochastic(x, rng.Uint32())
			if v.Nearest(s) != s {
				t.Fatalf("%v stochastic(%v) = %v is not a %v value", v, x, s, v)
			}
			// u = 0 rounds away from zero unless x is representable, the
			// largest u toward zero unless x is (nearly) the upper value.
			hi, lo := v.Stochastic(x, 0), v.Stochastic(x, math.MaxUint32)
			if v.Nearest(x) == x && (lo != x || hi != x) || abs32(lo) > abs32(x) || abs32(hi) < abs32(x) && abs32(hi) != f16Max {
				t.Fatalf("%v stochastic(%v): u=max gives %v, u=0 gives %v", v, x, lo, hi)
			}
		}
	}
	for _, c := range []struct {
		v    ValueType
		x    float32
		want float32
	}{
		{ValuesFloat16, 1e6, f16Max}, {ValuesFloat16, -70000, -f16Max}, {ValuesFloat16, 65519, f16Max},
		{ValuesFloat16, 1e-9, 0}, {ValuesBFloat16, math.MaxFloat32, bf16Max}, {ValuesBFloat16, -math.MaxFloat32, -bf16Max},
		{ValuesFloat32, 1.1, 1.1},
	} {
		if got := c.v.Nearest(c.x); got != c.want {
			t.Errorf("%v nearest(%v) = %v, want %v", c.v, c.x, got, c.want)
		}
		for _, u := range []uint32{0, 1 << 31, math.MaxUint32} {
			if got := c.v.Stochastic(c.x, u); abs32(c.x) > abs32(c.want) && c.want != 0 && got != c.want {
				t.Errorf("%v stochastic(%v, %d) = %v, want the saturated %v", c.v, c.x, u, got, c.want)
			}
		}
	}
	// Unbiased: 1 + 2^-12 lies a quarter of the way from 1 to 1 + 2^-10
	// (float16 neighbours), so about a quarter of uniform u round it up.
	x := float32(1 + 1.0/4096)
	up := 0
	for i := 0; i < 40000; i++ {
		if ValuesFloat16.Stochastic(x, rng.Uint32()) > 1 {
			up++
		}
	}
	if f := float64(up) / 40000; math.Abs(f-0.25) > 0.01 {
		t.Errorf("stochastic rounding of 1+2^-12 went up %.3f of the time, want 0.25", f)
	}
	// In the subnormal range too: 2^-26 is a quarter of float16's smallest
	// subnormal, 2^-24.
	x, up = float32(math.Ldexp(1, -26)), 0
	for i := 0; i < 40000; i++ {
		if ValuesFloat16.Stochastic(-x, rng.Uint32()) < 0 {
			up++
		}
	}
	if f := float64(up) / 40000; math.Abs(f-0.25) > 0.01 {
		t.Errorf("stochastic rounding of -2^-26 went away from zero %.3f of the time, want 0.25", f)
	}
}

func TestSparseCodecReducedValuesRoundTrip(t *testing.T) {
	s := Sparse{Idx: []uint32{100, 103, 4000}, Val: []float32{1.5, -0.333251953125, 65504}}
	for _, v := range []ValueType{ValuesFloat32, ValuesFloat16, ValuesBFloat16} {
		in := Sparse{Idx: s.Idx, Val: append([]float32(nil), s.Val...)}
		valueRounding{values: v}.apply(in)
		b := encodeSparseAs(nil, in, 100, v)
		if len(b) != codedIndexBytes(in.Idx)+v.width()*in.Len() {
			t.Fatalf("%v: %d bytes for %d pairs", v, len(b), in.Len())
		}
		out, err := decodeSparseAs(Sparse{}, b, uint64(in.Len()), 100, 5000, v)
		if err != nil {
			t.Fatalf("%v: %v", v, err)
		}
		for j := range in.Idx {
			if out.Idx[j] != in.Idx[j] || math.Float32bits(out.Val[j]) != math.Float32bits(in.Val[j]) {
				t.Fatalf("%v: entry %d came back as (%d, %v), sent (%d, %v)", v, j, out.Idx[j], out.Val[j], in.Idx[j], in.Val[j])
			}
		}
		if v == ValuesFloat32 {
			continue
		}
		for name, bad := range map[string]func() error{
			"short payload": func() error { _, err := decodeSparseAs(Sparse{}, b[:len(b)-1], 3, 100, 5000, v); return err },
			"count too big": func() error { _, err := decodeSparseAs(Sparse{}, b, 4, 100, 5000, v); return err },
			"index too big": func() error { _, err := decodeSparseAs(Sparse{}, b, 3, 100, 4000, v); return err },
		} {
			if err := bad(); !errors.Is(err, transport.ErrBadFrame) {
				t.Errorf("%v %s: %v, want ErrBadFrame", v, name, err)
			}
		}
	}
}

func TestReducedPrecisionStochasticRoundingIsReproducible(t *testing.T) {
	cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 16, TauPrime: 8, Values: ValuesFloat16, Stochastic: true}
	_, a, ra, _ := massRun(t, 3, 2000, 10, cfg, nil)
	_, b, rb, _ := massRun(t, 3, 2000, 10, cfg, nil)
	for it := range a {
		if hashFloats(a[it][0]) != hashFloats(b[it][0]) {
			t.Fatalf("call %d: two runs from the same inputs differ", it)
		}
	}
	for r := range ra {
		if hashFloats(ra[r]) != hashFloats(rb[r]) {
			t.Fatalf("rank %d's residuals differ between two runs", r)
		}
	}
	nearest := cfg
	nearest.Stochastic = false
	_, c, _, _ := massRun(t, 3, 2000, 10, nearest, nil)
	same := true
	for it := range a {
		same = same && hashFloats(a[it][0]) == hashFloats(c[it][0])
	}
	if same {
		t.Fatal("stochastic rounding gave the same outputs as rounding to nearest")
	}
}

// float16 values halve the 4-byte value of each pair (about 5.2 bytes with
// its coded index), 8-bit ones quarter it and add a scale per 32 (about
// 2.3 bytes a pair), 4-bit ones take half a byte and the scale (about
// 1.8). Measured on every rank over 40 calls of Ok-Topk (exact
// and reuse calls, histogram exchanges included); the ratios are logged for
// the record.
func TestReducedPrecisionOkTopkSendsFewerBytes(t *testing.T) {
	n, iters, p := 100000, 40, 4
	if raceEnabled {
		iters = 10 // the same frames, fewer of them; make test's non-race pass runs 40
	}
	base := Config{Algorithm: OkTopk, Density: 0.01, Tau: 64, TauPrime: 32}
	_, _, _, s32 := massRun(t, p, n, iters, base, nil)
	var b32 uint64
	for r := range s32 {
		b32 += s32[r].BytesSent
	}
	for _, c := range []struct {
		v    ValueType
		most float64
	}{{ValuesFloat16, 0.7}, {ValuesInt8, 0.6}, {ValuesInt4, 0.5}} {
		cfg := base
		cfg.Values = c.v
		_, _, _, s := massRun(t, p, n, iters, cfg, nil)
		var b uint64
		for r := range s {
			b += s[r].BytesSent
		}
		ratio := float64(b) / float64(b32)
		t.Logf("Ok-Topk P=%d n=%d density 0.01, %d calls: %.0f bytes sent per rank per call with float32 values, %.0f with %v (%.3f×)",
			p, n, iters, float64(b32)/float64(p*iters), float64(b)/float64(p*iters), c.v, ratio)
		if ratio > c.most {
			t.Errorf("%v values sent %.3f× the bytes of float32 ones, want at most %.1f×", c.v, ratio, c.most)
		}
	}
}

func TestReducedPrecisionRefusedWhereRoundingHasNoOwner(t *testing.T) {
	for _, alg := range []Algorithm{DenseRing, DenseRabenseifner, TopkDSA, SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather, GTopk} {
		for _, v := range []ValueType{ValuesFloat16, ValuesInt8, ValuesInt4} {
			cfg := Config{Algorithm: alg, Density: 0.01, Tau: 1, TauPrime: 1, Values: v}
			if err := cfg.Validate(); !errors.Is(err, ErrInvalidArgument) {
				t.Errorf("%v with %v values: %v, want ErrInvalidArgument", alg, v, err)
			}
		}
	}
	for _, cfg := range []Config{
		{Algorithm: OkTopk, Density: 0.01, Tau: 1, TauPrime: 1, Values: numValueTypes},
		{Algorithm: OkTopk, Density: 0.01, Tau: 1, TauPrime: 1, Stochastic: true},
		{Algorithm: OkTopk, Density: 0.01, Tau: 1, TauPrime: 1, Values: ValuesInt8, Stochastic: true},
		{Algorithm: OkTopk, Density: 0.01, Tau: 1, TauPrime: 1, Values: ValuesInt4, Stochastic: true},
	} {
		if err := cfg.Validate(); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%+v: %v, want ErrInvalidArgument", cfg, err)
		}
	}
	for _, v := range []ValueType{ValuesFloat16, ValuesInt8, ValuesInt4} {
		errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
			cfg := Config{Algorithm: OkTopk, Density: 0.5, Tau: 1, TauPrime: 1, Values: v}
			_, _, err := c.SparseAllreduceSparse(ctx, 10, Sparse{Idx: []uint32{1}, Val: []float32{1}}, cfg)
			return err
		})
		for r, err := range errs {
			if !errors.Is(err, ErrInvalidArgument) {
				t.Errorf("rank %d: sparse-input call with %v values: %v, want ErrInvalidArgument", r, v, err)
			}
		}
	}
}

// A frame names its call's value format by core's numbering.
func TestFramesNameValueTypesAsCoreNumbersThem(t *testing.T) {
	for v := range numValueTypes {
		if got := transport.ValueFormat(v).String(); got != v.String() {
			t.Errorf("value type %d is %s to frames, %v to core", v, got, v)
		}
	}
	if got := transport.ValueFormat(numValueTypes).String(); !strings.HasPrefix(got, "value format(") {
		t.Errorf("a format past core's has the name %q", got)
	}
}

// Ranks configured with different value types fail their first call with
// ErrMismatch naming the values (every frame of a call says its format),
// instead of reading each other's values in the wrong format.
func TestReducedPrecisionMixedValueTypesAreAMismatch(t *testing.T) {
	for _, alg := range []Algorithm{OkTopk, TopkA, Gaussiank} {
		for _, pair := range [][2]ValueType{{ValuesFloat32, ValuesFloat16}, {ValuesFloat32, ValuesInt8}, {ValuesBFloat16, ValuesInt8}, {ValuesInt8, ValuesInt4}} {
			errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
				cfg := Config{Algorithm: alg, Density: 0.1, Tau: 1, TauPrime: 1, Values: pair[rank]}
				g := make([]float32, 100)
				for i := range g {
					g[i] = float32(i)
				}
				_, err := c.SparseAllreduce(ctx, 1, g, cfg)
				return err
			})
			for r, err := range errs {
				if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "values: rank") {
					t.Errorf("%v, %v against %v, rank %d: %v, want ErrMismatch naming the values", alg, pair[0], pair[1], r, err)
				}
			}
		}
	}
}

// Entries a rank holds back are never sent: where every rank holds them the
// result is zero (the caller discards it), where one rank does the others'
// values still arrive, and the held grad + residual stays in the residual,
// so no mass is lost. Held entries are made the largest, so that any
// selection would take them.
func TestHeldEntriesStayInResidual(t *testing.T) {
	const p, n, iters = 3, 2000, 30
	everyone := Span{100, 300} // held by every rank on odd calls
	rank0 := Span{500, 600}    // held by rank 0 on every call
	holdOf := func(rank, it int) []Span {
		var h []Span
		if it%2 == 1 {
			h = append(h, everyone)
		}
		if rank == 0 {
			h = append(h, rank0)
		}
		return h
	}
	gen := newDriftingGradients(p, n, 11)
	grads := make([][][]float32, iters)
	for it := range grads {
		grads[it] = gen.next()
		for r := range grads[it] {
			for _, h := range holdOf(r, it) {
				for i := h.Start; i < h.End; i++ {
					grads[it][r][i] *= 1000
				}
			}
		}
	}
	for _, cfg := range []Config{
		{Algorithm: OkTopk, Density: 0.05, Tau: 4, TauPrime: 3},
		{Algorithm: OkTopk, Density: 0.05, Tau: 4, TauPrime: 3, Values: ValuesFloat16},
		{Algorithm: OkTopk, Density: 1, Tau: 4, TauPrime: 3},
		{Algorithm: TopkA, Density: 0.05, Tau: 1, TauPrime: 1},
		{Algorithm: TopkDSA, Density: 0.05, Tau: 1, TauPrime: 1},
		{Algorithm: SSARSplitAllgather, Density: 0.05, Tau: 1, TauPrime: 1},
	} {
		t.Run(fmt.Sprintf("%v/density=%v/%v", cfg.Algorithm, cfg.Density, cfg.Values), func(t *testing.T) {
			outs := make([][][]float32, iters)
			for it := range outs {
				outs[it] = make([][]float32, p)
			}
			residuals := make([][]float32, p)
			runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
				for it := 0; it < iters; it++ {
					g := append([]float32(nil), grads[it][rank]...)
					if _, err := c.SparseAllreduceHolding(ctx, 5, g, cfg, holdOf(rank, it)); err != nil {
						return fmt.Errorf("call %d: %w", it, err)
					}
					outs[it][rank] = g
				}
				residuals[rank] = append([]float32(nil), c.TensorStateOf(5).Residual...)
				return nil
			})
			checkMass(t, grads, outs, residuals)
			for it := 1; it < iters; it += 2 {
				for i := everyone.Start; i < everyone.End; i++ {
					if outs[it][0][i] != 0 {
						t.Fatalf("call %d: entry %d, held by every rank, has result %v", it, i, outs[it][0][i])
					}
				}
			}
			// Rank 0 never sent its held entries: its residual there is
			// their gradients summed in call order, bitwise (with float16
			// values, an owner's residual also takes its sums' rounding
			// errors, which the mass check above covers).
			for i := rank0.Start; i < rank0.End && cfg.Values == ValuesFloat32; i++ {
				var sum float32
				for it := range grads {
					sum += grads[it][0][i]
				}
				if residuals[0][i] != sum {
					t.Fatalf("rank 0's residual[%d] = %v, want its %d gradients' sum %v", i, residuals[0][i], iters, sum)
				}
			}
			// The other ranks' values there did arrive (some output is
			// nonzero in rank 0's range).
			arrived := false
			for it := range outs {
				for i := rank0.Start; i < rank0.End; i++ {
					arrived = arrived || outs[it][0][i] != 0
				}
			}
			if !arrived && cfg.Density < 1 {
				t.Fatalf("no other rank's value arrived in the range rank 0 held")
			}
		})
	}
	errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
		g := make([]float32, 10)
		_, err := c.SparseAllreduceHolding(ctx, 1, g, okTopkConfig(0.5), []Span{{4, 6}, {5, 8}})
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("rank %d: overlapping held ranges: %v, want ErrInvalidArgument", r, err)
		}
	}
}

// A hand-built 2-rank case with float16 values (k = 2 of n = 6). Rank 0
// selects {0, 1}, rank 1 selects {0, 4}; the regions are [0, 2) for rank 0
// and [2, 6) for rank 1. Sent: rank 0 1000.5 (for 1000.3) and 700.5 (for
// 700.7), rank 1 1000 (for 999.9) and -1500 (for -1500.2). Rank 0 sums
// index 0 to 2000.5 and rounds it to 2000 (a tie, to even): the global
// result is {0: 2000, 4: -1500}. Each rank's residual keeps acc − sent where
// its value made it into the result, rank 0's also the 0.5 its sum lost,
// and all of acc elsewhere (index 1: selected, not kept).
func TestReducedPrecisionResidualKeepsRoundingErrorsTwoRanks(t *testing.T) {
	in := [][]float32{
		{1000.3, 700.7, 0.5, -0.25, 0, 1},
		{999.9, -1, 0.5, 0, -1500.2, 0.75},
	}
	wantOut := []float32{1000, 0, 0, 0, -750, 0}
	wantResidual := [][]float32{
		{in[0][0] - 1000.5 + 0.5, 700.7, 0.5, -0.25, 0, 1},
		{in[1][0] - 1000, -1, 0.5, 0, in[1][4] + 1500, 0.75},
	}
	checkTwoRankCall(t, Config{Algorithm: OkTopk, Density: 2.0 / 6.0, Tau: 1, TauPrime: 1, Values: ValuesFloat16}, in, wantOut, wantResidual)
}
