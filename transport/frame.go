package transport

// The wire frame: its 96-byte header (FrameHeader, Encode and
// DecodeFrameHeader), the frame kinds, the token digest and abort reasons.

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
//	 95    1 call: the format of its sparse values (0 float32, 1 float16, 2 bfloat16, 3 int8, 4 int4)
//
// Bytes 64–95 are the sender's CallDesc (zero outside a started call); the
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
// neither refuse frames nor the completed-call count; version 3 sent a
// sparse payload's indices as plain uint32, where version 4 codes them as
// gaps (core/indexcode.go), and had byte 95 reserved.

const (
	frameMagic      = 0x4b544b4f // "OKTK" little-endian
	protocolVersion = 4
	HeaderSize      = 96 // bytes of every frame header (FrameHeader.Encode)
	maxAbortText    = 1024
	maxPayloadBytes = 1 << 40 // far above any message size limit; keeps count·width from overflowing
)

// FrameKind separates algorithm data from the transport's own control
// messages, which never reach the mailbox as data.
type FrameKind uint8

const (
	FrameData      FrameKind = 1
	FrameHello     FrameKind = 2 // sent once per peer by Connect
	FrameHeartbeat FrameKind = 3 // liveness while idle
	FrameBye       FrameKind = 4 // orderly Close
	FrameAbort     FrameKind = 5 // the sender aborted: fail calls waiting on it
	FrameRefuse    FrameKind = 6 // the sender refused call tag.Seq: fail that call here
)

// TokenDigest is what a frame carries of the job token: the first 16 bytes
// of its SHA-256 (domain-separated), never the token itself.
type TokenDigest [16]byte

// DigestToken is token's digest, as frames carry it.
func DigestToken(token string) TokenDigest {
	sum := sha256.Sum256([]byte("oktopk job token\x00" + token))
	var d TokenDigest
	copy(d[:], sum[:16])
	return d
}

// AbortReason says why a rank aborted, so that its peers fail with the same
// kind of error (a mismatch stays a mismatch on every rank).
type AbortReason uint8

const (
	AbortFailure  AbortReason = 0
	AbortMismatch AbortReason = 1
)

// FrameHeader is a frame's header, decoded: what a transport between
// processes (package zmq) sends ahead of each payload and checks on arrival.
type FrameHeader struct {
	Kind       FrameKind
	Token      TokenDigest
	Generation uint32
	Sender     uint32
	Tag        Tag
	Call       CallDesc
	Dtype      Dtype
	Count      uint64
	PayloadLen uint64
	Reason     AbortReason
}

// Encode writes the header into b, which holds at least HeaderSize bytes.
func (h *FrameHeader) Encode(b []byte) {
	_ = b[HeaderSize-1]
	binary.LittleEndian.PutUint32(b[0:], frameMagic)
	binary.LittleEndian.PutUint16(b[4:], protocolVersion)
	b[6] = byte(h.Kind)
	b[7] = 0
	copy(b[8:24], h.Token[:])
	binary.LittleEndian.PutUint32(b[24:], h.Generation)
	binary.LittleEndian.PutUint32(b[28:], h.Sender)
	binary.LittleEndian.PutUint64(b[32:], h.Tag.Seq)
	binary.LittleEndian.PutUint32(b[40:], h.Tag.Step)
	b[44] = byte(h.Tag.Op)
	b[45] = byte(h.Dtype)
	b[46], b[47] = 0, 0
	binary.LittleEndian.PutUint64(b[48:], h.Count)
	binary.LittleEndian.PutUint64(b[56:], h.PayloadLen)
	binary.LittleEndian.PutUint64(b[64:], h.Call.Tensor)
	binary.LittleEndian.PutUint64(b[72:], h.Call.N)
	binary.LittleEndian.PutUint64(b[80:], h.Call.K)
	b[88] = byte(h.Call.Dtype)
	b[89] = byte(h.Reason)
	binary.LittleEndian.PutUint32(b[90:], h.Call.Completed)
	b[94], b[95] = 0, byte(h.Call.Values)
	if h.Call.Exact {
		b[94] = 1
	}
}

