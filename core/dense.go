package core

// Pieces the dense allreduce algorithms share: how a vector is cut into
// chunks, and how a received dense chunk is checked and read.

import (
	"fmt"
	"unsafe"

	"github.com/oktopk/oktopk/transport"
)

// chunkStart is where chunk c of n elements cut into parts chunks begins.
// Chunk c is [chunkStart(n, parts, c), chunkStart(n, parts, c+1)); the
// chunks hold n/parts or n/parts+1 elements, so any n works with any count.
func chunkStart(n, parts, c int) int {
	return int(int64(n) * int64(c) / int64(parts))
}

// receivedFloats returns the want float32 values of a dense message,
// checking what the sender declared against what this rank expects: a
// different length means the ranks called with different vectors, which is
// a mismatched call, not something to guess around. The values are read in
// place when the payload is 4-byte aligned and copied into *scratch (grown
// as needed, kept for the next message) otherwise.
func receivedFloats(m transport.Message, want int, scratch *[]float32) ([]float32, error) {
	if m.Dtype != transport.DtypeFloat32 || m.Count != uint64(want) {
		return nil, fmt.Errorf("%w: expected %d float32 values, peer sent %d of %v", ErrMismatch, want, m.Count, m.Dtype)
	}
	if len(m.Payload) != 4*want {
		return nil, fmt.Errorf("%w: dense payload of %d bytes for %d floats", transport.ErrBadFrame, len(m.Payload), want)
	}
	if want == 0 {
		return nil, nil
	}
	if uintptr(unsafe.Pointer(&m.Payload[0]))%4 == 0 {
		return unsafe.Slice((*float32)(unsafe.Pointer(&m.Payload[0])), want), nil
	}
	if cap(*scratch) < want {
		*scratch = make([]float32, want)
	}
	vals := (*scratch)[:want]
	copy(float32Bytes(vals), m.Payload)
	return vals, nil
}

// receivedFloatsOwned is receivedFloats for a caller that keeps the values
// past the next receive (and may write them): a misaligned payload is
// copied into fresh storage instead of a shared scratch buffer.
func receivedFloatsOwned(m transport.Message, want int) ([]float32, error) {
	var fresh []float32
	return receivedFloats(m, want, &fresh)
}

// addInto adds src to dst element by element (the reduction of a chunk).
func addInto(dst, src []float32) {
	src = src[:len(dst)]
	for i := range dst {
		dst[i] += src[i]
	}
}
