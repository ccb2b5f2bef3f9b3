package core

// Tests of Ok-Topk's global selection: a result near k when the gradient's
// scale changes or every rank's input is the same, a reuse call keeping the
// exact top of the reduced entries, and its allgathers in one round.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// scaledGradients is driftingGradients multiplied by a per-call scale, the
// shape of a learning-rate drop or of gradients shrinking as training
// converges: the reused thresholds are suddenly (or steadily) far too high.
func scaledGradients(p, n, iters int, seed uint64, scale func(it int) float64) [][][]float32 {
	gen := newDriftingGradients(p, n, seed)
	out := make([][][]float32, iters)
	for it := range out {
		out[it] = gen.next()
		s := float32(scale(it))
		for _, g := range out[it] {
			for i := range g {
				g[i] *= s
			}
		}
	}
	return out
}

// okTopkCall is what one rank saw of one call.
type okTopkCall struct {
	Stats
	histogramWords int // sent in the histogram exchanges (control, not payload)
}

// payloadWords is what the paper's cost model counts: the sparse entries.
func (c okTopkCall) payloadWords() int { return int(c.WordsSent()) - c.histogramWords }

// okTopkRun runs every call of inputs ([call][rank]) on tensor 1 and returns
// what every rank saw of every call ([rank][call]).
func okTopkRun(t *testing.T, p int, cfg Config, inputs [][][]float32) [][]okTopkCall {
	t.Helper()
	calls := make([][]okTopkCall, p)
	runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
		for it := range inputs {
			g := append([]float32(nil), inputs[it][rank]...)
			st, err := c.SparseAllreduce(ctx, 1, g, cfg)
			if err != nil {
				return fmt.Errorf("call %d: %w", it, err)
			}
			calls[rank] = append(calls[rank], okTopkCall{st, st.histogramWords})
		}
		return nil
	})
	return calls
}

// The global result of every call, reuse calls included, holds between k/2
// and 2k entries even when the gradient's scale falls suddenly or steadily:
// the reused global threshold must follow the scale within the call, not
// leave the result starved (a handful of entries) for many calls.
func TestOkTopkGlobalCountNearKWhenScaleChanges(t *testing.T) {
	const density = 0.01
	n, iters := 1<<14, 64
	if raceEnabled {
		n, iters = 1<<12, 36 // still crosses the τ′ = 32 refresh
	}
	scenarios := []struct {
		name  string
		scale func(it int) float64
	}{
		{"drop 32x at call 5", func(it int) float64 {
			if it < 5 {
				return 1
			}
			return 1.0 / 32
		}},
		{"drop 32x at call 5 and again at 20", func(it int) float64 {
			return math.Pow(1.0/32, float64(min(1, it/5)+min(1, it/20)))
		}},
		{"decay x0.9 per call", func(it int) float64 { return math.Pow(0.9, float64(it)) }},
		{"growth x1.15 per call", func(it int) float64 { return math.Pow(1.15, float64(it)) }},
	}
	for _, p := range []int{2, 4} {
		for _, sc := range scenarios {
			t.Run(fmt.Sprintf("P=%d/%s", p, sc.name), func(t *testing.T) {
				cfg := okTopkConfig(density)
				k := cfg.K(n)
				stats := okTopkRun(t, p, cfg, scaledGradients(p, n, iters, uint64(p), sc.scale))
				lo, hi, sum := k, k, 0
				var bad []string
				for it, st := range stats[0] {
					g := st.GlobalSelected
					lo, hi, sum = min(lo, g), max(hi, g), sum+g
					if 2*g < k || g > 2*k {
						bad = append(bad, fmt.Sprintf("call %d: %d", it, g))
					}
				}
				t.Logf("k=%d: global count min %d, mean %.0f, max %d over %d calls", k, lo, float64(sum)/float64(iters), hi, iters)
				if len(bad) > 0 {
					t.Errorf("%d calls outside [k/2, 2k] = [%d, %d]: %v", len(bad), (k+1)/2, 2*k, bad)
				}
				// The volume of reuse calls stays within the paper's bound
				// on the payload, the histograms counted beside it.
				bound := 6 * float64(k) * float64(p-1) / float64(p)
				worst, hist, reuse := 0, 0, 0
				for r := range stats {
					for it, st := range stats[r] {
						if it%cfg.TauPrime == 0 {
							continue
						}
						worst, hist, reuse = max(worst, st.payloadWords()), hist+st.histogramWords, reuse+1
					}
				}
				t.Logf("reuse calls: payload ≤ %d words per rank (bound 6k(P−1)/P = %.0f), histograms %.0f words per rank on average", worst, bound, float64(hist)/float64(reuse))
				if float64(worst) > bound {
					t.Errorf("a reuse call sent %d payload words, above 6k(P−1)/P = %.0f", worst, bound)
				}
			})
		}
	}
}

