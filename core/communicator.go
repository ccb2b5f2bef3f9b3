package core

// Communicator: collectives over one transport, one call at a time in the
// same order on every rank, refusals told to the peers, per-tensor state kept
// between calls, and a failed call leaving the caller's data as it was.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// Communicator runs collectives over one transport in the order they are
// issued, which must be the same on every rank: each call takes the next
// sequence number, and the sequence number tags its messages. One call runs
// at a time: a call made while another runs is refused with ErrInvalidUsage
// and takes no sequence number (two goroutines' calls would be numbered in
// whichever order they happened to come, which differs from rank to rank).
//
// A call this rank refuses for its arguments still takes its sequence number
// and tells the peers (transport.Transport.RefuseCall): a peer that made the
// call fails it with ErrMismatch, and none pairs it with this rank's next
// call. After any failure that may have left peers mid-call, the
// communicator is poisoned: every later call fails fast with the first error.
type Communicator struct {
	T transport.Transport

	busy     atomic.Bool // a call is running; see begin
	mu       sync.Mutex  // held for a whole call, and by the tensor state accessors
	seq      uint64
	states   map[uint64]*TensorState
	poisoned error
	before   []float32   // the caller's data before a dense allreduce, put back if it fails
	link     *LinkModel  // Auto's link model, the same on every rank; nil until measured or set
	scratch  callScratch // lent to each sparse call (calls run one at a time)
}

// TensorIDs returns the ids of the tensors that have a state, ascending.
func (c *Communicator) TensorIDs() []uint64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	ids := make([]uint64, 0, len(c.states))
	for id := range c.states {
		ids = append(ids, id)
	}
	sort.Slice(ids, func(a, b int) bool { return ids[a] < ids[b] })
	return ids
}

// NewCommunicator wraps a connected transport.
func NewCommunicator(t transport.Transport) *Communicator {
	return &Communicator{T: t, states: make(map[uint64]*TensorState)}
}

func (c *Communicator) Rank() int { return c.T.Rank() }
func (c *Communicator) Size() int { return c.T.Size() }

// Abort fails the running call (if any) and every later one.
func (c *Communicator) Abort(cause error) {
	c.T.Abort(cause)
}

// errConcurrentCall refuses a call made while another runs.
var errConcurrentCall = fmt.Errorf("%w: another call is running on this communicator; "+
	"calls on one communicator must be made one at a time, in the same order on every rank", ErrInvalidUsage)

// begin takes the communicator for one call and its sequence number. A call
// made while another runs is refused before it takes a number, so the
// running call and the ranks' numbering are untouched.
func (c *Communicator) begin() (uint64, error) {
	if !c.busy.CompareAndSwap(false, true) {
		return 0, errConcurrentCall
	}
	c.mu.Lock()
	if c.poisoned != nil {
		err := fmt.Errorf("%w: earlier failure: %w", transport.ErrAborted, c.poisoned)
		c.release()
		return 0, err
	}
	c.seq++
	return c.seq, nil
}

func (c *Communicator) release() {
	c.mu.Unlock()
	c.busy.Store(false)
}

// end releases the communicator. Any error poisons it, except a step that
// every rank agreed to skip (NaN/Inf, or a malformed sparse input,
// somewhere): anything else may have stranded a peer mid-call, or may have
// completed on some ranks and not on others.
func (c *Communicator) end(err error) error {
	if err != nil && !errors.Is(err, errStepSkipped) {
		c.poisoned = err
		c.T.Abort(err)
	}
	c.release()
	return err
}

// refuse ends call seq, which this rank refuses for err before sending
// anything: the peers are told, and err is returned. The communicator is not
// poisoned here: when every rank refuses the call (the same bad argument
// everywhere) the ranks are still in step. A peer that made the call fails
// with ErrMismatch and aborts, and its abort reaches this rank.
func (c *Communicator) refuse(ctx context.Context, seq uint64, err error) error {
	c.T.RefuseCall(ctx, seq, err.Error())
	c.release()
	return err
}

// Refuse is for a caller that refuses a call before it reaches the
// communicator (the C ABI's checks of pointers and sizes): the refusal takes
// the call's sequence number and tells the peers, as a refusal by the
// communicator's own checks does. It returns err. On a poisoned
// communicator, or while another call runs, it only returns err.
func (c *Communicator) Refuse(ctx context.Context, err error) error {
	seq, berr := c.begin()
	if berr != nil {
		return err
	}
	return c.refuse(ctx, seq, err)
}

