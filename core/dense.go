package core

// Pieces the dense allreduce algorithms share: how a vector is cut into
// chunks, how a range of values travels (as messages of at most densePiece
// values), and how a received dense piece is checked and read.

import (
	"context"
	"fmt"
	"unsafe"

	"github.com/oktopk/oktopk/transport"
)

// densePiece is the most float32 values one message of a dense algorithm
// carries (1 MiB); a longer range travels as several messages, piece j of
// step s under step number s<<pieceBits | j. Why: ZeroMQ copies a message
// into malloc'd memory on the sender and receives it into another, and
// freed blocks of tens of MiB stay in the C heap's arenas (one per thread
// that touched them); pieces of 1 MiB are reused from block to block. The
// receiver also holds only a piece at a time where it adds or copies
// values in place. Cost: one more message header (96 bytes) and one more
// message per MiB; the words sent do not change.
const (
	densePiece = 1 << 18
	pieceBits  = 14 // pieces per range: 2^14 × 2^18 covers any n < 2^32
)

func pieceStep(step uint32, j int) uint32 { return step<<pieceBits | uint32(j) }

// pieceCount is how many messages carry a range of n values (an empty range
// still sends one, so the receiver always has a message to wait for).
func pieceCount(n int) int { return max(1, (n+densePiece-1)/densePiece) }

// sendPieces sends v to peer as the pieces of step.
func sendPieces(ctx context.Context, call *Call, peer int, step uint32, v []float32) error {
	return sendPiecesRange(ctx, call, peer, step, v, 0, pieceCount(len(v)))
}

// sendPiecesRange is sendPieces for pieces [first, end) of v.
func sendPiecesRange(ctx context.Context, call *Call, peer int, step uint32, v []float32, first, end int) error {
	for j := first; j < end; j++ {
		lo, hi := j*densePiece, min(len(v), (j+1)*densePiece)
		if err := call.Send(ctx, peer, pieceStep(step, j), transport.DtypeFloat32, uint64(hi-lo), float32Bytes(v[lo:hi])); err != nil {
			return err
		}
	}
	return nil
}

// recvPieces receives from peer the want values that sendPieces sent at
// step and calls use(lo, vals) on each piece in order, vals[i] being value
// lo+i of the range. With owned the pieces are the caller's to keep and to
// write (see receivedFloatsOwned); otherwise they are valid only during use.
func recvPieces(ctx context.Context, call *Call, peer int, step uint32, want int, owned bool, use func(lo int, vals []float32)) error {
	var scratch []float32
	return recvPiecesRange(ctx, call, peer, step, want, 0, pieceCount(want), owned, &scratch, use)
}

// recvPiecesRange is recvPieces for pieces [first, end) of the range, with
// the caller's scratch (see receivedFloats).
func recvPiecesRange(ctx context.Context, call *Call, peer int, step uint32, want, first, end int, owned bool,
	scratch *[]float32, use func(lo int, vals []float32)) error {
	for j := first; j < end; j++ {
		lo, hi := j*densePiece, min(want, (j+1)*densePiece)
		m, err := call.Recv(ctx, peer, pieceStep(step, j))
		if err != nil {
			return err
		}
		var vals []float32
		if owned {
			vals, err = receivedFloatsOwned(m, hi-lo)
		} else {
			vals, err = receivedFloats(m, hi-lo, scratch)
		}
		if err != nil {
			return err
		}
		use(lo, vals)
	}
	return nil
}

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

// addSumInto adds x + r to dst element by element, each sum formed first
// (the bits of adding a stored x + r).
func addSumInto(dst, x, r []float32) {
	x, r = x[:len(dst)], r[:len(dst)]
	for i := range dst {
		dst[i] += float32(x[i] + r[i])
	}
}
