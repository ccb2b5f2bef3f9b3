package transport

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
)

// Every message on the wire is two ZeroMQ frames: a fixed 96-byte header and
// the raw payload. The header is little-endian:
//
//	off size field
//	  0    4 magic "OKTK"
//	  4    2 protocol version
//	  6    1 kind (data, hello, heartbeat, bye, abort, refuse)
//	  7    1 reserved, zero
//	  8   16 job token digest (first 16 bytes of SHA-256 of the token)
//	 24    4 communicator generation
//	 28    4 sender rank
//	 32    8 sequence number of the operation
//	 40    4 step within the operation
//	 44    1 op
//	 45    1 dtype
//	 46    2 reserved, zero
//	 48    8 element count
//	 56    8 payload length in bytes
//	 64    8 call: tensor id
//	 72    8 call: elements in the caller's buffer (n)
//	 80    8 call: elements selected per rank (k; n for dense calls)
//	 88    1 call: dtype of the caller's buffer
//	 89    1 abort reason (abort frames): 0 failure, 1 mismatch
//	 90    4 call: calls completed on the tensor before this one (mod 2^32)
//	 94    1 call: 1 when it selects exactly (refreshes reused thresholds), else 0
//	 95    1 reserved, zero
//
// Bytes 64–94 are the sender's CallDesc (zero outside a started call); the
// receiver compares it with its own, so that ranks which issued different
// calls under one sequence number fail with ErrMismatch.
//
// Heartbeat frames use the sequence number field for the latest call their
// sender has started (stall diagnostics). Abort frames carry the reason as
// text in their payload, at most maxAbortText bytes. Refuse frames say that
// the sender refused the call of their sequence number (bad arguments, seen
// by that rank alone) and carry the reason as text, at most maxAbortText
// bytes: a rank running that call fails it with ErrMismatch.
//
// A receiver checks every field before it trusts the payload: wrong magic,
// version, token or generation, a sender out of range, or a length that does
// not match the payload or the dtype drops the frame.
//
// Version 1 had a 64-byte header without the call descriptor; version 2 had
// neither refuse frames nor the completed-call count.

const (
	frameMagic      = 0x4b544b4f // "OKTK" little-endian
	protocolVersion = 3
	headerSize      = 96
	maxAbortText    = 1024
	maxPayloadBytes = 1 << 40 // far above any message size limit; keeps count·width from overflowing
)

// frameKind separates algorithm data from the transport's own control
// messages, which never reach the mailbox as data.
type frameKind uint8

const (
	kindData      frameKind = 1
	kindHello     frameKind = 2 // sent once per peer by Connect
	kindHeartbeat frameKind = 3 // liveness while idle
	kindBye       frameKind = 4 // orderly Close
	kindAbort     frameKind = 5 // the sender aborted: fail calls waiting on it
	kindRefuse    frameKind = 6 // the sender refused call tag.Seq: fail that call here
)

type tokenDigest [16]byte

func digestToken(token string) tokenDigest {
	sum := sha256.Sum256([]byte("oktopk job token\x00" + token))
	var d tokenDigest
	copy(d[:], sum[:16])
	return d
}

// abortReason says why a rank aborted, so that its peers fail with the same
// kind of error (a mismatch stays a mismatch on every rank).
type abortReason uint8

const (
	abortFailure  abortReason = 0
	abortMismatch abortReason = 1
)

type frameHeader struct {
	kind       frameKind
	token      tokenDigest
	generation uint32
	sender     uint32
	tag        Tag
	call       CallDesc
	dtype      Dtype
	count      uint64
	payloadLen uint64
	reason     abortReason
}

func (h *frameHeader) encode(b []byte) {
	_ = b[headerSize-1]
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	binary.LittleEndian.PutUint16(b[4:], protocolVersion)
	b[6] = byte(h.kind)
	b[7] = 0
	copy(b[8:24], h.token[:])
	binary.LittleEndian.PutUint32(b[24:], h.generation)
	binary.LittleEndian.PutUint32(b[28:], h.sender)
	binary.LittleEndian.PutUint64(b[32:], h.tag.Seq)
	binary.LittleEndian.PutUint32(b[40:], h.tag.Step)
	b[44] = byte(h.tag.Op)
	b[45] = byte(h.dtype)
	b[46], b[47] = 0, 0
	binary.LittleEndian.PutUint64(b[48:], h.count)
	binary.LittleEndian.PutUint64(b[56:], h.payloadLen)
	binary.LittleEndian.PutUint64(b[64:], h.call.Tensor)
	binary.LittleEndian.PutUint64(b[72:], h.call.N)
	binary.LittleEndian.PutUint64(b[80:], h.call.K)
	b[88] = byte(h.call.Dtype)
	b[89] = byte(h.reason)
	binary.LittleEndian.PutUint32(b[90:], h.call.Completed)
	b[94], b[95] = 0, 0
	if h.call.Exact {
		b[94] = 1
	}
}