// Allreduce sums (or averages) data over every rank with a dense algorithm.
// A failed call leaves data as it was, so nothing of the caller's is lost.
func (c *Communicator) Allreduce(ctx context.Context, data []float32, average bool, alg Algorithm) (Stats, error) {
	return c.AllreduceWith(ctx, data, average, alg, CallOptions{})
}

// AllreduceWith is Allreduce with the call's options; a dense call reads
// only Dtype (what the caller's buffer held before it was widened).
func (c *Communicator) AllreduceWith(ctx context.Context, data []float32, average bool, alg Algorithm, opts CallOptions) (Stats, error) {
	seq, err := c.begin()
	if err != nil {
		return Stats{}, err
	}
	if alg.row().dense == nil && alg != Auto {
		return Stats{}, c.refuse(ctx, seq, fmt.Errorf("%w: %v is not a dense allreduce", ErrInvalidArgument, alg))
	}
	if alg == Auto {
		ch, next, err := c.autoChoose(ctx, seq, len(data), DefaultConfig(), false)
		if err != nil {
			return Stats{}, c.end(err)
		}
		seq, alg = next, ch.alg
	}
	return c.allreduce(ctx, seq, 0, data, average, alg, opts.Dtype)
}

// allreduce runs call seq, taken by begin, as a dense allreduce of data;
// tensor (0 if none) goes into the call's descriptor.
func (c *Communicator) allreduce(ctx context.Context, seq, tensor uint64, data []float32, average bool, alg Algorithm, dtype transport.Dtype) (Stats, error) {
	st := Stats{Algorithm: alg, Predicted: c.predicted(alg, len(data), DefaultConfig())}
	f := algorithms[alg].dense
	start := time.Now()
	call := NewCall(c.T, alg.Op(), seq, &st, WithDesc(DescribeCall(dtype, tensor, len(data), len(data))))
	// Rabenseifner reduces in place, so a failure midway would leave partial
	// sums; one copy (kept for the next call) puts the input back. The ring
	// writes data only once every message has arrived.
	call.Phase(PhaseOutput)
	backup := c.Size() > 1 && alg != DenseRing
	if backup {
		if cap(c.before) < len(data) {
			c.before = make([]float32, len(data))
		}
		copy(c.before[:len(data)], data)
	}
	err := f(ctx, call, data)
	call.Phase(PhaseOutput)
	if err != nil && backup {
		copy(data, c.before[:len(data)])
	}
	if err == nil && average {
		scale(data, c.Size())
	}
	call.EndPhases()
	st.Total = time.Since(start)
	return st, c.end(err)
}

// MaxElements is the largest n a sparse call takes: indices travel as
// uint32.
const MaxElements = math.MaxUint32

// tensorSnapshot is what a sparse call may change in a tensor's state before
// it knows the call will succeed; a failed call restores it, so a retry (or a
// skipped step) starts from exactly the state before it. The residual needs
// no copy: every algorithm writes it only after all communication succeeded.
type tensorSnapshot struct {
	config        Config
	iter          int
	local, global float32
	boundaries    []uint32
}

func snapshotOf(st *TensorState, cfg Config) tensorSnapshot {
	return tensorSnapshot{config: cfg, iter: st.Iter, local: st.LocalThreshold, global: st.GlobalThreshold,
		boundaries: append([]uint32(nil), st.Boundaries...)}
}

func (s tensorSnapshot) restore(st *TensorState) {
	st.Config = s.config
	st.Iter, st.LocalThreshold, st.GlobalThreshold = s.iter, s.local, s.global
	if s.boundaries == nil {
		st.Boundaries = nil
	} else {
		st.Boundaries = append(st.Boundaries[:0:0], s.boundaries...)
	}
}

