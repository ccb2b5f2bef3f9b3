package core

// TensorState, what sparse allreduce keeps per tensor between calls, and
// its checkpoint format: MarshalBinary, UnmarshalBinary (versions 1 to 3,
// the last checksummed) and CheckOwner.

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"
	"strings"
)

// TensorState is what sparse allreduce keeps for one tensor between calls:
// the residual of error feedback, the reused thresholds and the region
// boundaries of Ok-Topk, and the call counter that schedules their refresh.
type TensorState struct {
	N      int
	Config Config
	Iter   int // calls completed on this tensor

	Residual        []float32 // error feedback: what was computed but not yet sent
	LocalThreshold  float32   // reused |x| > threshold selection (0: not yet known)
	GlobalThreshold float32
	Boundaries      []uint32 // P+1 region starts: rank r owns [Boundaries[r], Boundaries[r+1])

	// CallerResidual: the residual is the caller's (caller-selected calls,
	// oktopk_selected.go) and Residual is empty; a checkpoint takes the
	// caller's residual (MarshalWithResidual).
	CallerResidual bool

	// The rank that keeps this state and its communicator's size. The
	// residual is this rank's own unsent gradient, so a checkpoint of it is
	// meaningful only to the same rank of a communicator of the same size;
	// a checkpoint records both so that loading it elsewhere can be refused
	// (CheckOwner). Size 0: unknown (a version-1 checkpoint).
	Rank, Size int

	// The residual as it was before the latest FoldResidual, kept until
	// UnfoldResidual or the tensor's next call: the fold's caller learns
	// only from its own dense sum whether the step was skipped.
	beforeFold []float32

	// What UndoCall needs to take back the tensor's latest call (undo.go).
	lastCall callRecord

	scratch okTopkScratch
}

// NewTensorState makes the state of a tensor of n elements.
func NewTensorState(n int, cfg Config) *TensorState {
	return &TensorState{N: n, Config: cfg, Residual: make([]float32, n)}
}

// The checkpoint format of a TensorState, little-endian:
//
//	magic "OKTS", version uint32, n uint64, iter uint64,
//	algorithm int32, density float64, tau int32, tau' int32,
//	local threshold float32, global threshold float32,
//	boundary count uint32, rank uint32, size uint32, checksum uint32,
//	boundaries uint32…, residual float32 × n
//
// The checksum is the CRC-32C (Castagnoli) of every other byte, the
// checksum field read as zero: a byte flipped in a saved file that would
// still load (a finite residual, a valid threshold) is refused instead of
// changing later results. Versions 1 (no rank, size or checksum) and 2 (no
// checksum) are still read.
const (
	stateMagic         = 0x53544b4f // "OKTS"
	stateVersion       = 3
	stateFixedV1       = 4 + 4 + 8 + 8 + 4 + 8 + 4 + 4 + 4 + 4 + 4
	stateFixedV2       = stateFixedV1 + 4 + 4
	stateFixed         = stateFixedV2 + 4
	maxStateRanks      = 1 << 20
	stateRankField     = stateFixedV1
	stateChecksumField = stateFixedV2
)

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// stateChecksum is the CRC-32C of a version-3 checkpoint with its checksum
// field taken as zero.
func stateChecksum(b []byte) uint32 {
	var zero [4]byte
	c := crc32.Update(0, castagnoli, b[:stateChecksumField])
	c = crc32.Update(c, castagnoli, zero[:])
	return crc32.Update(c, castagnoli, b[stateChecksumField+4:])
}

// MarshalBinary serializes the state for a checkpoint.
func (st *TensorState) MarshalBinary() ([]byte, error) {
	if st.CallerResidual {
		return nil, fmt.Errorf("%w: the residual of this tensor is the caller's: save it with the caller's residual", ErrInvalidArgument)
	}
	return st.marshal(st.Residual), nil
}

// MarshalWithResidual serializes a caller-residual state with the caller's
// residual, in the format of MarshalBinary: a checkpoint either form of the
// call resumes.
func (st *TensorState) MarshalWithResidual(residual []float32) ([]byte, error) {
	if !st.CallerResidual {
		return nil, fmt.Errorf("%w: this tensor keeps its residual in the library: save it without one", ErrInvalidArgument)
	}
	if len(residual) != st.N {
		return nil, fmt.Errorf("%w: residual of %d elements for a tensor of %d", ErrInvalidArgument, len(residual), st.N)
	}
	if bad := countNonFinite(residual); bad > 0 {
		return nil, fmt.Errorf("%w: the caller's residual holds %d NaN or Inf", ErrInvalidArgument, bad)
	}
	return st.marshal(residual), nil
}

