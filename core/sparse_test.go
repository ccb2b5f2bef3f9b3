package core

// Tests of the sparse wire codec: round trips, malformed payloads refused,
// and a fuzz test that decoding never panics or over-allocates and accepts
// only the encoder's frames (indexcode_test.go tests the coded indices).

import (
	"bytes"
	"errors"
	"fmt"
	"math"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

func TestSparseCodecRoundTripAndValidation(t *testing.T) {
	s := Sparse{Idx: []uint32{10, 11, 40}, Val: []float32{1, -2, 3.5}}
	b := EncodeSparse(nil, s, 10)
	got, err := DecodeSparse(Sparse{}, b, 3, 10, 50)
	if err != nil || !sparseBitwiseEqual(got, s) {
		t.Fatalf("round trip: %v %v", got, err)
	}
	for name, c := range map[string]struct {
		count     uint64
		base, lim uint32
	}{
		"index beyond the region":   {3, 10, 40},
		"count larger than payload": {4, 10, 50},
		"count smaller":             {2, 10, 50},
	} {
		if _, err := DecodeSparse(Sparse{}, b, c.count, c.base, c.lim); !errors.Is(err, transport.ErrBadFrame) {
			t.Errorf("%s: %v, want ErrBadFrame", name, err)
		}
	}
}

// FuzzDecodeSparse: a payload from the wire, read as a frame of float32,
// 16-bit, 8-bit or 4-bit values, either decodes into strictly increasing indices
// at or above the base and below the limit, or is refused with one of the
// codec's errors; never a panic, and never an allocation larger than the
// payload describes. What decodes is the one encoding of what it decodes
// to: encoding it again gives the same bytes (NaNs of 16-bit formats
// aside, which come back quieted). The seeds are frames of every shape the
// codec makes (testdata/fuzz/FuzzDecodeSparse holds more, and what the
// fuzzer found).
func FuzzDecodeSparse(f *testing.F) {
	f.Add(EncodeSparse(nil, Sparse{Idx: []uint32{1, 5}, Val: []float32{1, 2}}, 0), uint64(2), uint32(0), uint32(10), uint8(ValuesFloat32))
	f.Add([]byte{}, uint64(0), uint32(0), uint32(0), uint8(ValuesFloat32))
	frame, idx, base, limit := codedFrameToBreak()
	f.Add(frame, uint64(len(idx)), base, limit, uint8(ValuesFloat32))
	f.Add(frame, uint64(len(idx)), base, base+20000, uint8(ValuesFloat32))
	wide := Sparse{Idx: []uint32{0, 1, 2, 1 << 31, math.MaxUint32 - 1}, Val: []float32{1, 2, 3, 4, 5}}
	f.Add(EncodeSparse(nil, wide, 0), uint64(5), uint32(0), uint32(math.MaxUint32), uint8(ValuesFloat32))
	for _, v := range []ValueType{ValuesFloat16, ValuesBFloat16, ValuesInt8, ValuesInt4} {
		s := int8TestValues(100)
		if v.scaled() {
			v.quantize(s, nil)
		} else {
			valueRounding{values: v}.apply(s)
		}
		f.Add(encodeSparseAs(nil, s, 0, v), uint64(s.Len()), uint32(0), uint32(300), uint8(v))
	}
	f.Fuzz(func(t *testing.T, payload []byte, count uint64, base, limit uint32, values uint8) {
		v := ValueType(values % uint8(numValueTypes))
		s, err := decodeSparseAs(Sparse{}, payload, count, base, limit, v)
		if err != nil {
			for _, named := range []error{ErrSparseTruncated, ErrSparseCountMismatch, ErrSparseIndexPastEnd, ErrSparseGapWidth, ErrSparseNotCanonical, ErrSparseScale} {
				if errors.Is(err, named) {
					return
				}
			}
			t.Fatalf("refused with %v, none of the codec's errors", err)
		}
		if uint64(s.Len()) != count || len(s.Val) != len(s.Idx) {
			t.Fatalf("decoded %d entries for count %d", s.Len(), count)
		}
		for i, ix := range s.Idx {
			if ix >= limit || ix < base || (i > 0 && ix <= s.Idx[i-1]) {
				t.Fatalf("accepted index %d at %d (base %d, limit %d)", ix, i, base, limit)
			}
		}
		again := encodeSparseAs(nil, s, base, v)
		if v.half() {
			back, err := decodeSparseAs(Sparse{}, again, count, base, limit, v)
			for i := range s.Val {
				if err == nil && s.Val[i] != back.Val[i] && !(isNaN32(s.Val[i]) && isNaN32(back.Val[i])) {
					err = fmt.Errorf("value %d: %v came back as %v", i, s.Val[i], back.Val[i])
				}
			}
			if err != nil {
				t.Fatalf("%v values: %d entries decoded from %d bytes do not come back: %v", v, s.Len(), len(payload), err)
			}
			return
		}
		if !bytes.Equal(again, payload) {
			t.Fatalf("%v values: %d entries decoded from %d bytes encode into %d other bytes", v, s.Len(), len(payload), len(again))
		}
	})
}

// isNaN32 reports whether x is a NaN.
func isNaN32(x float32) bool { return x != x }
