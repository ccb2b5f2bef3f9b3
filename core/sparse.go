package core

// Sparse, the index-value vector the sparse algorithms exchange, its wire
// codec (EncodeSparse, and DecodeSparse, which validates before it
// allocates; the indices are coded as in indexcode.go), and the dense
// float32 payload codecs.

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

// A sparse frame of count entries with values of type v is the count
// indices coded as gaps (indexcode.go), then the count values, v.width()
// bytes each (little-endian float32, or the 16-bit formats' bits), or
// 8-bit or 4-bit values in blocks with their scales (int8values.go,
// int4values.go).

// EncodeSparse lays s out as a sparse frame with float32 values, its
// indices coded relative to base (region-relative).
func EncodeSparse(dst []byte, s Sparse, base uint32) []byte {
	return encodeSparseAs(dst, s, base, ValuesFloat32)
}

// DecodeSparse parses a frame made by EncodeSparse with count entries,
// adding base back to every index. It validates before it allocates: the
// frame must say it holds count entries and have room for their values;
// its coded indices must then be exactly count, each below limit, and the
// values fill the rest (indexcode.go names every refusal). dst's storage is
// reused.
func DecodeSparse(dst Sparse, payload []byte, count uint64, base, limit uint32) (Sparse, error) {
	return decodeSparseAs(dst, payload, count, base, limit, ValuesFloat32)
}

// sparseSlot is where the frame of entries [from, to) of a vector goes in
// a buffer shared by the frames of its consecutive parts, part being the
// frame's number among them: [e·from + 8·part, e·to + 8·(part+1)) with e
// the most an entry takes (its value, 5 bytes of coded index, and for
// 8-bit and 4-bit values a byte for its share of a scale; a 4-bit value
// counts a whole byte), the 8 the frame's own.
// The slots of parts in order never overlap, so the parts are encoded at
// once; a buffer of sparseSlotsBytes holds them all.
func sparseSlot(buf []byte, v ValueType, from, to, part int) []byte {
	e := maxEntryBytes(v)
	return buf[e*from+8*part : e*to+8*(part+1) : e*to+8*(part+1)]
}

// sparseSlotsBytes is the buffer that sparseSlot's slots of entries entries
// in parts parts take.
func sparseSlotsBytes(v ValueType, entries, parts int) int { return maxEntryBytes(v)*entries + 8*parts }

func maxEntryBytes(v ValueType) int {
	if v.scaled() {
		return v.width() + 6
	}
	return v.width() + 5
}

// encodeSparseAs is EncodeSparse with values of type v, which s's values
// must already hold exactly (they are converted, not rounded again; 8-bit
// scaled values as quantize left them). dst's storage is used when it has room
// for the frame's bound.
func encodeSparseAs(dst []byte, s Sparse, base uint32, v ValueType) []byte {
	n := s.Len()
	need := maxIndexBytes(n) + v.valueBytes(n)
	if cap(dst) < need {
		dst = make([]byte, need)
	}
	dst = dst[:need]
	at := putIndices(dst, s.Idx, base)
	switch v {
	case ValuesFloat32:
		copy(dst[at:], float32Bytes(s.Val))
	case ValuesInt8:
		putInt8Values(dst[at:], s.Val)
	case ValuesInt4:
		putInt4Values(dst[at:], s.Val)
	default:
		narrow := halves[v].narrow
		for i, x := range s.Val {
			binary.LittleEndian.PutUint16(dst[at+2*i:], narrow(x))
		}
	}
	return dst[:at+v.valueBytes(n)]
}

// decodeSparseAs is DecodeSparse for a frame made by encodeSparseAs with
// values of type v; the values come back widened to float32, exactly. On
// an error dst comes back empty, its storage kept.
func decodeSparseAs(dst Sparse, payload []byte, count uint64, base, limit uint32, v ValueType) (Sparse, error) {
	dst.Reset()
	if err := checkCodedCount(payload, count); err != nil {
		return dst, err
	}
	most := uint64(len(payload) / v.width()) // the values the payload could hold, a 4-bit one in half a byte
	if v == ValuesInt4 {
		most = 2 * uint64(len(payload))
	}
	if count > most {
		return dst, fmt.Errorf("%w: %d bytes cannot hold %d %v values", ErrSparseTruncated, len(payload), count, v)
	}
	n := int(count)
	if cap(dst.Idx) < n {
		dst.Idx = make([]uint32, 0, n)
	}
	if cap(dst.Val) < n {
		dst.Val = make([]float32, 0, n)
	}
	idx, at, err := readIndices(dst.Idx, payload, n, base, limit)
	if err != nil {
		dst.Idx = idx[:0]
		return dst, err
	}
	switch values := payload[at:]; {
	case len(values) < v.valueBytes(n):
		return dst, fmt.Errorf("%w: %d bytes for %d %v values", ErrSparseTruncated, len(values), n, v)
	case len(values) > v.valueBytes(n):
		return dst, fmt.Errorf("%w: %d bytes left after %d %v values", ErrSparseCountMismatch, len(values)-v.valueBytes(n), n, v)
	}
	dst.Idx, dst.Val = idx, dst.Val[:n]
	switch v {
	case ValuesFloat32:
		copy(float32Bytes(dst.Val), payload[at:])
	case ValuesInt8, ValuesInt4:
		read := readInt8Values
		if v == ValuesInt4 {
			read = readInt4Values
		}
		if err := read(dst.Val, payload[at:]); err != nil {
			dst.Idx, dst.Val = idx[:0], dst.Val[:0]
			return dst, err
		}
	default:
		widen := halves[v].widen
		for i := range dst.Val {
			dst.Val[i] = widen(binary.LittleEndian.Uint16(payload[at+2*i:]))
		}
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

// mergeSparse returns a and b (each ascending, no index in both) merged in
// index order, in dst's storage (reset first, grown when too small; it must
// not be a's or b's).
func mergeSparse(dst, a, b Sparse) Sparse {
	dst = reserveSparse(Sparse{Idx: dst.Idx[:0], Val: dst.Val[:0]}, a.Len()+b.Len())
	dst.Reset()
	i, j := 0, 0
	for i < a.Len() && j < b.Len() {
		if a.Idx[i] < b.Idx[j] {
			dst.Append(a.Idx[i], a.Val[i])
			i++
		} else {
			dst.Append(b.Idx[j], b.Val[j])
			j++
		}
	}
	dst.Idx, dst.Val = append(dst.Idx, a.Idx[i:]...), append(dst.Val, a.Val[i:]...)
	dst.Idx, dst.Val = append(dst.Idx, b.Idx[j:]...), append(dst.Val, b.Val[j:]...)
	return dst
}

// regionOf returns the slice of s (ascending) inside [lo, hi), sharing its
// storage.
func regionOf(s Sparse, lo, hi uint32) Sparse {
	a := sort.Search(len(s.Idx), func(i int) bool { return s.Idx[i] >= lo })
	b := a + sort.Search(len(s.Idx)-a, func(i int) bool { return s.Idx[a+i] >= hi })
	return Sparse{Idx: s.Idx[a:b], Val: s.Val[a:b]}
}