// When every rank holds the same gradient in an exact call, its candidates
// are exactly the global top-k: nothing is excluded, so there is no "largest
// excluded" magnitude to reuse as the global threshold. A zero threshold
// would keep every reduced entry in the reuse calls that follow (whose
// gradients differ between ranks again); the global count and the volume
// must stay as for any other input.
func TestOkTopkIdenticalExactCallKeepsGlobalCountAndVolume(t *testing.T) {
	const density, iters = 0.01, 32
	n := 1 << 14
	if raceEnabled {
		n = 1 << 12
	}
	for _, p := range []int{2, 4} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			cfg := okTopkConfig(density)
			k := cfg.K(n)
			gen := newDriftingGradients(p, n, 3)
			inputs := make([][][]float32, iters)
			for it := range inputs {
				inputs[it] = gen.next()
			}
			for r := range inputs[0] {
				inputs[0][r] = inputs[0][0]
			}
			stats := okTopkRun(t, p, cfg, inputs)
			if g := stats[0][0].GlobalSelected; g != k {
				t.Fatalf("exact call: global count %d, want k=%d", g, k)
			}
			if th := stats[0][0].GlobalThreshold; !(th > 0) {
				t.Fatalf("exact call left the global threshold at %v", th)
			}
			bound := 6 * float64(k) * float64(p-1) / float64(p)
			for it := 1; it < iters; it++ {
				if g := stats[0][it].GlobalSelected; 2*g < k || g > 2*k {
					t.Errorf("call %d: global count %d outside [k/2, 2k], k=%d", it, g, k)
				}
				for r := range stats {
					if w := float64(stats[r][it].payloadWords()); w > bound {
						t.Errorf("call %d rank %d: %.0f payload words above 6k(P−1)/P = %.0f", it, r, w, bound)
					}
				}
			}
		})
	}
}

