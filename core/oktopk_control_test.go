package core

// Tests of Ok-Topk's control exchanges as allreduces (SumAllreduce, beyond
// okTopkGatheredControlMaxP ranks): exact sums on every rank in the words
// the formula says, the same results as gathering every rank's histograms
// and boundaries, and at P = 64 histogram and repartition words per rank
// that do not grow with P.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// sumAllreduceOnce runs one SumAllreduce of every rank's vector (m values
// drawn from the rank) and checks the sums; it returns every rank's
// statistics.
func sumAllreduceOnce[T controlWord](t *testing.T, p, m int, limit uint64) []Stats {
	t.Helper()
	in := make([][]T, p)
	want := make([]T, m)
	rng := rand.New(rand.NewPCG(uint64(p), uint64(m)))
	for r := range in {
		in[r] = make([]T, m)
		for i := range in[r] {
			in[r][i] = T(rng.Uint64N(limit))
			want[i] += in[r][i]
		}
	}
	stats := make([]Stats, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		call := NewCall(c.T, OkTopk.Op(), 1, &stats[rank])
		data := slices.Clone(in[rank])
		if err := SumAllreduce(ctx, call, 5, data); err != nil {
			return err
		}
		if !slices.Equal(data, want) {
			return fmt.Errorf("rank %d: sums %v, want %v", rank, data, want)
		}
		return nil
	})
	return stats
}

// Every rank ends with the exact sums; the ranks that stay after the fold
// send 2m(P′−1) values in all, each within one value per round of its
// average share; an extra rank sends its m values once, its neighbour m
// more; no rank sends more than 2⌊log₂ P⌋ + 1 messages.
func TestSumAllreduceSumsExactlyInTheWordsItsFormulaSays(t *testing.T) {
	for _, p := range []int{1, 2, 3, 5, 7, 8, 13, 24, 64} {
		for _, m := range []int{0, 1, 5, 81, 130} {
			for _, wide := range []bool{false, true} {
				t.Run(fmt.Sprintf("P=%d/m=%d/uint64=%v", p, m, wide), func(t *testing.T) {
					var stats []Stats
					w := 1
					if wide {
						stats, w = sumAllreduceOnce[uint64](t, p, m, 1<<40), 2
					} else {
						stats = sumAllreduceOnce[uint32](t, p, m, 1<<20)
					}
					rounds := bits.Len(uint(p)) - 1
					pow2 := 1 << rounds
					extra := p - pow2
					total := 0
					for r, st := range stats {
						words := int(st.WordsSent())
						switch {
						case r < 2*extra && r%2 == 1:
							if words != w*m {
								t.Errorf("extra rank %d sent %d words, want its m values, %d", r, words, w*m)
							}
							continue
						case r < 2*extra:
							words -= w * m // the unfold
						}
						total += words
						avg := float64(2*m*(pow2-1)) / float64(pow2)
						if d := float64(words)/float64(w) - avg; d > float64(rounds+1) || d < -float64(rounds+1) {
							t.Errorf("rank %d sent %d values, %.1f from the average share %.1f", r, words/w, d, avg)
						}
						if st.MessagesSent > uint64(2*rounds+1) {
							t.Errorf("rank %d sent %d messages, want at most 2⌊log₂ P⌋+1 = %d", r, st.MessagesSent, 2*rounds+1)
						}
					}
					if want := w * 2 * m * (pow2 - 1); total != want {
						t.Errorf("the %d ranks that stay sent %d words in all, want 2m(P′−1)·%d = %d", pow2, total, w, want)
					}
				})
			}
		}
	}
}

// A rank whose vector has another length makes the call fail with
// ErrMismatch, not a wrong sum.
func TestSumAllreduceRefusesVectorsOfDifferentLengths(t *testing.T) {
	const p = 4
	errs := runInProcErrors(t, p, inProcTimeout, func(ctx context.Context, rank int, c *Communicator) error {
		call := NewCall(c.T, OkTopk.Op(), 1, nil)
		data := make([]uint32, 8+rank%2)
		return SumAllreduce(ctx, call, 0, data)
	})
	mismatch := 0
	for _, err := range errs {
		if errors.Is(err, ErrMismatch) {
			mismatch++
		}
	}
	if mismatch == 0 {
		t.Fatalf("no rank failed with ErrMismatch: %v", errs)
	}
}