// DecodeFrameHeader parses and validates a header frame against what this
// rank expects. It never allocates from wire-controlled sizes.
func DecodeFrameHeader(b []byte, token TokenDigest, generation uint32, size int) (FrameHeader, error) {
	var h FrameHeader
	if len(b) != HeaderSize {
		return h, fmt.Errorf("%w: header of %d bytes, want %d", ErrBadFrame, len(b), HeaderSize)
	}
	if binary.LittleEndian.Uint32(b[0:]) != frameMagic {
		return h, fmt.Errorf("%w: bad magic", ErrBadFrame)
	}
	if v := binary.LittleEndian.Uint16(b[4:]); v != protocolVersion {
		return h, fmt.Errorf("%w: protocol version %d, want %d", ErrBadFrame, v, protocolVersion)
	}
	h.Kind = FrameKind(b[6])
	if h.Kind < FrameData || h.Kind > FrameRefuse || b[7] != 0 || b[46] != 0 || b[47] != 0 || b[94] > 1 || int(b[95]) >= len(valueFormatNames) {
		return h, fmt.Errorf("%w: bad kind or reserved bytes", ErrBadFrame)
	}
	copy(h.Token[:], b[8:24])
	if h.Token != token {
		return h, fmt.Errorf("%w: frame carries another job's token", ErrAuth)
	}
	h.Generation = binary.LittleEndian.Uint32(b[24:])
	if h.Generation != generation {
		return h, fmt.Errorf("%w: generation %d, want %d", ErrBadFrame, h.Generation, generation)
	}
	h.Sender = binary.LittleEndian.Uint32(b[28:])
	if int64(h.Sender) >= int64(size) {
		return h, fmt.Errorf("%w: sender rank %d of %d", ErrBadFrame, h.Sender, size)
	}
	h.Tag.Seq = binary.LittleEndian.Uint64(b[32:])
	h.Tag.Step = binary.LittleEndian.Uint32(b[40:])
	h.Tag.Op = Op(b[44])
	h.Dtype = Dtype(b[45])
	h.Count = binary.LittleEndian.Uint64(b[48:])
	h.PayloadLen = binary.LittleEndian.Uint64(b[56:])
	h.Call = CallDesc{
		Tensor:    binary.LittleEndian.Uint64(b[64:]),
		N:         binary.LittleEndian.Uint64(b[72:]),
		K:         binary.LittleEndian.Uint64(b[80:]),
		Dtype:     Dtype(b[88]),
		Completed: binary.LittleEndian.Uint32(b[90:]),
		Exact:     b[94] == 1,
		Values:    ValueFormat(b[95]),
	}
	h.Reason = AbortReason(b[89])
	if h.Call.Dtype > DtypeUint64 || h.Reason > AbortMismatch {
		return h, fmt.Errorf("%w: bad call dtype or abort reason", ErrBadFrame)
	}
	if (h.Kind == FrameAbort || h.Kind == FrameRefuse) && h.PayloadLen > maxAbortText {
		return h, fmt.Errorf("%w: abort or refusal text of %d bytes", ErrBadFrame, h.PayloadLen)
	}
	if err := checkPayloadSize(h.Dtype, h.Count, h.PayloadLen); err != nil {
		return h, err
	}
	return h, nil
}

// checkPayloadSize verifies that count elements of dtype can occupy
// payloadLen bytes, without overflow: exactly count·width bytes for dense
// dtypes; for sparse ones, count indices coded as gaps and count values of
// width w (core/indexcode.go: 4 bytes for the count and 4 for the first
// index, then at most 4 bytes a gap and a width byte a block), between
// count·w + 8 and count·(w + 5) + 4 bytes, and none for no entries; 8-bit
// values add a 4-byte scale per 32 (core/int8values.go), at least one and
// at most a byte a value and 4 more; 4-bit values (core/int4values.go)
// take exactly ⌈count/2⌉ + 4·⌈count/32⌉ bytes after the indices. Core's
// decoder checks the coded indices and the scales themselves.
func checkPayloadSize(dtype Dtype, count, payloadLen uint64) error {
	var width, scales uint64 // scales: the most bytes of 8-bit values' scales
	sparse := false
	switch dtype {
	case DtypeBytes:
		width = 1
	case DtypeFloat16, DtypeBFloat16:
		width = 2
	case DtypeFloat32:
		width = 4
	case DtypeUint64:
		width = 8
	case DtypeSparseF32:
		width, sparse = 4, true
	case DtypeSparseF16, DtypeSparseBF16:
		width, sparse = 2, true
	case DtypeSparseI8:
		width, sparse, scales = 1, true, count+4
	case DtypeSparseI4:
		sparse = true
	default:
		return fmt.Errorf("%w: unknown dtype %d", ErrBadFrame, dtype)
	}
	// A value takes at least a byte, a 4-bit one half of one: a count
	// above that is refused before it is multiplied.
	bad := payloadLen > maxPayloadBytes || count > payloadLen && (dtype != DtypeSparseI4 || count > 2*payloadLen)
	switch {
	case bad:
	case !sparse:
		bad = count*width != payloadLen
	case count == 0:
		bad = payloadLen != 0
	default:
		least, most := count*width+8, count*(width+5)+4+scales
		switch {
		case dtype == DtypeSparseI4:
			values := (count+1)/2 + 4*((count+31)/32)
			least, most = values+8, values+count*5+4
		case scales > 0:
			least += 4
		}
		bad = payloadLen < least || payloadLen > most
	}
	if bad {
		return fmt.Errorf("%w: %d elements of %s in %d bytes", ErrBadFrame, count, dtype, payloadLen)
	}
	return nil
}

// CheckPayloadSize is checkPayloadSize for tests elsewhere that feed
// payloads past a transport: what it refuses, no frame would deliver.
func CheckPayloadSize(dtype Dtype, count, payloadLen uint64) error {
	return checkPayloadSize(dtype, count, payloadLen)
}
