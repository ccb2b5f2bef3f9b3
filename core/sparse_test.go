package core

// Tests of the sparse wire codec: round trips, malformed payloads refused,
// and a fuzz test that decoding never panics or over-allocates and accepts
// only the encoder's frames (indexcode_test.go tests the coded indices).

import (
	"bytes"
	"errors"
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

// FuzzDecodeSparse: a payload from the wire either decodes into strictly
// increasing indices below the limit, or is refused with one of the
// codec's errors; never a panic, and never an allocation larger than the
// payload describes. What decodes is the one encoding of what it decodes
// to: encoding it again gives the same bytes (float32 values travel as
// their bits). The seeds are frames of every shape the codec makes
// (testdata/fuzz/FuzzDecodeSparse holds more, and what the fuzzer found).
func FuzzDecodeSparse(f *testing.F) {
	f.Add(EncodeSparse(nil, Sparse{Idx: []uint32{1, 5}, Val: []float32{1, 2}}, 0), uint64(2), uint32(0), uint32(10))
	f.Add([]byte{}, uint64(0), uint32(0), uint32(0))
	frame, idx, base, limit := codedFrameToBreak()
	f.Add(frame, uint64(len(idx)), base, limit)
	f.Add(frame, uint64(len(idx)), base, base+20000)
	wide := Sparse{Idx: []uint32{0, 1, 2, 1 << 31, math.MaxUint32 - 1}, Val: []float32{1, 2, 3, 4, 5}}
	f.Add(EncodeSparse(nil, wide, 0), uint64(5), uint32(0), uint32(math.MaxUint32))
	f.Fuzz(func(t *testing.T, payload []byte, count uint64, base, limit uint32) {
		s, err := DecodeSparse(Sparse{}, payload, count, base, limit)
		if err != nil {
			for _, named := range []error{ErrSparseTruncated, ErrSparseCountMismatch, ErrSparseIndexPastEnd, ErrSparseGapWidth, ErrSparseNotCanonical} {
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
		if again := EncodeSparse(nil, s, base); !bytes.Equal(again, payload) {
			t.Fatalf("%d entries decoded from %d bytes encode into %d other bytes", s.Len(), len(payload), len(again))
		}
	})
}
