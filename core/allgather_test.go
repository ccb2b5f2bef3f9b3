package core

// Tests of the allgathers: equal blocks in ⌈log₂ P⌉ rounds or one direct
// round, blocks of any size by ring, Bruck or direct exchange, in rank order
// with the expected messages, and blocks of unequal size refused.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// blockOf is rank r's test block: m bytes that name the rank and position.
func blockOf(r, m int) []byte {
	b := make([]byte, m)
	for i := range b {
		b[i] = byte(31*r + i)
	}
	return b
}

// gatherEqualBlocks runs one equal-block allgather of rank's blockOf(rank, m)
// and checks that it returned every rank's block, in rank order; it returns
// the call for its statistics.
func gatherEqualBlocks(ctx context.Context, c *Communicator, rank, p, m int, gather func(context.Context, *Call, uint32, []byte) ([][]byte, error)) (*Call, error) {
	call := NewCall(c.T, OkTopk.Op(), 1, nil)
	blocks, err := gather(ctx, call, 0, blockOf(rank, m))
	if err != nil {
		return nil, err
	}
	if len(blocks) != p {
		return nil, fmt.Errorf("rank %d: %d blocks, want %d", rank, len(blocks), p)
	}
	for r, b := range blocks {
		if !bytes.Equal(b, blockOf(r, m)) {
			return nil, fmt.Errorf("rank %d: block %d is %v, want %v", rank, r, b, blockOf(r, m))
		}
	}
	return call, nil
}

// Every rank ends with every rank's block in rank order, for P that are and
// are not powers of two, in ⌈log₂ P⌉ messages per rank carrying (P−1)m bytes.
func TestAllgatherEqualGathersEveryBlockInLogRounds(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 7, 8, 13} {
		for _, m := range []int{0, 1, 324} {
			t.Run(fmt.Sprintf("P=%d/m=%d", p, m), func(t *testing.T) {
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					call, err := gatherEqualBlocks(ctx, c, rank, p, m, AllgatherEqual)
					if err != nil {
						return err
					}
					rounds := 0
					for d := 1; d < p; d *= 2 {
						rounds++
					}
					if call.Stats.BytesSent != uint64((p-1)*m) {
						return fmt.Errorf("rank %d sent %d bytes, want (P-1)m = %d", rank, call.Stats.BytesSent, (p-1)*m)
					}
					if got := call.Stats.MessagesSent; got != uint64(rounds) {
						return fmt.Errorf("rank %d sent %d messages, want ⌈log₂ P⌉ = %d", rank, got, rounds)
					}
					return nil
				})
			})
		}
	}
}

// A rank whose block has another size fails the call on every rank, and
// the rank that receives from it names it, with ErrMismatch; no rank hangs.
func TestAllgatherEqualRefusesBlocksOfDifferentSizes(t *testing.T) {
	const p = 5
	type gather func(context.Context, *Call, uint32, []byte) ([][]byte, error)
	for name, fn := range map[string]gather{"bruck": AllgatherEqual, "direct": AllgatherEqualDirect} {
		t.Run(name, func(t *testing.T) {
			errs := runInProcErrors(t, p, 10*time.Second, func(ctx context.Context, rank int, c *Communicator) error {
				m := 8
				if rank == 3 {
					m = 12
				}
				_, err := fn(ctx, NewCall(c.T, OkTopk.Op(), 1, nil), 0, blockOf(rank, m))
				return err
			})
			named := false
			for r, err := range errs {
				switch {
				case err == nil:
					t.Errorf("rank %d: no error", r)
				case !errors.Is(err, ErrMismatch):
					t.Errorf("rank %d: %v, want ErrMismatch", r, err)
				// Rank 3's 12 bytes are named by a rank that received
				// them, or by rank 3 itself, when it finds its peers'
				// blocks short before any of them finds its block long
				// (that first error then aborts every rank).
				case strings.Contains(err.Error(), "rank 3 sent 12 bytes"),
					strings.Contains(err.Error(), "rank 3 (this rank) expects 12"):
					named = true
				}
			}
			if !named {
				t.Fatalf("no rank named rank 3's 12 bytes: %v", errs)
			}
		})
	}
}

// The direct allgather of equal blocks gives every rank every block in rank
// order in one round: P−1 messages per rank carrying (P−1)m bytes, every
// one sent before any is received (TestOkTopkReuseCallAllgathersInOneRound
// checks the order).
func TestAllgatherEqualDirectGathersEveryBlock(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 8, 13} {
		for _, m := range []int{0, 1, 324} {
			t.Run(fmt.Sprintf("P=%d/m=%d", p, m), func(t *testing.T) {
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					call, err := gatherEqualBlocks(ctx, c, rank, p, m, AllgatherEqualDirect)
					if err != nil {
						return err
					}
					if call.Stats.BytesSent != uint64((p-1)*m) || call.Stats.MessagesSent != uint64(p-1) {
						return fmt.Errorf("rank %d sent %d bytes in %d messages, want (P-1)m = %d in P-1", rank, call.Stats.BytesSent, call.Stats.MessagesSent, (p-1)*m)
					}
					return nil
				})
			})
		}
	}
}

// The allgathers of blocks of any size (ring, Bruck, direct) give every
// rank every block, dtype and count included, in rank order, with P−1
// messages per rank.
func TestAllgathervBruckAndDirectGatherBlocksOfAnySize(t *testing.T) {
	type gather func(context.Context, *Call, uint32, Block) ([]Block, error)
	blockOfRank := func(r int) Block {
		m := (r * 37) % 11 // 0…10 float32s, some ranks empty
		return Block{Dtype: transport.DtypeFloat32, Count: uint64(m), Payload: blockOf(r, 4*m)}
	}
	for name, fn := range map[string]gather{"ring": Allgatherv, "bruck": AllgathervBruck, "direct": AllgatherDirect} {
		for _, p := range []int{1, 2, 3, 5, 7, 8, 13} {
			t.Run(fmt.Sprintf("%s/P=%d", name, p), func(t *testing.T) {
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					call := NewCall(c.T, OkTopk.Op(), 1, nil)
					blocks, err := fn(ctx, call, 0, blockOfRank(rank))
					if err != nil {
						return err
					}
					for r, b := range blocks {
						want := blockOfRank(r)
						if b.Dtype != want.Dtype || b.Count != want.Count || !bytes.Equal(b.Payload, want.Payload) {
							return fmt.Errorf("rank %d: block %d is %+v, want %+v", rank, r, b, want)
						}
					}
					if call.Stats.MessagesSent != uint64(p-1) {
						return fmt.Errorf("rank %d sent %d messages, want P-1 = %d", rank, call.Stats.MessagesSent, p-1)
					}
					return nil
				})
			})
		}
	}
}
