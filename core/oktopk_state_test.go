package core

// Tests of TensorState checkpoints: marshalling round trips, corrupt and
// version-1 input, owner checks, and a restored run continuing exactly.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"testing"
)

func TestTensorStateMarshalRoundTripAndCorruptInput(t *testing.T) {
	st := NewTensorState(5, okTopkConfig(0.2))
	st.Iter, st.LocalThreshold, st.GlobalThreshold = 17, 0.5, 1.25
	st.Boundaries = []uint32{0, 2, 5}
	st.Rank, st.Size = 1, 2
	copy(st.Residual, []float32{1, -2, 0, 3.5, -0.125})
	b, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var got TensorState
	if err := got.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if got.N != 5 || got.Iter != 17 || got.Config != st.Config || got.LocalThreshold != 0.5 ||
		got.GlobalThreshold != 1.25 || fmt.Sprint(got.Boundaries) != fmt.Sprint(st.Boundaries) ||
		fmt.Sprint(got.Residual) != fmt.Sprint(st.Residual) || got.Rank != 1 || got.Size != 2 {
		t.Fatalf("round trip: %+v", got)
	}
	// A rank outside its size is corrupt, not an owner to compare with.
	badRank := append([]byte(nil), b...)
	binary.LittleEndian.PutUint32(badRank[stateRankField:], 2)
	binary.LittleEndian.PutUint32(badRank[stateChecksumField:], stateChecksum(badRank)) // corrupt yet summed
	if err := new(TensorState).UnmarshalBinary(badRank); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("rank 2 of 2: %v", err)
	}
	for _, bad := range [][]byte{nil, b[:10], b[:len(b)-1], append(append([]byte(nil), b...), 0), []byte("OKTSgarbagegarbagegarbagegarbagegarbagegarbagegarbage")} {
		var x TensorState
		if err := x.UnmarshalBinary(bad); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("corrupt state of %d bytes: %v", len(bad), err)
		}
	}
}

// Any one byte flipped in a saved state is refused, the ones that would
// still load as a valid state (a residual value, a threshold) included,
// and the message says the file is corrupt.
func TestTensorStateRefusesEveryFlippedByte(t *testing.T) {
	st := NewTensorState(4, okTopkConfig(0.5))
	st.Iter, st.LocalThreshold, st.GlobalThreshold = 9, 0.75, 1.5
	st.Boundaries, st.Rank, st.Size = []uint32{0, 2, 4}, 0, 2
	copy(st.Residual, []float32{0.25, -1, 0, 2})
	b, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	for i := range b {
		for _, bit := range []byte{0x01, 0x80} {
			flipped := append([]byte(nil), b...)
			flipped[i] ^= bit
			err := new(TensorState).UnmarshalBinary(flipped)
			if !errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("byte %d ^ %#x loaded: %v", i, bit, err)
			}
		}
	}
	// The residual's last byte flipped: a finite value, refused by the sum alone.
	flipped := append([]byte(nil), b...)
	flipped[len(b)-1] ^= 0x01
	if err := new(TensorState).UnmarshalBinary(flipped); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Fatalf("flipped residual byte: %v", err)
	}
}

// A version-2 checkpoint (no checksum) is still read, owner included.
func TestTensorStateReadsVersion2(t *testing.T) {
	st := NewTensorState(3, okTopkConfig(0.5))
	st.Iter, st.Rank, st.Size, st.Boundaries = 4, 1, 2, []uint32{0, 1, 3}
	copy(st.Residual, []float32{0.5, 0, -1})
	b, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	v2 := append(append([]byte(nil), b[:stateFixedV2]...), b[stateFixed:]...)
	binary.LittleEndian.PutUint32(v2[4:], 2)
	var got TensorState
	if err := got.UnmarshalBinary(v2); err != nil {
		t.Fatal(err)
	}
	if !sameCheckpoint(&got, st) || got.Rank != 1 || got.Size != 2 {
		t.Fatalf("version 2: %+v", got)
	}
}

// A version-1 checkpoint (no rank and size) is still read, with its owner
// unknown.
func TestTensorStateReadsVersion1(t *testing.T) {
	st := NewTensorState(3, okTopkConfig(0.5))
	st.Iter, st.Rank, st.Size = 4, 1, 2
	copy(st.Residual, []float32{0.5, 0, -1})
	b, err := st.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	v1 := append(append([]byte(nil), b[:stateFixedV1]...), b[stateFixed:]...)
	binary.LittleEndian.PutUint32(v1[4:], 1)
	var got TensorState
	if err := got.UnmarshalBinary(v1); err != nil {
		t.Fatal(err)
	}
	if got.Iter != 4 || got.Rank != 0 || got.Size != 0 || fmt.Sprint(got.Residual) != fmt.Sprint(st.Residual) {
		t.Fatalf("version 1: %+v", got)
	}
	if err := got.CheckOwner(1, 3); err != nil {
		t.Fatalf("a version-1 state without boundaries has no owner to refuse: %v", err)
	}
}

// CheckOwner refuses another rank's state and a state of another
// communicator size, each with a message saying what to do; a version-1
// state is refused by its boundary count alone.
func TestTensorStateCheckOwnerRefusesAnotherRankOrSize(t *testing.T) {
	st := NewTensorState(8, okTopkConfig(0.5))
	st.Rank, st.Size, st.Boundaries = 1, 4, []uint32{0, 2, 4, 6, 8}
	if err := st.CheckOwner(1, 4); err != nil {
		t.Fatalf("own state refused: %v", err)
	}
	for _, c := range []struct {
		rank, size int
		want       string
	}{
		{0, 4, "saved by rank 1, this is rank 0"},
		{1, 2, "saved by a communicator of 4 ranks, this one has 2"},
	} {
		err := st.CheckOwner(c.rank, c.size)
		if !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("rank %d of %d: %v, want ErrInvalidArgument saying %q", c.rank, c.size, err, c.want)
		}
		if strings.Count(err.Error(), ErrInvalidArgument.Error()) != 1 {
			t.Errorf("sentinel repeated: %v", err)
		}
	}
	st.Rank, st.Size = 0, 0 // version 1: only the boundaries tell
	if err := st.CheckOwner(0, 2); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "5 region boundaries") {
		t.Errorf("version-1 state of 4 ranks into 2: %v", err)
	}
}

