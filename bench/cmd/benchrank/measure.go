package main

// What a row reports and how it is measured: each call's timing on every
// rank, summarized into the call's time and phases; the relative error to
// the exact top-k; the gathers that bring every rank's numbers to rank 0;
// peak RSS; and the statistics over the timed calls.

import (
	"bufio"
	"context"
	"math"
	"os"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/oktopk/oktopk/core"
)

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
