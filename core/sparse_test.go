package core

// Tests of the sparse wire codec: round trips, malformed payloads refused,
// and a fuzz test that decoding never panics or over-allocates.

import (
	"encoding/binary"
	"errors"
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
		count      uint64
		base, lim  uint32
		corruptIdx int
	}{
		"index beyond the region":   {3, 10, 40, -1},
		"count larger than payload": {4, 10, 50, -1},
		"indices out of order":      {3, 10, 50, 1},
	} {
		p := append([]byte(nil), b...)
		if c.corruptIdx >= 0 {
			binary.LittleEndian.PutUint32(p[4*c.corruptIdx:], 0)
		}
		if _, err := DecodeSparse(Sparse{}, p, c.count, c.base, c.lim); !errors.Is(err, transport.ErrBadFrame) {
			t.Errorf("%s: %v, want ErrBadFrame", name, err)
		}
	}
}

// FuzzDecodeSparse: a payload from the wire either decodes into strictly
// increasing indices below the limit, or is refused; never a panic, and
// never an allocation larger than the payload describes.
func FuzzDecodeSparse(f *testing.F) {
	f.Add(EncodeSparse(nil, Sparse{Idx: []uint32{1, 5}, Val: []float32{1, 2}}, 0), uint64(2), uint32(0), uint32(10))
	f.Add([]byte{}, uint64(0), uint32(0), uint32(0))
	f.Fuzz(func(t *testing.T, payload []byte, count uint64, base, limit uint32) {
		s, err := DecodeSparse(Sparse{}, payload, count, base, limit)
		if err != nil {
			return
		}
		if uint64(s.Len()) != count || len(s.Val) != len(s.Idx) {
			t.Fatalf("decoded %d entries for count %d", s.Len(), count)
		}
		for i, ix := range s.Idx {
			if ix >= limit || (i > 0 && ix <= s.Idx[i-1]) {
				t.Fatalf("accepted index %d at %d (limit %d)", ix, i, limit)
			}
		}
	})
}
