package core

// Tests of the link model Auto decides by: bitwise the same on every rank,
// and measured in a call of its own.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"testing"
)

// The measured model is bitwise the same on every rank, for any P (one
// rank included), and measures something on every link.
func TestLinkModelIsBitwiseTheSameOnEveryRank(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5} {
		models := make([]LinkModel, p)
		runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
			m, err := c.MeasureLink(ctx)
			if err != nil {
				return err
			}
			if held, ok := c.Link(); !ok || held != m {
				return fmt.Errorf("rank %d holds %v (%v), measured %v", r, held, ok, m)
			}
			models[r] = m
			return nil
		})
		for r, m := range models {
			bits := func(m LinkModel) [3]uint64 {
				return [3]uint64{math.Float64bits(m.Alpha), math.Float64bits(m.Beta), math.Float64bits(m.Gamma)}
			}
			if bits(m) != bits(models[0]) {
				t.Errorf("P=%d: rank %d holds %v, rank 0 %v", p, r, m, models[0])
			}
			if !m.Valid() || m.Gamma <= 0 || (p > 1 && (m.Alpha <= 0 || m.Beta <= 0)) {
				t.Errorf("P=%d: rank %d measured %v", p, r, m)
			}
		}
	}
}

// The first Auto call measures the link under a sequence number of its own,
// on every rank alike: calls before and after it pair up as before. A rank
// that measures while a peer makes another call fails with ErrMismatch
// instead of taking the peer's messages for its probes.
func TestLinkMeasurementTakesItsOwnCall(t *testing.T) {
	const p = 3
	runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
		x := []float32{float32(r + 1)}
		if _, err := c.Allreduce(ctx, x, false, DenseRing); err != nil || x[0] != 6 {
			return fmt.Errorf("before: %v, %v", x, err)
		}
		if _, ok := c.Link(); ok {
			return fmt.Errorf("a link model before any Auto call")
		}
		g := gaussianInputs(p, 4000, 5)[r]
		st, err := c.SparseAllreduce(ctx, 1, g, Config{Algorithm: Auto, Density: 0.05, Tau: 4, TauPrime: 4})
		if err != nil {
			return fmt.Errorf("first Auto call: %w", err)
		}
		if _, ok := c.Link(); !ok || st.Algorithm == Auto {
			return fmt.Errorf("after the first Auto call: link model %v, ran %v", ok, st.Algorithm)
		}
		x = []float32{float32(r + 1)}
		if _, err := c.Allreduce(ctx, x, false, DenseRabenseifner); err != nil || x[0] != 6 {
			return fmt.Errorf("after: %v, %v", x, err)
		}
		return nil
	})
	errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, r int, c *Communicator) error {
		if r == 0 {
			_, err := c.MeasureLink(ctx)
			return err
		}
		_, err := c.Allreduce(ctx, make([]float32, 10), false, DenseRing)
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) {
			t.Errorf("rank %d: %v, want ErrMismatch", r, err)
		}
	}
}