// A checkpoint restored into new communicators continues exactly where the
// uninterrupted run would have gone.
func TestOkTopkStateRestoreContinuesExactly(t *testing.T) {
	const p, n, iters, cut = 3, 4000, 10, 4
	cfg := Config{Algorithm: OkTopk, Density: 0.05, Tau: 2, TauPrime: 3}
	inputs := make([][][]float32, iters)
	gen := newDriftingGradients(p, n, 5)
	for it := range inputs {
		inputs[it] = gen.next()
	}
	full := make([][]float32, p)
	saved := make([][]byte, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := 0; it < iters; it++ {
			g := append([]float32(nil), inputs[it][rank]...)
			if _, err := c.SparseAllreduce(ctx, 9, g, cfg); err != nil {
				return err
			}
			full[rank] = g
			if it+1 == cut {
				if st := c.TensorStateOf(9); st.Rank != rank || st.Size != p {
					return fmt.Errorf("rank %d: state records rank %d of %d", rank, st.Rank, st.Size)
				}
				b, err := c.TensorStateOf(9).MarshalBinary()
				if err != nil {
					return err
				}
				saved[rank] = b
			}
		}
		return nil
	})
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		var st TensorState
		if err := st.UnmarshalBinary(saved[rank]); err != nil {
			return err
		}
		c.SetTensorState(9, &st)
		var g []float32
		for it := cut; it < iters; it++ {
			g = append([]float32(nil), inputs[it][rank]...)
			if _, err := c.SparseAllreduce(ctx, 9, g, cfg); err != nil {
				return err
			}
		}
		if hashFloats(g) != hashFloats(full[rank]) {
			return fmt.Errorf("rank %d: resumed run differs from the uninterrupted one", rank)
		}
		return nil
	})
}

// A state regrouped for a communicator of fewer ranks (a job going on
// without a lost rank) keeps the rank's residual whole and starts the
// schedule afresh: the next call is bitwise the call a fresh state makes on
// the gradient plus that residual, result and new residual alike. So the
// residual's mass reaches the smaller job exactly as if it had been folded
// into the gradient.
func TestTensorStateRegroupKeepsTheResidualForFewerRanks(t *testing.T) {
	const p, n, before = 4, 3000, 5
	cfg := Config{Algorithm: OkTopk, Density: 0.05, Tau: 4, TauPrime: 3}
	gen := newDriftingGradients(p, n, 11)
	inputs := make([][][]float32, before+1)
	for it := range inputs {
		inputs[it] = gen.next()
	}
	saved := make([][]byte, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := 0; it < before; it++ {
			g := append([]float32(nil), inputs[it][rank]...)
			if _, err := c.SparseAllreduce(ctx, 5, g, cfg); err != nil {
				return err
			}
		}
		b, err := c.TensorStateOf(5).MarshalBinary()
		saved[rank] = b
		return err
	})
	survivors := []int{0, 1, 3} // rank 2 is lost
	regrouped := make([][]float32, len(survivors))
	regroupedResidual := make([][]float32, len(survivors))
	folded := make([][]float32, len(survivors))
	foldedResidual := make([][]float32, len(survivors))
	runInProc(t, len(survivors), func(ctx context.Context, rank int, c *Communicator) error {
		var st TensorState
		if err := st.UnmarshalBinary(saved[survivors[rank]]); err != nil {
			return err
		}
		if st.CheckOwner(rank, len(survivors)) == nil {
			return fmt.Errorf("rank %d: a 4-rank state passed CheckOwner for 3 ranks", rank)
		}
		held := append([]float32(nil), st.Residual...)
		st.Regroup(rank, len(survivors))
		if err := st.CheckOwner(rank, len(survivors)); err != nil {
			return err
		}
		c.SetTensorState(5, &st)
		g := append([]float32(nil), inputs[before][survivors[rank]]...)
		if _, err := c.SparseAllreduce(ctx, 5, g, cfg); err != nil {
			return err
		}
		regrouped[rank], regroupedResidual[rank] = g, append([]float32(nil), c.TensorStateOf(5).Residual...)
		// The same rank starting afresh on gradient + residual.
		f := append([]float32(nil), inputs[before][survivors[rank]]...)
		for i := range f {
			f[i] += held[i]
		}
		if _, err := c.SparseAllreduce(ctx, 6, f, cfg); err != nil {
			return err
		}
		folded[rank], foldedResidual[rank] = f, c.TensorStateOf(6).Residual
		return nil
	})
	for r := range survivors {
		if hashFloats(regrouped[r]) != hashFloats(folded[r]) || hashFloats(regroupedResidual[r]) != hashFloats(foldedResidual[r]) {
			t.Fatalf("rank %d: the regrouped state's call differs from a fresh call on gradient + residual", r)
		}
	}
	var nonzero int
	for _, v := range regroupedResidual[0] {
		if v != 0 {
			nonzero++
		}
	}
	if nonzero == 0 {
		t.Fatal("the residual after the call is empty: the test would not see a residual dropped")
	}
}