// TakeResidual makes a state just loaded a caller-residual one, handing its
// residual to the caller.
func (st *TensorState) TakeResidual() []float32 {
	r := st.Residual
	st.Residual, st.CallerResidual = nil, true
	return r
}

// MarshaledSize is the length of the state's checkpoint.
func (st *TensorState) MarshaledSize() int { return stateFixed + 4*len(st.Boundaries) + 4*st.N }

func (st *TensorState) marshal(residual []float32) []byte {
	b := make([]byte, 0, stateFixed+4*len(st.Boundaries)+4*st.N)
	le := binary.LittleEndian
	b = le.AppendUint32(b, stateMagic)
	b = le.AppendUint32(b, stateVersion)
	b = le.AppendUint64(b, uint64(st.N))
	b = le.AppendUint64(b, uint64(st.Iter))
	b = le.AppendUint32(b, uint32(int32(st.Config.Algorithm)))
	b = le.AppendUint64(b, math.Float64bits(st.Config.Density))
	b = le.AppendUint32(b, uint32(int32(st.Config.Tau)))
	b = le.AppendUint32(b, uint32(int32(st.Config.TauPrime)))
	b = le.AppendUint32(b, math.Float32bits(st.LocalThreshold))
	b = le.AppendUint32(b, math.Float32bits(st.GlobalThreshold))
	b = le.AppendUint32(b, uint32(len(st.Boundaries)))
	b = le.AppendUint32(b, uint32(st.Rank))
	b = le.AppendUint32(b, uint32(st.Size))
	b = le.AppendUint32(b, 0) // the checksum, below
	for _, x := range st.Boundaries {
		b = le.AppendUint32(b, x)
	}
	b = append(b, float32Bytes(residual)...)
	le.PutUint32(b[stateChecksumField:], stateChecksum(b))
	return b
}

// UnmarshalBinary restores a state written by MarshalBinary; every length is
// checked before anything is allocated from it.
func (st *TensorState) UnmarshalBinary(b []byte) error {
	bad := func(what string) error { return fmt.Errorf("%w: tensor state: %s", ErrInvalidArgument, what) }
	le := binary.LittleEndian
	if len(b) < stateFixedV1 {
		return bad("too short")
	}
	if le.Uint32(b) != stateMagic {
		return bad("not a tensor state")
	}
	var fixed int
	switch v := le.Uint32(b[4:]); v {
	case 1:
		fixed = stateFixedV1
	case 2:
		fixed = stateFixedV2
	case stateVersion:
		fixed = stateFixed
	default:
		return bad(fmt.Sprintf("version %d, this library reads 1 to %d", v, stateVersion))
	}
	if len(b) < fixed {
		return bad("too short")
	}
	if fixed == stateFixed {
		if got, want := le.Uint32(b[stateChecksumField:]), stateChecksum(b); got != want {
			return bad(fmt.Sprintf("checksum %08x, the bytes sum to %08x: the saved state is corrupt", got, want))
		}
	}
	var rank, size uint64
	if fixed >= stateFixedV2 {
		rank, size = uint64(le.Uint32(b[stateRankField:])), uint64(le.Uint32(b[stateRankField+4:]))
		if size > maxStateRanks || (size > 0 && rank >= size) || (size == 0 && rank != 0) {
			return bad(fmt.Sprintf("rank %d of %d", rank, size))
		}
	}
	n, iter := le.Uint64(b[8:]), le.Uint64(b[16:])
	cfg := Config{
		Algorithm: Algorithm(int32(le.Uint32(b[24:]))),
		Density:   math.Float64frombits(le.Uint64(b[28:])),
		Tau:       int(int32(le.Uint32(b[36:]))),
		TauPrime:  int(int32(le.Uint32(b[40:]))),
	}
	local, global := math.Float32frombits(le.Uint32(b[44:])), math.Float32frombits(le.Uint32(b[48:]))
	nb := uint64(le.Uint32(b[52:]))
	if n > math.MaxUint32 || iter > math.MaxInt32 || nb > 1<<20 {
		return bad("sizes out of range")
	}
	if uint64(len(b)) != uint64(fixed)+4*nb+4*n {
		return bad(fmt.Sprintf("%d bytes for n=%d and %d boundaries", len(b), n, nb))
	}
	if err := cfg.Validate(); err != nil {
		return bad(strings.TrimPrefix(err.Error(), ErrInvalidArgument.Error()+": "))
	}
	bounds := make([]uint32, nb)
	for i := range bounds {
		bounds[i] = le.Uint32(b[fixed+4*i:])
		if bounds[i] > uint32(n) || (i > 0 && bounds[i] < bounds[i-1]) {
			return bad("region boundaries out of order")
		}
	}
	// The regions partition [0, n): an entry outside every region would be
	// sent to an owner whose region does not hold it.
	if nb > 0 && (bounds[0] != 0 || bounds[nb-1] != uint32(n)) {
		return bad(fmt.Sprintf("region boundaries run from %d to %d, not from 0 to n=%d", bounds[0], bounds[nb-1], n))
	}
	residual := make([]float32, n)
	copy(float32Bytes(residual), b[uint64(fixed)+4*nb:])
	for _, v := range residual {
		if !IsFinite(v) {
			return bad("residual holds NaN or Inf")
		}
	}
	*st = TensorState{N: int(n), Config: cfg, Iter: int(iter), Residual: residual,
		LocalThreshold: local, GlobalThreshold: global, Boundaries: bounds, Rank: int(rank), Size: int(size)}
	if nb == 0 {
		st.Boundaries = nil
	}
	return nil
}

