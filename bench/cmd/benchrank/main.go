// Command benchrank is one rank of the benchmark: it joins a job launched
// torchrun-style (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) over the
// ZeroMQ transport, runs the chosen algorithms on the same gradient workload
// and, on rank 0, prints one CSV row per algorithm (columns: Header).
// bench/run.sh starts one job per algorithm, so that each row's peak RSS is
// that algorithm's alone.
//
// The workload is shaped like data-parallel gradients: every rank sees a
// shared signal plus its own noise. Coordinate i has a scale σ_i drawn
// log-normal; the shared signal drifts as s_t = 0.9·s_{t−1} + 0.44·σ_i·ε
// and rank r's gradient is s_t + 0.5·σ_i·ε_r. The run has more calls than
// τ and τ′, so Ok-Topk both reuses and refreshes its thresholds and its
// region boundaries inside the timed iterations.
//
// Relative error: on the last iteration every rank keeps a copy of its
// accumulator acc = grad + residual (what the algorithm selects from); after
// the timed call the copies are summed with a dense ring allreduce (untimed)
// and rank 0 takes the exact top-k of that sum, ÷P, as the reference for
// the algorithm's averaged output: ‖out − ref‖₂ / ‖ref‖₂. Dense algorithms
// are compared with the exact (k = n) sum.
package main

