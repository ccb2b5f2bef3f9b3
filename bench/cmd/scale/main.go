package main

// Command scale runs the collectives of package core — the same code a job
// runs over ZeroMQ — for P ranks in one process, one goroutine per rank over
// transport.NewInProc, and counts what every rank sends in every phase of
// every call: words (4 bytes; an index and a value are one word each, as
// in the paper's cost model) and messages. That checks the paper's volume
// claims (Li & Hoefler, PPoPP'22, §3 and Table 1) at P up to 1,024 on one
// machine, without a network: Ok-Topk between the lower bound 2k(P−1)/P
// and its 6k(P−1)/P, TopkA's 2k(P−1), gTopk's k·log P, the dense 2n(P−1)/P.
//
// The counts are core's own (core.Stats: per phase, bytes and messages
// queued by this rank), so they are what the networked transport carries
// too (tests/inproc_zmq_test.go checks that they and the results are equal
// over both transports). Timing is not measured here: P goroutines on a
// few cores say nothing about a cluster's time.
//
// Inputs: gradients recorded from the project's training models by
// bench/scale_record.py (NAME.f32 holding B gradients of n values, and
// NAME.json), where rank r's gradient at call c is batch (r + c) mod B, so
// every rank sees its own minibatch as long as P ≤ B and ranks B apart
// share one beyond; and "uniform", an independent uniform(−1, 1) vector
// per rank and call. Each call is a training step's call on the same
// tensor: the residuals of error feedback carry over, and Ok-Topk's call 0
// is its exact one (every τ′) with the repartition (every τ), the later
// ones reuse its thresholds and regions.
//
// Dense algorithms move the same words whatever the values, so they run on
// one input only (uniform, when it is among the inputs).
//
//	scale -grads build/scale/grads -csv results/scale_traffic.csv -md build/scale/tables.md

import (
	"context"
	"encoding/binary"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// input is one workload: B recorded gradients of n values (nil for uniform).
type input struct {
	name, model string
	step        int
	n           int
	batches     [][]float32 // nil: uniform random, drawn per rank and call
}

// fill writes rank r's gradient for call c into g.
func (in *input) fill(g []float32, r, c int) {
	if in.batches == nil {
		rng := rand.New(rand.NewPCG(uint64(r), uint64(c)))
		for i := range g {
			g[i] = 2*rng.Float32() - 1
		}
		return
	}
	copy(g, in.batches[(r+c)%len(in.batches)])
}

type meta struct {
	Model   string `json:"model"`
	Step    int    `json:"step"`
	Batches int    `json:"batches"`
	N       int    `json:"n"`
}

func loadRecorded(dir, name string) (*input, error) {
	var m meta
	b, err := os.ReadFile(filepath.Join(dir, name+".json"))
	if err != nil {
		return nil, err
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return nil, fmt.Errorf("%s.json: %w", name, err)
	}
	raw, err := os.ReadFile(filepath.Join(dir, name+".f32"))
	if err != nil {
		return nil, err
	}
	if len(raw) != 4*m.Batches*m.N || m.N < 1 {
		return nil, fmt.Errorf("%s.f32: %d bytes, want %d batches of %d float32", name, len(raw), m.Batches, m.N)
	}
	in := &input{name: name, model: m.Model, step: m.Step, n: m.N}
	for j := 0; j < m.Batches; j++ {
		g := make([]float32, m.N)
		for i := range g {
			g[i] = math.Float32frombits(binary.LittleEndian.Uint32(raw[4*(j*m.N+i):]))
		}
		in.batches = append(in.batches, g)
	}
	return in, nil
}

// run is one (input, P, algorithm): every rank's Stats of every call.
type run struct {
	in    *input
	p     int
	alg   core.Algorithm
	stats [][]core.Stats // [call][rank]
	wall  time.Duration
	peak  peak
}

// peak is the most memory the process held while a run ran, sampled.
type peak struct {
	heap, stacks uint64 // bytes in use
	goroutines   int
}

// samplePeak samples the process's memory every 100 ms until stop closes,
// then sends the peaks.
func samplePeak(stop chan struct{}, out chan<- peak) {
	var pk peak
	var ms runtime.MemStats
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		runtime.ReadMemStats(&ms)
		pk.heap, pk.stacks = max(pk.heap, ms.HeapInuse), max(pk.stacks, ms.StackInuse)
		pk.goroutines = max(pk.goroutines, runtime.NumGoroutine())
		select {
		case <-stop:
			out <- pk
			return
		case <-tick.C:
		}
	}
}

