package core

// Coded indices: how a sparse frame carries its indices in about the bits
// their gaps need instead of 32 each.
//
// A frame's indices are strictly increasing and relative to the start of
// their region, so what the receiver needs is the first index and the gaps
// between the others. At density d the gaps are about 1/d apart on
// average, and a gap carries about log₂(e/d) bits of information: 8 at
// 1%, 11 at 0.1%, where plain integers take 32. The index section, which
// opens a sparse frame of count > 0 entries (none for no entries), is:
//
//  1. count, a little-endian uint32: the frame says how many entries it
//     holds, so a header that says otherwise is caught before anything
//     else is read.
//  2. The first index, a little-endian uint32. It stands apart because it
//     alone can be large: Ok-Topk's balanced shares start anywhere in the
//     tensor.
//  3. The count−1 gaps less one, gᵢ = idx[i] − idx[i−1] − 1 ≥ 0, in blocks
//     of gapBlock (the last one shorter): a byte holding the block's width
//     b = bits.Len32(the block's largest gap), 0…32, then the block's gaps,
//     b bits each, packed least significant bit first into ⌈len·b/8⌉ bytes.
//     A block's width is that of its largest gap, never more, and its
//     padding bits are zero: a frame is the one encoding of its indices.
//
// Why blocks of one width: decoding is a shift and a mask per gap, with no
// branch on the data, and the encoder needs no table. A width per block
// follows the gradient's structure — top-k entries cluster in some layers
// and thin out in others — where one width per frame would pay for the
// frame's largest gap on every entry. The price against the entropy is the
// spread of the gaps inside a block: the largest of 32 geometric gaps is
// about H₃₂ ≈ 4.1 times their mean, 2 bits above it, so uniformly spread
// indices at 1% take 9.1 bits and the width byte 0.25 more: 9.3, where
// Elias-Fano takes about 2 + log₂(1/d) = 8.6 and a Golomb-Rice code about
// the entropy, 8.1, each at a branch on the data per entry. Measured at 1%
// (TestCodedIndicesSizeAtOnePercent), blocks of 16, 32, 64, 128 and 256
// gaps take 9.30, 9.34, 9.43, 9.62 and 9.89 bits an index, at about one
// speed: 32 it is. A pair with a float32 value is then 5.2 bytes instead of
// 8, with a 16-bit one 3.2 instead of 6.
//
// The decoder checks everything before it trusts it: a count that
// disagrees with the header's, or bytes left after the values
// (ErrSparseCountMismatch); a payload that ends inside the count, the first
// index, a block or the values (ErrSparseTruncated); a width above 32
// (ErrSparseGapWidth); an index at or past the region's end
// (ErrSparseIndexPastEnd); a width above the block's largest gap's, or
// padding bits set (ErrSparseNotCanonical). It never reads outside the
// payload and allocates only what the payload can hold.
//
// Cost: the encoder reads each index twice (the block's width, then its
// gaps), the decoder once. A frame of float32 values encodes in about 2.2
// ns an entry and decodes in about 2.2, where plain integers took 1.0 and
// 2.7 (BenchmarkSparseCodec, the fastest of alternating runs on a shared
// 2-core machine); an index at 32 bits takes 3.2 ns on a 10 Gbit/s link, at
// 9.3 bits 0.9.

import (
	"encoding/binary"
	"fmt"
	mathbits "math/bits"

	"github.com/oktopk/oktopk/transport"
)

// gapBlock is how many gaps share one width.
const gapBlock = 32

// The ways a coded sparse frame is refused; each is a transport.ErrBadFrame.
var (
	ErrSparseTruncated     = fmt.Errorf("%w: sparse frame ends before its entries do", transport.ErrBadFrame)
	ErrSparseCountMismatch = fmt.Errorf("%w: sparse frame's count disagrees with its entries", transport.ErrBadFrame)
	ErrSparseIndexPastEnd  = fmt.Errorf("%w: sparse index at or past its region's end", transport.ErrBadFrame)
	ErrSparseGapWidth      = fmt.Errorf("%w: sparse gap width above 32 bits", transport.ErrBadFrame)
	ErrSparseNotCanonical  = fmt.Errorf("%w: sparse gaps wider than their largest, or padding bits set", transport.ErrBadFrame)
)

// maxIndexBytes bounds the bytes of count coded indices: 8 for the count
// and the first, at most 4 per gap and a width byte per block, so at most
// 5 an entry and 4 more.
func maxIndexBytes(count int) int {
	if count == 0 {
		return 0
	}
	gaps := count - 1
	return 8 + 4*gaps + (gaps+gapBlock-1)/gapBlock
}

// codedIndexBits is the cost model's bits per coded index (auto.go, and
// SparCML's and TopkDSA's dense switches) for indices spread at random
// over a range at density d: the expected width of a block of gapBlock
// gaps, plus its width byte's share. A gap less one is geometric,
// P(g ≥ t) = (1−d)^t, so a block is at most b bits wide with probability
// (1 − (1−d)^(2^b))^gapBlock, and its expected width is the sum over b of
// the probabilities that it is wider. At 1% that is 9.35 bits, where frames
// of the scale inputs measure 9.3 to 9.6 (results/wire.md); at density 1,
// a quarter of a bit. Only products, each rounded on its own, so every
// rank computes the same bits (auto.go's mul); the frame's own 8 bytes are
// left out.
func codedIndexBits(d float64) float64 {
	d = min(1, max(0, d))
	q := 1 - d // (1−d)^(2^b), for b = 0, 1, …
	var width float64
	for b := 0; b < 32; b++ {
		narrower := 1 - q // P(one gap < 2^b)
		for range 5 {     // ^32 = ^gapBlock
			narrower = mul(narrower, narrower)
		}
		width += 1 - narrower
		q = mul(q, q)
	}
	return width + 8.0/gapBlock
}