import (
	"bufio"
	"context"
	"flag"
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// Header is the CSV header; bench/gloo_allreduce.py prints the same columns.
const Header = "algorithm,P,n,density,k,iters,median_ms,min_ms,max_ms,select_ms,comm_ms," +
	"words_median,words_mean,words_reuse_mean,formula_words,lower_bound_words,reuse_over_lower_bound," +
	"lower_bound_ms,global_selected,rel_error,peak_rss_mib,base_rss_mib"

type options struct {
	n               int
	density         float64
	iters, warmup   int
	tau, tauPrime   int
	rateBitsPerSec  float64
	algs            []core.Algorithm
	header, verbose bool
}

func main() {
	var o options
	flag.IntVar(&o.n, "n", 1<<22, "gradient elements")
	flag.Float64Var(&o.density, "density", 0.01, "fraction selected")
	flag.IntVar(&o.iters, "iters", 20, "timed iterations per algorithm")
	flag.IntVar(&o.warmup, "warmup", 3, "untimed iterations first")
	flag.IntVar(&o.tau, "tau", 16, "Ok-Topk repartition period τ (calls)")
	flag.IntVar(&o.tauPrime, "tau-prime", 8, "Ok-Topk exact-threshold period τ′ (calls)")
	flag.Float64Var(&o.rateBitsPerSec, "rate-bps", 0, "each rank's link rate in bit/s, for the lower-bound time (0: unknown)")
	algList := flag.String("algs", "", "comma-separated algorithm names (default: all)")
	flag.BoolVar(&o.header, "header", false, "print the CSV header first")
	list := flag.Bool("list", false, "print the algorithm names, one a line, and exit")
	printHeader := flag.Bool("print-header", false, "print the CSV header and exit")
	flag.Parse()
	if *printHeader {
		fmt.Println(Header)
		return
	}
	if *list {
		for _, a := range core.Algorithms() {
			fmt.Println(a)
		}
		return
	}
	o.algs = core.Algorithms()
	if *algList != "" {
		o.algs = nil
		for _, name := range strings.Split(*algList, ",") {
			a, err := core.ParseAlgorithm(name)
			if err != nil {
				fmt.Fprintln(os.Stderr, "benchrank:", err)
				os.Exit(2)
			}
			o.algs = append(o.algs, a)
		}
	}
	if err := run(o); err != nil {
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

// reuseCall reports whether call c (0-based, per tensor) reuses Ok-Topk's
// thresholds and boundaries: neither an exact threshold (c mod τ′ = 0) nor a
// repartition (c mod τ = 0). The other algorithms are averaged over the same
// calls, so their columns compare like for like.
func reuseCall(c, tau, tauPrime int) bool { return c%tau != 0 && c%tauPrime != 0 }

type sample struct {
	ms, selectMs, commMs, words, selected float64
	reuse                                 bool
}

func run(o options) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	z, err := transport.InitFromEnv(ctx, transport.ZMQOptions{})
	if err != nil {
		return err
	}
	defer z.Close()
	comm := core.NewCommunicator(z)
	rank := comm.Rank()
	if rank == 0 && o.header {
		fmt.Println(Header)
	}
	for _, alg := range o.algs {
		row, err := runAlgorithm(ctx, comm, alg, o)
		if err != nil {
			return fmt.Errorf("%v: %w", alg, err)
		}
		if rank == 0 {
			fmt.Println(row)
		}
	}
	return nil
}

func runAlgorithm(ctx context.Context, comm *core.Communicator, alg core.Algorithm, o options) (string, error) {
	p, rank, n := comm.Size(), comm.Rank(), o.n
	// Start each algorithm from the same footprint: the previous one's
	// buffers are returned and the kernel's high-water mark is reset.
	runtime.GC()
	debug.FreeOSMemory()
	resetPeakRSS()
	w := newWorkload(n, rank)
	grad := make([]float32, n)
	baseRSS := rssMiB("VmRSS")
	cfg := core.Config{Algorithm: alg, Density: o.density, Tau: o.tau, TauPrime: o.tauPrime}
	k := cfg.K(n)
	id := uint64(alg)
	barrier := make([]float32, 1)
	trace := os.Getenv("BENCH_TRACE") == "1"
	var samples []sample
	var acc []float32 // the last call's accumulator, for the error
	var peakRSS float64
	ran := alg // the algorithm that ran: auto's choice, for auto
	total := o.warmup + o.iters
	for c := 0; c < total; c++ {
		w.next(grad)
		last := c == total-1
		if last {
			peakRSS = rssMiB("VmHWM") // before the reference's extra buffers
			acc = slices.Clone(grad)
			if st := comm.TensorStateOf(id); st != nil && !ran.Dense() {
				for i, r := range st.Residual {
					acc[i] += r
				}
			}
		}
		if _, err := comm.Allreduce(ctx, barrier, false, core.DenseRing); err != nil {
			return "", err
		}
		start := time.Now()
		st, err := comm.SparseAllreduce(ctx, id, grad, cfg)
		if err != nil {
			return "", err
		}
		el := time.Since(start)
		if alg == core.Auto && rank == 0 && st.Algorithm != ran {
			fmt.Fprintf(os.Stderr, "benchrank: auto chose %v at P=%d, n=%d, density %g (predicted %.2f ms)\n",
				st.Algorithm, p, n, o.density, ms(st.Predicted))
		}
		ran = st.Algorithm
		if trace && rank == 0 {
			// One line per call on stderr (BENCH_TRACE=1), to see which
			// calls are slow: refreshes (c mod τ′ = 0), repartitions
			// (c mod τ = 0) or reuse calls.
			fmt.Fprintf(os.Stderr, "trace %v call %d reuse %v: %.2f ms (select %.2f, predicted %.2f, ran %v), %d words sent, %d local, %d global\n",
				alg, c, reuseCall(c, o.tau, o.tauPrime), ms(el), ms(st.Select), ms(st.Predicted), st.Algorithm, st.WordsSent(), st.LocalSelected, st.GlobalSelected)
		}
		if c >= o.warmup {
			samples = append(samples, sample{
				ms:       ms(el),
				selectMs: ms(st.Select),
				commMs:   ms(el - st.Select),
				words:    float64(st.WordsSent()),
				selected: float64(st.GlobalSelected),
				reuse:    reuseCall(c, o.tau, o.tauPrime),
			})
		}
	}
	peakRSS = math.Max(peakRSS, rssMiB("VmHWM"))
	relErr, err := relativeError(ctx, comm, ran, acc, grad, k)
	if err != nil {
		return "", err
	}

	col := func(f func(s sample) float64, onlyReuse bool) []float64 {
		var v []float64
		for _, s := range samples {
			if !onlyReuse || s.reuse {
				v = append(v, f(s))
			}
		}
		return v
	}
	words := func(s sample) float64 { return s.words }
	wordsReuse := col(words, true)
	if len(wordsReuse) == 0 { // too few iterations for a reuse call
		wordsReuse = col(words, false)
	}
	// Per-rank numbers travel as one slot each of a P-vector, summed: every
	// rank then has every rank's value.
	mine := []float64{median(col(words, false)), mean(col(words, false)), mean(wordsReuse), peakRSS, baseRSS}
	all, err := gather(ctx, comm, mine)
	if err != nil {
		return "", err
	}
	if rank != 0 {
		return "", nil
	}
	wMedian, wMean, wReuse := meanOver(all, p, 0), meanOver(all, p, 1), meanOver(all, p, 2)
	peak, base := maxOver(all, p, 3), maxOver(all, p, 4)

	kk := k
	if ran.Dense() {
		kk = n // a dense allreduce sends everything: its bound is 2n(P−1)/P
	}
	lower := 2 * float64(kk) * float64(p-1) / float64(p)
	lowerMs := math.NaN()
	if o.rateBitsPerSec > 0 {
		lowerMs = 1000 * lower * 32 / o.rateBitsPerSec
	}
	times := col(func(s sample) float64 { return s.ms }, false)
	selected := median(col(func(s sample) float64 { return s.selected }, false))
	if ran.Dense() {
		selected = float64(n)
	}
	return fmt.Sprintf("%v,%d,%d,%g,%d,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%.0f,%.0f,%.0f,%.0f,%.0f,%.3f,%.2f,%.0f,%.3g,%.0f,%.0f",
		alg, p, n, o.density, k, o.iters, median(times), slices.Min(times), slices.Max(times),
		median(col(func(s sample) float64 { return s.selectMs }, false)),
		median(col(func(s sample) float64 { return s.commMs }, false)),
		wMedian, wMean, wReuse, formula(ran, p, n, k), lower, wReuse/lower, lowerMs,
		selected, relErr, peak, base), nil
}

// relativeError sums every rank's accumulator (untimed, dense ring) and
// compares out, the algorithm's averaged result, with the exact top-k of
// that sum ÷ P on rank 0; other ranks return 0.
func relativeError(ctx context.Context, comm *core.Communicator, alg core.Algorithm, acc, out []float32, k int) (float64, error) {
	if _, err := comm.Allreduce(ctx, acc, false, core.DenseRing); err != nil {
		return 0, err
	}
	if comm.Rank() != 0 {
		return 0, nil
	}
	p := float64(comm.Size())
	ref := make([]float64, len(acc))
	if alg.Dense() {
		for i, v := range acc {
			ref[i] = float64(v) / p
		}
	} else {
		top, err := core.TopK(acc, k)
		if err != nil {
			return 0, err
		}
		for j, i := range top.Idx {
			ref[i] = float64(top.Val[j]) / p
		}
	}
	var diff, norm float64
	for i, r := range ref {
		d := float64(out[i]) - r
		diff += d * d
		norm += r * r
	}
	if norm == 0 {
		return 0, nil
	}
	return math.Sqrt(diff / norm), nil
}

// gather returns every rank's v, rank r's at [r*len(v) : (r+1)*len(v)],
// through a dense sum where each rank fills only its own slots (float32 on
// the wire: enough for words and MiB).
func gather(ctx context.Context, comm *core.Communicator, v []float64) ([]float64, error) {
	p, r := comm.Size(), comm.Rank()
	buf := make([]float32, p*len(v))
	for i, x := range v {
		buf[r*len(v)+i] = float32(x)
	}
	if _, err := comm.Allreduce(ctx, buf, false, core.DenseRing); err != nil {
		return nil, err
	}
	out := make([]float64, len(buf))
	for i, x := range buf {
		out[i] = float64(x)
	}
	return out, nil
}

func meanOver(all []float64, p, field int) float64 {
	stride, s := len(all)/p, 0.0
	for r := 0; r < p; r++ {
		s += all[r*stride+field]
	}
	return s / float64(p)
}

func maxOver(all []float64, p, field int) float64 {
	stride, m := len(all)/p, math.Inf(-1)
	for r := 0; r < p; r++ {
		m = math.Max(m, all[r*stride+field])
	}
	return m
}

// resetPeakRSS resets the kernel's VmHWM to the current RSS (Linux ≥ 4.0);
// where that is refused the peak is the process's since its start.
func resetPeakRSS() {
	_ = os.WriteFile("/proc/self/clear_refs", []byte("5"), 0)
}

// rssMiB reads one field (VmRSS, VmHWM) of /proc/self/status in MiB, or
// falls back to getrusage's peak.
func rssMiB(field string) float64 {
	if f, err := os.Open("/proc/self/status"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			rest, ok := strings.CutPrefix(sc.Text(), field+":")
			if !ok {
				continue
			}
			kb, err := strconv.ParseFloat(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 64)
			if err == nil {
				return kb / 1024
			}
		}
	}
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return float64(ru.Maxrss) / 1024
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }

func median(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

func mean(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := 0.0
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
