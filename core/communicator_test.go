package core

// Tests of the Communicator's call discipline: n above 2^32−1 refused,
// refusals on one rank or all, a concurrent call refused, states or τ′ that
// differ across ranks a mismatch, and failed calls leaving no new state.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/oktopk/oktopk/transport"
)

// Indices travel as uint32, so a sparse call on more than 2^32−1 elements is
// ErrInvalidArgument before anything is touched or sent (the oversized
// gradient here is 16 GiB of address space mapped without access: reading
// it would crash).
func TestSparseCallsRejectMoreThanUint32Elements(t *testing.T) {
	c := NewCommunicator(transport.NewInProc(1)[0])
	defer c.T.Close()
	mem, err := syscall.Mmap(-1, 0, 4<<32, syscall.PROT_NONE, syscall.MAP_PRIVATE|syscall.MAP_ANON|syscall.MAP_NORESERVE)
	if err != nil {
		t.Skipf("cannot reserve 16 GiB of address space: %v", err)
	}
	defer syscall.Munmap(mem)
	huge := unsafe.Slice((*float32)(unsafe.Pointer(&mem[0])), 1<<32)
	for _, alg := range Algorithms() {
		cfg := Config{Algorithm: alg, Density: 0.01, Tau: 1, TauPrime: 1}
		if _, err := c.SparseAllreduce(context.Background(), 1, huge, cfg); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("%v: SparseAllreduce of 2^32 elements: %v, want ErrInvalidArgument", alg, err)
		}
		if alg.row().sparseInput == nil {
			continue
		}
		for _, n := range []int{-1, 1 << 32} {
			if _, _, err := c.SparseAllreduceSparse(context.Background(), n, Sparse{}, cfg); !errors.Is(err, ErrInvalidArgument) {
				t.Errorf("%v: SparseAllreduceSparse with n=%d: %v, want ErrInvalidArgument", alg, n, err)
			}
		}
	}
	// The communicator is not poisoned by rejected arguments.
	if _, err := c.SparseAllreduce(context.Background(), 1, []float32{1, 2}, DefaultConfig()); err != nil {
		t.Fatalf("a valid call after rejected ones: %v", err)
	}
}

