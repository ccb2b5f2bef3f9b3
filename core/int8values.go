package core

// 8-bit values (Config.Values = ValuesInt8): a value is a byte, and each
// block of int8Block consecutive values of a frame shares a scale.
//
// Values that went through top-k and error feedback tolerate 8 bits: what
// the quantization takes off goes into a residual, exactly, so no gradient
// mass is lost — the 16-bit formats' argument (values.go), with a rounding
// that depends on a value's neighbours instead of the value alone:
//
//  1. A frame's values come in blocks of int8Block (the last one shorter).
//     A block's scale is the power of two 2^e with e the least in
//     [−149, 120] for which the block's largest magnitude m ≤ 127·2^e; each
//     value x travels as the code q = round(x / 2^e) in [−127, 127] and
//     arrives as q·2^e. On the wire a block is its scale as a little-endian
//     float32, then its codes.
//  2. Power-of-two scales make every step exact: x / 2^e and q·2^e only
//     move the exponent, and x − q·2^e (at most half a step, and a multiple
//     of x's last bit, since 2^e ≥ m/127 is above it) is a float32. So the
//     error kept for the residual is exactly what the rounding took off, and
//     a block quantized once encodes again into the same codes: its largest
//     code is 64 to 127 (or e is at a bound), so its scale comes out the
//     same. The price is half a bit against a scale of m/127.
//  3. The rounding happens where a frame is made, with that frame's blocks
//     (quantizeInt8), and the entries keep the values that left:
//       - a rank's own selected entries, as it sends them to their owners
//         (Ok-Topk's split) or to everyone (TopkA's and Gaussiank's
//         allgather): its residual keeps acc − what it sent, as for the
//         16-bit formats; an owner's entries of its own region never leave
//         it and stay float32;
//       - an Ok-Topk owner's kept sums, as it moves them to the rank whose
//         share holds them (balance), the error going into the owner's
//         residual; and each rank's balanced share as it allgathers it, the
//         error going into that rank's residual. Every rank, this one too,
//         uses the share as it decodes it, so the results stay bitwise
//         identical on every rank.
//
// A frame of count 8-bit values takes count + 4·⌈count/int8Block⌉ bytes:
// 1.125 bytes a value, and with its coded index (indexcode.go) 2.3 bytes a
// pair at density 1%, against 8 for plain 32-bit pairs. The decoder refuses
// a scale that is not a power of two in range (NaN, infinite, negative, or
// above 2^120, where 127 codes would overflow) as ErrSparseScale, and codes
// the encoder would not have made as ErrSparseNotCanonical.
//
// Cost: a pass over a frame's values to round them and one to write their
// codes, each block's largest magnitude found in both; with the indices,
// about 11–16 ns an entry to round and encode and 6–9 to decode, against
// 2–5 and 5–6 for float32 values (BenchmarkSparseCodec, alternating runs on
// a loaded 2-core machine), for 2.3 bytes an entry instead of 5.2.

import (
	"encoding/binary"
	"fmt"
	"math"
	mathbits "math/bits"

	"github.com/oktopk/oktopk/transport"
)

// int8Block is how many values share one scale.
const int8Block = 32

// The least and the largest scale exponents: 2^−149 is float32's smallest
// subnormal, and 127·2^120 < 2^127 keeps every value a code can stand for
// finite.
const (
	int8MinExp = -149
	int8MaxExp = 120
)

// ErrSparseScale is a frame's 8-bit or 4-bit values refused for their
// scale.
var ErrSparseScale = fmt.Errorf("%w: sparse 8-bit or 4-bit values with a scale that is not 0 or a power of two from 2^-149 to 2^120", transport.ErrBadFrame)

// int8ValueBytes is the bytes of count 8-bit values: a scale per block and a
// byte each.
func int8ValueBytes(count int) int { return count + 4*((count+int8Block-1)/int8Block) }

