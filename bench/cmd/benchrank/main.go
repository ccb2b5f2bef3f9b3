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
	n               int
	density         float64
	iters, warmup   int
	tau, tauPrime   int
	rateBitsPerSec  float64
	rep, position   int
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
	flag.Float64Var(&o.rateBitsPerSec, "rate-bps", 0, "each rank's link rate in bit/s, for the lower-bound and wire times (0: unknown)")
	flag.IntVar(&o.rep, "rep", 1, "repetition number, printed in the row")
	flag.IntVar(&o.position, "position", 0, "place of this job in its repetition's order, printed in the row")
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

// formula is the words-per-rank bound each algorithm's file states (from its
// paper's cost analysis).
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

// sample is one timed call as this rank saw it.
type sample struct {
	words, selected float64
	reuse           bool
	timing          callTiming
}

// callTiming is what every rank reports of one call for rank 0 to combine:
// start and end on the shared wall clock (ns), each phase's time (ns) and
// bytes.
type callTiming struct {
	start, end         uint64
	phase, sent, recvd [core.NumPhases]uint64
}

const timingWords = 2 + 3*int(core.NumPhases)

func (t callTiming) words() []uint64 {
	w := []uint64{t.start, t.end}
	w = append(w, t.phase[:]...)
	w = append(w, t.sent[:]...)
	return append(w, t.recvd[:]...)
}

func timingOf(w []uint64) callTiming {
	t := callTiming{start: w[0], end: w[1]}
	np := int(core.NumPhases)
	copy(t.phase[:], w[2:2+np])
	copy(t.sent[:], w[2+np:2+2*np])
	copy(t.recvd[:], w[2+2*np:2+3*np])
	return t
}

// callSummary is one call combined over the ranks.
type callSummary struct {
	ms, rank0Ms, skewMs float64
	phaseMs, wireMs     [core.NumPhases]float64
}

// summarize combines every rank's view of one call (ranks[r] is rank r's):
// the call lasts from the first rank's start to the last rank's end; the
// phases are the last rank's; a phase's wire time is the most bytes any
// rank sent or received in it ÷ the rate (NaN when the rate is unknown).
func summarize(ranks []callTiming, rateBitsPerSec float64) callSummary {
	first, lastStart, last := ranks[0].start, ranks[0].start, 0
	for r, t := range ranks {
		first, lastStart = min(first, t.start), max(lastStart, t.start)
		if t.end > ranks[last].end {
			last = r
		}
	}
	nsToMs := func(ns uint64) float64 { return float64(ns) / 1e6 }
	s := callSummary{
		ms:      nsToMs(ranks[last].end - first),
		rank0Ms: nsToMs(ranks[0].end - ranks[0].start),
		skewMs:  nsToMs(lastStart - first),
	}
	for p := range s.phaseMs {
		s.phaseMs[p] = nsToMs(ranks[last].phase[p])
		var most uint64
		for _, t := range ranks {
			most = max(most, t.sent[p], t.recvd[p])
		}
		s.wireMs[p] = math.NaN()
		if rateBitsPerSec > 0 {
			s.wireMs[p] = 1000 * float64(most) * 8 / rateBitsPerSec
		}
	}
	return s
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

// gatherExact returns every rank's v (the same length on every rank), rank
// r's at [r], exactly: each value travels as four 16-bit pieces, one float32
// slot each, in a dense sum where only the owner's slots are nonzero (a
// float32 holds any integer below 2^24 exactly, and adding zeros keeps it).
func gatherExact(ctx context.Context, comm *core.Communicator, v []uint64) ([][]uint64, error) {
	p, r := comm.Size(), comm.Rank()
	buf := make([]float32, 4*p*len(v))
	own := buf[4*r*len(v):]
	for i, x := range v {
		for j := range 4 {
			own[4*i+j] = float32(x >> (16 * j) & 0xffff)
		}
	}
	if _, err := comm.Allreduce(ctx, buf, false, core.DenseRing); err != nil {
		return nil, err
	}
	out := make([][]uint64, p)
	for q := range out {
		out[q] = make([]uint64, len(v))
		slots := buf[4*q*len(v):]
		for i := range out[q] {
			for j := range 4 {
				out[q][i] |= uint64(slots[4*i+j]) << (16 * j)
			}
		}
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
