package core

// Helpers shared by the tests: P ranks run in process with a timeout and
// an abort on failure, a two-rank call checked bitwise, and integer and
// sparse inputs drawn through internal/testref.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/internal/testref"
	"github.com/oktopk/oktopk/transport"
)

// inProcTimeout bounds every in-process run, so a deadlock fails the test
// with the ranks' errors instead of hanging it (generous for -race on a
// loaded machine).
const inProcTimeout = 60 * time.Second

// runInProcErrors runs fn once per rank, each in its own goroutine with its
// own Communicator over one in-process transport group, and returns every
// rank's error. When a rank fails, every rank's transport is aborted so the
// others return promptly instead of waiting for the timeout.
func runInProcErrors(t testing.TB, p int, timeout time.Duration, fn func(ctx context.Context, rank int, c *Communicator) error) []error {
	t.Helper()
	ts := transport.NewInProc(p)
	return runRanks(ts, timeout, func(ctx context.Context, r int) error {
		return fn(ctx, r, NewCommunicator(ts[r]))
	})
}

// runRanks runs fn once per rank of the transport group ts, each in its own
// goroutine, and returns every rank's error; a rank's panic is returned as
// its error. When a rank fails, every transport of ts is aborted so the
// others return promptly instead of waiting for the timeout; every transport
// is closed before it returns.
func runRanks(ts []transport.Transport, timeout time.Duration, fn func(ctx context.Context, r int) error) []error {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	p := len(ts)
	errs := make([]error, p)
	var wg sync.WaitGroup
	var once sync.Once
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			defer func() {
				if v := recover(); v != nil {
					errs[r] = fmt.Errorf("rank %d panicked: %v", r, v)
				}
				if errs[r] != nil {
					once.Do(func() {
						for _, tr := range ts {
							tr.Abort(fmt.Errorf("rank %d failed: %w", r, errs[r]))
						}
					})
				}
			}()
			errs[r] = fn(ctx, r)
		}(r)
	}
	wg.Wait()
	for _, tr := range ts {
		tr.Close()
	}
	return errs
}

// runInProc is runInProcErrors for runs that must succeed on every rank.
func runInProc(t testing.TB, p int, fn func(ctx context.Context, rank int, c *Communicator) error) {
	t.Helper()
	if err := errors.Join(runInProcErrors(t, p, inProcTimeout, fn)...); err != nil {
		t.Fatalf("P=%d: %v", p, err)
	}
}

// checkTwoRankCall runs one SparseAllreduce (tensor 1, cfg) on two in-process
// ranks with gradients in[rank] and requires every rank's output to equal
// wantOut and its residual wantResidual[rank], bitwise.
func checkTwoRankCall(t *testing.T, cfg Config, in [][]float32, wantOut []float32, wantResidual [][]float32) {
	t.Helper()
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		g := append([]float32(nil), in[rank]...)
		if _, err := c.SparseAllreduce(ctx, 1, g, cfg); err != nil {
			return err
		}
		res := c.TensorStateOf(1).Residual
		for i := range g {
			if g[i] != wantOut[i] {
				return fmt.Errorf("rank %d output[%d] = %v, want %v", rank, i, g[i], wantOut[i])
			}
			if res[i] != wantResidual[rank][i] {
				return fmt.Errorf("rank %d residual[%d] = %v, want %v", rank, i, res[i], wantResidual[rank][i])
			}
		}
		return nil
	})
}

// integerInputsOkTopk is testref.IntegerInputs drawn from seed: P ranks' n
// integer-valued floats, on which every summation order is exact.
func integerInputsOkTopk(p, n int, seed uint64) [][]float32 {
	return testref.IntegerInputs(rand.New(rand.NewPCG(seed, 5)), p, n)
}

// randomSparse is testref.RandomSparse as a Sparse.
func randomSparse(rng *rand.Rand, n int, density float64) Sparse {
	idx, val := testref.RandomSparse(rng, n, density)
	return Sparse{Idx: idx, Val: val}
}