// A reuse call's global selection (steps 4 and 5 with a reused threshold),
// driven directly with owners' reduced entries built to be hard: thousands
// of magnitudes tied at the cut, a pile of entries just under the previous
// threshold, a scale far below or far above it, zeros, fewer than k
// entries, k = 0. Whatever it keeps must be exactly the top of all reduced
// entries (largest |v| first, ties to the lower index) — a threshold cut
// that may split ties only toward the lower index — and its size must be
// within [3k/4, 5k/4], or k when ties had to be split, or everything when
// fewer than k were reduced.
func TestOkTopkReuseGlobalSelectionKeepsTopOfReducedEntries(t *testing.T) {
	const n = 1 << 14
	type scenario struct {
		name      string
		threshold float32                              // the previous call's global threshold
		k         int                                  //
		value     func(rng *rand.Rand) (float32, bool) // one index's reduced entry, if any
	}
	sign := func(rng *rand.Rand, v float32) float32 {
		if rng.IntN(2) == 0 {
			return -v
		}
		return v
	}
	scenarios := []scenario{
		{"ties at the cut", 1, 100, func(rng *rand.Rand) (float32, bool) {
			switch rng.IntN(40) {
			case 0:
				return sign(rng, 3), true // ~400 tied entries above
			case 1, 2, 3, 4:
				return sign(rng, 2), true // ~1600 tied entries where the cut falls
			}
			return 0, false
		}},
		{"pile just under the threshold", 1, 164, func(rng *rand.Rand) (float32, bool) {
			switch rng.IntN(16) {
			case 0:
				return sign(rng, 2+rng.Float32()), true
			case 1, 2, 3, 4, 5, 6:
				return sign(rng, 0.95+0.049*rng.Float32()), true
			}
			return 0, false
		}},
		{"scale far below", 1000, 164, func(rng *rand.Rand) (float32, bool) {
			if rng.IntN(8) == 0 {
				return sign(rng, 1e-3*float32(math.Exp(rng.NormFloat64()))), true
			}
			return 0, false
		}},
		{"scale far above", 1e-3, 164, func(rng *rand.Rand) (float32, bool) {
			if rng.IntN(8) == 0 {
				return sign(rng, 1e6*float32(math.Exp(rng.NormFloat64()))), true
			}
			return 0, false
		}},
		{"no threshold known", 0, 164, func(rng *rand.Rand) (float32, bool) {
			if rng.IntN(8) == 0 {
				return sign(rng, float32(math.Exp(rng.NormFloat64()))), true
			}
			return 0, false
		}},
		{"mostly zeros", 1, 164, func(rng *rand.Rand) (float32, bool) {
			switch rng.IntN(128) {
			case 0:
				return sign(rng, 1+rng.Float32()), true // fewer than k nonzero
			case 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16:
				return float32(math.Copysign(0, float64(sign(rng, 1)))), true // a reduced exact zero
			}
			return 0, false
		}},
		{"fewer than k", 1, 500, func(rng *rand.Rand) (float32, bool) {
			if rng.IntN(64) == 0 {
				return sign(rng, 1+rng.Float32()), true
			}
			return 0, false
		}},
		{"k = 0", 1, 0, func(rng *rand.Rand) (float32, bool) {
			if rng.IntN(8) == 0 {
				return sign(rng, 1+rng.Float32()), true
			}
			return 0, false
		}},
	}
	for _, p := range []int{1, 2, 3, 4} {
		for _, sc := range scenarios {
			t.Run(fmt.Sprintf("P=%d/%s", p, sc.name), func(t *testing.T) {
				rng := rand.New(rand.NewPCG(uint64(p), 3))
				var all Sparse // every owner's reduced entries, in index order
				for i := 0; i < n; i++ {
					if v, ok := sc.value(rng); ok {
						all.Append(uint32(i), v)
					}
				}
				bounds := make([]uint32, p+1)
				for j := range bounds {
					bounds[j] = uint32(j * n / p)
				}
				results := make([]Sparse, p)
				runInProc(t, p, func(ctx context.Context, rank int, c *Communicator) error {
					st := NewTensorState(n, okTopkConfig(0.01))
					st.GlobalThreshold = sc.threshold
					call := NewCall(c.T, OkTopk.Op(), 1, nil)
					global, skip, err := globalSelection(ctx, call, st, regionOf(all, bounds[rank], bounds[rank+1]), sc.k, false, false)
					if skip {
						return fmt.Errorf("skipped")
					}
					results[rank] = global
					return err
				})
				got := results[0]
				for r := 1; r < p; r++ {
					if fmt.Sprint(results[r]) != fmt.Sprint(got) {
						t.Fatalf("rank %d's global result differs from rank 0's", r)
					}
				}
				want := topKSparse(all, got.Len())
				if fmt.Sprint(got) != fmt.Sprint(want) {
					t.Fatalf("kept %d entries that are not the top %d of the reduced entries", got.Len(), got.Len())
				}
				k, m := sc.k, got.Len()
				switch {
				case all.Len() < k:
					if m != all.Len() {
						t.Fatalf("kept %d of %d reduced entries (fewer than k=%d), want all", m, all.Len(), k)
					}
				case m != k && (4*m < 3*k || 4*m > 5*k):
					t.Fatalf("kept %d entries, want k=%d or within [3k/4, 5k/4]", m, k)
				}
				t.Logf("%d reduced entries, k=%d, kept %d", all.Len(), k, m)
			})
		}
	}
}

