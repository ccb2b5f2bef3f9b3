package core

// Tests of Auto across ranks: the same choice on every rank, a mismatch
// when link models differ, exact mass when the choice switches, and a
// non-finite step skipped everywhere under a dense choice.

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
	"github.com/oktopk/oktopk/transport"
)

func init() {
	if raceEnabled {
		// The same code paths at sizes the race detector runs quickly:
		// every Auto call of a new communicator measures first.
		probeBytes, probePassLen = 1<<14, 1<<14
	}
}

// Link models spanning what a job meets: no cost at all, a latency-bound
// one, loopback, 10 and 1 Gbit/s and 200 Mbit/s Ethernet, and the last on
// a host whose cores are shared by many ranks.
var testLinkModels = []LinkModel{
	{},
	{Alpha: 100e-6},
	{Alpha: 30e-6, Beta: 0.5e-9, Gamma: 0.1e-9},
	{Alpha: 20e-6, Beta: 0.8e-9, Gamma: 0.1e-9},
	{Alpha: 50e-6, Beta: 8e-9, Gamma: 0.15e-9},
	{Alpha: 100e-6, Beta: 40e-9, Gamma: 0.15e-9},
	{Alpha: 500e-6, Beta: 40e-9, Gamma: 0.6e-9},
}

func outputHash(v []float32) uint64 {
	h := fnv.New64a()
	h.Write(float32Bytes(v))
	return h.Sum64()
}

// autoCall is what one rank saw of one call in a randomized sequence.
type autoCall struct {
	alg  Algorithm
	hash uint64
}

// Every rank runs the same random sequence of Auto calls — tensors of
// 1 to 40000 elements, densities from 0.1% to 1, the three caller dtypes,
// each rank with its own gradients — with re-measurements of the link and
// installed models in between; every rank must choose the same algorithm
// for every call (and so return the same bits).
func TestAutoChoosesTheSameAlgorithmOnEveryRank(t *testing.T) {
	sizes := []int{1, 7, 21, 300, 5000, 40000}
	densities := []float64{0.001, 0.01, 0.05, 0.3, 1}
	dtypes := []transport.Dtype{transport.DtypeFloat32, transport.DtypeFloat16, transport.DtypeBFloat16}
	for _, p := range []int{2, 3, 5} {
		t.Run(fmt.Sprintf("P=%d", p), func(t *testing.T) {
			const calls = 40
			seen := make([][]autoCall, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				shared := rand.New(rand.NewPCG(uint64(p), 1)) // the same on every rank
				own := rand.New(rand.NewPCG(uint64(p), uint64(r)+100))
				for i := 0; i < calls; i++ {
					switch {
					case i%13 == 12:
						if _, err := c.MeasureLink(ctx); err != nil {
							return fmt.Errorf("re-measuring before call %d: %w", i, err)
						}
					case i%7 == 6:
						if err := c.SetLinkModel(testLinkModels[shared.IntN(len(testLinkModels))]); err != nil {
							return err
						}
					}
					tensor := shared.IntN(len(sizes))
					grad := make([]float32, sizes[tensor])
					for j := range grad {
						grad[j] = float32(own.NormFloat64())
					}
					cfg := Config{Algorithm: Auto, Density: densities[shared.IntN(len(densities))], Tau: 4, TauPrime: 8}
					st, err := c.SparseAllreduceWith(ctx, uint64(tensor), grad, cfg, CallOptions{Dtype: dtypes[shared.IntN(len(dtypes))]})
					if err != nil {
						return fmt.Errorf("call %d: %w", i, err)
					}
					if st.Algorithm == Auto || !st.Algorithm.Valid() {
						return fmt.Errorf("call %d: stats name %v as the algorithm that ran", i, st.Algorithm)
					}
					seen[r] = append(seen[r], autoCall{st.Algorithm, outputHash(grad)})
				}
				return nil
			})
			distinct := map[Algorithm]bool{}
			var dense, sparse bool
			for i := 0; i < calls; i++ {
				for r := 1; r < p; r++ {
					if seen[r][i] != seen[0][i] {
						t.Fatalf("call %d: rank 0 ran %v (output %x), rank %d ran %v (output %x)",
							i, seen[0][i].alg, seen[0][i].hash, r, seen[r][i].alg, seen[r][i].hash)
					}
				}
				distinct[seen[0][i].alg] = true
				dense = dense || seen[0][i].alg.Dense()
				sparse = sparse || !seen[0][i].alg.Dense()
			}
			if !dense || !sparse {
				t.Fatalf("the sequence exercised only %v; the test needs dense and sparse choices", distinct)
			}
			t.Logf("P=%d: %d calls, algorithms chosen: %v", p, calls, distinct)
		})
	}
}

