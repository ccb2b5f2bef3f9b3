package tests

// Tests that a ZeroMQ job with CURVE on gives exact dense allreduces and
// Ok-Topk results bit for bit equal to the same job without CURVE.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport/zmq"
)

// curveComms connects p ranks like zmqComms, with CURVE on or off.
func curveComms(t *testing.T, p int, curve bool) []*core.Communicator {
	t.Helper()
	comms := zmqCommsWith(t, p, func(r int, o *zmq.Options) { o.Curve = curve })
	for r, c := range comms {
		if ep := c.T.(*zmq.Transport).Endpoint(); curve && !strings.Contains(ep, "#curve=") {
			t.Fatalf("rank %d: CURVE on but endpoint %q carries no key", r, ep)
		}
	}
	return comms
}

// eachRankCurve runs f on every rank concurrently and joins their errors.
func eachRankCurve(p int, f func(r int) error) error {
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(r)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// TestCurveJobAllreducesBitwiseCorrect: a 3-rank job with CURVE on. Dense
// allreduces of small integers (exact in float32, so the sum has one right
// answer) must equal that answer bit for bit, and several Ok-Topk
// iterations must give, bit for bit, what the same job gives without CURVE.
func TestCurveJobAllreducesBitwiseCorrect(t *testing.T) {
	if !zmq.CurveAvailable() {
		t.Skip("libzmq here was built without CURVE (no libsodium/tweetnacl): CURVE test skipped")
	}
	const p, n, iters = 3, 10007, 6
	secure := curveComms(t, p, true)

	for _, alg := range []core.Algorithm{core.DenseRing, core.DenseRabenseifner} {
		out := make([][]float32, p)
		err := eachRankCurve(p, func(r int) error {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			x := make([]float32, n)
			for i := range x {
				x[i] = float32((i*7+r*13)%101 - 50)
			}
			_, err := secure[r].Allreduce(ctx, x, false, alg)
			out[r] = x
			return err
		})
		if err != nil {
			t.Fatalf("%v: %v", alg, err)
		}
		for r := range out {
			for i, v := range out[r] {
				var want float32
				for q := 0; q < p; q++ {
					want += float32((i*7+q*13)%101 - 50)
				}
				if math.Float32bits(v) != math.Float32bits(want) {
					t.Fatalf("%v: rank %d element %d = %v, want %v", alg, r, i, v, want)
				}
			}
		}
	}

	plain := curveComms(t, p, false)
	// Gradients with a shared drifting signal plus per-rank noise.
	rng := rand.New(rand.NewPCG(3, 1))
	shared := make([]float64, n)
	inputs := make([][][]float32, iters)
	for it := range inputs {
		for i := range shared {
			shared[i] = 0.9*shared[i] + rng.NormFloat64()*float64(1+i%7)
		}
		inputs[it] = make([][]float32, p)
		for r := range inputs[it] {
			inputs[it][r] = make([]float32, n)
			for i := range shared {
				inputs[it][r][i] = float32(shared[i] + 0.5*rng.NormFloat64())
			}
		}
	}
	cfg := core.DefaultConfig()
	cfg.Algorithm, cfg.Tau, cfg.TauPrime = core.OkTopk, 4, 4
	run := func(comms []*core.Communicator) [][][]float32 {
		out := make([][][]float32, iters)
		for it := range out {
			out[it] = make([][]float32, p)
		}
		err := eachRankCurve(p, func(r int) error {
			ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
			defer cancel()
			for it := 0; it < iters; it++ {
				g := append([]float32(nil), inputs[it][r]...)
				if _, err := comms[r].SparseAllreduce(ctx, 1, g, cfg); err != nil {
					return fmt.Errorf("rank %d iteration %d: %w", r, it, err)
				}
				out[it][r] = g
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	got, want := run(secure), run(plain)
	for it := range got {
		for r := range got[it] {
			for i := range got[it][r] {
				if math.Float32bits(got[it][r][i]) != math.Float32bits(want[it][r][i]) {
					t.Fatalf("Ok-Topk iteration %d rank %d element %d: %v with CURVE, %v without", it, r, i, got[it][r][i], want[it][r][i])
				}
			}
		}
	}
}