// int8Top is the largest 8-bit code: codes are −127…127, a block's scale
// is chosen so that its largest magnitude is at most 127 of them.
const int8Top = 127

// int8Exponent is the scale exponent of a block of 8-bit values whose
// largest magnitude is m (blockExponent).
func int8Exponent(m float32) int { return blockExponent(m, int8Top) }

// blockExponent is the scale exponent of a block whose largest magnitude
// is m, for codes up to top (2^b − 1: 127 for 8-bit values, 7 for 4-bit
// ones, int4values.go): the least e in [int8MinExp, int8MaxExp] with
// m ≤ top·2^e, or the largest when none is (m above top·2^120, or
// infinite: the codes saturate at ±top).
func blockExponent(m float32, top int) int {
	if m == 0 || math.IsInf(float64(m), 0) || float64(m) > float64(top)*0x1p120 {
		if m == 0 {
			return int8MinExp
		}
		return int8MaxExp
	}
	_, e := math.Frexp(float64(m)) // m = f·2^e, f in [0.5, 1): m/2^(e−b) in [2^(b−1), 2^b)
	e -= mathbits.Len(uint(top))
	if float64(m)*pow2(-e) > float64(top) {
		e++
	}
	return max(e, int8MinExp)
}

// pow2 is 2^e as a float64, exactly, for e in [−1022, 1023].
func pow2(e int) float64 { return math.Float64frombits(uint64(1023+e) << 52) }

// blockCode is x's code at the scale whose inverse is inv (2^−e): x·2^−e
// rounded half away from zero, saturated at ±top where the block's scale
// saturates (e = int8MaxExp; elsewhere |x·2^−e| ≤ top by the choice of
// e). x·2^−e is exact in float64, and so is adding a half to it (it has
// at most 24 significant bits and is at most 2^7). No branch on the
// value: signs come in no order.
func blockCode(x float32, inv float64, saturates bool, top float64) int8 {
	t := float64(x) * inv
	if saturates {
		t = max(-top, min(top, t))
	}
	return int8(t + math.Copysign(0.5, t))
}

// largestMagnitude is the largest |x| of block: for magnitudes, the order
// of their bits is the order of their values.
func largestMagnitude(block []float32) float32 {
	var m uint32
	for _, x := range block {
		m = max(m, math.Float32bits(x)&^(1<<31))
	}
	return math.Float32frombits(m)
}

// quantizeInt8 rounds s's values in place to 8 bits, in the blocks of a
// frame made of s (a block is int8Block consecutive entries from s's first),
// and, unless errs is nil, appends to it x − the rounded value for each
// entry the rounding changed, ascending with s.
func quantizeInt8(s Sparse, errs *Sparse) { quantizeBlocks(s, errs, int8Top) }

// quantizeBlocks is quantizeInt8 for codes up to top (4-bit values too:
// their blocks are as long).
func quantizeBlocks(s Sparse, errs *Sparse, top int) {
	for start := 0; start < s.Len(); start += int8Block {
		block := s.Val[start:min(start+int8Block, s.Len())]
		e := blockExponent(largestMagnitude(block), top)
		inv, scale, saturates := pow2(-e), pow2(e), e == int8MaxExp
		for j, x := range block {
			q := float32(float64(blockCode(x, inv, saturates, float64(top))) * scale)
			block[j] = q
			if d := x - q; d != 0 && errs != nil {
				errs.Append(s.Idx[start+j], d)
			}
		}
	}
}

// blockScale is the scale of a block as it goes on the wire, for its
// largest magnitude m and exponent e: 2^e, or +0 for a block of zeros.
func blockScale(m float32, e int) float32 {
	if m == 0 {
		return 0
	}
	return float32(pow2(e))
}