// Ranks that hold different link models may choose differently; the call
// then fails with ErrMismatch on "algorithm" on every rank instead of
// combining data of two algorithms.
func TestAutoOnRanksWithDifferentLinkModelsFailsWithMismatch(t *testing.T) {
	free := LinkModel{}                     // every prediction 0: dense wins the tie
	bandwidthBound := LinkModel{Beta: 1e-8} // a sparse algorithm sends far less
	cfg := Config{Algorithm: Auto, Density: 0.01, Tau: 4, TauPrime: 4}
	const n = 1 << 16
	if a, _ := free.Choose(n, 2, cfg); !a.Dense() {
		t.Fatalf("setup: %v under a free link", a)
	}
	if a, _ := bandwidthBound.Choose(n, 2, cfg); a.Dense() {
		t.Fatalf("setup: %v under a bandwidth-bound link", a)
	}
	errs := runInProcErrors(t, 2, inProcTimeout, func(ctx context.Context, r int, c *Communicator) error {
		m := free
		if r == 1 {
			m = bandwidthBound
		}
		if err := c.SetLinkModel(m); err != nil {
			return err
		}
		_, err := c.SparseAllreduce(ctx, 1, make([]float32, n), cfg)
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "algorithm") {
			t.Errorf("rank %d: %v, want ErrMismatch on the algorithm", r, err)
		}
	}
}

// One tensor, Auto, and link models and densities that make consecutive
// calls choose different algorithms (dense ones, Ok-Topk, allgathers,
// recursive doubling): in every call, the sum over the ranks of the
// gradient plus the residual before, less the residual after, is exactly P
// × the output (integer gradients, P a power of two): nothing is lost or
// made up, whatever the algorithm before.
func TestAutoSwitchingAlgorithmsKeepsExactMass(t *testing.T) {
	n := 1 << 16
	if raceEnabled {
		n = 1 << 13
	}
	for _, p := range []int{4, 8} {
		t.Run(fmt.Sprintf("P=%d", p), func(t *testing.T) {
			schedule := switchingSchedule(t, n, p)
			calls := len(schedule)
			var mu sync.Mutex
			contributed := make([][]float64, calls) // Σ over ranks of grad + residual before − residual after
			outputs := make([][]float32, calls)
			ran := make([][]Algorithm, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				rng := rand.New(rand.NewPCG(uint64(r), 7))
				prev := make([]float32, n)
				for i := 0; i < calls; i++ {
					step := schedule[i]
					if err := c.SetLinkModel(step.model); err != nil {
						return err
					}
					grad := make([]float32, n)
					for j := range grad {
						grad[j] = float32(rng.IntN(17) - 8)
					}
					orig := slices.Clone(grad)
					cfg := Config{Algorithm: Auto, Density: step.density, Tau: 5, TauPrime: 1 << 20}
					st, err := c.SparseAllreduce(ctx, 9, grad, cfg)
					if err != nil {
						return fmt.Errorf("call %d (%v): %w", i, step.alg, err)
					}
					if st.Algorithm != step.alg {
						return fmt.Errorf("call %d: ran %v, the model chose %v", i, st.Algorithm, step.alg)
					}
					ran[r] = append(ran[r], st.Algorithm)
					residual := c.TensorStateOf(9).Residual
					mu.Lock()
					if contributed[i] == nil {
						contributed[i] = make([]float64, n)
						outputs[i] = grad
					}
					for j := range grad {
						contributed[i][j] += float64(orig[j]) + float64(prev[j]) - float64(residual[j])
					}
					mu.Unlock()
					copy(prev, residual)
				}
				return nil
			})
			for i := 0; i < calls; i++ {
				for j, v := range outputs[i] {
					if want := contributed[i][j]; float64(v)*float64(p) != want {
						t.Fatalf("call %d (%v): entry %d: output %v × %d = %v, but the gradients and residuals moved %v",
							i, ran[0][i], j, v, p, float64(v)*float64(p), want)
					}
				}
			}
			t.Logf("P=%d: %d calls alternating %v", p, calls, ran[0])
		})
	}
}

type scheduleStep struct {
	model   LinkModel
	density float64
	alg     Algorithm
}

