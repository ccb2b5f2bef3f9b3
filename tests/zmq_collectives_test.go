package tests

// Acceptance over real ZeroMQ TCP sockets on loopback (one process, one
// goroutine per rank): the same properties core's tests check over the
// in-process transport — dense allreduce bitwise equal to a serial sum,
// every sparse algorithm at density 1 equal to the dense average, ranks
// bitwise identical over many iterations, SparCML equal to the exact sum of
// its sparse inputs, gTopk equal to its serial tree (those two in
// zmq_sparse_input_test.go) — for P in {1, 2, 3, 5, 8}. The references here,
// and those in internal/testref, are written out independently of core.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/internal/testref"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// zmqComms connects p ranks over ZeroMQ on loopback (one goroutine per
// rank), as separate processes would, through an in-memory store.
func zmqComms(t *testing.T, p int) []*core.Communicator { return zmqCommsWith(t, p, nil) }

// zmqCommsWith is zmqComms with each rank's options changed by mutate
// (nil: the defaults).
func zmqCommsWith(t *testing.T, p int, mutate func(r int, o *zmq.Options)) []*core.Communicator {
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
			o := zmq.Options{Rank: r, Size: p, Token: token}
			if mutate != nil {
				mutate(r, &o)
			}
			z, err := zmq.Rendezvous(ctx, store, o)
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

// runRanks calls fn once per rank, concurrently, and fails t with every
// rank's error. A rank that fails aborts the others' communicators, so no
// rank waits for the timeout on a peer that already gave up.
func runRanks(t *testing.T, comms []*core.Communicator, fn func(ctx context.Context, r int, c *core.Communicator) error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	errs := make([]error, len(comms))
	var wg sync.WaitGroup
	var once sync.Once
	for r, c := range comms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[r] = fn(ctx, r, c); errs[r] != nil {
				errs[r] = fmt.Errorf("rank %d: %w", r, errs[r])
				once.Do(func() {
					for _, other := range comms {
						other.Abort(errs[r])
					}
				})
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// integerInputs is testref.IntegerInputs drawn from seed: P ranks' n
// integer-valued floats, on which every summation order is exact.
func integerInputs(p, n int, seed uint64) [][]float32 {
	return testref.IntegerInputs(rand.New(rand.NewPCG(seed, uint64(n))), p, n)
}

func serialSum(in [][]float32) []float32 {
	out := make([]float32, len(in[0]))
	for _, v := range in {
		for i := range out {
			out[i] += v[i]
		}
	}
	return out
}

var rankCounts = []int{1, 2, 3, 5, 8}

func sparseAlgorithms() []core.Algorithm {
	var out []core.Algorithm
	for _, a := range core.Algorithms() {
		if !a.Dense() {
			out = append(out, a)
		}
	}
	return out
}

func config(alg core.Algorithm, density float64) core.Config {
	return core.Config{Algorithm: alg, Density: density, Tau: 16, TauPrime: 8}
}

// Dense ring and Rabenseifner, sum and average, over ZeroMQ: every rank's
// result is bitwise the serial sum (or the serial sum divided by P) on
// integer-valued floats, for n that do and do not divide by P. Under -race
// the 2^20+3 case runs at P = 3 and 8 only.
func TestDenseAllreduceOverZMQIsBitwiseSerialSum(t *testing.T) {
	for _, p := range rankCounts {
		comms := zmqComms(t, p)
		sizes := []int{0, 1, 7, 1000}
		if p-1 > 1 && p-1 != 7 {
			sizes = append(sizes, p-1)
		}
		if !raceEnabled || p == 3 || p == 8 {
			sizes = append(sizes, 1<<20+3)
		}
		for _, n := range sizes {
			in := integerInputs(p, n, uint64(p))
			sum := serialSum(in)
			for _, alg := range []core.Algorithm{core.DenseRing, core.DenseRabenseifner} {
				for _, average := range []bool{false, true} {
					t.Run(fmt.Sprintf("P=%d/n=%d/%v/average=%v", p, n, alg, average), func(t *testing.T) {
						want := append([]float32(nil), sum...)
						if average {
							for i := range want {
								want[i] /= float32(p)
							}
						}
						runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
							data := append([]float32(nil), in[r]...)
							if _, err := c.Allreduce(ctx, data, average, alg); err != nil {
								return err
							}
							if i, bad := testref.FirstBitwiseDifference(data, want); bad {
								return fmt.Errorf("element %d: %v, serial %v", i, data[i], want[i])
							}
							return nil
						})
					})
				}
			}
		}
	}
}

// Every sparse algorithm at density 1 over ZeroMQ: every rank's result is
// bitwise the dense average and nothing is left in the residual.
func TestSparseAlgorithmsOverZMQDensityOneEqualsDenseAverage(t *testing.T) {
	for _, p := range rankCounts {
		comms := zmqComms(t, p)
		for _, n := range []int{7, 1000} {
			in := integerInputs(p, n, uint64(10*p))
			want := serialSum(in)
			for i := range want {
				want[i] /= float32(p)
			}
			for _, alg := range sparseAlgorithms() {
				t.Run(fmt.Sprintf("P=%d/n=%d/%v", p, n, alg), func(t *testing.T) {
					id := uint64(n)<<8 | uint64(alg)
					runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
						g := append([]float32(nil), in[r]...)
						if _, err := c.SparseAllreduce(ctx, id, g, config(alg, 1)); err != nil {
							return err
						}
						if i, bad := testref.FirstBitwiseDifference(g, want); bad {
							return fmt.Errorf("element %d: %v, dense average %v", i, g[i], want[i])
						}
						for i, v := range c.TensorStateOf(id).Residual {
							if v != 0 {
								return fmt.Errorf("residual[%d] = %v, want 0 (everything was sent)", i, v)
							}
						}
						return nil
					})
				})
			}
		}
	}
}