func runRanks(in *input, p int, alg core.Algorithm, cfg core.Config, calls int, timeout time.Duration) (*run, error) {
	ts := transport.NewInProcDiagnostics(p, transport.Diagnostics{StallWarn: -1})
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	out := &run{in: in, p: p, alg: alg, stats: make([][]core.Stats, calls)}
	for c := range out.stats {
		out.stats[c] = make([]core.Stats, p)
	}
	errs := make([]error, p)
	stop := make(chan struct{})
	sampled := make(chan peak)
	go samplePeak(stop, sampled)
	start := time.Now()
	var wg sync.WaitGroup
	var once sync.Once
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			comm := core.NewCommunicator(ts[r])
			g := make([]float32, in.n)
			for c := 0; c < calls; c++ {
				in.fill(g, r, c)
				st, err := comm.SparseAllreduce(ctx, 1, g, cfg)
				if err != nil {
					errs[r] = fmt.Errorf("rank %d call %d: %w", r, c, err)
					once.Do(func() {
						for _, t := range ts {
							t.Abort(errs[r])
						}
					})
					return
				}
				out.stats[c][r] = st
			}
		}()
	}
	wg.Wait()
	out.wall = time.Since(start)
	close(stop)
	out.peak = <-sampled
	for _, t := range ts {
		t.Close()
	}
	return out, errors.Join(errs...)
}

// The rows of the CSV: the phases of core.Phase, then sums of them. For
// Ok-Topk, "repartition" is step 2's boundaries (counted by core inside
// the reduce phase), "split" is the reduce phase without them, "payload"
// is what the paper's bounds count (split, balance, allgather) and
// "control" the rest (repartition, the global cut's histograms and,
// beyond 16 ranks, the owners' counts, the baselines' NaN agreement).
var extraRows = []string{"repartition", "split", "payload", "control", "total"}

type counts struct{ sent, msgs, recvd []float64 }

// rowCounts is, for each rank, the words sent, messages sent and words
// received in row (a phase name or one of extraRows).
func rowCounts(sts []core.Stats, row string) counts {
	c := counts{make([]float64, len(sts)), make([]float64, len(sts)), make([]float64, len(sts))}
	for r, st := range sts {
		ph := func(p core.Phase) (float64, float64, float64) {
			x := st.Phases[p]
			return float64(x.BytesSent / 4), float64(x.MessagesSent), float64(x.BytesReceived / 4)
		}
		var s, m, v float64
		rep, repMsgs := float64(st.RepartitionWords), float64(st.RepartitionMessages)
		switch row {
		case "repartition":
			s, m, v = rep, repMsgs, rep
		case "split":
			s, m, v = ph(core.PhaseReduce)
			s, m, v = s-rep, m-repMsgs, v-rep
		case "payload", "control", "total":
			for p := core.Phase(0); p < core.NumPhases; p++ {
				a, b, d := ph(p)
				isControl := p == core.PhaseAgree || p == core.PhaseGlobalSelect
				if row == "total" || (row == "control") == isControl {
					s, m, v = s+a, m+b, v+d
				}
			}
			switch row {
			case "payload":
				s, m, v = s-rep, m-repMsgs, v-rep
			case "control":
				s, m, v = s+rep, m+repMsgs, v+rep
			}
		default:
			p := phaseByName(row)
			s, m, v = ph(p)
		}
		c.sent[r], c.msgs[r], c.recvd[r] = s, m, v
	}
	return c
}

func phaseByName(name string) core.Phase {
	for p := core.Phase(0); p < core.NumPhases; p++ {
		if p.String() == name {
			return p
		}
	}
	panic("no phase " + name)
}

