package core

// Auto: the collective of every call chosen from a cost model, as NCCL's
// tuner picks ring or tree per call.
//
// A call with Auto works as follows.
//
//  1. Link model. The communicator's first Auto call measures α, β and γ
//     under a sequence number of its own (linkmodel.go), unless
//     MeasureLink or SetLinkModel gave it one already.
//  2. Predict. For every candidate, predict the call's time from what
//     every rank knows alike — n, k = ⌈density·n⌉, P, τ, τ′ and the agreed
//     model — never from what one rank alone knows (its local count, its
//     residual, whether it already holds a state): rounds·α + bytes·β +
//     bytes of memory passes·γ (predictTerms below has each algorithm's
//     terms, counted from this library's implementations: the rounds of
//     the NaN agreement and of the ring allgathers included, and Ok-Topk's
//     volume as measured, 2.2× the lower bound in calls that reuse its
//     thresholds). A selected entry costs what its frame carries: its
//     index coded as a gap at the frame's density and its value in the
//     configured format (pairBytes), not 8 bytes. Every rank computes
//     the same numbers in the same order, each product rounded on its own
//     (no fused multiply-add), so every rank chooses the same algorithm;
//     a rank that chose otherwise would fail the call with ErrMismatch on
//     "algorithm", never mix data.
//  3. Choose. The cheapest sparse algorithm, unless a dense allreduce is
//     predicted within denseMargin of it: dense is exact (nothing waits in
//     a residual), so a sparse algorithm must save time to be worth its
//     error feedback. With one rank nothing travels and dense is chosen.
//     Gaussiank is not a candidate: its count is only estimated, so its
//     volume cannot be predicted, and on the model's terms it equals TopkA
//     with more passes. (gTopk is one: its error feedback keeps every
//     partial sum its tree cuts, so switching to it loses no mass.)
//  4. Run the choice on the tensor's state, which every Auto call keeps
//     (so that a checkpoint holds every tensor, whatever was chosen).
//     Residuals are per tensor whatever the algorithm. A dense choice
//     reduces gradient + residual and empties the residual, so switching
//     never strands gradient mass. NaN or Inf on any rank shows in the sum,
//     which every rank holds bitwise alike, so every rank skips the step
//     (ErrNonFinite) with its buffer and state as before, without an
//     agreement round. Ok-Topk's state stays valid across other
//     algorithms: its region boundaries and global threshold are values
//     every rank agreed on, and its reused local threshold, stale after
//     other calls, is guarded as always (when more than 4k/3 or fewer than
//     k/2 entries pass it, that call selects exactly). Every call, dense
//     ones on a state included, counts in the tensor's call count, which
//     schedules Ok-Topk's refreshes alike on every rank.
//
// OKTOPK_DEBUG_AUTO=1 logs every choice, its prediction and its measured
// time (and the runner-up) to stderr; Stats carries the algorithm that ran
// and the prediction on every call.