// readBlockScale checks a block's scale bits as they came off the wire:
// +0, or a power of two 2^e with e in [int8MinExp, int8MaxExp] (NaN,
// infinite, negative, subnormal-looking or off-power scales are refused,
// ErrSparseScale). It returns the scale and e (int8MinExp for +0).
func readBlockScale(bits uint32, start int) (float32, int, error) {
	scale := math.Float32frombits(bits)
	if bits == 0 {
		return 0, int8MinExp, nil
	}
	f, exp := math.Frexp(float64(scale)) // NaN and ±Inf come back as they are
	e := exp - 1
	if f != 0.5 || e < int8MinExp || e > int8MaxExp {
		return 0, 0, fmt.Errorf("%w: block of values %d… has scale %v", ErrSparseScale, start, scale)
	}
	return scale, e, nil
}

// checkBlockCanonical refuses a block whose scale the encoder would not
// have chosen for the codes it holds, their largest magnitude being
// largest: a zero scale with codes, codes with a zero scale, or a largest
// code that another scale would have been chosen for.
func checkBlockCanonical(scale float32, e, largest, top, start int) error {
	if (scale == 0) != (largest == 0) || (largest > 0 && blockExponent(float32(largest)*scale, top) != e) {
		return fmt.Errorf("%w: block of values %d… has scale %v for a largest code of %d", ErrSparseNotCanonical, start, scale, largest)
	}
	return nil
}

// putInt8Values writes vals, which quantizeInt8 rounded in the same blocks,
// as 8-bit values into out (int8ValueBytes(len(vals)) bytes).
func putInt8Values(out []byte, vals []float32) {
	at := 0
	for start := 0; start < len(vals); start += int8Block {
		block := vals[start:min(start+int8Block, len(vals))]
		m := largestMagnitude(block)
		e := int8Exponent(m)
		binary.LittleEndian.PutUint32(out[at:], math.Float32bits(blockScale(m, e)))
		at += 4
		codes := out[at : at+len(block)]
		inv, saturates := pow2(-e), e == int8MaxExp
		for j, x := range block {
			codes[j] = byte(blockCode(x, inv, saturates, int8Top))
		}
		at += len(block)
	}
}

// checkValueBytes refuses a frame's value section of have bytes unless it
// is exactly the need bytes that n values of the given bits take: short is
// a truncated frame, long a count that disagrees with the indices'.
func checkValueBytes(have, need, n, bits int) error {
	switch {
	case have < need:
		return fmt.Errorf("%w: %d bytes for %d %d-bit values, which take %d", ErrSparseTruncated, have, n, bits, need)
	case have > need:
		return fmt.Errorf("%w: %d bytes left after %d %d-bit values", ErrSparseCountMismatch, have-need, n, bits)
	}
	return nil
}

// readInt8Values decodes the len(dst) 8-bit values that make up all of b
// into dst. A block is refused for a scale that is not +0 or a power of two
// from 2^−149 to 2^120 (ErrSparseScale), and for codes the encoder would not
// have made of the values they stand for (ErrSparseNotCanonical): −128,
// anything but zeros at scale 0, or a largest code that another scale
// would have been chosen for. What decodes is finite and encodes again
// into the same bytes.
func readInt8Values(dst []float32, b []byte) error {
	if err := checkValueBytes(len(b), int8ValueBytes(len(dst)), len(dst), 8); err != nil {
		return err
	}
	at := 0
	for start := 0; start < len(dst); start += int8Block {
		block := dst[start:min(start+int8Block, len(dst))]
		scale, e, err := readBlockScale(binary.LittleEndian.Uint32(b[at:]), start)
		if err != nil {
			return err
		}
		codes := b[at+4 : at+4+len(block)]
		at += 4 + len(block)
		largest := 0
		for j, c := range codes {
			q := int(int8(c))
			if q == -128 {
				return fmt.Errorf("%w: block of values %d… holds the code −128", ErrSparseNotCanonical, start)
			}
			largest = max(largest, q, -q)
			block[j] = float32(q) * scale
		}
		if err := checkBlockCanonical(scale, e, largest, int8Top, start); err != nil {
			return err
		}
	}
	return nil
}
