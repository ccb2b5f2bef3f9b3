package core

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"
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
		if _, ok := sparseInputAlgorithms[alg]; !ok {
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

// A sparse call refused on one rank for misuse (its tensor changed size)
// sends nothing and takes no sequence number, so that rank's next call still
// meets its peers' next call.
func TestRefusedSparseCallLeavesRanksInStep(t *testing.T) {
	runInProc(t, 2, func(ctx context.Context, rank int, c *Communicator) error {
		cfg := DefaultConfig()
		if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 100), cfg); err != nil {
			return err
		}
		if rank == 0 {
			if _, err := c.SparseAllreduce(ctx, 1, make([]float32, 101), cfg); !errors.Is(err, ErrInvalidArgument) {
				return fmt.Errorf("tensor 1 with another size: %v, want ErrInvalidArgument", err)
			}
		}
		x := []float32{float32(rank + 1), 4}
		if _, err := c.SparseAllreduce(ctx, 2, x, Config{Algorithm: OkTopk, Density: 1, Tau: 1, TauPrime: 1}); err != nil {
			return fmt.Errorf("the next call: %w", err)
		}
		if x[0] != 1.5 || x[1] != 4 {
			return fmt.Errorf("the next call gave %v, want [1.5 4]", x)
		}
		return nil
	})
}
