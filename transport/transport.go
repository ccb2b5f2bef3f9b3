// Package transport moves tagged byte messages between the ranks of one job.
//
// Algorithms in package core never see sockets: they call Send and Recv on a
// Transport with a Tag naming the operation, its sequence number on the
// communicator and the step within it, so messages of concurrent operations
// never cross. Two implementations exist: an in-process one over channels
// (for unit tests) and a ZeroMQ TCP one in package transport/zmq (what a
// user runs). This package also holds what both share: the frame format,
// the mailbox that matches messages to receives, and the rendezvous (a
// Store, a unique id, a launcher's environment).
package transport

import (
	"context"
	"errors"
	"fmt"
)

// Op is the kind of collective operation a message belongs to. It travels in
// every frame header so that two ranks issuing different operations with the
// same sequence number are caught as a mismatch instead of exchanging data.
type Op uint8

const (
	OpNone Op = iota
	OpAllreduceRing
	OpAllreduceRabenseifner
	OpAllgather
	OpOkTopk
	OpTopkA
	OpTopkDSA
	OpSSARRecursiveDouble
	OpSSARSplitAllgather
	OpDSARSplitAllgather
	OpGTopk
	OpGaussiank
	OpBroadcast
	OpBarrier
	OpControl
	OpLinkProbe // the link measurement of core's auto algorithm choice
	OpXiSums    // the dense sums a call that measures ξ reduces first (core/xi.go)
)

var opNames = [...]string{"none", "allreduce_ring", "allreduce_rabenseifner", "allgather",
	"oktopk", "topka", "topkdsa", "ssar_recursive_double", "ssar_split_allgather",
	"dsar_split_allgather", "gtopk", "gaussiank", "broadcast", "barrier", "control", "link_probe", "xi_sums"}