// putIndices codes idx (strictly increasing, every index ≥ base) relative
// to base into out, which holds at least maxIndexBytes(len(idx)) bytes, and
// returns how many bytes it wrote.
func putIndices(out []byte, idx []uint32, base uint32) int {
	if len(idx) == 0 {
		return 0
	}
	binary.LittleEndian.PutUint32(out, uint32(len(idx)))
	binary.LittleEndian.PutUint32(out[4:], idx[0]-base)
	at := 8
	for start := 1; start < len(idx); start += gapBlock {
		block := idx[start-1 : min(start+gapBlock, len(idx))] // the index before the block, then its own
		var ored uint32                                       // every gap OR-ed: its bit length is the largest gap's
		for i := 1; i < len(block); i++ {
			ored |= block[i] - block[i-1] - 1
		}
		width := uint(mathbits.Len32(ored))
		out[at] = byte(width)
		at++
		var acc uint64 // bits not yet written, the oldest lowest
		var held uint
		for i := 1; i < len(block); i++ {
			acc |= uint64(block[i]-block[i-1]-1) << held
			held += width
			if held >= 32 {
				binary.LittleEndian.PutUint32(out[at:], uint32(acc))
				at += 4
				acc >>= 32
				held -= 32
			}
		}
		for ; held > 0; held -= min(held, 8) {
			out[at] = byte(acc)
			at++
			acc >>= 8
		}
	}
	return at
}

// checkCodedCount checks that coded indices at the start of b say they are
// count, as the frame's header does (none: b says nothing).
func checkCodedCount(b []byte, count uint64) error {
	switch {
	case count == 0:
		return nil
	case len(b) < 8:
		return fmt.Errorf("%w: %d bytes where the count and the first index take 8", ErrSparseTruncated, len(b))
	case uint64(binary.LittleEndian.Uint32(b)) != count:
		return fmt.Errorf("%w: %d entries, the header says %d", ErrSparseCountMismatch, binary.LittleEndian.Uint32(b), count)
	}
	return nil
}

// readIndices decodes the n coded indices at the start of b, adding base,
// into dst (its storage reused; it grows when it has no room for n), and
// returns them with the bytes they took. Every index must be below limit.
func readIndices(dst []uint32, b []byte, n int, base, limit uint32) ([]uint32, int, error) {
	if err := checkCodedCount(b, uint64(n)); err != nil || n == 0 {
		return dst[:0], 0, err
	}
	next := uint64(binary.LittleEndian.Uint32(b[4:])) + uint64(base) // the last index decoded
	if next >= uint64(limit) {
		return dst[:0], 0, fmt.Errorf("%w: first index %d, limit %d", ErrSparseIndexPastEnd, next, limit)
	}
	if cap(dst) < n {
		dst = make([]uint32, n)
	}
	dst = dst[:n]
	dst[0] = uint32(next)
	var padded [4*gapBlock + 8]byte // a block near b's end, with room to read 8 bytes at its last gap
	at := 8
	for start := 1; start < n; start += gapBlock {
		out := dst[start:min(start+gapBlock, n)]
		if at >= len(b) {
			return dst[:0], 0, fmt.Errorf("%w: no width byte for entries %d… (%d bytes)", ErrSparseTruncated, start, len(b))
		}
		width := uint(b[at])
		at++
		if width > 32 {
			return dst[:0], 0, fmt.Errorf("%w: block of entries %d… is %d bits wide", ErrSparseGapWidth, start, width)
		}
		bits := uint(len(out)) * width
		size := int(bits+7) / 8
		if size > len(b)-at {
			return dst[:0], 0, fmt.Errorf("%w: block of entries %d… needs %d bytes, %d left", ErrSparseTruncated, start, size, len(b)-at)
		}
		// Gap i is the width bits from bit i·width on: 8 bytes read at its
		// first byte hold it whole (7 + 32 bits at most).
		src, from := b, at
		if at+size+8 > len(b) {
			clear(padded[size : size+8])
			copy(padded[:], b[at:at+size])
			src, from = padded[:], 0
		}
		mask := uint64(1)<<width - 1
		var ored uint64
		for i := range out {
			bit := uint(i) * width
			gap := binary.LittleEndian.Uint64(src[from+int(bit/8):]) >> (bit % 8) & mask
			ored |= gap
			next += gap + 1
			out[i] = uint32(next)
		}
		if next >= uint64(limit) { // the indices grow: the block's last is its largest
			return dst[:0], 0, fmt.Errorf("%w: entries %d… reach %d, limit %d", ErrSparseIndexPastEnd, start, next, limit)
		}
		if uint(mathbits.Len64(ored)) != width || (bits%8 != 0 && b[at+size-1]>>(bits%8) != 0) {
			return dst[:0], 0, fmt.Errorf("%w: block of entries %d… is %d bits wide, its largest gap %d bits", ErrSparseNotCanonical, start, width, mathbits.Len64(ored))
		}
		at += size
	}
	return dst, at, nil
}