// state returns the per-tensor state for id, creating it for a tensor of n
// elements; a later call with a different n is misuse, reported as
// ErrInvalidArgument.
func (c *Communicator) state(id uint64, n int, cfg Config) (*TensorState, error) {
	st := c.states[id]
	if st == nil {
		st = NewTensorState(n, cfg)
		st.Rank, st.Size = c.Rank(), c.Size()
		c.states[id] = st
		return st, nil
	}
	if st.N != n {
		return nil, fmt.Errorf("%w: tensor %d has %d elements, earlier calls had %d", ErrInvalidArgument, id, n, st.N)
	}
	st.beforeFold = nil // a fold is undone before the tensor's next call or not at all
	if st.CallerResidual {
		return nil, fmt.Errorf("%w: tensor %d's residual is the caller's (caller-selected calls); a dense-input call needs it in the library "+
			"(a new tensor id, or its checkpoint loaded without taking the residual)", ErrInvalidArgument, id)
	}
	if len(st.Residual) != n {
		return nil, fmt.Errorf("%w: tensor %d's state holds a residual of %d elements for n=%d", ErrInvalidArgument, id, len(st.Residual), n)
	}
	st.Config = cfg
	return st, nil
}

// SparseAllreduce reduces grad (this rank's gradient) in place into the
// averaged sparse global result, keeping tensor id's residual and thresholds.
// Dense algorithms in cfg are allowed and average without state; Auto
// chooses the algorithm of every call (auto.go).
//
// A failed call leaves grad and the tensor's state (residual, thresholds,
// region boundaries, call count) as they were. NaN or Inf in grad+residual on
// any rank makes every rank return ErrNonFinite for the step (skipped
// everywhere, the communicator stays usable). Bad arguments are
// ErrInvalidArgument here and ErrMismatch on every peer that made the call.
func (c *Communicator) SparseAllreduce(ctx context.Context, id uint64, grad []float32, cfg Config) (Stats, error) {
	return c.SparseAllreduceHolding(ctx, id, grad, cfg, nil)
}

// SparseAllreduceHolding is SparseAllreduce with the entries of grad in the
// ranges hold (ascending, disjoint) held back by this rank for this call:
// none of them is selected or sent, and their grad + residual stays in the
// residual. Other ranks' entries there are reduced as usual. It is for
// entries whose result the caller will discard — a parameter a framework
// found unused at this step (PyTorch DDP leaves the gradient of a
// parameter unused on every rank untouched) — so that error feedback loses
// nothing of them. Dense algorithms keep no residual and ignore hold.
func (c *Communicator) SparseAllreduceHolding(ctx context.Context, id uint64, grad []float32, cfg Config, hold []Span) (Stats, error) {
	return c.SparseAllreduceWith(ctx, id, grad, cfg, CallOptions{Hold: hold})
}

// CallOptions are the extras of one sparse call (SparseAllreduceWith).
type CallOptions struct {
	// Hold is the ranges of grad this rank holds back for this call
	// (SparseAllreduceHolding).
	Hold []Span
	// MeasureXi makes the call also measure ξ (xi.go) into Stats.Xi; every
	// rank must ask for it in the same call (else ErrMismatch).
	MeasureXi bool
	// SparseOnly makes Auto choose among the sparse algorithms only, for a
	// caller that weighs sparse against a dense allreduce of its own.
	SparseOnly bool
	// Undoable makes the call keep what UndoCall needs to take it back: a
	// copy of the tensor's residual before the call (undo.go). Local: the
	// ranks need not agree on it.
	Undoable bool
	// Dtype is the element type of the caller's buffer (a binding widens
	// float16 and bfloat16 to float32 before the call); every frame carries
	// it, so ranks passing different dtypes fail with ErrMismatch. The zero
	// value stands for float32.
	Dtype transport.Dtype
}