// withGatheredControlMaxP runs f with okTopkGatheredControlMaxP set to
// maxP (core's tests run one at a time).
func withGatheredControlMaxP(maxP int, f func()) {
	saved := okTopkGatheredControlMaxP
	okTopkGatheredControlMaxP = maxP
	defer func() { okTopkGatheredControlMaxP = saved }()
	f()
}

// okTopkTrace is what one rank saw of one call, to compare the two forms.
type okTopkTrace struct {
	out, residual              uint64 // hashes
	global, kept, local        int
	localTh, globalTh          float32
	split, balance, allgathers uint64 // payload bytes sent per phase
	skipped                    bool   // the call failed with ErrNonFinite
}

// traceOkTopk runs every call of inputs ([call][rank]) on tensor 1.
func traceOkTopk(t *testing.T, p int, cfg Config, inputs [][][]float32) [][]okTopkTrace {
	t.Helper()
	traces := make([][]okTopkTrace, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := range inputs {
			g := slices.Clone(inputs[it][rank])
			st, err := c.SparseAllreduce(ctx, 1, g, cfg)
			skipped := errors.Is(err, ErrNonFinite)
			if err != nil && !skipped {
				return fmt.Errorf("call %d: %w", it, err)
			}
			traces[rank] = append(traces[rank], okTopkTrace{skipped: skipped,
				out: hashFloats(g), residual: hashFloats(c.TensorStateOf(1).Residual),
				global: st.GlobalSelected, kept: st.Kept, local: st.LocalSelected,
				localTh: st.LocalThreshold, globalTh: st.GlobalThreshold,
				split:      st.Phases[PhaseReduce].BytesSent - 4*uint64(st.RepartitionWords),
				balance:    st.Phases[PhaseBalance].BytesSent,
				allgathers: st.Phases[PhaseAllgather].BytesSent,
			})
		}
		return nil
	})
	return traces
}

// Summing the histograms and boundaries by allreduce changes no decision:
// outputs, residuals, thresholds, counts and the payload's words are the
// same as when every rank gathers every rank's vectors, over exact calls
// with repartitions and reuse calls, with ties split by owner (integer
// gradients), in 16-bit values, with a NaN on one rank (every rank skips
// that call), and for sparse inputs; P not a power of two included.
func TestOkTopkSummedControlGivesTheGatheredResults(t *testing.T) {
	const n, calls = 1 << 12, 9
	ps := []int{2, 3, 5, 8, 20}
	if testing.Short() || raceEnabled {
		ps = []int{3, 20}
	}
	for _, p := range ps {
		drift := newDriftingGradients(p, n, uint64(7+p))
		inputs := map[string][][][]float32{"drifting": nil, "integer": integerGradients(p, n, calls, uint64(p))}
		for range calls {
			inputs["drifting"] = append(inputs["drifting"], drift.next())
		}
		nan := make([][][]float32, calls)
		for it := range nan {
			nan[it] = make([][]float32, p)
			for r := range p {
				nan[it][r] = slices.Clone(inputs["drifting"][it][r])
			}
		}
		nan[4][p-1][n/3] = float32(math.NaN())
		inputs["NaN at call 4"] = nan
		for name, in := range inputs {
			for _, values := range []ValueType{ValuesFloat32, ValuesFloat16} {
				t.Run(fmt.Sprintf("P=%d/%s/%v", p, name, values), func(t *testing.T) {
					cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 4, TauPrime: 3, Values: values}
					var gathered, summed [][]okTopkTrace
					withGatheredControlMaxP(1<<20, func() { gathered = traceOkTopk(t, p, cfg, in) })
					withGatheredControlMaxP(0, func() { summed = traceOkTopk(t, p, cfg, in) })
					if name == "NaN at call 4" && !summed[0][4].skipped {
						t.Fatalf("call 4 with a NaN was not skipped")
					}
					for r := range gathered {
						for it := range gathered[r] {
							if gathered[r][it] != summed[r][it] {
								t.Fatalf("rank %d call %d: gathered %+v, summed %+v", r, it, gathered[r][it], summed[r][it])
							}
						}
					}
				})
			}
		}
		t.Run(fmt.Sprintf("P=%d/sparse input", p), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(uint64(p), 3))
			in := make([]Sparse, p)
			for r := range in {
				for i := 0; i < n; i++ {
					if rng.IntN(10) == 0 {
						in[r].Append(uint32(i), float32(rng.IntN(9)-4)) // ties everywhere
					}
				}
			}
			cfg := Config{Algorithm: OkTopk, Density: 0.02, Tau: 1, TauPrime: 1}
			results := map[int][]Sparse{}
			for _, maxP := range []int{1 << 20, 0} {
				results[maxP] = make([]Sparse, p)
				withGatheredControlMaxP(maxP, func() {
					runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
						out, _, err := c.SparseAllreduceSparse(ctx, n, in[rank], cfg)
						results[maxP][rank] = Sparse{Idx: slices.Clone(out.Idx), Val: slices.Clone(out.Val)}
						return err
					})
				})
			}
			for r := range p {
				a, b := results[1<<20][r], results[0][r]
				if !slices.Equal(a.Idx, b.Idx) || !slices.Equal(a.Val, b.Val) {
					t.Fatalf("rank %d: gathered and summed results differ (%d and %d entries)", r, a.Len(), b.Len())
				}
			}
		})
	}
}