func (o Op) String() string {
	if int(o) < len(opNames) {
		return opNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Dtype is the element type a payload carries. Bulk payloads are raw
// little-endian bytes of this type; sparse ones their indices coded as gaps
// (core/indexcode.go), then their values so.
type Dtype uint8

const (
	DtypeBytes Dtype = iota // opaque bytes (control messages)
	DtypeFloat32
	DtypeFloat16
	DtypeBFloat16
	DtypeSparseF32 // count indices coded as gaps, then count float32 values
	DtypeUint64
	DtypeSparseF16  // count coded indices, then count float16 values
	DtypeSparseBF16 // count coded indices, then count bfloat16 values
	DtypeSparseI8   // count coded indices, then count 8-bit values with a scale per 32 (core/int8values.go)
	DtypeSparseI4   // count coded indices, then count 4-bit values with a scale per 32 (core/int4values.go)
)

var dtypeNames = [...]string{"bytes", "float32", "float16", "bfloat16", "sparse_f32", "uint64", "sparse_f16", "sparse_bf16", "sparse_i8", "sparse_i4"}

func (d Dtype) String() string {
	if int(d) < len(dtypeNames) {
		return dtypeNames[d]
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// Tag identifies one message of one operation: which operation (Op), which
// call on the communicator (Seq, issued identically on every rank) and which
// step of that call (Step). Recv matches on (Seq, Step) and reports a
// mismatch when the peer's Op differs, or its CallDesc (see StartCall).
type Tag struct {
	Op   Op
	Seq  uint64
	Step uint32
}

// CallDesc describes one collective call as the calling rank issued it
// (Transport.StartCall). Every data frame of the call carries the sender's,
// and the receiver compares it with its own:
// ranks that issued different calls under one sequence number (another
// tensor, size, dtype or k) fail with ErrMismatch naming the field and both
// values, instead of exchanging data that merely happens to fit.
type CallDesc struct {
	Tensor uint64 // tensor id (0 for calls without one)
	N      uint64 // elements in the caller's buffer
	K      uint64 // elements selected per rank (N for dense calls)
	Dtype  Dtype  // element type of the caller's buffer
	// Completed is how many calls on the tensor this rank's state has
	// completed (mod 2^32; 0 for calls without state). Ranks that disagree
	// hold states from different steps, for example states saved after a
	// call that completed on some ranks and failed on others.
	Completed uint32
	// Exact says the call selects exactly, refreshing the thresholds it
	// otherwise reuses (Ok-Topk's every-τ′ calls): ranks that disagree would
	// cut the global selection differently.
	Exact bool
	// Values is the format the call's sparse values travel in (core's
	// ValueType: float32, float16, bfloat16, int8, int4; 0 for calls without
	// sparse values): ranks that disagree would read each other's values
	// in the wrong format.
	Values ValueFormat
}

// ValueFormat is CallDesc.Values, numbered as core's ValueType.
type ValueFormat uint8

var valueFormatNames = [...]string{"float32", "float16", "bfloat16", "int8", "int4"}

func (v ValueFormat) String() string {
	if int(v) < len(valueFormatNames) {
		return valueFormatNames[v]
	}
	return fmt.Sprintf("value format(%d)", uint8(v))
}

// checkSameCall compares the call rank self issued (op, mine) with what
// peer's frame of call seq says (theirOp, theirs) and names the first field
// that differs.
func checkSameCall(self, peer int, seq uint64, op Op, mine CallDesc, theirOp Op, theirs CallDesc) error {
	field, a, b := "", "", ""
	switch {
	case op != theirOp:
		field, a, b = "algorithm", op.String(), theirOp.String()
	case mine.Tensor != theirs.Tensor:
		field, a, b = "tensor", fmt.Sprint(mine.Tensor), fmt.Sprint(theirs.Tensor)
	case mine.N != theirs.N:
		field, a, b = "n", fmt.Sprint(mine.N), fmt.Sprint(theirs.N)
	case mine.Dtype != theirs.Dtype:
		field, a, b = "dtype", mine.Dtype.String(), theirs.Dtype.String()
	case mine.K != theirs.K:
		field, a, b = "k", fmt.Sprint(mine.K), fmt.Sprint(theirs.K)
	case mine.Completed != theirs.Completed:
		field, a, b = "completed calls", fmt.Sprint(mine.Completed), fmt.Sprint(theirs.Completed)
	case mine.Exact != theirs.Exact:
		field, a, b = "exact selection", fmt.Sprint(mine.Exact), fmt.Sprint(theirs.Exact)
	case mine.Values != theirs.Values:
		field, a, b = "values", mine.Values.String(), theirs.Values.String()
	default:
		return nil
	}
	return &MismatchError{Field: field, Seq: seq, Ranks: [2]int{self, peer}, Values: [2]string{a, b}}
}

// MismatchError says which field of a call differed between two ranks.
// errors.Is(err, ErrMismatch) holds for it.
type MismatchError struct {
	Field  string    // algorithm, tensor, n, dtype, k, completed calls, exact selection or values
	Seq    uint64    // the call's sequence number
	Ranks  [2]int    // the two ranks compared
	Values [2]string // the field's value on each
}

func (e *MismatchError) Error() string {
	return fmt.Sprintf("%v: %s", ErrMismatch, e.Detail())
}

// Detail is the error without the ErrMismatch prefix, as peers receive it.
func (e *MismatchError) Detail() string {
	return fmt.Sprintf("%s: rank %d has %s, rank %d has %s (call seq=%d)",
		e.Field, e.Ranks[0], e.Values[0], e.Ranks[1], e.Values[1], e.Seq)
}

func (e *MismatchError) Unwrap() error { return ErrMismatch }

func (t Tag) String() string { return fmt.Sprintf("%s seq=%d step=%d", t.Op, t.Seq, t.Step) }

// Message is what Recv returns: the payload plus what the sender's frame
// header said about it.
type Message struct {
	Tag     Tag
	Dtype   Dtype
	Count   uint64   // element count the sender declared
	Call    CallDesc // the sender's call, as it announced it in StartCall
	Payload []byte
}

// Transport is one rank's endpoint to every other rank of the job.
//
// Send and Recv are safe for concurrent use by many goroutines. Messages
// between one pair of ranks with the same Tag arrive in the order sent;
// messages from different peers never block each other. Both honour ctx's
// deadline and cancellation, and fail fast once the transport is closed or
// aborted.
type Transport interface {
	Rank() int
	Size() int
	// StartCall announces that this rank has begun call seq, running op, as
	// described by call. Its messages of that call carry call; peers' frames
	// of that call are checked against it as they arrive (a difference is
	// ErrMismatch on every rank); peers learn from this rank's heartbeats
	// that it started (stall diagnostics).
	StartCall(op Op, seq uint64, call CallDesc)
	// RefuseCall announces that this rank refused call seq for reason (an
	// argument its peers may not share) and will send nothing under it. It
	// tells every peer; a peer whose call seq is running, or starts later,
	// fails it with ErrMismatch naming this rank and the reason. A peer
	// that refused call seq too ignores it, so ranks that all refuse a call
	// stay in step. Frames of call seq that arrive here are dropped.
	// It returns once the peers are told (over TCP: the frames are handed
	// to the sockets) or ctx ends.
	RefuseCall(ctx context.Context, seq uint64, reason string)
	// Send queues payload for peer. When Send returns the caller may reuse
	// payload; delivery errors surface on the peer's side or in later calls.
	Send(ctx context.Context, peer int, tag Tag, dtype Dtype, count uint64, payload []byte) error
	// Recv blocks until the message with tag.Seq and tag.Step from peer
	// arrives. A message whose Op differs from tag.Op, or whose CallDesc
	// differs from this rank's for that call, yields ErrMismatch and fails
	// the transport, so that every rank learns of it.
	Recv(ctx context.Context, peer int, tag Tag) (Message, error)
	// Abort fails every blocked and future call with ErrAborted (plus cause).
	Abort(cause error)
	// Close releases sockets and goroutines; it returns within the linger
	// bound even when peers are dead.
	Close() error
}

// Errors a caller can test for with errors.Is. They map one-to-one onto the
// C ABI's result codes.
var (
	ErrTimeout    = errors.New("oktopk: timeout")
	ErrAborted    = errors.New("oktopk: communicator aborted")
	ErrMismatch   = errors.New("oktopk: mismatched call across ranks")
	ErrRemote     = errors.New("oktopk: remote peer failed")
	ErrClosed     = errors.New("oktopk: transport closed")
	ErrBadFrame   = errors.New("oktopk: malformed frame")
	ErrBadPeer    = errors.New("oktopk: peer rank out of range")
	ErrAuth       = errors.New("oktopk: connection with wrong job token refused")
	ErrRendezvous = errors.New("oktopk: rendezvous failed")
	// ErrInvalidArgument is a bad setting or argument; package core's
	// ErrInvalidArgument is this same value, so every layer's reports map
	// to the one result code.
	ErrInvalidArgument = errors.New("oktopk: invalid argument")
)

// ContextError turns a context error into ErrTimeout / ErrAborted with what
// was being waited for, so a user sees which peer and which operation hung.
func ContextError(ctx context.Context, what string) error {
	err := ctx.Err()
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("%w: %s", ErrTimeout, what)
	}
	if cause := context.Cause(ctx); cause != nil && !errors.Is(cause, context.Canceled) {
		return fmt.Errorf("%w: %s: %w", ErrAborted, what, cause)
	}
	return fmt.Errorf("%w: %s: %w", ErrAborted, what, err)
}

// CheckPeer refuses a peer rank that is out of range or t's own, with
// ErrBadPeer: what every Send and Recv checks first.
func CheckPeer(t Transport, peer int) error {
	if peer < 0 || peer >= t.Size() || peer == t.Rank() {
		return fmt.Errorf("%w: peer %d with rank %d of %d", ErrBadPeer, peer, t.Rank(), t.Size())
	}
	return nil
}