func median(x []float64) float64 {
	s := slices.Clone(x)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func maxOf(x []float64) float64 { return slices.Max(x) }

func log2Ceil(p int) int { return bits.Len(uint(p - 1)) }

// Bounds in words per rank (the paper's Table 1 and §3).
func lowerBound(k, p int) float64  { return 2 * float64(k) * float64(p-1) / float64(p) }
func okTopkBound(k, p int) float64 { return 3 * lowerBound(k, p) }
func topkAWords(k, p int) float64  { return 2 * float64(k) * float64(p-1) }
func gTopkWords(k, p int) float64  { return 2 * float64(k) * float64(log2Ceil(p)) }
func denseWords(n, p int) float64  { return 2 * float64(n) * float64(p-1) / float64(p) }
func topkDSAUpper(k, n, p int) float64 {
	return float64(2*k+n) * float64(p-1) / float64(p)
}

// formula is the words per rank the paper gives for alg (sent by the
// busiest rank), the yardstick of its row.
func formula(alg core.Algorithm, k, n, p int) float64 {
	switch alg {
	case core.OkTopk:
		return okTopkBound(k, p)
	case core.TopkA, core.Gaussiank:
		return topkAWords(k, p)
	case core.GTopk:
		return gTopkWords(k, p)
	case core.TopkDSA, core.SSARSplitAllgather, core.DSARSplitAllgather:
		return topkDSAUpper(k, n, p)
	case core.DenseRing, core.DenseRabenseifner:
		return denseWords(n, p)
	}
	return math.NaN()
}

func main() {
	grads := flag.String("grads", "build/scale/grads", "folder of recorded gradients (bench/scale_record.py)")
	inputsFlag := flag.String("inputs", "", "inputs, comma-separated: recorded names (file stems in -grads) and uniform (default: every recorded one, then uniform)")
	psFlag := flag.String("p", "2,4,8,16,64,256,1024", "rank counts")
	algsFlag := flag.String("algorithms", "oktopk,topka,topkdsa,gtopk,dense_ring,dense_rabenseifner", "algorithms")
	density := flag.Float64("density", 0.01, "k = ceil(density·n)")
	calls := flag.Int("calls", 4, "calls per run (the first is Ok-Topk's exact call with the repartition)")
	tau := flag.Int("tau", 64, "Ok-Topk's τ (repartition period)")
	tauPrime := flag.Int("tau-prime", 32, "Ok-Topk's τ′ (exact threshold period)")
	uniformN := flag.Int("n", 1<<18, "uniform input's n (recorded inputs have their own)")
	gatherMaxP := flag.Int("gather-max-p", 64, "largest P for TopkA: each of its ranks holds and sums, in rank order, all P selections "+
		"(P·k pairs each, O(P²·k) work per rank), which at P = 256 takes this machine most of an hour")
	csvPath := flag.String("csv", "", "CSV output (one row per input, P, algorithm, call and phase)")
	mdPath := flag.String("md", "", "markdown tables")
	timeout := flag.Duration("timeout", 20*time.Minute, "per run")
	memLimit := flag.Float64("mem-limit", 6e9, "the Go runtime's soft memory limit in bytes (debug.SetMemoryLimit): "+
		"1,024 ranks' transient selection scratch would otherwise let the heap grow to twice its live size")
	flag.Parse()
	debug.SetMemoryLimit(int64(*memLimit))

	ps, err := parseInts(*psFlag)
	check(err)
	var algs []core.Algorithm
	for _, name := range strings.Split(*algsFlag, ",") {
		a, err := core.ParseAlgorithm(strings.TrimSpace(name))
		check(err)
		algs = append(algs, a)
	}
	names := strings.Split(*inputsFlag, ",")
	if *inputsFlag == "" {
		files, _ := filepath.Glob(filepath.Join(*grads, "*.json"))
		names = nil
		for _, f := range files {
			names = append(names, strings.TrimSuffix(filepath.Base(f), ".json"))
		}
		slices.SortFunc(names, compareInputNames)
		names = append(names, "uniform")
	}
	denseOn := names[0]
	if slices.Contains(names, "uniform") {
		denseOn = "uniform"
	}

	var csv *os.File
	if *csvPath != "" {
		csv, err = os.Create(*csvPath)
		check(err)
		defer csv.Close()
		fmt.Fprintln(csv, "input,model,step,n,k,P,algorithm,call,exact,row,words_sent_median,words_sent_max,"+
			"messages_sent_median,messages_sent_max,words_received_median,words_received_max,"+
			"kept_min,kept_mean,kept_max,global_selected,lower_bound,formula,run_wall_s")
	}
	rep := &report{density: *density}
	started := time.Now()
	for _, name := range names {
		var in *input
		if name == "uniform" {
			in = &input{name: "uniform", model: "uniform", n: *uniformN}
		} else {
			in, err = loadRecorded(*grads, name)
			check(err)
		}
		for _, p := range ps {
			for _, alg := range algs {
				if alg.Dense() && name != denseOn {
					continue
				}
				cfg := core.Config{Algorithm: alg, Density: *density, Tau: *tau, TauPrime: *tauPrime}
				k := cfg.K(in.n)
				if gathers(alg) && p > *gatherMaxP {
					fmt.Fprintf(os.Stderr, "%s P=%d %v: skipped (-gather-max-p %d)\n", name, p, alg, *gatherMaxP)
					rep.skipped = append(rep.skipped, fmt.Sprintf("%v at P = %d on %s", alg, p, name))
					continue
				}
				res, err := runRanks(in, p, alg, cfg, *calls, *timeout)
				check(err)
				fmt.Fprintf(os.Stderr, "%s P=%d %v: %d calls in %.1f s (%.0f s so far), peak heap %.2f GB, stacks %.2f GB, %d goroutines\n",
					name, p, alg, *calls, res.wall.Seconds(), time.Since(started).Seconds(), float64(res.peak.heap)/1e9, float64(res.peak.stacks)/1e9, res.peak.goroutines)
				if csv != nil {
					writeRows(csv, res, k)
				}
				rep.add(res, k)
				runtime.GC()
				debug.FreeOSMemory()
			}
		}
		in.batches = nil
	}
	if *mdPath != "" {
		check(os.WriteFile(*mdPath, []byte(rep.markdown(*calls, time.Since(started))), 0o644))
	}
}

// gathers says whether every rank of alg holds every rank's selection at
// once (P·k pairs each).
func gathers(alg core.Algorithm) bool { return alg == core.TopkA || alg == core.Gaussiank }

func writeRows(w *os.File, res *run, k int) {
	rows := []string{}
	for p := core.Phase(0); p < core.NumPhases; p++ {
		rows = append(rows, p.String())
	}
	rows = append(rows, extraRows...)
	for c, sts := range res.stats {
		kept := keptOf(sts)
		for _, row := range rows {
			x := rowCounts(sts, row)
			fmt.Fprintf(w, "%s,%s,%d,%d,%d,%d,%v,%d,%t,%s,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.0f,%.1f,%.0f,%d,%.1f,%.1f,%.1f\n",
				res.in.name, res.in.model, res.in.step, res.in.n, k, res.p, res.alg, c, exactCall(res.alg, c, sts), row,
				median(x.sent), maxOf(x.sent), median(x.msgs), maxOf(x.msgs), median(x.recvd), maxOf(x.recvd),
				kept.min, kept.mean, kept.max, sts[0].GlobalSelected, lowerBound(k, res.p), formula(res.alg, k, res.in.n, res.p), res.wall.Seconds())
		}
	}
}

// exactCall says whether call c was Ok-Topk's exact one (a repartition
// came with it, or the run's first call).
func exactCall(alg core.Algorithm, c int, sts []core.Stats) bool {
	return alg == core.OkTopk && (c == 0 || sts[0].RepartitionWords > 0)
}

type keptStats struct{ min, mean, max float64 }

func keptOf(sts []core.Stats) keptStats {
	k := keptStats{min: math.Inf(1)}
	for _, st := range sts {
		v := float64(st.Kept)
		k.min, k.max, k.mean = min(k.min, v), max(k.max, v), k.mean+v/float64(len(sts))
	}
	return k
}

func parseInts(s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		v, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || v < 1 {
			return nil, fmt.Errorf("scale: bad rank count %q", f)
		}
		out = append(out, v)
	}
	return out, nil
}