// switchingSchedule finds, for every algorithm Auto can choose for this n
// and P, a link model and density that make it choose that algorithm, and
// orders them so that every algorithm follows several others, Ok-Topk
// most often.
func switchingSchedule(t *testing.T, n, p int) []scheduleStep {
	t.Helper()
	found := map[Algorithm]scheduleStep{}
	var order []Algorithm
	for _, a := range []float64{0, 1e-6, 1e-5, 1e-4, 1e-3} {
		for _, b := range []float64{0, 1e-10, 1e-9, 1e-8, 1e-7} {
			for _, g := range []float64{0, 1e-10, 1e-9, 1e-8} {
				for _, d := range []float64{0.001, 0.01, 0.05, 0.2, 0.5, 1} {
					m := LinkModel{Alpha: a, Beta: b, Gamma: g}
					alg, _ := m.Choose(n, p, Config{Density: d, Tau: 5, TauPrime: 1 << 20})
					if _, ok := found[alg]; !ok {
						found[alg] = scheduleStep{m, d, alg}
						order = append(order, alg)
					}
				}
			}
		}
	}
	hasDense := found[DenseRing].alg == DenseRing || found[DenseRabenseifner].alg == DenseRabenseifner
	if _, ok := found[OkTopk]; !ok || !hasDense || len(found) < 4 {
		t.Fatalf("setup: Auto chooses only %v at n=%d, P=%d; the test needs Ok-Topk, a dense algorithm and two more", order, n, p)
	}
	var others []scheduleStep
	for _, a := range order {
		if a != OkTopk {
			others = append(others, found[a])
		}
	}
	var out []scheduleStep
	for round := 0; round < 3; round++ {
		for j := range others {
			out = append(out, others[(j+round)%len(others)])
			if j%2 == round%2 {
				out = append(out, found[OkTopk])
			}
		}
	}
	return out
}

// A dense choice reduces gradient + residual; NaN or Inf on one rank shows
// in the sum that every rank holds alike, so every rank returns
// ErrNonFinite with its gradient and state bitwise as before, and the next
// call goes on — with or without a state from earlier sparse calls.
func TestAutoDenseChoiceSkipsANonFiniteStepOnEveryRank(t *testing.T) {
	const n, p = 5000, 3
	sparse := LinkModel{Beta: 1e-8} // bandwidth-bound: a sparse algorithm at density 1%
	for _, withState := range []bool{false, true} {
		for _, bad := range []float32{float32(math.NaN()), float32(math.Inf(1))} {
			t.Run(fmt.Sprintf("state=%v/%v", withState, bad), func(t *testing.T) {
				runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
					if err := c.SetLinkModel(sparse); err != nil {
						return err
					}
					if withState {
						g := gaussianInputs(p, n, 1)[r]
						st, err := c.SparseAllreduce(ctx, 3, g, Config{Algorithm: Auto, Density: 0.01, Tau: 4, TauPrime: 4})
						if err != nil || st.Algorithm.Dense() {
							return fmt.Errorf("sparse warm-up: %v ran, %v", st.Algorithm, err)
						}
					}
					dense := Config{Algorithm: Auto, Density: 1, Tau: 4, TauPrime: 4}
					g := gaussianInputs(p, n, 2)[r]
					if r == 1 {
						g[n/2] = bad
					}
					orig := slices.Clone(g)
					var before *stateCopy // a skipped first call leaves no state
					if st := c.TensorStateOf(3); st != nil {
						b := copyState(st)
						before = &b
					}
					_, err := c.SparseAllreduce(ctx, 3, g, dense)
					if !errors.Is(err, ErrNonFinite) {
						return fmt.Errorf("rank %d: %v, want ErrNonFinite", r, err)
					}
					if i, differs := testref.FirstBitwiseDifference(g, orig); differs {
						return fmt.Errorf("rank %d: skipped step changed gradient[%d]", r, i)
					}
					if st := c.TensorStateOf(3); (st == nil) != (before == nil) {
						return fmt.Errorf("rank %d: state after a skipped call: %v, before it: %v", r, st != nil, before != nil)
					} else if st != nil && sameState(st, *before) != nil {
						e := sameState(st, *before)
						return fmt.Errorf("rank %d: skipped step changed the state: %w", r, e)
					}
					// The communicator goes on: the residual (if any) flows
					// into the dense result and is emptied.
					g = gaussianInputs(p, n, 3)[r]
					st, err := c.SparseAllreduce(ctx, 3, g, dense)
					if err != nil || !st.Algorithm.Dense() {
						return fmt.Errorf("rank %d: next call: %v ran, %v", r, st.Algorithm, err)
					}
					for i, v := range c.TensorStateOf(3).Residual {
						if v != 0 {
							return fmt.Errorf("rank %d: residual[%d] = %v after a dense call", r, i, v)
						}
					}
					return nil
				})
			})
		}
	}
}