// Regroup makes a state that rank kept in a communicator of another size
// this rank's state in a communicator of size ranks, for a job that went on
// without a lost rank (a shrink) or took one back: the residual, this
// rank's own unsent gradient, is kept whole, so no mass it holds is lost.
// What depends on the rank count is dropped: the region boundaries
// partition the tensor among the old ranks, and the global threshold was
// read from their sum. The call count starts again at 0, so that the next
// call selects exactly and partitions afresh on every rank alike (every
// rank regroups every tensor at the same step).
func (st *TensorState) Regroup(rank, size int) {
	st.Rank, st.Size = rank, size
	st.Iter = 0
	st.LocalThreshold, st.GlobalThreshold = 0, 0
	st.Boundaries = nil
	st.beforeFold = nil
	st.lastCall = callRecord{}
}

// RegroupedCopy is a copy of st (its residual copied too, when it holds
// one) regrouped for rank of size (Regroup).
func (st *TensorState) RegroupedCopy(rank, size int) *TensorState {
	c := &TensorState{N: st.N, Config: st.Config, CallerResidual: st.CallerResidual}
	if st.Residual != nil {
		c.Residual = append([]float32(nil), st.Residual...)
	}
	c.Regroup(rank, size)
	return c
}

// CheckOwner refuses a state that belongs to another rank, or to a
// communicator of another size, than rank of size: its residual is another
// rank's unsent gradient, and its Ok-Topk region boundaries partition the
// tensor among another number of ranks. Loading it would not fail at once
// but make the run drift, or fail at the first step. A state of unknown
// owner (version 1) is checked only by its boundary count.
func (st *TensorState) CheckOwner(rank, size int) error {
	if st.Size != 0 && st.Size != size {
		return fmt.Errorf("%w: state was saved by a communicator of %d ranks, this one has %d: "+
			"residuals and region boundaries are per rank and cannot be repartitioned; resume with %d ranks or start this tensor afresh",
			ErrInvalidArgument, st.Size, size, st.Size)
	}
	if st.Size != 0 && st.Rank != rank {
		return fmt.Errorf("%w: state was saved by rank %d, this is rank %d: each rank must load its own state "+
			"(save every rank's state, e.g. under a per-rank file name)", ErrInvalidArgument, st.Rank, rank)
	}
	if n := len(st.Boundaries); n != 0 && n != size+1 {
		return fmt.Errorf("%w: state has %d region boundaries (saved by a communicator of %d ranks), this one has %d ranks: "+
			"resume with %d ranks or start this tensor afresh", ErrInvalidArgument, n, n-1, size, n-1)
	}
	return nil
}