// SparseAllreduceWith is SparseAllreduce with the call's extras: held
// ranges and the measurement of ξ.
func (c *Communicator) SparseAllreduceWith(ctx context.Context, id uint64, grad []float32, cfg Config, opts CallOptions) (Stats, error) {
	var stats Stats
	seq, err := c.begin()
	if err != nil {
		return stats, err
	}
	if err := cfg.Validate(); err != nil {
		return stats, c.refuse(ctx, seq, err)
	}
	if uint64(len(grad)) > MaxElements {
		return stats, c.refuse(ctx, seq, fmt.Errorf("%w: %d elements, at most 2^32-1", ErrInvalidArgument, len(grad)))
	}
	if err := checkHold(opts.Hold, len(grad)); err != nil {
		return stats, c.refuse(ctx, seq, err)
	}
	if cfg.Algorithm == Auto {
		return c.autoSparseAllreduce(ctx, seq, id, grad, cfg, opts)
	}
	if cfg.Algorithm.Dense() {
		// A dense algorithm keeps no residual and selects nothing: there is
		// no selection error to measure, so MeasureXi is ignored.
		return c.allreduce(ctx, seq, id, grad, true, cfg.Algorithm, opts.Dtype)
	}
	if cfg.Algorithm.row().sparse == nil {
		return stats, c.refuse(ctx, seq, fmt.Errorf("%w: %v is not built into this library", ErrInvalidArgument, cfg.Algorithm))
	}
	st, undo, err := c.callState(id, len(grad), cfg, opts.Undoable)
	if err != nil {
		return stats, c.refuse(ctx, seq, err)
	}
	var sums *xiSums
	if opts.MeasureXi {
		if sums, seq, err = c.measureXiSums(ctx, seq, id, st, grad, opts.Dtype); err != nil {
			undo()
			return stats, c.end(err)
		}
	}
	stats.Predicted = c.predicted(cfg.Algorithm, len(grad), cfg)
	err = c.sparseCall(ctx, seq, id, st, undo, grad, cfg.Algorithm, opts, &stats)
	if err == nil && sums != nil {
		sums.report(&stats, grad, c.Size())
	}
	return stats, c.end(err)
}

// callState is state for a call that may fail: it also returns how to undo
// what taking the state did (a new state removed, the tensor's earlier
// settings put back) together with what the call itself changes before it
// knows it succeeded (snapshotOf). A failed call leaves no trace. An
// undoable call also keeps what UndoCall needs (undo.go).
func (c *Communicator) callState(id uint64, n int, cfg Config, undoable bool) (*TensorState, func(), error) {
	old, existed := c.states[id]
	var oldConfig Config
	if existed {
		oldConfig = old.Config
	}
	st, err := c.state(id, n, cfg)
	if err != nil {
		return nil, nil, err
	}
	before := snapshotOf(st, oldConfig)
	st.keepForUndo(before, !existed, undoable) // the residual copied before the call changes it (undo.go)
	undo := func() {
		before.restore(st)
		st.dropUndo() // a failed call left nothing to take back
		if !existed {
			delete(c.states, id)
		}
	}
	return st, undo, nil
}

// sparseCall runs call seq on tensor id, whose state is st, with the sparse
// algorithm alg and the call's options (this rank's held ranges, the
// caller's dtype); a failure undoes what the call did to the states.
func (c *Communicator) sparseCall(ctx context.Context, seq, id uint64, st *TensorState, undo func(), grad []float32, alg Algorithm, opts CallOptions, stats *Stats) error {
	start := time.Now()
	stats.Algorithm = alg
	stats.K = st.Config.K(len(grad))
	desc := DescribeCall(opts.Dtype, id, len(grad), stats.K)
	desc.Completed, desc.Values = uint32(st.Iter), transport.ValueFormat(st.Config.Values)
	if exact := algorithms[alg].exactCall; exact != nil {
		desc.Exact = exact(st, stats.K, len(grad))
	}
	call := NewCall(c.T, alg.Op(), seq, stats, WithDesc(desc), withScratch(&c.scratch))
	call.Values, call.Hold = st.Config.Values, opts.Hold
	err := algorithms[alg].sparse(ctx, call, st, grad)
	call.EndPhases()
	if err != nil {
		undo()
	}
	stats.Total = time.Since(start)
	return err
}

// TensorStateOf returns the state kept for tensor id, or nil.
func (c *Communicator) TensorStateOf(id uint64) *TensorState {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.states[id]
}

// SetTensorState installs st for tensor id (restoring a checkpoint).
func (c *Communicator) SetTensorState(id uint64, st *TensorState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.states[id] = st
}

// scale divides by the number of ranks; division (not multiplication by
// 1/P) keeps integer-valued sums exact when P divides them.
func scale(v []float32, p int) {
	if p == 1 {
		return
	}
	fp := float32(p)
	for i := range v {
		v[i] /= fp
	}
}

func countNonFinite(v []float32) int {
	bad := 0
	for _, x := range v {
		if x-x != 0 { // NaN for NaN and ±Inf, 0 otherwise
			bad++
		}
	}
	return bad
}
