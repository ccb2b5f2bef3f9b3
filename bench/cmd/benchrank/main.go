// Command benchrank is one rank of the benchmark: it joins a job launched
// torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) over the
// ZeroMQ transport, runs every algorithm on the same gradient workload and,
// on rank 0, prints one CSV row per algorithm.
//
// The workload is shaped like data-parallel gradients: every rank sees a
// shared signal plus its own noise. Coordinate i has a scale σ_i drawn
// log-normal; the shared signal drifts as s_t = 0.9·s_{t−1} + 0.44·σ_i·ε
// and rank r's gradient is s_t + 0.5·σ_i·ε_r. The iterations are enough for
// Ok-Topk to reuse its thresholds and to refresh them (τ′ = 8, τ = 16 here).
package main

import (
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

func main() {
	n := flag.Int("n", 1<<22, "gradient elements")
	density := flag.Float64("density", 0.01, "fraction selected")
	iters := flag.Int("iters", 12, "timed iterations per algorithm")
	warmup := flag.Int("warmup", 3, "untimed iterations first")
	algs := flag.String("algs", "", "comma-separated algorithm names (default: all)")
	header := flag.Bool("header", false, "print the CSV header first")
	flag.Parse()
	if err := run(*n, *density, *iters, *warmup, *algs, *header); err != nil {
		fmt.Fprintln(os.Stderr, "benchrank:", err)
		os.Exit(1)
	}
}

type workload struct {
	sigma, shared []float32
	normals       []float32 // a table of standard normal draws
	shared64      uint64    // LCG states: the shared signal's and this rank's
	rank64        uint64
}

// Drawing 2n normals per iteration would cost more than the allreduce being
// measured, so draws come from a table of 2^16 normals indexed by an LCG.
func newWorkload(n, rank int) *workload {
	rng := rand.New(rand.NewPCG(1, 2))
	w := &workload{sigma: make([]float32, n), shared: make([]float32, n), normals: make([]float32, 1<<16),
		shared64: 7, rank64: uint64(rank)*0x9e3779b97f4a7c15 + 1}
	for i := range w.normals {
		w.normals[i] = float32(rng.NormFloat64())
	}
	for i := range w.sigma {
		w.sigma[i] = float32(math.Exp(1.5 * rng.NormFloat64()))
		w.shared[i] = w.sigma[i] * float32(rng.NormFloat64())
	}
	return w
}

func (w *workload) draw(state *uint64) float32 {
	*state = *state*6364136223846793005 + 1442695040888963407
	return w.normals[*state>>48]
}

func (w *workload) next(dst []float32) {
	for i, s := range w.shared {
		s = 0.9*s + 0.44*w.sigma[i]*w.draw(&w.shared64)
		w.shared[i] = s
		dst[i] = s + 0.5*w.sigma[i]*w.draw(&w.rank64)
	}
}

// formula is the words-per-rank bound of DESIGN.md's cost table.
func formula(alg core.Algorithm, p, n, k int) float64 {
	P, N, K := float64(p), float64(n), float64(k)
	switch alg {
	case core.DenseRing, core.DenseRabenseifner:
		return 2 * N * (P - 1) / P
	case core.OkTopk:
		return 6 * K * (P - 1) / P
	case core.TopkA, core.SSARRecursiveDouble:
		return 2 * K * (P - 1)
	case core.Gaussiank:
		return 2 * 1.25 * K * (P - 1)
	case core.TopkDSA, core.DSARSplitAllgather:
		return (2*K + N) * (P - 1) / P
	case core.SSARSplitAllgather:
		return 2*K*(P-1)/P + 2*K*(P-1)
	case core.GTopk:
		return 4 * K * math.Ceil(math.Log2(P))
	}
	return math.NaN()
}

func run(n int, density float64, iters, warmup int, algList string, header bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	z, err := transport.InitFromEnv(ctx, transport.ZMQOptions{})
	if err != nil {
		return err
	}
	defer z.Close()
	comm := core.NewCommunicator(z)
	p, rank := comm.Size(), comm.Rank()
	algs := core.Algorithms()
	if algList != "" {
		algs = algs[:0]
		for _, name := range strings.Split(algList, ",") {
			a, err := core.ParseAlgorithm(name)
			if err != nil {
				return err
			}
			algs = append(algs, a)
		}
	}
	if rank == 0 && header {
		fmt.Println("algorithm,P,n,density,k,median_ms,min_ms,max_ms,select_ms,words_per_rank,formula_words,lower_bound_words,words_over_lower_bound,global_selected,peak_rss_mib")
	}
	grad := make([]float32, n)
	barrier := make([]float32, 1)
	for _, alg := range algs {
		w := newWorkload(n, rank)
		cfg := core.Config{Algorithm: alg, Density: density, Tau: 16, TauPrime: 8}
		k := cfg.K(n)
		var times, selects []float64
		var words, selected []float64
		for it := 0; it < warmup+iters; it++ {
			w.next(grad)
			if _, err := comm.Allreduce(ctx, barrier, false, core.DenseRing); err != nil {
				return err
			}
			start := time.Now()
			st, err := comm.SparseAllreduce(ctx, uint64(alg), grad, cfg)
			if err != nil {
				return fmt.Errorf("%v: %w", alg, err)
			}
			el := time.Since(start)
			if it >= warmup {
				times = append(times, float64(el.Microseconds())/1000)
				selects = append(selects, float64(st.Select.Microseconds())/1000)
				words = append(words, float64(st.WordsSent()))
				selected = append(selected, float64(st.GlobalSelected))
			}
		}
		// Words per rank: the mean over ranks of each rank's median.
		mine := []float32{float32(median(words))}
		if _, err := comm.Allreduce(ctx, mine, true, core.DenseRing); err != nil {
			return err
		}
		if rank == 0 {
			var ru syscall.Rusage
			syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
			lower := 2 * float64(k) * float64(p-1) / float64(p)
			if alg.Dense() {
				lower = math.NaN()
			}
			fmt.Printf("%v,%d,%d,%g,%d,%.2f,%.2f,%.2f,%.2f,%.0f,%.0f,%.0f,%.2f,%.0f,%d\n",
				alg, p, n, density, k, median(times), slices.Min(times), slices.Max(times), median(selects),
				mine[0], formula(alg, p, n, k), lower, float64(mine[0])/lower, median(selected), ru.Maxrss/1024)
		}
	}
	return nil
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}