// compareInputNames orders MODEL_stepS by model, then step as a number.
func compareInputNames(a, b string) int {
	ma, sa, _ := strings.Cut(a, "_step")
	mb, sb, _ := strings.Cut(b, "_step")
	if ma != mb {
		return strings.Compare(ma, mb)
	}
	ia, _ := strconv.Atoi(sa)
	ib, _ := strconv.Atoi(sb)
	return ia - ib
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "scale:", err)
		os.Exit(1)
	}
}

// summary is one run reduced to what the tables show: per call, the
// median and the largest over ranks, then the median over calls.
type summary struct {
	in         *input
	p          int
	alg        core.Algorithm
	k          int
	wall       time.Duration
	payloadMed float64 // per-rank payload words: median over ranks, median over calls
	payloadMax float64 // largest over ranks, median over calls
	payloadTop float64 // largest over ranks and calls
	totalMed   float64
	totalMax   float64
	controlMax float64
	msgsMed    float64 // messages sent per rank, median over ranks, median over calls
	msgsMax    float64
	recvdMax   float64 // words received by the busiest receiver, median over calls
	// Ok-Topk's regions before the balance (median over calls): the owners'
	// kept entries, and what step 5 moved and gathered on the busiest rank.
	keptMin, keptMean, keptMax float64
	balanceMax, allgatherMax   float64
	splitMax                   float64
}

