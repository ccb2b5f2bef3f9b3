package core

// Sparse, the index-value vector the sparse algorithms exchange, its wire
// codec (EncodeSparse, and DecodeSparse, which validates before it
// allocates), and the dense float32 payload codecs.

import (
	"encoding/binary"
	"fmt"
	"math"
	"sort"
	"unsafe"

	"github.com/oktopk/oktopk/transport"
)

// Sparse is a sparse vector: Idx strictly increasing, Val[i] the value at
// Idx[i]. Indices are integers on the wire too (never packed into floats,
// which are exact only below 2^24).
type Sparse struct {
	Idx []uint32
	Val []float32
}

func (s Sparse) Len() int { return len(s.Idx) }

// Reset empties s keeping its storage.
func (s *Sparse) Reset() { s.Idx, s.Val = s.Idx[:0], s.Val[:0] }

// Append adds one entry; i must be larger than every index already in s.
func (s *Sparse) Append(i uint32, v float32) {
	s.Idx = append(s.Idx, i)
	s.Val = append(s.Val, v)
}

// EncodeSparse lays s out as raw little-endian bytes: len(s) uint32 indices,
// then len(s) float32 values, each index shifted down by base (region-relative).
func EncodeSparse(dst []byte, s Sparse, base uint32) []byte {
	n := s.Len()
	need := 8 * n
	if cap(dst) < need {
		dst = make([]byte, need)
	}
	dst = dst[:need]
	for i, ix := range s.Idx {
		binary.LittleEndian.PutUint32(dst[4*i:], ix-base)
	}
	copy(dst[4*n:], float32Bytes(s.Val))
	return dst
}

// DecodeSparse parses a payload made by EncodeSparse with count entries,
// adding base back to every index. It validates before it allocates: the
// payload length must match count, every index must be below limit and
// indices must strictly increase. dst's storage is reused.
func DecodeSparse(dst Sparse, payload []byte, count uint64, base, limit uint32) (Sparse, error) {
	if count > uint64(len(payload))/8 || uint64(len(payload)) != 8*count {
		return dst, fmt.Errorf("%w: sparse payload of %d bytes for %d entries", transport.ErrBadFrame, len(payload), count)
	}
	n := int(count)
	dst, err := decodeIndices(dst, payload, n, base, limit)
	if err != nil {
		return dst, err
	}
	dst.Val = append(dst.Val, bytesFloat32(payload[4*n:])...)
	return dst, nil
}

// decodeIndices resets dst (keeping its storage, with room for n values)
// and reads the n region-relative uint32 indices that open payload, adding
// base; every index must be below limit and above the one before.
func decodeIndices(dst Sparse, payload []byte, n int, base, limit uint32) (Sparse, error) {
	dst.Reset()
	if cap(dst.Idx) < n {
		dst.Idx = make([]uint32, 0, n)
		dst.Val = make([]float32, 0, n)
	}
	prev := int64(-1)
	for i := 0; i < n; i++ {
		rel := binary.LittleEndian.Uint32(payload[4*i:])
		ix := uint64(rel) + uint64(base)
		if ix >= uint64(limit) || int64(ix) <= prev {
			return dst, fmt.Errorf("%w: sparse index %d (entry %d) out of order or not below %d", transport.ErrBadFrame, ix, i, limit)
		}
		prev = int64(ix)
		dst.Idx = append(dst.Idx, uint32(ix))
	}
	return dst, nil
}

// float32Bytes views a float32 slice as its little-endian bytes (oktopk runs
// on little-endian hosts only; see the init check below).
func float32Bytes(v []float32) []byte {
	if len(v) == 0 {
		return nil
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), 4*len(v))
}

// bytesFloat32 copies little-endian bytes into a new float32 slice view.
// The payload may not be 4-byte aligned, so it is copied, not reinterpreted.
func bytesFloat32(b []byte) []float32 {
	out := make([]float32, len(b)/4)
	copy(float32Bytes(out), b)
	return out
}

// Float32Bytes and BytesToFloat32 are the dense payload codecs.
func Float32Bytes(v []float32) []byte { return float32Bytes(v) }

// CopyBytesToFloat32 fills dst from a little-endian payload; the lengths must
// agree exactly.
func CopyBytesToFloat32(dst []float32, b []byte) error {
	if len(b) != 4*len(dst) {
		return fmt.Errorf("%w: dense payload of %d bytes for %d floats", transport.ErrBadFrame, len(b), len(dst))
	}
	copy(float32Bytes(dst), b)
	return nil
}

func init() {
	x := uint16(1)
	if *(*byte)(unsafe.Pointer(&x)) != 1 {
		panic("oktopk: big-endian hosts are not supported")
	}
}

// IsFinite reports whether v is neither NaN nor ±Inf.
func IsFinite(v float32) bool {
	return !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0)
}

// regionOf returns the slice of s (ascending) inside [lo, hi), sharing its
// storage.
func regionOf(s Sparse, lo, hi uint32) Sparse {
	a := sort.Search(len(s.Idx), func(i int) bool { return s.Idx[i] >= lo })
	b := a + sort.Search(len(s.Idx)-a, func(i int) bool { return s.Idx[a+i] >= hi })
	return Sparse{Idx: s.Idx[a:b], Val: s.Val[a:b]}
}
