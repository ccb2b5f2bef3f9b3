package core

// Tests of 8-bit values: the rounding keeps its error exactly and a rounded
// block encodes into codes that decode to the same bits; each malformed
// block is refused by name; frames pass the header's size check.

import (
	"encoding/binary"
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// int8TestValues is n values of every kind a block may hold: magnitudes
// over the whole float32 range (subnormals and the largest finite ones,
// which saturate, included), zeros of both signs, and blocks of one
// magnitude.
func int8TestValues(n int) Sparse {
	rng := rand.New(rand.NewPCG(62, 8))
	s := Sparse{}
	for i := range n {
		var x float32
		switch block := i / int8Block; block % 6 {
		case 0: // spread over many octaves
			x = float32(math.Ldexp(rng.NormFloat64(), rng.IntN(60)-30))
		case 1: // subnormals
			x = math.Float32frombits(uint32(rng.IntN(1 << 12)))
		case 2: // large, below where the codes saturate
			x = float32(math.Ldexp(1+rng.Float64(), 125))
		case 3: // zeros
			x = float32(math.Copysign(0, rng.NormFloat64()))
		case 4: // one octave
			x = float32(1 + rng.Float64())
		default: // the largest finite values, where the codes saturate at 127·2^120
			x = float32(math.Ldexp(1+0.99*rng.Float64(), 127))
		}
		if rng.IntN(2) == 0 {
			x = -x
		}
		s.Append(uint32(3*i), x)
	}
	return s
}

func TestInt8RoundingKeepsItsErrorExactlyAndEncodesAgainTheSame(t *testing.T) {
	const n = 6*int8Block*3 + 7 // every kind of block, and a short last one
	exact := int8TestValues(n)
	s := Sparse{Idx: exact.Idx, Val: append([]float32(nil), exact.Val...)}
	var errs Sparse
	quantizeInt8(s, &errs)
	e := 0
	for i, x := range exact.Val {
		q := s.Val[i]
		var d float32
		if e < errs.Len() && errs.Idx[e] == s.Idx[i] {
			d = errs.Val[e]
			e++
		}
		if float64(q)+float64(d) != float64(x) || (d != 0) != (q != x) {
			t.Fatalf("entry %d: %v rounded to %v with error %v", i, x, q, d)
		}
	}
	if e != errs.Len() {
		t.Fatalf("%d errors for %d entries the rounding changed", errs.Len(), e)
	}
	// Rounded values are a block's own: rounding again changes nothing, and
	// the frame decodes to the same bits.
	again := Sparse{Idx: s.Idx, Val: append([]float32(nil), s.Val...)}
	var none Sparse
	quantizeInt8(again, &none)
	if none.Len() != 0 || !sparseBitwiseEqual(again, s) {
		t.Fatalf("rounding rounded values changed %d of them", none.Len())
	}
	frame := encodeSparseAs(nil, s, 0, ValuesInt8)
	if want := codedIndexBytes(s.Idx) + n + 4*((n+int8Block-1)/int8Block); len(frame) != want {
		t.Fatalf("%d bytes, want %d", len(frame), want)
	}
	if err := transport.CheckPayloadSize(transport.DtypeSparseI8, uint64(n), uint64(len(frame))); err != nil {
		t.Fatalf("the frame would be dropped: %v", err)
	}
	out, err := decodeSparseAs(Sparse{}, frame, uint64(n), 0, uint32(3*n), ValuesInt8)
	if err != nil || !sparseBitwiseEqual(out, s) {
		t.Fatalf("the frame came back as %d entries (%v)", out.Len(), err)
	}
}

// A value is rounded to within half its block's step, and the step is at
// most 2/127 of the block's largest magnitude (at one octave, values in
// [1, 2): within 2^−7), the blocks that saturate aside.
func TestInt8RoundingIsWithinHalfAStep(t *testing.T) {
	s := int8TestValues(6 * int8Block)
	exact := append([]float32(nil), s.Val...)
	quantizeInt8(s, nil)
	for start := 0; start < s.Len(); start += int8Block {
		var m float32
		for _, x := range exact[start : start+int8Block] {
			m = max(m, abs32(x))
		}
		if m > 127*0x1p120 {
			continue
		}
		step := math.Ldexp(1, int8Exponent(m))
		for j := start; j < start+int8Block; j++ {
			if d := math.Abs(float64(exact[j]) - float64(s.Val[j])); d > step/2 || (m > 0x1p-140 && d > float64(m)/127) {
				t.Fatalf("entry %d: %v rounded to %v, step %v, block's largest %v", j, exact[j], s.Val[j], step, m)
			}
		}
	}
}

func TestInt8ValuesRefuseEachMalformedBlockByName(t *testing.T) {
	s := Sparse{}
	for i := range 40 { // a block of 32 and one of 8
		s.Append(uint32(10+i), float32(i)-20)
	}
	quantizeInt8(s, nil)
	frame := encodeSparseAs(nil, s, 0, ValuesInt8)
	values := len(frame) - int8ValueBytes(s.Len()) // the first block's scale
	edit := func(f func(b []byte)) []byte {
		b := append([]byte(nil), frame...)
		f(b)
		return b
	}
	scale := func(x float32) []byte {
		return edit(func(b []byte) { binary.LittleEndian.PutUint32(b[values:], math.Float32bits(x)) })
	}
	code := func(j int, c int8) []byte { return edit(func(b []byte) { b[values+4+j] = byte(c) }) }
	if got := math.Float32frombits(binary.LittleEndian.Uint32(frame[values:])); got != 0.25 {
		t.Fatalf("the first block's scale is %v, not the 2^-2 its largest value of 20 takes", got)
	}
	for _, c := range []struct {
		name    string
		payload []byte
		want    error
	}{
		{"a NaN scale", scale(float32(math.NaN())), ErrSparseScale},
		{"an infinite scale", scale(float32(math.Inf(1))), ErrSparseScale},
		{"a negative scale", scale(-0.5), ErrSparseScale},
		{"a negative zero scale", scale(float32(math.Copysign(0, -1))), ErrSparseScale},
		{"a scale not a power of two", scale(0.75), ErrSparseScale},
		{"a scale above 2^120", scale(0x1p121), ErrSparseScale},
		{"a largest code below 64", edit(func(b []byte) {
			for j := range int8Block {
				b[values+4+j] = 1
			}
		}), ErrSparseNotCanonical},
		{"a zero scale with codes", scale(0), ErrSparseNotCanonical},
		{"the code -128", code(0, -128), ErrSparseNotCanonical},
		{"the values cut short", frame[:len(frame)-1], ErrSparseTruncated},
		{"a byte past the values", append(append([]byte(nil), frame...), 0), ErrSparseCountMismatch},
	} {
		if _, err := decodeSparseAs(Sparse{}, c.payload, uint64(s.Len()), 0, 100, ValuesInt8); !errors.Is(err, c.want) || !errors.Is(err, transport.ErrBadFrame) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if _, err := decodeSparseAs(Sparse{}, frame, uint64(s.Len()), 0, 100, ValuesInt8); err != nil {
		t.Fatalf("the unbroken frame: %v", err)
	}
}