type report struct {
	density float64
	runs    []summary
	skipped []string
}

func (rp *report) add(res *run, k int) {
	s := summary{in: res.in, p: res.p, alg: res.alg, k: k, wall: res.wall}
	var pm, px, tm, tx, cx, mm, mx, rx, kmin, kmean, kmax, bx, ax, sx []float64
	for _, sts := range res.stats {
		pay, tot, ctl := rowCounts(sts, "payload"), rowCounts(sts, "total"), rowCounts(sts, "control")
		pm, px = append(pm, median(pay.sent)), append(px, maxOf(pay.sent))
		tm, tx, cx = append(tm, median(tot.sent)), append(tx, maxOf(tot.sent)), append(cx, maxOf(ctl.sent))
		mm, mx, rx = append(mm, median(tot.msgs)), append(mx, maxOf(tot.msgs)), append(rx, maxOf(tot.recvd))
		kept := keptOf(sts)
		kmin, kmean, kmax = append(kmin, kept.min), append(kmean, kept.mean), append(kmax, kept.max)
		bx = append(bx, maxOf(rowCounts(sts, "balance").sent))
		ax = append(ax, maxOf(rowCounts(sts, "allgather").sent))
		sx = append(sx, maxOf(rowCounts(sts, "split").sent))
	}
	s.payloadMed, s.payloadMax, s.payloadTop = median(pm), median(px), maxOf(px)
	s.totalMed, s.totalMax, s.controlMax = median(tm), median(tx), median(cx)
	s.msgsMed, s.msgsMax, s.recvdMax = median(mm), median(mx), median(rx)
	s.keptMin, s.keptMean, s.keptMax = median(kmin), median(kmean), median(kmax)
	s.balanceMax, s.allgatherMax, s.splitMax = median(bx), median(ax), median(sx)
	rp.runs = append(rp.runs, s)
}

func (rp *report) find(input string, p int, alg core.Algorithm) *summary {
	for i := range rp.runs {
		r := &rp.runs[i]
		if r.in.name == input && r.p == p && r.alg == alg {
			return r
		}
	}
	return nil
}

// words prints a word count compactly (12.3k, 1.05M).
func words(w float64) string {
	switch {
	case math.IsNaN(w):
		return "–"
	case w >= 1e6:
		return fmt.Sprintf("%.2fM", w/1e6)
	case w >= 1e4:
		return fmt.Sprintf("%.1fk", w/1e3)
	}
	return fmt.Sprintf("%.0f", w)
}

