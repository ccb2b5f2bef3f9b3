package transport

import (
	"errors"
	"testing"
)

var testCall = CallDesc{Tensor: 9, N: 1000, K: 10, Dtype: DtypeBFloat16, Completed: 1<<32 - 3, Exact: true}

func validHeader(kind frameKind, dtype Dtype, count, length uint64) []byte {
	h := frameHeader{kind: kind, token: digestToken("tok"), generation: 3, sender: 1,
		tag: Tag{OpOkTopk, 42, 7}, call: testCall, dtype: dtype, count: count, payloadLen: length}
	b := make([]byte, headerSize)
	h.encode(b)
	return b
}

func withByte(b []byte, off int, v byte) []byte {
	c := append([]byte(nil), b...)
	c[off] = v
	return c
}

func TestFrameHeaderRoundTripAndRejections(t *testing.T) {
	b := validHeader(kindData, DtypeSparseF32, 3, 24)
	h, err := decodeFrameHeader(b, digestToken("tok"), 3, 4)
	if err != nil || h.tag != (Tag{OpOkTopk, 42, 7}) || h.call != testCall || h.count != 3 || h.payloadLen != 24 || h.sender != 1 {
		t.Fatalf("round trip: %+v, %v", h, err)
	}
	// Sparse pairs with 16-bit values are 6 bytes each.
	for _, dt := range []Dtype{DtypeSparseF16, DtypeSparseBF16} {
		if h, err := decodeFrameHeader(validHeader(kindData, dt, 3, 18), digestToken("tok"), 3, 4); err != nil || h.dtype != dt {
			t.Fatalf("%v round trip: %+v, %v", dt, h, err)
		}
		if _, err := decodeFrameHeader(validHeader(kindData, dt, 3, 24), digestToken("tok"), 3, 4); !errors.Is(err, ErrBadFrame) {
			t.Fatalf("%v with 8-byte pairs accepted: %v", dt, err)
		}
	}
	abort := frameHeader{kind: kindAbort, token: digestToken("tok"), generation: 3, reason: abortMismatch, dtype: DtypeBytes, count: 5, payloadLen: 5}
	ab := make([]byte, headerSize)
	abort.encode(ab)
	if h, err := decodeFrameHeader(ab, digestToken("tok"), 3, 4); err != nil || h.reason != abortMismatch {
		t.Fatalf("abort round trip: %+v, %v", h, err)
	}
	long := abort
	long.count, long.payloadLen = maxAbortText+1, maxAbortText+1
	longB := make([]byte, headerSize)
	long.encode(longB)
	refuse := frameHeader{kind: kindRefuse, token: digestToken("tok"), generation: 3, tag: Tag{Seq: 7}, dtype: DtypeBytes, count: 5, payloadLen: 5}
	rb := make([]byte, headerSize)
	refuse.encode(rb)
	if h, err := decodeFrameHeader(rb, digestToken("tok"), 3, 4); err != nil || h.kind != kindRefuse || h.tag.Seq != 7 {
		t.Fatalf("refuse round trip: %+v, %v", h, err)
	}
	longRefuse := refuse
	longRefuse.count, longRefuse.payloadLen = maxAbortText+1, maxAbortText+1
	longRefuseB := make([]byte, headerSize)
	longRefuse.encode(longRefuseB)
	v2 := withByte(b, 4, 2)
	v1 := append([]byte(nil), b[:64]...)
	v1[4] = 1
	cases := map[string]struct {
		b     []byte
		token string
		gen   uint32
		size  int
		want  error
	}{
		"other job's token":   {b, "other", 3, 4, ErrAuth},
		"other generation":    {b, "tok", 4, 4, ErrBadFrame},
		"sender out of range": {b, "tok", 3, 1, ErrBadFrame},
		"short header":        {b[:60], "tok", 3, 4, ErrBadFrame},
		"count vs length":     {validHeader(kindData, DtypeSparseF32, 4, 24), "tok", 3, 4, ErrBadFrame},
		"overflowing count":   {validHeader(kindData, DtypeSparseF32, 1<<62, 0), "tok", 3, 4, ErrBadFrame},
		"unknown dtype":       {validHeader(kindData, Dtype(99), 0, 0), "tok", 3, 4, ErrBadFrame},
		"unknown call dtype":  {withByte(b, 88, 99), "tok", 3, 4, ErrBadFrame},
		"unknown abort code":  {withByte(b, 89, 7), "tok", 3, 4, ErrBadFrame},
		"reserved byte set":   {withByte(b, 95, 1), "tok", 3, 4, ErrBadFrame},
		"exact flag of 2":     {withByte(b, 94, 2), "tok", 3, 4, ErrBadFrame},
		"long abort text":     {longB, "tok", 3, 4, ErrBadFrame},
		"long refusal text":   {longRefuseB, "tok", 3, 4, ErrBadFrame},
		"unknown kind":        {withByte(b, 6, byte(kindRefuse+1)), "tok", 3, 4, ErrBadFrame},
		"version 2 header":    {v2, "tok", 3, 4, ErrBadFrame},
		"version 1 header":    {v1, "tok", 3, 4, ErrBadFrame},
	}
	for name, c := range cases {
		if _, err := decodeFrameHeader(c.b, digestToken(c.token), c.gen, c.size); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", name, err, c.want)
		}
	}
}

// FuzzDecodeFrame: any bytes either decode into a header whose sizes are
// consistent, or are refused; never a panic.
func FuzzDecodeFrame(f *testing.F) {
	f.Add(validHeader(kindData, DtypeFloat32, 4, 16))
	f.Add(validHeader(kindHello, DtypeBytes, 0, 0))
	f.Add(validHeader(kindData, DtypeSparseF32, 1, 8))
	f.Add([]byte("GET / HTTP/1.1\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := decodeFrameHeader(b, digestToken("tok"), 3, 4)
		if err != nil {
			return
		}
		if h.sender >= 4 || checkPayloadSize(h.dtype, h.count, h.payloadLen) != nil {
			t.Fatalf("accepted an inconsistent header: %+v", h)
		}
	})
}
