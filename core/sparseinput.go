package core

// SparseAllreduceSparse, the sparse-input call: inputs that are already
// sparse, checked and agreed on by every rank, then reduced without state.

import (
	"context"
	"fmt"
	"time"
)

// The sparse-input form of the sparse algorithms: inputs that are already
// sparse (a framework's sparse gradients, or a caller's own selection),
// reduced without state; the ranks agree on their inputs before any
// algorithm runs.

// SparseAllreduceSparse reduces sparse inputs without state and returns the
// averaged sparse global result. The ranks first agree on their inputs: a
// malformed input on any rank is ErrInvalidArgument on every rank, NaN or Inf
// on any rank ErrNonFinite (skipped) on every rank, and the communicator
// stays usable. Bad settings or n are refused as in SparseAllreduce.
// Memory and time follow the pairs and P, not n: no algorithm
// holds an array over the index space, only the dense form of a region
// (SparCML's, TopkDSA's), which is taken where the region holds pairs at a
// third or more of its indices: an array of at most a few words per pair.
func (c *Communicator) SparseAllreduceSparse(ctx context.Context, n int, in Sparse, cfg Config) (Sparse, Stats, error) {
	var stats Stats
	seq, err := c.begin()
	if err != nil {
		return Sparse{}, stats, err
	}
	if err := cfg.Validate(); err != nil {
		return Sparse{}, stats, c.refuse(ctx, seq, err)
	}
	if n < 0 || uint64(n) > MaxElements {
		return Sparse{}, stats, c.refuse(ctx, seq, fmt.Errorf("%w: n=%d not in 0…2^32-1", ErrInvalidArgument, n))
	}
	alg := cfg.Algorithm
	if alg.row().sparseInput == nil && alg != Auto {
		return Sparse{}, stats, c.refuse(ctx, seq, fmt.Errorf("%w: %v has no sparse-input form", ErrInvalidArgument, alg))
	}
	if cfg.Values != ValuesFloat32 {
		return Sparse{}, stats, c.refuse(ctx, seq, fmt.Errorf("%w: %v values: a sparse-input call keeps no residual to take the rounding error back; "+
			"it sends float32 values only", ErrInvalidArgument, cfg.Values))
	}
	if alg == Auto {
		ch, next, err := c.autoChoose(ctx, seq, n, cfg, true)
		if err != nil {
			return Sparse{}, stats, c.end(err)
		}
		seq, alg, stats.Predicted = next, ch.alg, duration(ch.predicted)
	}
	f := algorithms[alg].sparseInput
	start := time.Now()
	stats.Algorithm = alg
	stats.K = cfg.K(n)
	call := NewCall(c.T, alg.Op(), seq, &stats, WithDesc(DescribeCall(0, 0, n, stats.K))) // float32 values in, float32 out
	call.Phase(PhaseAgree)                                                                // the input's checks and the agreement on them
	invalid := checkSparse(in, n)
	nonFinite := 0
	if invalid == nil {
		nonFinite = countNonFinite(in.Val)
	}
	if err := agreeOnInput(ctx, call, nonFinite, invalid); err != nil {
		call.EndPhases()
		stats.Total = time.Since(start)
		return Sparse{}, stats, c.end(err)
	}
	out, err := f(ctx, call, n, in, stats.K)
	call.Phase(PhaseOutput)
	if err == nil {
		scale(out.Val, c.Size())
	}
	call.EndPhases()
	stats.Total = time.Since(start)
	return out, stats, c.end(err)
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