func (rp *report) markdown(calls int, took time.Duration) string {
	var b strings.Builder
	var inputs []*input
	var ps []int
	var algs []core.Algorithm
	for _, r := range rp.runs {
		if !slices.Contains(inputs, r.in) {
			inputs = append(inputs, r.in)
		}
		if !slices.Contains(ps, r.p) {
			ps = append(ps, r.p)
		}
		if !slices.Contains(algs, r.alg) {
			algs = append(algs, r.alg)
		}
	}
	slices.Sort(ps)
	fmt.Fprintf(&b, "Generated by bench/cmd/scale in %.0f s: %d calls per run; words are 4-byte words sent per rank "+
		"(an index and a value one each); \"median\" is over ranks, then the median over the calls.\n\n", took.Seconds(), calls)

	// The yardsticks, per P (every input has the same n here, or k differs
	// and the row says so).
	fmt.Fprintf(&b, "### The paper's formulas (words per rank)\n\n")
	fmt.Fprintf(&b, "| n | k | P | lower bound 2k(P−1)/P | Ok-Topk 6k(P−1)/P | TopkA 2k(P−1) | gTopk 2k⌈log₂P⌉ | TopkDSA ≤ (2k+n)(P−1)/P | dense 2n(P−1)/P |\n|---|---|---|---|---|---|---|---|---|\n")
	seen := map[[2]int]bool{}
	for _, in := range inputs {
		for _, p := range ps {
			k := core.Config{Density: rp.density}.K(in.n)
			if seen[[2]int{in.n, p}] {
				continue
			}
			seen[[2]int{in.n, p}] = true
			fmt.Fprintf(&b, "| %d | %d | %d | %s | %s | %s | %s | %s | %s |\n", in.n, k, p, words(lowerBound(k, p)), words(okTopkBound(k, p)),
				words(topkAWords(k, p)), words(gTopkWords(k, p)), words(topkDSAUpper(k, in.n, p)), words(denseWords(in.n, p)))
		}
	}

	fmt.Fprintf(&b, "\n### Ok-Topk: payload words per rank against the bounds\n\n")
	fmt.Fprintf(&b, "Payload is what the bounds count (split-and-reduce, balance, allgatherv); control is the repartition's "+
		"boundaries and the global cut's histograms (with, beyond 16 ranks, the owners' counts). ÷LB is the median over ranks of the median call ÷ 2k(P−1)/P; ≤6k says "+
		"whether the largest payload of any rank in any call stays within 6k(P−1)/P.\n\n")
	fmt.Fprintf(&b, "| input | P | k | payload median | ÷LB | payload max (median call) | max, any call | ≤6k | control max | total max | messages median / max | run s |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, in := range inputs {
		for _, p := range ps {
			r := rp.find(in.name, p, core.OkTopk)
			if r == nil {
				continue
			}
			ok := "yes"
			if r.payloadTop > okTopkBound(r.k, p) {
				ok = "**no**"
			}
			fmt.Fprintf(&b, "| %s | %d | %d | %s | %.2f | %s | %s | %s | %s | %s | %.0f / %.0f | %.1f |\n", in.name, p, r.k, words(r.payloadMed),
				r.payloadMed/lowerBound(r.k, p), words(r.payloadMax), words(r.payloadTop), ok, words(r.controlMax), words(r.totalMax),
				r.msgsMed, r.msgsMax, r.wall.Seconds())
		}
	}

	fmt.Fprintf(&b, "\n### Every algorithm: words sent per rank, largest over ranks (median call), and messages\n\n")
	fmt.Fprintf(&b, "Each cell: words (÷ its formula above; Ok-Topk's ÷ 6k(P−1)/P counts payload and control) · messages of the busiest rank. "+
		"Dense rows ran on one input (their traffic does not depend on the values).\n\n")
	fmt.Fprintf(&b, "| input | P |")
	for _, a := range algs {
		fmt.Fprintf(&b, " %v |", a)
	}
	fmt.Fprintf(&b, "\n|---|---|%s\n", strings.Repeat("---|", len(algs)))
	for _, in := range inputs {
		for _, p := range ps {
			fmt.Fprintf(&b, "| %s | %d |", in.name, p)
			for _, a := range algs {
				r := rp.find(in.name, p, a)
				if r == nil {
					fmt.Fprintf(&b, " – |")
					continue
				}
				fmt.Fprintf(&b, " %s (%.2f) · %.0f |", words(r.totalMax), r.totalMax/formula(a, r.k, in.n, p), r.msgsMax)
			}
			fmt.Fprintf(&b, "\n")
		}
	}

	fmt.Fprintf(&b, "\n### Ok-Topk's balance step: the regions before it, and what it buys\n\n")
	fmt.Fprintf(&b, "kept: entries of the global result each owner held after the cut (step 4), min / mean / max over ranks; "+
		"max÷mean is the imbalance the balance step removes. Balance and allgatherv: words sent by the busiest rank. "+
		"Without balance (derived, not run): an allgatherv of the owners' unbalanced blocks sent directly or by a ring "+
		"costs the busiest rank's block P−1 times, 2(P−1)·max kept words on the critical path, against the balanced "+
		"2(P−1)·⌈total/P⌉.\n\n")
	fmt.Fprintf(&b, "| input | P | kept min / mean / max | max÷mean | split max | balance max | allgatherv max | without balance: 2(P−1)·max kept | with: balance + allgatherv |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, in := range inputs {
		for _, p := range ps {
			r := rp.find(in.name, p, core.OkTopk)
			if r == nil || p == 1 {
				continue
			}
			fmt.Fprintf(&b, "| %s | %d | %.0f / %.1f / %.0f | %.2f | %s | %s | %s | %s | %s |\n", in.name, p, r.keptMin, r.keptMean, r.keptMax,
				r.keptMax/r.keptMean, words(r.splitMax), words(r.balanceMax), words(r.allgatherMax),
				words(2*float64(p-1)*r.keptMax), words(r.balanceMax+r.allgatherMax))
		}
	}
	if len(rp.skipped) > 0 {
		fmt.Fprintf(&b, "\nNot run: %s.\n", strings.Join(rp.skipped, "; "))
	}
	return b.String()
}