// driftingInputs is rank r's gradient at one iteration: a shared drifting
// signal plus per-rank noise (the shape of data-parallel gradients).
type driftingInputs struct {
	rng    *rand.Rand
	shared []float64
	p      int
}

func newDriftingInputs(p, n int, seed uint64) *driftingInputs {
	return &driftingInputs{rng: rand.New(rand.NewPCG(seed, 1)), shared: make([]float64, n), p: p}
}

func (d *driftingInputs) next() [][]float32 {
	for i := range d.shared {
		d.shared[i] = 0.9*d.shared[i] + d.rng.NormFloat64()*float64(1+i%7)
	}
	out := make([][]float32, d.p)
	for r := range out {
		out[r] = make([]float32, len(d.shared))
		for i, s := range d.shared {
			out[r][i] = float32(s + 0.5*d.rng.NormFloat64())
		}
	}
	return out
}

// Every sparse algorithm at density 1% on arbitrary floats over ZeroMQ, with
// error feedback over many calls (Ok-Topk 100, crossing threshold refreshes
// and repartitions; 20 under -race): after every call all ranks hold the
// same bits. Ok-Topk also runs at P = 7. Under -race it runs at P = 3, 7
// and 8 only (make test runs every P again without the race detector).
func TestSparseAlgorithmsOverZMQRanksBitwiseIdentical(t *testing.T) {
	const n = 20011
	for _, p := range append(rankCounts, 7) {
		if raceEnabled && p != 3 && p < 7 {
			continue
		}
		comms := zmqComms(t, p)
		for _, alg := range sparseAlgorithms() {
			if p == 7 && alg != core.OkTopk {
				continue
			}
			iters := 12
			if alg == core.OkTopk {
				iters = 100
			}
			if raceEnabled {
				iters = min(iters, 20)
			}
			t.Run(fmt.Sprintf("P=%d/%v", p, alg), func(t *testing.T) {
				inputs := newDriftingInputs(p, n, uint64(p))
				out := make([][]float32, p)
				for it := 0; it < iters; it++ {
					in := inputs.next()
					runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
						out[r] = in[r]
						if _, err := c.SparseAllreduce(ctx, uint64(alg), out[r], config(alg, 0.01)); err != nil {
							return fmt.Errorf("iteration %d: %w", it, err)
						}
						return nil
					})
					nonzero := 0
					for _, v := range out[0] {
						if v != 0 {
							nonzero++
						}
					}
					if nonzero == 0 {
						t.Fatalf("iteration %d: empty result", it)
					}
					for r := 1; r < p; r++ {
						if i, bad := testref.FirstBitwiseDifference(out[r], out[0]); bad {
							t.Fatalf("iteration %d: rank %d element %d is %v, rank 0 has %v", it, r, i, out[r][i], out[0][i])
						}
					}
				}
			})
		}
	}
}

// 16-bit, 8-bit and 4-bit values over ZeroMQ (each frame through the header's size
// check) for the algorithms that take them, with error feedback over calls
// that refresh and reuse thresholds and repartition: every rank holds the
// same bits after every call, and no gradient mass is lost: the gradients
// sum to P × the outputs plus the residuals, up to float32 rounding.
func TestReducedValuesOverZMQRanksBitwiseIdenticalAndMassKept(t *testing.T) {
	const n, iters = 20011, 12
	for _, p := range []int{2, 5} {
		comms := zmqComms(t, p)
		for _, alg := range []core.Algorithm{core.OkTopk, core.TopkA, core.Gaussiank} {
			for _, v := range []core.ValueType{core.ValuesFloat16, core.ValuesBFloat16, core.ValuesInt8, core.ValuesInt4} {
				t.Run(fmt.Sprintf("P=%d/%v/%v", p, alg, v), func(t *testing.T) {
					cfg := core.Config{Algorithm: alg, Density: 0.01, Tau: 8, TauPrime: 4, Values: v}
					id := uint64(1000 + 10*int(alg) + int(v))
					inputs := newDriftingInputs(p, n, uint64(p))
					in := make([]float64, n)  // the gradients' sum over ranks and calls
					out := make([]float64, n) // P × the outputs' sum over calls
					scale := make([]float64, n)
					result := make([][]float32, p)
					for it := 0; it < iters; it++ {
						grads := inputs.next()
						for r := range grads {
							for i, g := range grads[r] {
								in[i] += float64(g)
								scale[i] += math.Abs(float64(g))
							}
						}
						runRanks(t, comms, func(ctx context.Context, r int, c *core.Communicator) error {
							result[r] = append([]float32(nil), grads[r]...)
							if _, err := c.SparseAllreduce(ctx, id, result[r], cfg); err != nil {
								return fmt.Errorf("iteration %d: %w", it, err)
							}
							return nil
						})
						for r := 1; r < p; r++ {
							if i, bad := testref.FirstBitwiseDifference(result[r], result[0]); bad {
								t.Fatalf("iteration %d: rank %d element %d is %v, rank 0 has %v", it, r, i, result[r][i], result[0][i])
							}
						}
						for i, o := range result[0] {
							out[i] += float64(p) * float64(o)
						}
					}
					for i := range in {
						left := 0.0
						for _, c := range comms {
							left += float64(c.TensorStateOf(id).Residual[i])
						}
						if d := math.Abs(in[i]-out[i]-left) / (scale[i] + 1e-30); d > 1e-6 {
							t.Fatalf("entry %d: %.3g of the gradient mass through it lost", i, d)
						}
					}
				})
			}
		}
	}
}
