package transport

// Tests of the frame header: round trips, the rejection of every malformed
// or foreign header, and a fuzz test of DecodeFrameHeader.

import (
	"errors"
	"testing"
)

var testCall = CallDesc{Tensor: 9, N: 1000, K: 10, Dtype: DtypeBFloat16, Completed: 1<<32 - 3, Exact: true, Values: 3}

func validHeader(kind FrameKind, dtype Dtype, count, length uint64) []byte {
	h := FrameHeader{Kind: kind, Token: DigestToken("tok"), Generation: 3, Sender: 1,
		Tag: Tag{OpOkTopk, 42, 7}, Call: testCall, Dtype: dtype, Count: count, PayloadLen: length}
	b := make([]byte, HeaderSize)
	h.Encode(b)
	return b
}

func withByte(b []byte, off int, v byte) []byte {
	c := append([]byte(nil), b...)
	c[off] = v
	return c
}

func TestFrameHeaderRoundTripAndRejections(t *testing.T) {
	b := validHeader(FrameData, DtypeSparseF32, 3, 24)
	h, err := DecodeFrameHeader(b, DigestToken("tok"), 3, 4)
	if err != nil || h.Tag != (Tag{OpOkTopk, 42, 7}) || h.Call != testCall || h.Count != 3 || h.PayloadLen != 24 || h.Sender != 1 {
		t.Fatalf("round trip: %+v, %v", h, err)
	}
	// A sparse payload is its indices coded as gaps, then its values:
	// between count·w + 8 and count·(w + 5) + 4 bytes for values of w bytes,
	// 8-bit values with at least one 4-byte scale and at most count + 4
	// bytes of them; 4-bit values take ⌈count/2⌉ + 4·⌈count/32⌉ bytes.
	for _, c := range []struct {
		dt    Dtype
		count uint64
		least uint64 // the shortest payload accepted
		most  uint64 // the longest
	}{{DtypeSparseF32, 3, 20, 31}, {DtypeSparseF16, 3, 14, 25}, {DtypeSparseBF16, 3, 14, 25}, {DtypeSparseI8, 3, 15, 29}, {DtypeSparseI4, 3, 14, 25}} {
		for _, length := range []uint64{c.least, c.most} {
			if h, err := DecodeFrameHeader(validHeader(FrameData, c.dt, c.count, length), DigestToken("tok"), 3, 4); err != nil || h.Dtype != c.dt {
				t.Fatalf("%v: %d entries in %d bytes refused: %v", c.dt, c.count, length, err)
			}
		}
		for _, length := range []uint64{c.least - 1, c.most + 1} {
			if _, err := DecodeFrameHeader(validHeader(FrameData, c.dt, c.count, length), DigestToken("tok"), 3, 4); !errors.Is(err, ErrBadFrame) {
				t.Fatalf("%v: %d entries in %d bytes accepted: %v", c.dt, c.count, length, err)
			}
		}
		if _, err := DecodeFrameHeader(validHeader(FrameData, c.dt, 0, 1), DigestToken("tok"), 3, 4); !errors.Is(err, ErrBadFrame) {
			t.Fatalf("%v: no entries in a byte accepted: %v", c.dt, err)
		}
	}
	abort := FrameHeader{Kind: FrameAbort, Token: DigestToken("tok"), Generation: 3, Reason: AbortMismatch, Dtype: DtypeBytes, Count: 5, PayloadLen: 5}
	ab := make([]byte, HeaderSize)
	abort.Encode(ab)
	if h, err := DecodeFrameHeader(ab, DigestToken("tok"), 3, 4); err != nil || h.Reason != AbortMismatch {
		t.Fatalf("abort round trip: %+v, %v", h, err)
	}
	long := abort
	long.Count, long.PayloadLen = maxAbortText+1, maxAbortText+1
	longB := make([]byte, HeaderSize)
	long.Encode(longB)
	refuse := FrameHeader{Kind: FrameRefuse, Token: DigestToken("tok"), Generation: 3, Tag: Tag{Seq: 7}, Dtype: DtypeBytes, Count: 5, PayloadLen: 5}
	rb := make([]byte, HeaderSize)
	refuse.Encode(rb)
	if h, err := DecodeFrameHeader(rb, DigestToken("tok"), 3, 4); err != nil || h.Kind != FrameRefuse || h.Tag.Seq != 7 {
		t.Fatalf("refuse round trip: %+v, %v", h, err)
	}
	longRefuse := refuse
	longRefuse.Count, longRefuse.PayloadLen = maxAbortText+1, maxAbortText+1
	longRefuseB := make([]byte, HeaderSize)
	longRefuse.Encode(longRefuseB)
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
		"count vs length":     {validHeader(FrameData, DtypeSparseF32, 4, 23), "tok", 3, 4, ErrBadFrame},
		"overflowing count":   {validHeader(FrameData, DtypeSparseF32, 1<<62, 0), "tok", 3, 4, ErrBadFrame},
		"unknown dtype":       {validHeader(FrameData, Dtype(99), 0, 0), "tok", 3, 4, ErrBadFrame},
		"unknown call dtype":  {withByte(b, 88, 99), "tok", 3, 4, ErrBadFrame},
		"unknown abort code":  {withByte(b, 89, 7), "tok", 3, 4, ErrBadFrame},
		"reserved byte set":   {withByte(b, 47, 1), "tok", 3, 4, ErrBadFrame},
		"unknown values":      {withByte(b, 95, 5), "tok", 3, 4, ErrBadFrame},
		"exact flag of 2":     {withByte(b, 94, 2), "tok", 3, 4, ErrBadFrame},
		"long abort text":     {longB, "tok", 3, 4, ErrBadFrame},
		"long refusal text":   {longRefuseB, "tok", 3, 4, ErrBadFrame},
		"unknown kind":        {withByte(b, 6, byte(FrameRefuse+1)), "tok", 3, 4, ErrBadFrame},
		"version 2 header":    {v2, "tok", 3, 4, ErrBadFrame},
		"version 1 header":    {v1, "tok", 3, 4, ErrBadFrame},
	}
	for name, c := range cases {
		if _, err := DecodeFrameHeader(c.b, DigestToken(c.token), c.gen, c.size); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", name, err, c.want)
		}
	}
}

// FuzzDecodeFrame: any bytes either decode into a header whose sizes are
// consistent, or are refused; never a panic.
func FuzzDecodeFrame(f *testing.F) {
	f.Add(validHeader(FrameData, DtypeFloat32, 4, 16))
	f.Add(validHeader(FrameHello, DtypeBytes, 0, 0))
	f.Add(validHeader(FrameData, DtypeSparseF32, 1, 12))
	f.Add(validHeader(FrameData, DtypeSparseF16, 200, 620))
	f.Add([]byte("GET / HTTP/1.1\r\n"))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := DecodeFrameHeader(b, DigestToken("tok"), 3, 4)
		if err != nil {
			return
		}
		if h.Sender >= 4 || checkPayloadSize(h.Dtype, h.Count, h.PayloadLen) != nil {
			t.Fatalf("accepted an inconsistent header: %+v", h)
		}
	})
}