// controlLedger counts, per call and rank, the words of Ok-Topk's control
// exchanges by the step they use.
type controlLedger struct {
	op transport.Op
	p  int
	mu sync.Mutex
	by map[controlKey]*controlWords
}

type controlKey struct {
	seq  uint64
	rank int
}

type controlWords struct {
	histograms, counts, repartition int
	refine                          map[uint32]int // words per refinement round
}

func (l *controlLedger) note(tag transport.Tag, rank, bytes int) {
	if tag.Op != l.op {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	key := controlKey{tag.Seq, rank}
	w := l.by[key]
	if w == nil {
		w = &controlWords{refine: map[uint32]int{}}
		l.by[key] = w
	}
	switch step := tag.Step; {
	case step >= stepRefine:
		w.refine[(step-stepRefine)/SumAllreduceSteps(l.p)] += bytes / 4
	case step>>20 == stepHistograms>>20:
		w.histograms += bytes / 4
	case step>>20 == stepCounts>>20:
		w.counts += bytes / 4
	case step>>20 == stepRepartition>>20:
		w.repartition += bytes / 4
	}
}

type controlTransport struct {
	transport.Transport
	ledger *controlLedger
}

func (c *controlTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	c.ledger.note(tag, c.Rank(), len(payload))
	return c.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

// At P = 64 the histograms are one allreduce of 81 counts: 2·81·63 words
// over the ranks in all, at most 2·81 + log₂ P per rank (not 81(P−1) =
// 5,103); each refinement round one of 64 (2·64·63 in all); the owners'
// counts one allgather of a word each (two when the cut splits ties),
// P−1 per rank; the repartition one allreduce of P+1 64-bit boundaries:
// 2·2(P+1)·63 words in all, at most 4(P+1) + 2 log₂ P per rank (not
// 2(P+1)(P−1) = 8,190). Stats count exactly these words: the histograms'
// and counts' in the global-select phase (the private histogramWords),
// the boundaries' in RepartitionWords.
func TestOkTopkControlWordsAtP64AreTheAllreducesFormula(t *testing.T) {
	const p, n, calls = 64, 1 << 14, 4
	const lg = 6 // log₂ P
	gen := newDriftingGradients(p, n, 64)
	inputs := make([][][]float32, calls)
	for it := range inputs {
		inputs[it] = gen.next()
	}
	ledger := &controlLedger{op: OkTopk.Op(), p: p, by: map[controlKey]*controlWords{}}
	stats := make([][]Stats, p)
	inner := transport.NewInProc(p)
	errs := runRanks(inner, inProcTimeout, func(ctx context.Context, r int) error {
		c := NewCommunicator(&controlTransport{Transport: inner[r], ledger: ledger})
		for it := range inputs {
			st, err := c.SparseAllreduce(ctx, 1, slices.Clone(inputs[it][r]), okTopkConfig(0.01))
			if err != nil {
				return err
			}
			stats[r] = append(stats[r], st)
		}
		return nil
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for it := range calls {
		seq := uint64(it + 1)
		var hist, rep int
		rounds := map[uint32]int{}
		countWidth := -1
		for r := range p {
			w := ledger.by[controlKey{seq, r}]
			st := stats[r][it]
			if w == nil {
				t.Fatalf("call %d rank %d: no control messages seen", it, r)
			}
			refine := 0
			for _, words := range w.refine {
				refine += words
			}
			if got := w.histograms + refine + w.counts; st.histogramWords != got {
				t.Errorf("call %d rank %d: Stats count %d histogram words, the wire %d", it, r, st.histogramWords, got)
			}
			if got := int(st.Phases[PhaseGlobalSelect].BytesSent / 4); got != st.histogramWords {
				t.Errorf("call %d rank %d: global-select phase %d words, histograms %d", it, r, got, st.histogramWords)
			}
			if st.RepartitionWords != w.repartition {
				t.Errorf("call %d rank %d: Stats count %d repartition words, the wire %d", it, r, st.RepartitionWords, w.repartition)
			}
			if w.histograms > 2*(histogramBins+1)+lg {
				t.Errorf("call %d rank %d: %d histogram words, above 2·81 + log₂ P = %d", it, r, w.histograms, 2*(histogramBins+1)+lg)
			}
			if w.repartition > 2*(2*(p+1)+lg) {
				t.Errorf("call %d rank %d: %d repartition words, above 2(2(P+1) + log₂ P) = %d", it, r, w.repartition, 2*(2*(p+1)+lg))
			}
			width := w.counts / (p - 1)
			if w.counts%(p-1) != 0 || width < 1 || width > 2 || (countWidth >= 0 && width != countWidth) {
				t.Errorf("call %d rank %d: %d count words, want P−1 or 2(P−1), the same on every rank", it, r, w.counts)
			}
			countWidth = width
			hist += w.histograms
			rep += w.repartition
			rounds[uint32(len(w.refine))]++
		}
		if want := 2 * (histogramBins + 1) * (p - 1); hist != want {
			t.Errorf("call %d: histograms %d words over the ranks, want 2·81·(P−1) = %d", it, hist, want)
		}
		if len(rounds) != 1 {
			t.Errorf("call %d: ranks saw different numbers of refinement rounds: %v", it, rounds)
		}
		var refineTotal int
		for r := range p {
			for _, words := range ledger.by[controlKey{seq, r}].refine {
				refineTotal += words
			}
		}
		var nRounds int
		for k := range rounds {
			nRounds = int(k)
		}
		if want := nRounds * 2 * refineBins * (p - 1); refineTotal != want {
			t.Errorf("call %d: %d refinement rounds sent %d words over the ranks, want 2·64·(P−1) each, %d", it, nRounds, refineTotal, want)
		}
		wantRep := 0
		if it == 0 { // τ = 64: only the first call repartitions
			wantRep = 2 * 2 * (p + 1) * (p - 1)
		}
		if rep != wantRep {
			t.Errorf("call %d: repartition %d words over the ranks, want %d", it, rep, wantRep)
		}
		t.Logf("call %d: per rank on average %.1f histogram words (gathered: 81(P−1) = %d), %d refinement round(s), %d count words, %.1f repartition words (gathered: 2(P+1)(P−1) = %d)",
			it, float64(hist)/p, (histogramBins+1)*(p-1), nRounds, countWidth*(p-1), float64(rep)/p, 2*(p+1)*(p-1))
	}
}
