package core

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// denseAllreduceFunc sums data over every rank, in place; every rank ends
// with bitwise identical data.
type denseAllreduceFunc func(ctx context.Context, call *Call, data []float32) error

// sparseAllreduceFunc reduces one rank's dense gradient with error feedback:
// on return grad holds the averaged sparse global result (zeros elsewhere,
// bitwise identical on every rank) and st.Residual what was not sent.
type sparseAllreduceFunc func(ctx context.Context, call *Call, st *TensorState, grad []float32) error

// sparseInputFunc reduces sparse inputs with no state and returns the summed
// (not averaged) sparse global result, identical on every rank.
type sparseInputFunc func(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error)

// The algorithm files register themselves here in their init functions, so
// the dispatcher never has to know their internals.
var (
	denseAlgorithms       = map[Algorithm]denseAllreduceFunc{}
	sparseAlgorithms      = map[Algorithm]sparseAllreduceFunc{}
	sparseInputAlgorithms = map[Algorithm]sparseInputFunc{}
)

func registerDense(a Algorithm, f denseAllreduceFunc)   { denseAlgorithms[a] = f }
func registerSparse(a Algorithm, f sparseAllreduceFunc) { sparseAlgorithms[a] = f }
func registerSparseInput(a Algorithm, f sparseInputFunc) {
	sparseInputAlgorithms[a] = f
}

// Communicator runs collectives over one transport in the order they are
// issued, which must be the same on every rank: each call takes the next
// sequence number, and the sequence number tags its messages. After any
// failure that may have left peers mid-call, the communicator is poisoned:
// every later call fails fast with the first error.
type Communicator struct {
	T transport.Transport

	mu       sync.Mutex // held for a whole call: calls run one at a time, in issue order
	seq      uint64
	states   map[uint64]*TensorState
	poisoned error
	before   []float32   // the caller's data before a dense allreduce, put back if it fails
	scratch  callScratch // lent to each sparse call (calls run one at a time)
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

// begin takes the communicator for one call and its sequence number.
func (c *Communicator) begin() (uint64, error) {
	c.mu.Lock()
	if c.poisoned != nil {
		c.mu.Unlock()
		return 0, fmt.Errorf("%w: earlier failure: %w", transport.ErrAborted, c.poisoned)
	}
	c.seq++
	return c.seq, nil
}

// end releases the communicator; a communication error poisons it, because
// peers may be stranded mid-call and the sequence numbers no longer agree.
func (c *Communicator) end(err error) error {
	// A step that every rank agreed to skip (NaN/Inf somewhere) leaves the
	// ranks in step; anything else may have stranded a peer mid-call.
	if err != nil && !errors.Is(err, ErrInvalidArgument) && !errors.Is(err, ErrInvalidUsage) && !errors.Is(err, errStepSkipped) {
		c.poisoned = err
		c.T.Abort(err)
	}
	c.mu.Unlock()
	return err
}

// Allreduce sums (or averages) data over every rank with a dense algorithm.
// A failed call leaves data as it was, so nothing of the caller's is lost.
func (c *Communicator) Allreduce(ctx context.Context, data []float32, average bool, alg Algorithm) (Stats, error) {
	var st Stats
	f, ok := denseAlgorithms[alg]
	if !ok {
		return st, fmt.Errorf("%w: %v is not a dense allreduce", ErrInvalidArgument, alg)
	}
	seq, err := c.begin()
	if err != nil {
		return st, err
	}
	start := time.Now()
	// Rabenseifner reduces in place, so a failure midway would leave partial
	// sums; one copy (kept for the next call) puts the input back. The ring
	// writes data only once every message has arrived.
	backup := c.Size() > 1 && alg != DenseRing
	if backup {
		if cap(c.before) < len(data) {
			c.before = make([]float32, len(data))
		}
		copy(c.before[:len(data)], data)
	}
	err = f(ctx, NewCall(c.T, alg.Op(), seq, &st, WithDesc(DescribeCall(ctx, 0, len(data), len(data)))), data)
	if err != nil && backup {
		copy(data, c.before[:len(data)])
	}
	if err == nil && average {
		scale(data, c.Size())
	}
	st.Total = time.Since(start)
	return st, c.end(err)
}

// maxElements is the largest n a sparse call takes: indices travel as uint32.
const maxElements = math.MaxUint32

// tensorSnapshot is what a sparse call may change in a tensor's state before
// it knows the call will succeed; a failed call restores it, so a retry (or a
// skipped step) starts from exactly the state before it. The residual needs
// no copy: every algorithm writes it only after all communication succeeded.
type tensorSnapshot struct {
	iter          int
	local, global float32
	boundaries    []uint32
}

func snapshotOf(st *TensorState) tensorSnapshot {
	return tensorSnapshot{iter: st.Iter, local: st.LocalThreshold, global: st.GlobalThreshold,
		boundaries: append([]uint32(nil), st.Boundaries...)}
}

func (s tensorSnapshot) restore(st *TensorState) {
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
		c.states[id] = st
		return st, nil
	}
	if st.N != n {
		return nil, fmt.Errorf("%w: tensor %d has %d elements, earlier calls had %d", ErrInvalidArgument, id, n, st.N)
	}
	st.Config = cfg
	return st, nil
}