// decodeFrameHeader parses and validates a header frame against what this
// rank expects. It never allocates from wire-controlled sizes.
func decodeFrameHeader(b []byte, token tokenDigest, generation uint32, size int) (frameHeader, error) {
	var h frameHeader
	if len(b) != headerSize {
		return h, fmt.Errorf("%w: header of %d bytes, want %d", ErrBadFrame, len(b), headerSize)
	}
	if binary.LittleEndian.Uint32(b[0:]) != frameMagic {
		return h, fmt.Errorf("%w: bad magic", ErrBadFrame)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != protocolVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", ErrBadFrame, v, protocolVersion)
	}
	h.kind = frameKind(b[6])
	if h.kind < kindData || h.kind > kindRefuse || b[7] != 0 || b[46] != 0 || b[47] != 0 || b[94] > 1 || b[95] != 0 {
		return h, fmt.Errorf("%w: bad kind or reserved bytes", ErrBadFrame)
	}
	copy(h.token[:], b[8:24])
	if h.token != token {
		return h, fmt.Errorf("%w: frame carries another job's token", ErrAuth)
	}
	h.generation = binary.LittleEndian.Uint32(b[24:])
	if h.generation != generation {
		return h, fmt.Errorf("%w: generation %d, want %d", ErrBadFrame, h.generation, generation)
	}
	h.sender = binary.LittleEndian.Uint32(b[28:])
	if int64(h.sender) >= int64(size) {
		return h, fmt.Errorf("%w: sender rank %d of %d", ErrBadFrame, h.sender, size)
	}
	h.tag.Seq = binary.LittleEndian.Uint64(b[32:])
	h.tag.Step = binary.LittleEndian.Uint32(b[40:])
	h.tag.Op = Op(b[44])
	h.dtype = Dtype(b[45])
	h.count = binary.LittleEndian.Uint64(b[48:])
	h.payloadLen = binary.LittleEndian.Uint64(b[56:])
	h.call = CallDesc{
		Tensor:    binary.LittleEndian.Uint64(b[64:]),
		N:         binary.LittleEndian.Uint64(b[72:]),
		K:         binary.LittleEndian.Uint64(b[80:]),
		Dtype:     Dtype(b[88]),
		Completed: binary.LittleEndian.Uint32(b[90:]),
		Exact:     b[94] == 1,
	}
	h.reason = abortReason(b[89])
	if h.call.Dtype > DtypeUint64 || h.reason > abortMismatch {
		return h, fmt.Errorf("%w: bad call dtype or abort reason", ErrBadFrame)
	}
	if (h.kind == kindAbort || h.kind == kindRefuse) && h.payloadLen > maxAbortText {
		return h, fmt.Errorf("%w: abort or refusal text of %d bytes", ErrBadFrame, h.payloadLen)
	}
	if err := checkPayloadSize(h.dtype, h.count, h.payloadLen); err != nil {
		return h, err
	}
	return h, nil
}

// checkPayloadSize verifies that count elements of dtype occupy exactly
// payloadLen bytes, without overflow.
func checkPayloadSize(dtype Dtype, count, payloadLen uint64) error {
	var width uint64
	switch dtype {
	case DtypeBytes:
		width = 1
	case DtypeFloat16, DtypeBFloat16:
		width = 2
	case DtypeFloat32:
		width = 4
	case DtypeSparseF32, DtypeUint64:
		width = 8
	case DtypeSparseF16, DtypeSparseBF16:
		width = 6
	default:
		return fmt.Errorf("%w: unknown dtype %d", ErrBadFrame, dtype)
	}
	if payloadLen > maxPayloadBytes || count > payloadLen || count*width != payloadLen {
		return fmt.Errorf("%w: %d elements of %s in %d bytes", ErrBadFrame, count, dtype, payloadLen)
	}
	return nil
}
