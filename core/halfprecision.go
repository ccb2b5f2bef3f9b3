package core

// Conversions between float32 and the half-precision formats (IEEE
// float16 and bfloat16): exact widening, and narrowing with round to
// nearest, ties to even.

import "math"

// Half-precision gradients (IEEE float16 and bfloat16) are reduced in float32:
// the caller's buffer is widened into a float32 scratch, reduced, and narrowed
// back with round-to-nearest-even, the rounding every framework uses, so a
// value that was exact in half precision before the reduction comes back
// bitwise unchanged. Widening is exact for both formats.

// Float16ToFloat32 widens IEEE binary16 values (raw bits) into dst.
func Float16ToFloat32(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = float16ToFloat32(h)
	}
}

// Float32ToFloat16 narrows src into IEEE binary16 bits with round to nearest,
// ties to even; overflow gives ±Inf and NaN stays NaN.
func Float32ToFloat16(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		dst[i] = float32ToFloat16(f)
	}
}

// BFloat16ToFloat32 widens bfloat16 values (the top 16 bits of a float32).
func BFloat16ToFloat32(dst []float32, src []uint16) {
	dst = dst[:len(src)]
	for i, h := range src {
		dst[i] = math.Float32frombits(uint32(h) << 16)
	}
}

// Float32ToBFloat16 narrows src into bfloat16 bits with round to nearest,
// ties to even; NaN stays NaN (a carry must not turn it into Inf).
func Float32ToBFloat16(dst []uint16, src []float32) {
	dst = dst[:len(src)]
	for i, f := range src {
		dst[i] = float32ToBFloat16(f)
	}
}

func float16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f: // Inf or NaN: keep the payload
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0: // normal
		return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	}
	// Subnormal half: mant·2^-24 is a normal float32; shift the leading
	// one into the implicit bit.
	e := uint32(127 - 15 + 1)
	for mant&0x400 == 0 {
		mant <<= 1
		e--
	}
	return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
}

func float32ToFloat16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff
	if exp == 0xff {
		if mant != 0 {
			return sign | 0x7e00 | uint16(mant>>13) // quiet NaN, top payload bits kept
		}
		return sign | 0x7c00
	}
	e := exp - 127 + 15 // biased half exponent
	if e >= 0x1f {
		return sign | 0x7c00
	}
	if e <= 0 {
		// The result is a half subnormal (or zero): its unit is 2^-24, and
		// the float32 value is (mant | implicit one) >> (14 - e) such units.
		if e < -10 {
			return sign // below half the smallest subnormal
		}
		mant |= 0x800000
		shift := uint32(14 - e)
		h := mant >> shift
		rem := mant & (1<<shift - 1)
		halfway := uint32(1) << (shift - 1)
		if rem > halfway || (rem == halfway && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	}
	h := uint32(e)<<10 | mant>>13
	rem := mant & 0x1fff
	// A carry out of the mantissa correctly bumps the exponent, up to Inf.
	if rem > 0x1000 || (rem == 0x1000 && h&1 == 1) {
		h++
	}
	return sign | uint16(h)
}

func float32ToBFloat16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 {
		return uint16(b>>16) | 0x40 // quiet NaN
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}
