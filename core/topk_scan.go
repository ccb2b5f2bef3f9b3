package core

// The block scan under SelectAbove: it finds the blocks of x that hold an
// entry above a threshold without a data-dependent branch (see blockScan),
// and stores the entries of those blocks that are above it.

import (
	"math/bits"
	"unsafe"
)

const (
	// scanBlock is how many entries a blockScan tests at once: 8 words of
	// two floats.
	scanBlock = 16
	// tileBlocks is how many blocks one nextTile call tests: 4096 entries,
	// 16 KiB, so the hits' second look finds them in the L1 cache.
	tileBlocks = 256
)

// blockScan finds the blocks x[lo:lo+scanBlock] that hold a key ≥ cmpKey
// (cmpKey ≤ infKey), a tile at a time, in increasing order. The blocks run
// from x[from], the first 8-byte-aligned entry, to x[end]; x[:from] and
// x[end:] (under one block) are left to the caller.
//
// Why it is fast: keys above a threshold are rare (about k of n), and a
// branch per entry, or per block, mispredicts at every hit and throws away
// the loads in flight. So the scan has no data-dependent branch: it tests
// two keys per 64-bit word (SWAR) and writes every block's index to the
// tile's list, advancing the list's end only past blocks with a hit. With
// both keys' sign bits set, a word minus cmpKey in both halves borrows
// nothing across the halves, since each half stays ≥ 2^31 > cmpKey; a half
// keeps its top bit exactly when its key ≥ cmpKey. Which half is which
// entry does not matter, only whether any is, so the test is the same on
// either byte order.
type blockScan struct {
	words     []uint64
	cmp       uint64 // cmpKey in both halves
	j         int    // next word to test
	from, end int
}

func newBlockScan(x []float32, cmpKey uint32) blockScan {
	s := blockScan{cmp: uint64(cmpKey) | uint64(cmpKey)<<32}
	if len(x) > 0 && uintptr(unsafe.Pointer(&x[0]))%8 != 0 {
		s.from = 1
	}
	blocks := max(0, len(x)-s.from) / scanBlock
	s.end = s.from + blocks*scanBlock
	if blocks > 0 {
		s.words = unsafe.Slice((*uint64)(unsafe.Pointer(&x[s.from])), blocks*scanBlock/2)
	}
	return s
}

// nextTile tests the next tile of blocks and returns the starts (indices
// into x) of those with a hit, in found's storage; nil when no tile is left.
func (s *blockScan) nextTile(found *[tileBlocks]int) []int {
	const signs = 0x80000000_80000000
	if s.j >= len(s.words) {
		return nil
	}
	words := s.words[s.j:min(len(s.words), s.j+tileBlocks*scanBlock/2)]
	y, at, m := s.cmp, s.from+2*s.j, 0
	for j := 0; j+8 <= len(words); j += 8 {
		w := words[j : j+8 : j+8]
		hit := ((w[0] | signs) - y) | ((w[1] | signs) - y) | ((w[2] | signs) - y) | ((w[3] | signs) - y) |
			((w[4] | signs) - y) | ((w[5] | signs) - y) | ((w[6] | signs) - y) | ((w[7] | signs) - y)
		found[m&(tileBlocks-1)] = at + 2*j
		m += int((hit>>31 | hit>>63) & 1)
	}
	s.j += len(words)
	return found[:m]
}

// storeHits writes, from position n of idx and val (which have room for
// scanBlock more), the entries of one block of scanBlock that appendSome
// would append; the block holds at least one key ≥ min(minKey, infKey). It
// forms a bit mask of those entries without branching, two keys per word as
// the block scan does, then visits only its set bits, so a block with one
// hit costs about one branch, not one per entry.
func storeHits(idx []uint32, val []float32, n int, x []float32, base int, minKey uint32, nonFinite int) (int, int) {
	x = x[:scanBlock]
	cmp := uint64(min(minKey, infKey))
	y := cmp | cmp<<32
	w := (*[scanBlock / 2]uint64)(unsafe.Pointer(&x[0])) // x[0] is 8-byte aligned
	// Unrolled: as a loop the compiler keeps it one word at a time.
	hits := pairAtLeast(w[0], y) | pairAtLeast(w[1], y)<<2 | pairAtLeast(w[2], y)<<4 | pairAtLeast(w[3], y)<<6 |
		pairAtLeast(w[4], y)<<8 | pairAtLeast(w[5], y)<<10 | pairAtLeast(w[6], y)<<12 | pairAtLeast(w[7], y)<<14
	for ; hits != 0; hits &= hits - 1 {
		e := bits.TrailingZeros32(hits)
		v := x[e]
		if u := key(v); u >= infKey {
			nonFinite++
			if u != infKey || u < minKey {
				continue // NaN, or ±Inf not above th
			}
		}
		idx[n], val[n] = uint32(base+e), v
		n++
	}
	return n, nonFinite
}

// pairAtLeast tests the two keys of a word w, the entries x[e] and x[e+1],
// against y (the same cmpKey in both halves, as in blockScan): bit 0 of the
// result is set when x[e]'s key ≥ cmpKey, bit 1 when x[e+1]'s is. Which half
// of the word holds x[e] depends on the byte order (byteorder_*.go).
func pairAtLeast(w, y uint64) uint32 {
	d := (w | 0x80000000_80000000) - y
	return uint32(d>>firstEntryTopBit&1 | d>>secondEntryTopBit&1<<1)
}

//go:noinline
func appendSome(dst Sparse, x []float32, base int, minKey uint32, nonFinite int) (Sparse, int) {
	cmpKey := min(minKey, infKey)
	for i, v := range x {
		if u := key(v); u >= cmpKey {
			if u >= infKey {
				nonFinite++
				if u != infKey || u < minKey {
					continue // NaN, or ±Inf not above th
				}
			}
			dst.Idx = append(dst.Idx, uint32(base+i))
			dst.Val = append(dst.Val, v)
		}
	}
	return dst, nonFinite
}
