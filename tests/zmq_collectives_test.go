package tests

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// zmqComms connects p ranks over real ZeroMQ TCP sockets on loopback (one
// process, one goroutine per rank) and returns their communicators.
func zmqComms(t *testing.T, p int) []*core.Communicator {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	store := transport.NewMemStore()
	token := transport.NewToken()
	comms := make([]*core.Communicator, p)
	errs := make([]error, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			z, err := transport.RendezvousZMQ(ctx, store, transport.ZMQOptions{Rank: r, Size: p, Token: token})
			if err != nil {
				errs[r] = err
				return
			}
			comms[r] = core.NewCommunicator(z)
		}()
	}
	wg.Wait()
	t.Cleanup(func() {
		for _, c := range comms {
			if c != nil {
				c.T.Close()
			}
		}
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	return comms
}

// driftingInputs: rank r's gradient at iteration it, a shared drifting
// signal plus per-rank noise (the same shape as data-parallel gradients).
func driftingInputs(p, n, iters int, seed uint64) [][][]float32 {
	rng := rand.New(rand.NewPCG(seed, 1))
	shared := make([]float64, n)
	out := make([][][]float32, iters)
	for it := range out {
		for i := range shared {
			shared[i] = 0.9*shared[i] + rng.NormFloat64()*float64(1+i%7)
		}
		out[it] = make([][]float32, p)
		for r := range out[it] {
			out[it][r] = make([]float32, n)
			for i := range shared {
				out[it][r][i] = float32(shared[i] + 0.5*rng.NormFloat64())
			}
		}
	}
	return out
}

// TestSparseAlgorithmsOverZMQRanksBitwiseIdentical runs every sparse
// algorithm at density 1% over real sockets for several iterations (Ok-Topk
// crosses a threshold refresh) and checks that every rank's output has the
// same bits on every call.
func TestSparseAlgorithmsOverZMQRanksBitwiseIdentical(t *testing.T) {
	const n, iters = 30011, 12
	for _, p := range []int{2, 3, 4} {
		comms := zmqComms(t, p)
		inputs := driftingInputs(p, n, iters, uint64(p))
		for _, alg := range core.Algorithms() {
			if alg.Dense() {
				continue
			}
			t.Run(fmt.Sprintf("P=%d/%v", p, alg), func(t *testing.T) {
				cfg := core.DefaultConfig()
				cfg.Algorithm, cfg.TauPrime, cfg.Tau = alg, 8, 8
				hashes := make([][]uint64, p)
				errs := make([]error, p)
				var wg sync.WaitGroup
				for r := 0; r < p; r++ {
					wg.Add(1)
					go func() {
						defer wg.Done()
						ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
						defer cancel()
						for it := 0; it < iters; it++ {
							g := append([]float32(nil), inputs[it][r]...)
							if _, err := comms[r].SparseAllreduce(ctx, uint64(alg), g, cfg); err != nil {
								errs[r] = fmt.Errorf("rank %d iteration %d: %w", r, it, err)
								return
							}
							h := fnv.New64a()
							h.Write(core.Float32Bytes(g))
							hashes[r] = append(hashes[r], h.Sum64())
						}
					}()
				}
				wg.Wait()
				if err := errors.Join(errs...); err != nil {
					t.Fatal(err)
				}
				for r := 1; r < p; r++ {
					for it := range hashes[0] {
						if hashes[r][it] != hashes[0][it] {
							t.Fatalf("iteration %d: rank %d's output differs from rank 0's", it, r)
						}
					}
				}
			})
		}
	}
}
