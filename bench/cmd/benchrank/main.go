package main

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
// Time of a call: a synchronous training step waits for the slowest rank, so
// a call lasts until every rank has finished it. Every call starts right
// after a barrier; each rank notes when it started and finished the call on
// the machine's wall clock, which every process on one machine shares (the
// emulated cluster runs every rank on one machine), and the call's time is
// the last rank's finish minus the first rank's start. The barrier's own
// exit skew (the last rank's start minus the first's) is thus counted
// against the call, never for it; it is reported beside it (start_skew_ms),
// as is the time rank 0 alone saw (rank0_median_ms), which undercounts
// whenever rank 0 returns before its peers (gTopk's root, say).
//
// Phases: every rank's core.Stats cuts each call into the phases of
// core.Phase. A row reports, per phase, the median over the timed calls of
// that phase's time on the rank that finished the call last (the rank the
// step waited for, so its phases add up to about the call's time) and of its
// wire time: the most bytes any rank sent or received in that phase (each
// rank's link is limited in both directions) ÷ the link's rate.
//
// Relative error: on the last iteration every rank keeps a copy of its
// accumulator acc = grad + residual (what the algorithm selects from); after
// the timed call the copies are summed with a dense ring allreduce (untimed)
// and rank 0 takes the exact top-k of that sum, ÷P, as the reference for
// the algorithm's averaged output: ‖out − ref‖₂ / ‖ref‖₂. Dense algorithms
// are compared with the exact (k = n) sum.

import (
	"context"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport/zmq"
)

// Header is the CSV header; bench/gloo_allreduce.py prints the same columns.
var Header = "algorithm,P,n,density,k,rep,position,iters,median_ms,min_ms,max_ms,rank0_median_ms,start_skew_ms," +
	phaseColumns("_ms") + "," + phaseColumns("_wire_ms") + "," +
	"words_median,words_mean,words_reuse_mean,formula_words,lower_bound_words,reuse_over_lower_bound," +
	"lower_bound_ms,global_selected,rel_error,peak_rss_mib,base_rss_mib"

// phaseColumns is every phase's name with suffix, comma-separated.
func phaseColumns(suffix string) string {
	cols := make([]string, core.NumPhases)
	for p := range cols {
		cols[p] = core.Phase(p).String() + suffix
	}
	return strings.Join(cols, ",")
}

type options struct {
	n              int
	density        float64
	iters, warmup  int
	tau, tauPrime  int
	rateBitsPerSec float64
	values         core.ValueType // the format selected values travel in (algorithms that take one)
	rep, position  int
	algs           []core.Algorithm
	header         bool
}

