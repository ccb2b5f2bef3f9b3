package core

// 4-bit values (Config.Values = ValuesInt4): a value is half a byte, and
// each block of int8Block consecutive values of a frame shares a scale —
// 8-bit values' format (int8values.go) with codes of 4 bits instead of 8.
//
// Values that went through top-k and error feedback tolerate 4 bits for
// the same reason they tolerate 8: what the rounding takes off goes into a
// residual, exactly, and is sent at a later call. A coarser rounding only
// delays more of each value:
//
//  1. A frame's values come in blocks of 32 (the last one shorter). A
//     block's scale is the power of two 2^e with e the least in
//     [−149, 120] for which the block's largest magnitude m ≤ 7·2^e; each
//     value x travels as the code q = round(x / 2^e) in [−7, 7] and
//     arrives as q·2^e. On the wire a block is its scale as a
//     little-endian float32, then its codes, two to a byte, the even
//     entry's in the low nibble, as 4-bit two's complement; a short block
//     of odd length pads its last byte with a zero nibble.
//  2. Every step is exact as for 8 bits: 2^e ≥ m/7 is above the last bit
//     of every value of the block, so x − q·2^e (at most half a step) is a
//     float32, what the rounding took off, and a block rounded once encodes
//     again into the same codes: its largest code is 4 to 7 (or e is at a
//     bound), so its scale comes out the same.
//  3. The rounding happens where a frame is made, by the rules of 8-bit
//     values (int8values.go, step 3): a rank's own selection as it sends
//     it, its residual keeping acc − what left; an Ok-Topk owner's sums as
//     it moves them (balance), and each rank's share as it allgathers it,
//     the errors going into that rank's residual. Every rank sums what it
//     receives in float32.
//
// A frame of count 4-bit values takes ⌈count/2⌉ + 4·⌈count/32⌉ bytes: 0.625
// a value, and with its coded index (indexcode.go) 1.8 bytes a pair at
// density 1% for indices spread at random, 1.2–1.7 on the recorded
// gradients of results/wire.md, against 2.3 and 1.7–2.2 with 8-bit values
// and 8 with plain 32-bit pairs. A value moves by at most half its block's step, 1/14
// of the block's largest magnitude (8-bit values: 1/254): more of each
// value waits in the residual for a later call, so the error feedback, not
// the wire, bounds what 4 bits cost the training.
//
// The decoder refuses what the 8-bit decoder refuses (a scale that is not
// a power of two in range, ErrSparseScale; a largest code another scale
// would have been chosen for, ErrSparseNotCanonical) and the code −8 and a
// padding nibble that is not zero (ErrSparseNotCanonical), so a frame is
// the one encoding of what it decodes to.
//
// Cost: as 8-bit values, a pass to round and one to write the codes, each
// finding every block's largest magnitude, a nibble packed per value: with
// the indices about 10 ns an entry to round and encode and 5 to decode, as
// for 8-bit values, against 2.7 each way for float32 ones
// (BenchmarkSparseCodec, results/wire.md).

import (
	"encoding/binary"
	"fmt"
	"math"
)

// int4Top is the largest 4-bit code: codes are −7…7.
const int4Top = 7

// int4ValueBytes is the bytes of count 4-bit values: a scale per block and
// half a byte each, a block's odd last nibble padded.
func int4ValueBytes(count int) int {
	return (count+1)/2 + 4*((count+int8Block-1)/int8Block)
}

// quantizeInt4 rounds s's values in place to 4 bits, in the blocks of a
// frame made of s, and, unless errs is nil, appends to it x − the rounded
// value for each entry the rounding changed, ascending with s.
func quantizeInt4(s Sparse, errs *Sparse) { quantizeBlocks(s, errs, int4Top) }

// putInt4Values writes vals, which quantizeInt4 rounded in the same blocks,
// as 4-bit values into out (int4ValueBytes(len(vals)) bytes).
func putInt4Values(out []byte, vals []float32) {
	at := 0
	for start := 0; start < len(vals); start += int8Block {
		block := vals[start:min(start+int8Block, len(vals))]
		m := largestMagnitude(block)
		e := blockExponent(m, int4Top)
		binary.LittleEndian.PutUint32(out[at:], math.Float32bits(blockScale(m, e)))
		at += 4
		inv, saturates := pow2(-e), e == int8MaxExp
		j := 0
		for ; j+1 < len(block); j += 2 {
			lo := blockCode(block[j], inv, saturates, int4Top)
			hi := blockCode(block[j+1], inv, saturates, int4Top)
			out[at] = byte(lo)&0xf | byte(hi)<<4
			at++
		}
		if j < len(block) {
			out[at] = byte(blockCode(block[j], inv, saturates, int4Top)) & 0xf
			at++
		}
	}
}

// readInt4Values decodes the len(dst) 4-bit values that make up all of b
// into dst, refusing what readInt8Values refuses, the code −8, and a
// padding nibble that is not zero. What decodes is finite and encodes
// again into the same bytes.
func readInt4Values(dst []float32, b []byte) error {
	if err := checkValueBytes(len(b), int4ValueBytes(len(dst)), len(dst), 4); err != nil {
		return err
	}
	at := 0
	for start := 0; start < len(dst); start += int8Block {
		block := dst[start:min(start+int8Block, len(dst))]
		scale, e, err := readBlockScale(binary.LittleEndian.Uint32(b[at:]), start)
		if err != nil {
			return err
		}
		codes := b[at+4 : at+4+(len(block)+1)/2]
		at += 4 + len(codes)
		if len(block)%2 == 1 && codes[len(codes)-1]>>4 != 0 {
			return fmt.Errorf("%w: block of values %d… pads its last byte with a nibble of %d", ErrSparseNotCanonical, start, codes[len(codes)-1]>>4)
		}
		largest, minus8 := 0, false
		for j := 0; j < len(block); j += 2 {
			c := codes[j/2]
			lo, hi := int(int8(c<<4)>>4), int(int8(c)>>4) // the nibbles, sign-extended
			minus8 = minus8 || lo == -8 || hi == -8
			largest = max(largest, lo, -lo, hi, -hi)
			block[j] = float32(lo) * scale
			if j+1 < len(block) {
				block[j+1] = float32(hi) * scale
			}
		}
		if minus8 {
			return fmt.Errorf("%w: block of values %d… holds the code −8", ErrSparseNotCanonical, start)
		}
		if err := checkBlockCanonical(scale, e, largest, int4Top, start); err != nil {
			return err
		}
	}
	return nil
}
