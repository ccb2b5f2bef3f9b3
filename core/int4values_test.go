package core

// Tests of 4-bit values: the rounding keeps its error exactly and a rounded
// block encodes into codes that decode to the same bits; each malformed
// block is refused by name; frames pass the header's size check.

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

func TestInt4RoundingKeepsItsErrorExactlyAndEncodesAgainTheSame(t *testing.T) {
	for _, n := range []int{6*int8Block*3 + 7, 6*int8Block*3 + 8, 1, 2} { // every kind of block, a short last one of odd and even length
		exact := int8TestValues(n)
		s := Sparse{Idx: exact.Idx, Val: append([]float32(nil), exact.Val...)}
		var errs Sparse
		quantizeInt4(s, &errs)
		e := 0
		for i, x := range exact.Val {
			q := s.Val[i]
			var d float32
			if e < errs.Len() && errs.Idx[e] == s.Idx[i] {
				d = errs.Val[e]
				e++
			}
			if float64(q)+float64(d) != float64(x) || (d != 0) != (q != x) {
				t.Fatalf("n=%d entry %d: %v rounded to %v with error %v", n, i, x, q, d)
			}
		}
		if e != errs.Len() {
			t.Fatalf("n=%d: %d errors for %d entries the rounding changed", n, errs.Len(), e)
		}
		again := Sparse{Idx: s.Idx, Val: append([]float32(nil), s.Val...)}
		var none Sparse
		quantizeInt4(again, &none)
		if none.Len() != 0 || !sparseBitwiseEqual(again, s) {
			t.Fatalf("n=%d: rounding rounded values changed %d of them", n, none.Len())
		}
		frame := encodeSparseAs(nil, s, 0, ValuesInt4)
		if want := codedIndexBytes(s.Idx) + (n+1)/2 + 4*((n+int8Block-1)/int8Block); len(frame) != want {
			t.Fatalf("n=%d: %d bytes, want %d", n, len(frame), want)
		}
		if err := transport.CheckPayloadSize(transport.DtypeSparseI4, uint64(n), uint64(len(frame))); err != nil {
			t.Fatalf("n=%d: the frame would be dropped: %v", n, err)
		}
		out, err := decodeSparseAs(Sparse{}, frame, uint64(n), 0, uint32(3*n), ValuesInt4)
		if err != nil || !sparseBitwiseEqual(out, s) {
			t.Fatalf("n=%d: the frame came back as %d entries (%v)", n, out.Len(), err)
		}
	}
}

// A value is rounded to within half its block's step, and the step is at
// most 2/7 of the block's largest magnitude, the blocks that saturate
// aside; the block's largest code is 4 to 7.
func TestInt4RoundingIsWithinHalfAStep(t *testing.T) {
	s := int8TestValues(6 * int8Block)
	exact := append([]float32(nil), s.Val...)
	quantizeInt4(s, nil)
	for start := 0; start < s.Len(); start += int8Block {
		var m float32
		for _, x := range exact[start : start+int8Block] {
			m = max(m, abs32(x))
		}
		if m > 7*0x1p120 {
			continue
		}
		e := blockExponent(m, int4Top)
		step := math.Ldexp(1, e)
		var largest float64
		for j := start; j < start+int8Block; j++ {
			if d := math.Abs(float64(exact[j]) - float64(s.Val[j])); d > step/2 || (m > 0x1p-140 && d > float64(m)/7) {
				t.Fatalf("entry %d: %v rounded to %v, step %v, block's largest %v", j, exact[j], s.Val[j], step, m)
			}
			largest = max(largest, math.Abs(float64(s.Val[j]))/step)
		}
		if m != 0 && e > int8MinExp && (largest < 4 || largest > 7) {
			t.Fatalf("block %d: largest code %v", start/int8Block, largest)
		}
	}
}

func TestInt4ValuesRefuseEachMalformedBlockByName(t *testing.T) {
	s := Sparse{}
	for i := range 41 { // a block of 32 and one of 9, odd: its last byte is padded
		s.Append(uint32(10+i), float32(i)-20)
	}
	quantizeInt4(s, nil)
	frame := encodeSparseAs(nil, s, 0, ValuesInt4)
	values := len(frame) - int4ValueBytes(s.Len()) // the first block's scale
	second := values + 4 + int8Block/2             // the second block's scale
	edit := func(f func(b []byte)) []byte {
		b := append([]byte(nil), frame...)
		f(b)
		return b
	}
	scale := func(x float32) []byte {
		return edit(func(b []byte) { binary.LittleEndian.PutUint32(b[values:], math.Float32bits(x)) })
	}
	if got := math.Float32frombits(binary.LittleEndian.Uint32(frame[values:])); got != 4 {
		t.Fatalf("the first block's scale is %v, not the 2^2 its largest value of 20 takes", got)
	}
	for _, c := range []struct {
		name    string
		payload []byte
		want    error
	}{
		{"a NaN scale", scale(float32(math.NaN())), ErrSparseScale},
		{"an infinite scale", scale(float32(math.Inf(-1))), ErrSparseScale},
		{"a negative scale", scale(-4), ErrSparseScale},
		{"a scale not a power of two", scale(3), ErrSparseScale},
		{"a scale above 2^120", scale(0x1p122), ErrSparseScale},
		{"a subnormal scale below 2^-149's power", scale(math.Float32frombits(3)), ErrSparseScale},
		{"a largest code below 4", edit(func(b []byte) {
			for j := range int8Block / 2 {
				b[values+4+j] = 0x11
			}
		}), ErrSparseNotCanonical},
		{"a zero scale with codes", scale(0), ErrSparseNotCanonical},
		{"the code -8", edit(func(b []byte) { b[values+4] = b[values+4]&0xf0 | 0x8 }), ErrSparseNotCanonical},
		{"a padding nibble set", edit(func(b []byte) { b[len(b)-1] |= 0x10 }), ErrSparseNotCanonical},
		{"the second block's scale NaN", edit(func(b []byte) { binary.LittleEndian.PutUint32(b[second:], 0x7fc00000) }), ErrSparseScale},
		{"the values cut short", frame[:len(frame)-1], ErrSparseTruncated},
		{"a byte past the values", append(append([]byte(nil), frame...), 0), ErrSparseCountMismatch},
		{"a count one more", frame, ErrSparseCountMismatch},
	} {
		count := uint64(s.Len())
		if c.name == "a count one more" {
			count++
		}
		out, err := decodeSparseAs(Sparse{}, c.payload, count, 0, 100, ValuesInt4)
		if !errors.Is(err, c.want) || !errors.Is(err, transport.ErrBadFrame) || out.Len() != 0 {
			t.Errorf("%s: %v (%d entries), want %v", c.name, err, out.Len(), c.want)
		}
	}
	if _, err := decodeSparseAs(Sparse{}, frame, uint64(s.Len()), 0, 100, ValuesInt4); err != nil {
		t.Fatalf("the unbroken frame: %v", err)
	}
	// The frame check in the header refuses a payload of the wrong size
	// for its count before the decoder sees it.
	for _, size := range []int{len(frame) - int4ValueBytes(s.Len()) - 1, 5*s.Len() + 4 + int4ValueBytes(s.Len()) + 1} {
		if err := transport.CheckPayloadSize(transport.DtypeSparseI4, uint64(s.Len()), uint64(size)); !errors.Is(err, transport.ErrBadFrame) {
			t.Errorf("a payload of %d bytes for %d entries passes the header's check: %v", size, s.Len(), err)
		}
	}
}