// A call refused on one rank only (there tensor 1 changed size) takes its
// sequence number there and fails on every rank: the refusing rank gets
// ErrInvalidArgument, its peers ErrMismatch naming it, the call and the
// reason, and no rank ever returns success for that call or a later one.
// (Before, the refusing rank took no sequence number, so its next call met
// the peers' refused one and every rank returned data combined from
// different steps.) Rank 0 learns of the refusal while its call runs; rank
// 1 starts late, when the refusal (or rank 0's abort) is already there.
func TestCallRefusedOnOneRankFailsOnEveryRank(t *testing.T) {
	errs := runInProcErrors(t, 3, 10*time.Second, func(ctx context.Context, rank int, c *Communicator) error {
		cfg := DefaultConfig()
		for i := 0; i < 2; i++ {
			if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 1000), cfg); err != nil {
				return fmt.Errorf("agreed call %d: %w", i+1, err)
			}
		}
		n := 1000
		switch rank {
		case 1:
			time.Sleep(100 * time.Millisecond)
		case 2:
			n = 1001
			time.Sleep(50 * time.Millisecond)
		}
		_, err := c.SparseAllreduce(ctx, 1, make([]float32, n), cfg)
		switch {
		case rank == 2 && !errors.Is(err, ErrInvalidArgument):
			return fmt.Errorf("refused call: %v, want ErrInvalidArgument", err)
		case rank != 2 && !errors.Is(err, ErrMismatch):
			return fmt.Errorf("call its peer refused: %v, want ErrMismatch", err)
		case rank != 2 && !strings.Contains(err.Error(), "rank 2 refused call 3: invalid argument: tensor 1 has 1001 elements, earlier calls had 1000"):
			return fmt.Errorf("mismatch does not name the refusing rank, the call and the reason: %v", err)
		}
		t.Logf("rank %d: %v", rank, err)
		// No later call succeeds, whatever each rank passes.
		for i := 0; i < 2; i++ {
			if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 1000), cfg); err == nil {
				return fmt.Errorf("later call %d succeeded", i+1)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// Refusals made before the call reaches any tensor (bad settings, an
// algorithm that is not dense, an n out of range) are refusals too: the
// peers' call of that number fails with ErrMismatch, for SparseAllreduce,
// Allreduce and SparseAllreduceSparse alike.
func TestEveryKindOfRefusalReachesThePeers(t *testing.T) {
	cases := []struct {
		name   string
		reason string
		call   func(ctx context.Context, c *Communicator, refuse bool) error
	}{
		{"sparse bad density", "density 2 not in [0, 1]", func(ctx context.Context, c *Communicator, refuse bool) error {
			cfg := DefaultConfig()
			if refuse {
				cfg.Density = 2
			}
			_, err := c.SparseAllreduce(ctx, 1, make([]float32, 100), cfg)
			return err
		}},
		{"dense path of sparse call", "tau 0 < 1", func(ctx context.Context, c *Communicator, refuse bool) error {
			cfg := Config{Algorithm: DenseRing, Density: 1, Tau: 1, TauPrime: 1}
			if refuse {
				cfg.Tau = 0
			}
			_, err := c.SparseAllreduce(ctx, 1, make([]float32, 100), cfg)
			return err
		}},
		{"allreduce", "oktopk is not a dense allreduce", func(ctx context.Context, c *Communicator, refuse bool) error {
			alg := DenseRabenseifner
			if refuse {
				alg = OkTopk
			}
			_, err := c.Allreduce(ctx, make([]float32, 100), false, alg)
			return err
		}},
		{"sparse input", "n=-1 not in", func(ctx context.Context, c *Communicator, refuse bool) error {
			n := 100
			if refuse {
				n = -1
			}
			_, _, err := c.SparseAllreduceSparse(ctx, n, Sparse{}, Config{Algorithm: TopkA, Density: 0.1, Tau: 1, TauPrime: 1})
			return err
		}},
		{"outside the communicator", "data is NULL", func(ctx context.Context, c *Communicator, refuse bool) error {
			if refuse {
				return c.Refuse(ctx, fmt.Errorf("%w: data is NULL", ErrInvalidArgument))
			}
			_, err := c.Allreduce(ctx, make([]float32, 100), false, DenseRing)
			return err
		}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			errs := runInProcErrors(t, 2, 10*time.Second, func(ctx context.Context, rank int, c *Communicator) error {
				if _, err := c.Allreduce(ctx, make([]float32, 10), false, DenseRing); err != nil {
					return err
				}
				err := tc.call(ctx, c, rank == 1)
				switch {
				case rank == 1 && !errors.Is(err, ErrInvalidArgument):
					return fmt.Errorf("refused call: %v, want ErrInvalidArgument", err)
				case rank == 0 && (!errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "rank 1 refused call 2: invalid argument: "+tc.reason)):
					return fmt.Errorf("call its peer refused: %v, want ErrMismatch naming rank 1, call 2 and %q", err, tc.reason)
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

// When every rank refuses the same call nobody is stranded: each gets
// ErrInvalidArgument, the refusals they send each other fail nothing, and
// the communicator stays usable, also when the ranks refuse several calls in
// a row at different paces.
func TestCallRefusedOnEveryRankLeavesCommunicatorUsable(t *testing.T) {
	runInProc(t, 3, func(ctx context.Context, rank int, c *Communicator) error {
		cfg := DefaultConfig()
		if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 100), cfg); err != nil {
			return err
		}
		for i := 0; i < 3; i++ {
			time.Sleep(time.Duration(rank*10) * time.Millisecond)
			if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 101), cfg); !errors.Is(err, ErrInvalidArgument) || errors.Is(err, ErrMismatch) {
				return fmt.Errorf("tensor 1 with another size on every rank: %v, want ErrInvalidArgument", err)
			}
		}
		x := []float32{float32(rank + 1), 4}
		if _, err := c.SparseAllreduce(ctx, 2, x, Config{Algorithm: OkTopk, Density: 1, Tau: 1, TauPrime: 1}); err != nil {
			return fmt.Errorf("the next call: %w", err)
		}
		if x[0] != 2 || x[1] != 4 {
			return fmt.Errorf("the next call gave %v, want [2 4]", x)
		}
		return nil
	})
}

// A second call made while one runs on the same communicator (another
// goroutine) is refused with ErrInvalidUsage at once, without taking a
// sequence number: the running call completes with the right result, and
// the next calls of both ranks still meet. (Before, the second call waited
// and then ran as the next call, meeting whatever call the peer made next.)
func TestConcurrentCallIsRefusedWithoutTakingASequenceNumber(t *testing.T) {
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		if rank == 1 {
			time.Sleep(300 * time.Millisecond) // rank 0's first call waits for this rank
		}
		x := []float32{float32(rank + 1), 1}
		first := make(chan error, 1)
		go func() {
			_, err := c.Allreduce(ctx, x, false, DenseRing)
			first <- err
		}()
		if rank == 0 {
			time.Sleep(100 * time.Millisecond)
			start := time.Now()
			y := []float32{7, 7}
			_, err := c.Allreduce(ctx, y, false, DenseRing)
			if !errors.Is(err, ErrInvalidUsage) || time.Since(start) > 50*time.Millisecond {
				return fmt.Errorf("a call while another runs: %v after %v, want ErrInvalidUsage at once", err, time.Since(start))
			}
			if y[0] != 7 || y[1] != 7 {
				return fmt.Errorf("the refused call changed its buffer: %v", y)
			}
		}
		if err := <-first; err != nil {
			return fmt.Errorf("the running call: %w", err)
		}
		if x[0] != 3 || x[1] != 2 {
			return fmt.Errorf("the running call gave %v, want [3 2]", x)
		}
		z := []float32{float32(10 * (rank + 1))}
		if _, err := c.Allreduce(ctx, z, false, DenseRing); err != nil || z[0] != 30 {
			return fmt.Errorf("the next call: %v, %v, want [30]", z, err)
		}
		return nil
	})
}

