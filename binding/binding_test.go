package binding

// Tests of Buffer and Widener: a half-precision buffer is widened for the
// call and narrowed back only when the call succeeds; a float32 buffer is
// used in place; other element types are refused.

import (
	"errors"
	"testing"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

func TestWidenerNarrowsBackOnlyWhenTheCallSucceeds(t *testing.T) {
	for _, dt := range []transport.Dtype{transport.DtypeFloat16, transport.DtypeBFloat16} {
		half := make([]uint16, 3)
		wide := []float32{1.5, -2, 0.25} // exact in both formats
		if dt == transport.DtypeFloat16 {
			core.Float32ToFloat16(half, wide)
		} else {
			core.Float32ToBFloat16(half, wide)
		}
		before := append([]uint16(nil), half...)
		var w Widener
		failed := errors.New("the call failed")
		_, err := w.Run(Buffer{Dtype: dt, Half: half}, func(x []float32) (core.Stats, error) {
			for i := range x {
				x[i] *= 2
			}
			return core.Stats{}, failed
		})
		if !errors.Is(err, failed) || string(u16bytes(half)) != string(u16bytes(before)) {
			t.Fatalf("%v: a failed call changed the buffer: %v %v", dt, half, err)
		}
		if _, err := w.Run(Buffer{Dtype: dt, Half: half}, func(x []float32) (core.Stats, error) {
			for i := range x {
				x[i] *= 2
			}
			return core.Stats{}, nil
		}); err != nil {
			t.Fatal(err)
		}
		got := make([]float32, 3)
		if dt == transport.DtypeFloat16 {
			core.Float16ToFloat32(got, half)
		} else {
			core.BFloat16ToFloat32(got, half)
		}
		if got[0] != 3 || got[1] != -4 || got[2] != 0.5 {
			t.Fatalf("%v: narrowed back %v, want [3 -4 0.5]", dt, got)
		}
	}
}

func TestFloat32BuffersAreUsedInPlaceAndOtherTypesRefused(t *testing.T) {
	x := []float32{1, 2}
	var w Widener
	if _, err := w.Run(Float32(x), func(y []float32) (core.Stats, error) {
		if &y[0] != &x[0] {
			t.Error("a float32 buffer was copied")
		}
		return core.Stats{}, nil
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Run(Buffer{Dtype: transport.DtypeBytes}, nil); !errors.Is(err, core.ErrInvalidArgument) {
		t.Fatalf("bytes buffer: %v", err)
	}
}

func u16bytes(h []uint16) []byte {
	b := make([]byte, 0, 2*len(h))
	for _, v := range h {
		b = append(b, byte(v), byte(v>>8))
	}
	return b
}