// SparseAllreduce reduces grad (this rank's gradient) in place into the
// averaged sparse global result, keeping tensor id's residual and thresholds.
// Dense algorithms in cfg are allowed and average without state.
//
// A failed call leaves grad and the tensor's state (residual, thresholds,
// region boundaries, call count) as they were. NaN or Inf in grad+residual on
// any rank makes every rank return ErrNonFinite for the step (skipped
// everywhere, the communicator stays usable).
func (c *Communicator) SparseAllreduce(ctx context.Context, id uint64, grad []float32, cfg Config) (Stats, error) {
	var stats Stats
	if err := cfg.Validate(); err != nil {
		return stats, err
	}
	if uint64(len(grad)) > maxElements {
		return stats, fmt.Errorf("%w: %d elements, at most 2^32-1", ErrInvalidArgument, len(grad))
	}
	if cfg.Algorithm.Dense() {
		return c.Allreduce(ctx, grad, true, cfg.Algorithm)
	}
	f, ok := sparseAlgorithms[cfg.Algorithm]
	if !ok {
		return stats, fmt.Errorf("%w: %v is not built into this library", ErrInvalidArgument, cfg.Algorithm)
	}
	seq, err := c.begin()
	if err != nil {
		return stats, err
	}
	st, err := c.state(id, len(grad), cfg)
	if err != nil {
		c.seq-- // nothing was sent: the number goes back, so ranks stay in step
		return stats, c.end(err)
	}
	before := snapshotOf(st)
	start := time.Now()
	stats.K = cfg.K(len(grad))
	err = f(ctx, NewCall(c.T, cfg.Algorithm.Op(), seq, &stats, WithDesc(DescribeCall(ctx, id, len(grad), stats.K)), withScratch(&c.scratch)), st, grad)
	if err != nil {
		before.restore(st)
	}
	stats.Total = time.Since(start)
	return stats, c.end(err)
}

// SparseAllreduceSparse reduces sparse inputs without state and returns the
// averaged sparse global result. The ranks first agree on their inputs: a
// malformed input on any rank is ErrInvalidArgument on every rank, NaN or Inf
// on any rank ErrNonFinite (skipped) on every rank, and the communicator
// stays usable.
func (c *Communicator) SparseAllreduceSparse(ctx context.Context, n int, in Sparse, cfg Config) (Sparse, Stats, error) {
	var stats Stats
	if err := cfg.Validate(); err != nil {
		return Sparse{}, stats, err
	}
	if n < 0 || uint64(n) > maxElements {
		return Sparse{}, stats, fmt.Errorf("%w: n=%d not in 0…2^32-1", ErrInvalidArgument, n)
	}
	f, ok := sparseInputAlgorithms[cfg.Algorithm]
	if !ok {
		return Sparse{}, stats, fmt.Errorf("%w: %v has no sparse-input form", ErrInvalidArgument, cfg.Algorithm)
	}
	seq, err := c.begin()
	if err != nil {
		return Sparse{}, stats, err
	}
	start := time.Now()
	stats.K = cfg.K(n)
	call := NewCall(c.T, cfg.Algorithm.Op(), seq, &stats, WithDesc(DescribeCall(ctx, 0, n, stats.K)))
	invalid := checkSparse(in, n)
	nonFinite := 0
	if invalid == nil {
		nonFinite = countNonFinite(in.Val)
	}
	if err := agreeOnInput(ctx, call, nonFinite, invalid); err != nil {
		stats.Total = time.Since(start)
		return Sparse{}, stats, c.end(err)
	}
	out, err := f(ctx, call, n, in, stats.K)
	if err == nil {
		scale(out.Val, c.Size())
	}
	stats.Total = time.Since(start)
	return out, stats, c.end(err)
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

// checkSparse reports a malformed sparse vector (not its values) as
// ErrInvalidArgument.
func checkSparse(s Sparse, n int) error {
	if len(s.Idx) != len(s.Val) {
		return fmt.Errorf("%w: %d indices but %d values", ErrInvalidArgument, len(s.Idx), len(s.Val))
	}
	prev := int64(-1)
	for i, ix := range s.Idx {
		if int64(ix) <= prev || int64(ix) >= int64(n) {
			return fmt.Errorf("%w: index %d at position %d is out of order or not below n=%d", ErrInvalidArgument, ix, i, n)
		}
		prev = int64(ix)
	}
	return nil
}