// A reuse call's allgathers — the histograms, every refinement round, the
// balanced shares — each take one round of messages up to P = 16
// (okTopkDirectMaxP): a rank sends its block straight to every rank before
// it receives any, where Bruck's algorithm took ⌈log₂ P⌉ rounds in a row
// (send, wait for a block, send it on). So a reuse call without
// refinement has three rounds after its split (histograms, balance,
// allgather) instead of 2⌈log₂ P⌉ + 1, nine at P = 8 with the split's two.
// A transport in between counts, per rank and allgather, the sends that
// follow one of that allgather's receives.
func TestOkTopkReuseCallAllgathersInOneRound(t *testing.T) {
	for _, p := range []int{4, 8} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			const n, calls = 1 << 14, 5
			cfg := okTopkConfig(0.01) // τ = 64, τ′ = 32: every call after the first reuses
			gen := newDriftingGradients(p, n, 21)
			inputs := make([][][]float32, calls)
			for it := range inputs {
				inputs[it] = gen.next()
			}
			ledger := &roundLedger{op: OkTopk.Op(), p: p, ex: map[exchangeKey]*exchangeRounds{}}
			inner := transport.NewInProc(p)
			errs := runRanks(inner, inProcTimeout, func(ctx context.Context, r int) error {
				c := NewCommunicator(&roundTransport{Transport: inner[r], ledger: ledger})
				for it := range inputs {
					if _, err := c.SparseAllreduce(ctx, 1, append([]float32(nil), inputs[it][r]...), cfg); err != nil {
						return err
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			gathers := 0
			for key, ex := range ledger.ex {
				if key.seq == 1 {
					continue // the first call is exact, with its repartition
				}
				gathers++
				if ex.rounds != 1 {
					t.Errorf("call %d, rank %d, allgather at step %#x: %d rounds in a row, want 1", key.seq, key.rank, key.first, ex.rounds)
				}
			}
			if want := 2 * p * (calls - 1); gathers < want {
				t.Errorf("saw %d allgathers of reuse calls on all ranks, want at least %d (histograms and shares)", gathers, want)
			}
		})
	}
}

// exchangeKey is one rank's part in one allgather of one call: first is
// the allgather's first step number.
type exchangeKey struct {
	seq   uint64
	rank  int
	first uint32
}

type exchangeRounds struct {
	rounds   int  // 1 + the sends that followed a receive
	received bool // a receive since the last send
}

// roundLedger counts the rounds of Ok-Topk's allgathers, rank by rank.
type roundLedger struct {
	op transport.Op
	p  int
	mu sync.Mutex
	ex map[exchangeKey]*exchangeRounds
}

// gather is the allgather a step belongs to: the histograms (stepHistograms),
// a refinement round, or the shares (stepAllgather); false for the split
// and the balance.
func (l *roundLedger) gather(step uint32) (uint32, bool) {
	switch {
	case step >= stepRefine:
		return stepRefine + (step-stepRefine)/AllgatherSteps(l.p)*AllgatherSteps(l.p), true
	case step>>20 == stepHistograms>>20:
		return stepHistograms, true
	case step>>20 == stepAllgather>>20:
		return stepAllgather, true
	}
	return 0, false
}

func (l *roundLedger) note(tag transport.Tag, rank int, send bool) {
	first, ok := l.gather(tag.Step)
	if tag.Op != l.op || !ok {
		return
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	key := exchangeKey{tag.Seq, rank, first}
	ex := l.ex[key]
	if ex == nil {
		ex = &exchangeRounds{rounds: 1}
		l.ex[key] = ex
	}
	switch {
	case !send:
		ex.received = true
	case ex.received:
		ex.rounds++
		ex.received = false
	}
}

type roundTransport struct {
	transport.Transport
	ledger *roundLedger
}

func (l *roundTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	l.ledger.note(tag, l.Rank(), true)
	return l.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

func (l *roundTransport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	m, err := l.Transport.Recv(ctx, peer, tag)
	if err == nil {
		l.ledger.note(tag, l.Rank(), false)
	}
	return m, err
}