func main() {
	var o options
	flag.IntVar(&o.n, "n", 1<<22, "gradient elements")
	flag.Float64Var(&o.density, "density", 0.01, "fraction selected")
	flag.IntVar(&o.iters, "iters", 20, "timed iterations per algorithm")
	flag.IntVar(&o.warmup, "warmup", 3, "untimed iterations first")
	flag.IntVar(&o.tau, "tau", 16, "Ok-Topk repartition period τ (calls)")
	flag.IntVar(&o.tauPrime, "tau-prime", 8, "Ok-Topk exact-threshold period τ′ (calls)")
	flag.Float64Var(&o.rateBitsPerSec, "rate-bps", 0, "each rank's link rate in bit/s, for the lower-bound and wire times (0: unknown)")
	flag.IntVar(&o.rep, "rep", 1, "repetition number, printed in the row")
	flag.IntVar(&o.position, "position", 0, "place of this job in its repetition's order, printed in the row")
	algList := flag.String("algs", "", "comma-separated algorithm names (default: all)")
	valuesName := flag.String("values", "float32", "the format selected values travel in: float32, float16, bfloat16, int8 or int4 "+
		"(for the algorithms that take one; the others send float32)")
	flag.BoolVar(&o.header, "header", false, "print the CSV header first")
	list := flag.Bool("list", false, "print the algorithm names, one a line, and exit")
	printHeader := flag.Bool("print-header", false, "print the CSV header and exit")
	flag.Parse()
	var err error
	if o.values, err = core.ParseValueType(*valuesName); err != nil {
		fmt.Fprintln(os.Stderr, "benchrank:", err)
		os.Exit(2)
	}
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

func run(o options) error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Minute)
	defer cancel()
	z, err := zmq.InitFromEnv(ctx, zmq.Options{})
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
	if alg.TakesReducedValues() {
		cfg.Values = o.values
	}
	k := cfg.K(n)
	id := uint64(alg)
	barrier := make([]float32, 1)
	trace := os.Getenv("BENCH_TRACE") == "1"
	var samples []sample
	var acc []float32 // the last call's accumulator, for the error
	var peakRSS float64
	ran := alg // the algorithm that ran: auto's choice, for auto
	if alg == core.Auto {
		// Auto's start-up cost: the link measurement its first call would
		// make, made here on its own after a barrier and timed (it ends with
		// the ranks agreeing on the figures, so every rank ends together).
		if _, err := comm.Allreduce(ctx, barrier, false, core.DenseRing); err != nil {
			return "", err
		}
		start := time.Now()
		m, err := comm.MeasureLink(ctx)
		if err != nil {
			return "", err
		}
		if rank == 0 {
			fmt.Fprintf(os.Stderr, "benchrank: auto's link measurement took %.1f ms at P=%d: alpha %.1f us, beta %.3f ns/B (%.0f Mbit/s), gamma %.3f ns/B\n",
				ms(time.Since(start)), p, m.Alpha*1e6, m.Beta*1e9, 8/m.Beta/1e6, m.Gamma*1e9)
		}
	}
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
		end := time.Now()
		if alg == core.Auto && rank == 0 && st.Algorithm != ran {
			fmt.Fprintf(os.Stderr, "benchrank: auto chose %v at P=%d, n=%d, density %g (predicted %.2f ms)\n",
				st.Algorithm, p, n, o.density, ms(st.Predicted))
		}
		ran = st.Algorithm
		if trace {
			// One line per call and rank on stderr (BENCH_TRACE=1), to see
			// which calls are slow: refreshes (c mod τ′ = 0), repartitions
			// (c mod τ = 0) or reuse calls, and in which phase.
			var phases strings.Builder
			for p := range core.NumPhases {
				fmt.Fprintf(&phases, " %v %.2f", p, ms(st.Time(p)))
			}
			fmt.Fprintf(os.Stderr, "trace %v rank %d call %d reuse %v: %.2f ms (%s, predicted %.2f, ran %v), %d words sent, %d local, %d global\n",
				alg, rank, c, reuseCall(c, o.tau, o.tauPrime), ms(end.Sub(start)), strings.TrimSpace(phases.String()), ms(st.Predicted), st.Algorithm, st.WordsSent(), st.LocalSelected, st.GlobalSelected)
		}
		if c >= o.warmup {
			t := callTiming{start: uint64(start.UnixNano()), end: uint64(end.UnixNano())}
			for p, ph := range st.Phases {
				t.phase[p], t.sent[p], t.recvd[p] = uint64(ph.Time), ph.BytesSent, ph.BytesReceived
			}
			samples = append(samples, sample{
				words:    float64(st.WordsSent()),
				selected: float64(st.GlobalSelected),
				reuse:    reuseCall(c, o.tau, o.tauPrime),
				timing:   t,
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
	var timingWordsMine []uint64
	for _, s := range samples {
		timingWordsMine = append(timingWordsMine, s.timing.words()...)
	}
	timings, err := gatherExact(ctx, comm, timingWordsMine)
	if err != nil {
		return "", err
	}
	if rank != 0 {
		return "", nil
	}
	calls := make([]callSummary, len(samples))
	for c := range calls {
		ranks := make([]callTiming, p)
		for r := range ranks {
			ranks[r] = timingOf(timings[r][c*timingWords : (c+1)*timingWords])
		}
		calls[c] = summarize(ranks, o.rateBitsPerSec)
	}
	callCol := func(f func(s callSummary) float64) []float64 {
		v := make([]float64, len(calls))
		for c, s := range calls {
			v[c] = f(s)
		}
		return v
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
	times := callCol(func(s callSummary) float64 { return s.ms })
	selected := median(col(func(s sample) float64 { return s.selected }, false))
	if ran.Dense() {
		selected = float64(n)
	}
	var phases, wires []string
	for ph := range core.NumPhases {
		phases = append(phases, fmt.Sprintf("%.2f", median(callCol(func(s callSummary) float64 { return s.phaseMs[ph] }))))
		wires = append(wires, fmt.Sprintf("%.2f", median(callCol(func(s callSummary) float64 { return s.wireMs[ph] }))))
	}
	return fmt.Sprintf("%v,%d,%d,%g,%d,%d,%d,%d,%.2f,%.2f,%.2f,%.2f,%.2f,%s,%s,%.0f,%.0f,%.0f,%.0f,%.0f,%.3f,%.2f,%.0f,%.3g,%.0f,%.0f",
		alg, p, n, o.density, k, o.rep, o.position, o.iters, median(times), slices.Min(times), slices.Max(times),
		median(callCol(func(s callSummary) float64 { return s.rank0Ms })),
		median(callCol(func(s callSummary) float64 { return s.skewMs })),
		strings.Join(phases, ","), strings.Join(wires, ","),
		wMedian, wMean, wReuse, formula(ran, p, n, k), lower, wReuse/lower, lowerMs,
		selected, relErr, peak, base), nil
}
