package core

// Tests of the half-precision conversions: every float16 and bfloat16 value
// round-trips exactly, and narrowing rounds to nearest, ties to even.

import (
	"math"
	"sort"
	"testing"
)

// Every half value widens to a float32 that narrows back to the same bits
// (NaNs stay NaN with the same sign).
func TestFloat16RoundTripIsExactForEveryValue(t *testing.T) {
	for h := 0; h < 1<<16; h++ {
		f := float16ToFloat32(uint16(h))
		back := float32ToFloat16(f)
		if isNaN16(uint16(h)) {
			if !isNaN16(back) || back&0x8000 != uint16(h)&0x8000 || !math.IsNaN(float64(f)) {
				t.Fatalf("NaN %#04x -> %v -> %#04x", h, f, back)
			}
			continue
		}
		if back != uint16(h) {
			t.Fatalf("%#04x -> %v -> %#04x", h, f, back)
		}
	}
}

func TestBFloat16RoundTripIsExactForEveryValue(t *testing.T) {
	src := make([]uint16, 1<<16)
	for i := range src {
		src[i] = uint16(i)
	}
	wide := make([]float32, len(src))
	BFloat16ToFloat32(wide, src)
	back := make([]uint16, len(src))
	Float32ToBFloat16(back, wide)
	for i, h := range src {
		if math.IsNaN(float64(wide[i])) {
			if b := math.Float32frombits(uint32(back[i]) << 16); !math.IsNaN(float64(b)) {
				t.Fatalf("NaN %#04x came back as %#04x", h, back[i])
			}
			continue
		}
		if back[i] != h {
			t.Fatalf("%#04x -> %v -> %#04x", h, wide[i], back[i])
		}
	}
}

// Narrowing picks the nearest representable value, ties to the even
// mantissa, overflow to Inf: checked against a float64 search over every
// finite half for about a million float32 bit patterns spread over the range.
func TestFloat32ToFloat16RoundsToNearestEven(t *testing.T) {
	// Finite non-negative halves in increasing order, with +Inf standing in
	// for the next value after the largest (65536), as IEEE rounding does.
	type cand struct {
		v    float64
		bits uint16
	}
	var cands []cand
	for h := uint16(0); h < 0x7c00; h++ {
		cands = append(cands, cand{float64(float16ToFloat32(h)), h})
	}
	cands = append(cands, cand{65536, 0x7c00})
	want := func(f float32) uint16 {
		a := math.Abs(float64(f))
		sign := uint16(0)
		if math.Signbit(float64(f)) {
			sign = 0x8000
		}
		if a >= 65536 {
			return sign | 0x7c00
		}
		i := sort.Search(len(cands), func(i int) bool { return cands[i].v >= a })
		if cands[i].v == a {
			return sign | cands[i].bits
		}
		lo, hi := cands[i-1], cands[i]
		switch dl, dh := a-lo.v, hi.v-a; {
		case dl < dh:
			return sign | lo.bits
		case dh < dl:
			return sign | hi.bits
		case lo.bits&1 == 0:
			return sign | lo.bits
		default:
			return sign | hi.bits
		}
	}
	for b := uint64(0); b < 1<<32; b += 4093 {
		f := math.Float32frombits(uint32(b))
		if math.IsNaN(float64(f)) || math.IsInf(float64(f), 0) {
			continue
		}
		if got, w := float32ToFloat16(f), want(f); got != w {
			t.Fatalf("%v (%#08x): got %#04x want %#04x", f, b, got, w)
		}
	}
	// Exact ties around 1.0: 1 + 2^-11 lies halfway between 1 and 1+2^-10.
	if got := float32ToFloat16(1 + 1.0/2048); got != 0x3c00 {
		t.Fatalf("tie to even below: %#04x", got)
	}
	if got := float32ToFloat16(1 + 3.0/2048); got != 0x3c02 {
		t.Fatalf("tie to even above: %#04x", got)
	}
	if got := float32ToFloat16(65520); got != 0x7c00 {
		t.Fatalf("65520 must overflow to Inf, got %#04x", got)
	}
}

func TestFloat32ToBFloat16RoundsToNearestEven(t *testing.T) {
	for b := uint64(0); b < 1<<32; b += 4093 {
		f := math.Float32frombits(uint32(b))
		if math.IsNaN(float64(f)) {
			if g := math.Float32frombits(uint32(float32ToBFloat16(f)) << 16); !math.IsNaN(float64(g)) {
				t.Fatalf("NaN %#08x narrowed to non-NaN", b)
			}
			continue
		}
		lo := uint32(b) &^ 0xffff
		hi := lo + 0x10000
		rem := uint32(b) & 0xffff
		w := lo
		if rem > 0x8000 || (rem == 0x8000 && (lo>>16)&1 == 1) {
			w = hi
		}
		if got := float32ToBFloat16(f); uint32(got) != w>>16 {
			t.Fatalf("%v (%#08x): got %#04x want %#04x", f, b, got, w>>16)
		}
	}
}

func isNaN16(h uint16) bool { return h&0x7c00 == 0x7c00 && h&0x3ff != 0 }