import (
	"context"
	"fmt"
	"math"
	"math/bits"
	"os"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// denseMargin: a dense allreduce is chosen when predicted within this
// fraction of the fastest sparse algorithm.
const denseMargin = 0.05

// okTopkReuseVolume is Ok-Topk's payload in calls that reuse its thresholds,
// as a multiple of the lower bound 2k(P−1)/P words, as measured by the
// benchmark at every P (2.21–2.27).
const okTopkReuseVolume = 2.2

// Passes over an n-element float32 array (4n bytes each, read or written)
// of one call, counted from the implementations.
const (
	// Dense under Auto: a copy kept to undo a failed or skipped step (2),
	// gradient + residual (3), the reduction's adds and copies (5(P−1)/P,
	// added where used), the check for NaN/Inf fused with the average (2),
	// the residual emptied (1).
	denseAutoPasses = 8.0
	// Exact top-k baselines: accumulate grad + residual (3), exact top-k
	// (1.8, the radix select's measured cost over one read), residual update
	// (2), scatter of the result (1).
	exactSelectPasses = 7.8
	// Gaussiank: accumulate (3), mean and deviation (1), selection and its
	// corrections (4), residual (2), scatter (1).
	gaussianPasses = 11.0
	// Ok-Topk in a reuse call: accumulation fused with the threshold
	// selection (3.2), residual (2), scatter (1); plus 3/P for the owner's
	// dense region sum and 1.6/τ′ for the exact refresh.
	okTopkPasses = 6.2
)

// costTerms are one call's predicted work on one rank's critical path.
type costTerms struct {
	rounds  float64 // messages in sequence
	bytes   float64 // bytes sent in sequence
	passes  float64 // passes over an n-element float32 array
	entries float64 // (index, value) pairs merged or copied: 16 bytes of memory traffic each
}

// pairBytes is the model's bytes of one selected entry on the wire, in a
// frame whose indices are spread at density d over its range: its coded
// index (indexcode.go's codedIndexBits) and its value in format v, its
// share of a block's scale included (values.go). At density 1% that is
// 5.17 bytes with float32 values, 2.29 with 8-bit and 1.79 with 4-bit
// ones, where 32-bit indices and values took 8 whatever the density.
func pairBytes(d float64, v ValueType) float64 { return codedIndexBits(d)/8 + v.bytesPerValue() }

// mul is a product rounded on its own: Go may fuse a*b+c into one
// multiply-add on some architectures, which rounds differently, and every
// rank must compute the same bits.
func mul(a, b float64) float64 { return float64(a * b) }

// callShape is what the algorithms' costs are written in: a call on n
// elements selecting k over p ranks, and the quantities their schedules
// use. Each algorithm's file holds its cost (the table's cost column).
type callShape struct {
	n, k, p int
	N, K, P float64
	L       float64 // ⌈log₂ P⌉
	Pp, Lp  float64 // P′, the largest power of two ≤ P, and log₂ P′
	fold    float64 // 1 when P ≠ P′: Rabenseifner and SSAR fold the extra ranks in and out
	f       float64 // (P−1)/P
	U       float64 // the sum of the P selections: disjoint at worst
}

func shapeOf(n, k, p int) callShape {
	N, K, P := float64(n), float64(k), float64(p)
	pp := 1 << (bits.Len(uint(p)) - 1)
	return callShape{n: n, k: k, p: p, N: N, K: K, P: P,
		L:  float64(bits.Len(uint(p - 1))),
		Pp: float64(pp), Lp: float64(bits.Len(uint(pp)) - 1),
		fold: b2f(pp != p), f: (P - 1) / P, U: math.Min(N, mul(K, P))}
}

// costFunc is an algorithm's terms for a call of shape s with cfg's
// periods; sparseInput: the sparse-input form (its passes over n are then
// dropped by predictTerms: its cost follows the pairs).
type costFunc func(s callShape, cfg Config, sparseInput bool) costTerms

// predictTerms are alg's terms for a call on n elements selecting k, over p
// ranks; sparseInput: the sparse-input form, whose cost follows the pairs,
// not n (no passes over n).
func predictTerms(alg Algorithm, n, k, p int, cfg Config, sparseInput bool) costTerms {
	cost := alg.row().cost
	if cost == nil {
		return costTerms{} // Auto: it runs another row
	}
	t := cost(shapeOf(n, k, p), cfg, sparseInput)
	if sparseInput {
		t.passes = 0
	}
	if p <= 1 {
		t.rounds, t.bytes = 0, 0 // nothing travels
	}
	return t
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// seconds is the model's time for terms t on n elements.
func (m LinkModel) seconds(t costTerms, n int) float64 {
	memory := mul(mul(t.passes, 4*float64(n))+mul(t.entries, 16), m.Gamma)
	return mul(t.rounds, m.Alpha) + mul(t.bytes, m.Beta) + memory
}

// Predict is the model's time for one call of alg on n elements with cfg's
// density and periods over p ranks (a dense gradient; alg not Auto).
func (m LinkModel) Predict(alg Algorithm, n, p int, cfg Config) time.Duration {
	return duration(m.seconds(predictTerms(alg, n, cfg.K(n), p, cfg, false), n))
}

// Choose is Auto's choice for a call on a dense gradient of n elements with
// cfg's density and periods over p ranks, and its predicted time.
func (m LinkModel) Choose(n, p int, cfg Config) (Algorithm, time.Duration) {
	ch := m.choose(n, p, cfg, false)
	return ch.alg, duration(ch.predicted)
}

// choice is an Auto decision: the algorithm, its prediction, and the
// runner-up (for the debug log).
type choice struct {
	alg, next                Algorithm
	predicted, nextPredicted float64
}

// autoCandidates are the algorithms Auto chooses from (see the top).
var autoCandidates = []Algorithm{DenseRing, DenseRabenseifner, OkTopk, TopkA, TopkDSA,
	SSARRecursiveDouble, SSARSplitAllgather, DSARSplitAllgather, GTopk}

// choose ranks the candidates for a call (sparseInput: the sparse-input
// form, among the algorithms that have one). Ties go to the earlier
// algorithm of the enum.
func (m LinkModel) choose(n, p int, cfg Config, sparseInput bool) choice {
	k := cfg.K(n)
	bestDense, bestSparse := choice{alg: -1, next: -1}, choice{alg: -1, next: -1}
	for _, a := range autoCandidates {
		if sparseInput {
			if a.row().sparseInput == nil {
				continue
			}
		}
		if cfg.Values != ValuesFloat32 && !a.Dense() && !a.takesReducedValues() {
			continue // it would sum rounded partial sums no residual can take back
		}
		t := m.seconds(predictTerms(a, n, k, p, cfg, sparseInput), n)
		best := &bestSparse
		if a.Dense() {
			best = &bestDense
		}
		switch {
		case best.alg < 0 || t < best.predicted:
			best.next, best.nextPredicted = best.alg, best.predicted
			best.alg, best.predicted = a, t
		case best.next < 0 || t < best.nextPredicted:
			best.next, best.nextPredicted = a, t
		}
	}
	if sparseInput {
		return bestSparse
	}
	if p <= 1 || bestDense.predicted <= mul(bestSparse.predicted, 1+denseMargin) {
		return choice{alg: bestDense.alg, predicted: bestDense.predicted, next: bestSparse.alg, nextPredicted: bestSparse.predicted}
	}
	return choice{alg: bestSparse.alg, predicted: bestSparse.predicted, next: bestDense.alg, nextPredicted: bestDense.predicted}
}

func duration(seconds float64) time.Duration {
	return time.Duration(math.Round(seconds * 1e9))
}

// predicted is the model's time for a call of alg, or 0 without a model.
func (c *Communicator) predicted(alg Algorithm, n int, cfg Config) time.Duration {
	if c.link == nil || !alg.Valid() || alg == Auto {
		return 0
	}
	return c.link.Predict(alg, n, c.Size(), cfg)
}

// autoSparseAllreduce is SparseAllreduce with Auto, as call seq (taken by
// begin, the arguments checked). The link measurement, when there is none
// yet, takes seq and the collective the next number.
func (c *Communicator) autoSparseAllreduce(ctx context.Context, seq, id uint64, grad []float32, cfg Config, opts CallOptions) (Stats, error) {
	var stats Stats
	n := len(grad)
	st, undo, err := c.callState(id, n, cfg, opts.Undoable)
	if err != nil {
		return stats, c.refuse(ctx, seq, err)
	}
	if seq, err = c.ensureLink(ctx, seq); err != nil {
		undo()
		return stats, c.end(err)
	}
	var sums *xiSums
	if opts.MeasureXi {
		if sums, seq, err = c.measureXiSums(ctx, seq, id, st, grad, opts.Dtype); err != nil {
			undo()
			return stats, c.end(err)
		}
	}
	ch := c.link.choose(n, c.Size(), cfg, false)
	if opts.SparseOnly && ch.alg.Dense() && ch.next >= 0 {
		ch = choice{alg: ch.next, predicted: ch.nextPredicted, next: ch.alg, nextPredicted: ch.predicted}
	}
	if ch.alg.Dense() {
		err = c.autoDense(ctx, seq, id, st, grad, ch.alg, opts.Dtype, &stats)
		if err != nil {
			undo()
		}
	} else {
		err = c.sparseCall(ctx, seq, id, st, undo, grad, ch.alg, opts, &stats)
	}
	if err == nil && sums != nil {
		sums.report(&stats, grad, c.Size())
	}
	stats.Predicted = duration(ch.predicted)
	c.logChoice(seq, id, n, cfg.K(n), ch, stats, err)
	return stats, c.end(err)
}

// autoDense runs a dense choice of Auto as call seq: it reduces grad +
// residual in grad and empties the residual. A failure, or NaN/Inf in the
// sum (so on some rank, and seen alike by every rank), leaves grad and the
// state as they were: grad is copied first into the communicator's scratch
// (one array for every tensor, where a per-tensor accumulator would double
// the memory of tensors that Auto keeps dense).
func (c *Communicator) autoDense(ctx context.Context, seq, id uint64, st *TensorState, grad []float32, alg Algorithm, dtype transport.Dtype, stats *Stats) error {
	n, p := len(grad), c.Size()
	start := time.Now()
	stats.Algorithm, stats.K = alg, n
	desc := DescribeCall(dtype, id, n, n)
	desc.Completed = uint32(st.Iter)
	call := NewCall(c.T, alg.Op(), seq, stats, WithDesc(desc))
	// The copy and the accumulate pass are the select phase, as in the
	// sparse algorithms; the phases are ended before the total is taken,
	// so that they add up to it (the algorithm's last phase stays open).
	call.Phase(PhaseSelect)
	if cap(c.before) < n {
		c.before = make([]float32, n)
	}
	copy(c.before[:n], grad)
	Accumulate(grad, grad, st.Residual) // NaN/Inf show in the sum
	err := algorithms[alg].dense(ctx, call, grad)
	call.Phase(PhaseOutput)
	if err == nil {
		if bad := scaleCountingNonFinite(grad, p); bad > 0 {
			err = fmt.Errorf("%w: %d entries of the sum over the ranks: %w", ErrNonFinite, bad, errStepSkipped)
		}
	}
	call.EndPhases()
	stats.Total = time.Since(start)
	if err != nil {
		copy(grad, c.before[:n])
		return err
	}
	clear(st.Residual)
	st.Iter++
	stats.LocalSelected, stats.GlobalSelected = n, n
	return nil
}

// scaleCountingNonFinite divides by p (as scale) and counts the entries
// that are NaN or ±Inf.
func scaleCountingNonFinite(v []float32, p int) int {
	bad := 0
	fp := float32(p)
	for i, x := range v {
		if x-x != 0 {
			bad++
		}
		if p > 1 {
			v[i] = x / fp
		}
	}
	return bad
}

// autoChoose resolves Auto for the dense and sparse-input calls, as call seq
// (the link measurement, when needed, takes seq); it returns the algorithm,
// its prediction and the collective's sequence number.
func (c *Communicator) autoChoose(ctx context.Context, seq uint64, n int, cfg Config, sparseInput bool) (choice, uint64, error) {
	seq, err := c.ensureLink(ctx, seq)
	if err != nil {
		return choice{}, seq, err
	}
	if !sparseInput {
		// A dense allreduce: the faster of the two dense algorithms.
		r := c.link.seconds(predictTerms(DenseRing, n, n, c.Size(), cfg, false), n)
		h := c.link.seconds(predictTerms(DenseRabenseifner, n, n, c.Size(), cfg, false), n)
		if h < r {
			return choice{alg: DenseRabenseifner, predicted: h, next: DenseRing, nextPredicted: r}, seq, nil
		}
		return choice{alg: DenseRing, predicted: r, next: DenseRabenseifner, nextPredicted: h}, seq, nil
	}
	return c.link.choose(n, c.Size(), cfg, true), seq, nil
}

func debugAuto() bool { return transport.Getenv("OKTOPK_DEBUG_AUTO") == "1" }

func logAuto(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "oktopk: auto: "+format+"\n", args...)
}

// logChoice logs one Auto call when OKTOPK_DEBUG_AUTO=1.
func (c *Communicator) logChoice(seq, id uint64, n, k int, ch choice, st Stats, err error) {
	if !debugAuto() {
		return
	}
	outcome := fmt.Sprintf("took %.3f ms", ms(st.Total))
	if err != nil {
		outcome = fmt.Sprintf("failed after %.3f ms: %v", ms(st.Total), err)
	}
	next := "none"
	if ch.next >= 0 {
		next = fmt.Sprintf("%v %.3f ms", ch.next, ch.nextPredicted*1e3)
	}
	logAuto("rank %d call %d tensor %d n=%d k=%d P=%d: %v predicted %.3f ms, %s (next: %s)",
		c.Rank(), seq, id, n, k, c.Size(), ch.alg, ch.predicted*1e3, outcome, next)
}