// Tensor states from different steps (as states saved after a call that
// completed on some ranks and failed on others would be) are caught: every
// rank's next call on that tensor fails with ErrMismatch naming the
// completed calls of both, instead of running Ok-Topk's schedule, which
// follows that count, differently on each rank.
func TestStatesFromDifferentStepsAreAMismatch(t *testing.T) {
	const p = 2
	cfg := Config{Algorithm: OkTopk, Density: 0.05, Tau: 2, TauPrime: 3}
	saved := make([][]byte, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := 0; it < 3; it++ {
			g := make([]float32, 200)
			for i := range g {
				g[i] = float32((i*7+rank*3+it)%23) - 11
			}
			if _, err := c.SparseAllreduce(ctx, 9, g, cfg); err != nil {
				return err
			}
			if it+1 == 2+rank { // rank 0 after its second call, rank 1 after its third
				b, err := c.TensorStateOf(9).MarshalBinary()
				if err != nil {
					return err
				}
				saved[rank] = b
			}
		}
		return nil
	})
	errs := runInProcErrors(t, p, 10*time.Second, func(ctx context.Context, rank int, c *Communicator) error {
		var st TensorState
		if err := st.UnmarshalBinary(saved[rank]); err != nil {
			return err
		}
		c.SetTensorState(9, &st)
		_, err := c.SparseAllreduce(ctx, 9, make([]float32, 200), cfg)
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "completed calls: rank") ||
			!strings.Contains(err.Error(), "has 2") || !strings.Contains(err.Error(), "has 3") {
			return fmt.Errorf("call with states from different steps: %v, want ErrMismatch naming completed calls 2 and 3", err)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// Ranks whose τ′ differs make one call exact on one rank and a reuse call on
// another, which would cut the global selection differently: the call's
// descriptor carries whether it is exact, so every rank fails with
// ErrMismatch naming it (which aborts the communicator, as every mismatch
// does), leaving the caller's buffer and the tensor's state as they were.
func TestTauPrimeThatDiffersAcrossRanksIsAMismatch(t *testing.T) {
	const p, n = 2, 300
	grad := func(rank, it int) []float32 {
		g := make([]float32, n)
		for i := range g {
			g[i] = float32((i*7+rank*5+it*3)%29) - 14
		}
		return g
	}
	errs := runInProcErrors(t, p, 10*time.Second, func(ctx context.Context, rank int, c *Communicator) error {
		cfg := Config{Algorithm: OkTopk, Density: 0.05, Tau: 4, TauPrime: 3}
		if _, err := c.SparseAllreduce(ctx, 5, grad(rank, 0), cfg); err != nil { // call 0: exact on both
			return err
		}
		before, err := c.TensorStateOf(5).MarshalBinary()
		if err != nil {
			return err
		}
		mine := cfg
		mine.TauPrime = 1 + rank*2 // rank 0: τ′ 1 (call 1 exact), rank 1: τ′ 3 (a reuse call)
		g := grad(rank, 1)
		_, err = c.SparseAllreduce(ctx, 5, g, mine)
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "exact selection") {
			return fmt.Errorf("call with τ′ %d: %v, want ErrMismatch naming the exact selection", mine.TauPrime, err)
		}
		after, err := c.TensorStateOf(5).MarshalBinary()
		if err != nil {
			return err
		}
		if !bytes.Equal(before, after) || !slices.Equal(g, grad(rank, 1)) {
			return fmt.Errorf("the refused call changed the tensor's state or the caller's buffer")
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// A failed call leaves no trace in the tensor states: a tensor's first call
// failing (here a mismatch of tensor ids) leaves no state for it, and a
// failing call with other settings leaves the earlier settings in place.
func TestFailedCallLeavesNoNewStateAndTheOldSettings(t *testing.T) {
	const n = 1000
	base := Config{Algorithm: OkTopk, Density: 0.01, Tau: 4, TauPrime: 2}
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		grad := make([]float32, n)
		for i := range grad {
			grad[i] = float32((i*7+rank)%13) - 6
		}
		if _, err := c.SparseAllreduce(ctx, 1, grad, base); err != nil {
			return err
		}
		other := base
		other.Algorithm, other.Density = TopkA, 0.05
		// Rank 0 calls tensor 1 with other settings, rank 1 a new tensor 2.
		id := uint64(1 + rank)
		if _, err := c.SparseAllreduce(ctx, id, grad, other); !errors.Is(err, ErrMismatch) {
			return fmt.Errorf("mismatched call: %v, want a mismatch", err)
		}
		if c.TensorStateOf(2) != nil {
			return fmt.Errorf("tensor 2's failed first call left a state")
		}
		if got := c.TensorStateOf(1).Config; got != base {
			return fmt.Errorf("tensor 1's settings after a failed call: %+v, want %+v", got, base)
		}
		return nil
	})
}
