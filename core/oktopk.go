package core

// Ok-Topk sparse allreduce (Li & Hoefler, PPoPP'22, Algorithms 1 and 2).
// This file holds steps 1, 2 and 6 and the call that runs them all; step 3
// is in oktopk_reduce.go, step 4 in oktopk_cut.go, step 5 in
// oktopk_balance.go.
//
// One call works on acc = grad + residual, on every rank at once:
//
//  1. Local threshold. Select about k entries of acc by |acc| > local
//     threshold. Every τ′ calls the threshold is recomputed exactly (the k-th
//     largest |acc|, and the selection is the exact top-k); in between it is
//     reused and nudged (SelectByThreshold).
//  2. Space repartition, every τ calls. Each rank takes the P-quantile
//     positions of its selected indices; the boundaries are averaged over
//     the ranks (summed as integers, then divided by P: gathered and summed
//     by every rank up to 16 ranks, summed by an allreduce beyond), so
//     each of the P regions holds about k/P selected entries of every rank.
//     In between the boundaries are reused.
//  3. Split and reduce. Rank r owns region r. In step i = 1…P−1 rank r sends
//     its selected entries of region (r+i) mod P to that rank and receives
//     region r's entries from rank (r−i) mod P; the rotation spreads the
//     traffic so no rank is every sender's target at once. Up to
//     min(4, P) exchanges are in flight, and the owner adds contributions
//     in the order the schedule delivers them (its own, then ranks r−1,
//     r−2, …) while later ones are still on the wire. Only the owner sums
//     its region, so every rank gets the same bits. Indices travel
//     region-relative, coded as gaps (indexcode.go). The dense-gradient call sums into an
//     array over its region; the sparse-input call merges the sorted index
//     lists instead, so its cost follows the pairs, not n (same bits).
//  4. Global selection. The owners' histograms of their reduced
//     magnitudes — 80 bins an eighth of an octave wide, centred on the last
//     global threshold — are summed (up to 16 ranks every rank gathers them
//     all and sums them; beyond, an allreduce sums them), and every rank
//     cuts the summed histogram at the bin edge that keeps closest to k
//     entries. When that keeps outside
//     [3k/4, 5k/4] (entries that only one rank contributed pile up just above
//     the local thresholds, often in the very bin the cut falls in), the
//     ranks refine that bin with histograms of 64 sub-bins, round after
//     round, down to a single magnitude whose ties are then split in owner
//     order, which is index order. Each owner keeps its entries above the
//     cut. Every τ′ calls (and when k = n) the refinement goes on until
//     exactly k entries stay: that is the exact global top-k (ties to the
//     lower index, as TopK), found with a few histogram rounds instead of
//     gathering every owner's candidates (up to 2k(P−1) words, which made
//     those calls two to five times slower than the others).
//     This departs from the paper's step 4, which reuses the last threshold
//     and nudges it from the count: a nudged threshold lags any change of
//     the gradient's scale by many calls (measured: after a 32× drop the
//     global result held 3–10 entries per call for tens of calls). Cutting
//     the current call's histogram costs control words instead, but the
//     global count is near k on every call.
//  5. Balance, then allgatherv. Every owner's count follows from the
//     gathered histograms up to 16 ranks; beyond, where the histograms
//     were summed, the owners allgather their counts (one word each; two
//     when the cut splits ties, which every rank then splits in owner
//     order). The kept entries, in index order, are cut into P equal
//     shares and moved to the rank holding that share; the balanced blocks
//     are allgathered. Every rank now has the
//     same sparse global result, divided by P and written densely into the
//     caller's buffer.
//  6. Residual (error feedback). residual = acc with exactly the entries
//     zeroed that were selected locally and are in the global result. It
//     is formed in the pass that writes the result into the caller's
//     buffer, the call's one pass over n after its last message (a failed
//     call must leave both as they were, so neither can be written
//     earlier), with the sparse updates made tile by tile while the tile
//     is in the cache (foldOutput).
//
// Values travel as float32, or as float16 or bfloat16 (Config.Values,
// values.go): each rank rounds its selection before step 3, each owner its
// kept sums before step 5, and every rank uses the owner's rounded sums. In
// step 6 a rank's residual keeps acc − what it sent, and an owner's also
// takes its sums' rounding errors, so nothing is lost; a value is then half
// a word instead of one. Entries the caller holds back
// (SparseAllreduceHolding) are left out of step 1's selection and stay in
// the residual.
//
// NaN or Inf in acc on any rank is caught in step 1 and announced in step 4's
// histogram exchange, which every rank makes anyway: then every rank skips
// the step, leaving its gradient, residual and thresholds as they were.
//
// At density 1 (k = n) every entry is kept, and no sparse schedule beats
// the dense one: the call is a dense ring allreduce of acc (2n(P−1)/P words
// instead of the exact path's ~2n(P−1)), after one agreement word on NaN/Inf
// (⌈log P⌉ rounds, as the baselines'), and the residual becomes zero.
//
// Cost per call, in words per rank. Payload, in reuse iterations: step 3
// moves the ~k selected entries (2 words each) once, 2k(P−1)/P; step 5's
// allgatherv 2k(P−1)/P and its balance at most the same again, so at most
// 6k(P−1)/P, the paper's bound (the lower bound of any sparse allreduce is
// 2k(P−1)/P). Control, beside it, up to 16 ranks (okTopkGatheredControlMaxP),
// where every rank gathers every rank's vectors: the histograms, 81(P−1)
// words (80 counts and the NaN flag), and 64(P−1) per refinement round (at
// most 4 rounds for an eighth-octave bin, 6 for the open-ended end bins;
// usually none or one); every τ calls the repartition's P+1 boundaries of
// 2 words, 2(P+1)(P−1). Beyond 16 ranks each of these is an allreduce
// (SumAllreduce: recursive halving, then doubling; P′ the largest power of
// two ≤ P): the histograms 2·81(P′−1)/P′ words per rank on average (≈ 162),
// each refinement round 2·64(P′−1)/P′ (≈ 128), the repartition
// 2·2(P+1)(P′−1)/P′ (≈ 4(P+1)), a rank's share within a word per round of
// that average, and a rank folded in or out (P not a power of two) sending
// the vector once more; step 5 then needs the owners' counts, an allgather
// of one word per owner, P−1 (2(P−1) when the cut splits ties). So a reuse
// call's control is about 162 + (P−1) words instead of 81(P−1): 1.2k
// instead of 82.9k at P = 1,024, the repartition 4.1k instead of 2.1M.
// Every τ′ calls the exact cut takes up to 6 refinement rounds.
//
// Latency: (P−1)α for split-and-reduce, about α for the balance (its few
// messages go out at once). Up to P = 16 every allgather — the histograms,
// each refinement round, the repartition's boundaries, and step 5's
// balanced shares — is one round, each rank sending its block straight to
// every other (AllgatherDirect: P−1 messages at once): about (P + 3)α per
// reuse call with one refinement round. Beyond, the shares and the counts
// are allgathered by Bruck's algorithm in ⌈log₂ P⌉ rounds (AllgatherEqual,
// AllgathervBruck; okTopkDirectMaxP) and the histograms, each refinement
// round and the boundaries are allreduces of 2⌊log₂ P⌋ rounds (+2 when P
// is not a power of two): Pα + (4⌊log₂ P⌋ + 2⌈log₂ P⌉)α per reuse call
// with one refinement round, ⌊log₂ P⌋ rounds more per allreduce than the
// allgathers of every rank's vector took, for words that do not grow with
// P. Both within the paper's (2P + 2 log P)α.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
)

// Step numbers of the phases of one call; each phase uses steps from its
// base up, so phases never share a tag.
const (
	stepRepartition uint32 = 0 << 20
	stepSplit       uint32 = 1 << 20
	stepHistograms  uint32 = 2 << 20
	stepCounts      uint32 = 3 << 20 // the owners' counts, when the histograms were summed
	stepBalance     uint32 = 4 << 20
	stepAllgather   uint32 = 5 << 20
	stepRefine      uint32 = 6 << 20 // P steps per refinement round
)

// maxExchangesInFlight bounds step 3's concurrent exchanges, as the
// reference does, so memory for arrived contributions stays bounded.
const maxExchangesInFlight = 4

// okTopkScratch is the storage of one call's steps, reused from call to
// call: a call through a Communicator uses the communicator's (callScratch,
// one set for all its tensors), any other call the tensor's own. Nothing in
// it is n elements long: acc = grad + residual is never stored (vec.go), and
// step 3 sums only this rank's region, n/P entries; everything else holds
// about k entries. So a steady-state call allocates nothing in proportion
// to n, and only the transport's messages in proportion to k.
type okTopkScratch struct {
	local     Sparse         // step 1: this rank's selection
	held      []float32      // step 1: grad's and the residual's held entries, stashed (selectHolding)
	encoded   []byte         // step 3: the selection's regions, encoded for their owners
	decoded   []Sparse       // step 3: the contributions received, per sender
	regionSum []float32      // step 3: this rank's region, summed densely
	touched   []uint64       // step 3: which entries of regionSum some rank sent (bits)
	dense     denseRegionSum // step 3: the region's sum over regionSum and touched
	reduced   Sparse         // step 3: the region's reduced entries
	kept      Sparse         // step 4: the reduced entries above the global cut
	ownerErr  Sparse         // steps 4 and 5: rounding errors of this owner's sums and this rank's share, for its residual
	shareErr  Sparse         // step 5: 8-bit rounding errors of this rank's share, merged into ownerErr
	errSpare  Sparse         // step 5: ownerErr's storage before the merge, for the next one
	sends     []byte         // step 5: the kept entries other ranks' shares take, encoded
	parts     []Sparse       // step 5: the parts of this rank's share received, per owner
	balanced  Sparse         // step 5: this rank's share
	share     []byte         // step 5: this rank's share, encoded for the allgather
	blocks    []Sparse       // step 5: the shares gathered, decoded, per rank
	global    Sparse         // step 5: the global result
}

// okTopkDirectMaxP is the most ranks for which Ok-Topk's allgathers (the
// histograms, each refinement round, the repartition's boundaries, step 5's
// shares) send every block straight to every rank: one round of P−1
// messages (AllgatherDirect), where Bruck's algorithm takes ⌈log₂ P⌉ rounds
// in a row, each waiting on the one before. Same words. A reuse call then
// has about five rounds of messages in a row at P = 8 instead of nine
// (TestOkTopkReuseCallAllgathersInOneRound). Measured on the emulated cluster
// (P = 8, n = 2^22, density 1%, 6 A/B runs): median call 141 ms with
// Bruck, 130 ms direct, faster in 5 runs of 6. Beyond 16 ranks (which the
// benchmark does not reach) a rank's P−1 messages grow past the rounds
// saved, and Bruck's algorithm gathers.
const okTopkDirectMaxP = 16

// okTopkGatheredControlMaxP is the most ranks for which Ok-Topk's control
// exchanges — the global cut's histograms and refinement rounds, and the
// repartition's boundaries — allgather every rank's vector (in one direct
// round up to okTopkDirectMaxP ranks), so that every rank sums them itself
// and has every owner's count for step 5. Beyond it they are allreduces
// (SumAllreduce: recursive halving and doubling), whose words per rank do
// not grow with P, in 2⌊log₂ P⌋ rounds (+2 when P is not a power of two)
// instead of one round or ⌈log₂ P⌉; step 5 then allgathers the owners'
// counts, one word each (two when the cut splits ties). A variable so that
// tests can run either form at any P; the two give the same results.
var okTopkGatheredControlMaxP = okTopkDirectMaxP

// okTopkSumsControl says whether a call over p ranks sums its control
// vectors by allreduce (okTopkGatheredControlMaxP).
func okTopkSumsControl(p int) bool { return p > okTopkGatheredControlMaxP }

func okTopkGatherEqual(ctx context.Context, call *Call, step uint32, own []byte) ([][]byte, error) {
	if call.Size() <= okTopkDirectMaxP {
		return AllgatherEqualDirect(ctx, call, step, own)
	}
	return AllgatherEqual(ctx, call, step, own)
}

func okTopkGather(ctx context.Context, call *Call, step uint32, own Block) ([]Block, error) {
	if call.Size() <= okTopkDirectMaxP {
		return AllgatherDirect(ctx, call, step, own)
	}
	return AllgathervBruck(ctx, call, step, own)
}

// errStepSkipped marks an error that every rank agreed on before any data
// moved (NaN/Inf, or a malformed sparse input, somewhere): every rank skipped
// the step, and the communicator stays usable.
var errStepSkipped = fmt.Errorf("every rank skipped this step")

// okTopkExact says whether the tensor's next Ok-Topk call, selecting k of
// n, selects exactly: every τ′ calls, and with k = n, where every entry is
// kept, which only the exact path does without a threshold (a zero sum is
// still a selected entry). The call's descriptor carries it, so that ranks
// with different τ′ fail with ErrMismatch instead of cutting differently.
func (st *TensorState) okTopkExact(k, n int) bool {
	return st.Iter%st.Config.TauPrime == 0 || k == n
}

func okTopkAllreduce(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
	n, p := len(grad), call.Size()
	call.Phase(PhaseSelect) // the passes that form acc count as selection, as in the baselines
	k := st.Config.K(n)
	if len(st.Residual) != n {
		return fmt.Errorf("%w: residual holds %d elements, gradient %d", ErrInvalidArgument, len(st.Residual), n)
	}
	// acc = grad + residual, never stored: every pass forms it as it reads.
	acc := sumVec(grad, st.Residual)
	if k == n && p > 1 {
		return okTopkDense(ctx, call, st, grad)
	}
	sc := call.okTopkScratch(st)
	exact := st.okTopkExact(k, n)
	savedLocal, savedGlobal := st.LocalThreshold, st.GlobalThreshold

	// Step 1: local threshold and selection, in the same passes that form
	// acc (on a reuse call, one pass); NaN or Inf in acc is found by them.
	// Held entries read as zero and are never selected (selectHolding).
	local := sc.local
	local.Reset()
	var nonFinite bool
	var err error
	if k == 0 {
		nonFinite = acc.countNonFinite() > 0 // nothing to select, but every rank must agree
	} else {
		local, sc.held, err = selectHolding(acc, call.Hold, sc.held, func() (Sparse, error) {
			if k == n {
				// density 1 on one rank: everything is selected
				s := selectAll(local, acc)
				if bad := countNonFinite(s.Val); bad > 0 {
					return s, fmt.Errorf("%w: %d entries", ErrNonFinite, bad)
				}
				return s, nil
			}
			s, _, err := selectByThresholdOf(local, acc, k, &st.LocalThreshold, exact, selectionChunks(n))
			return s, err
		})
		if errors.Is(err, ErrNonFinite) {
			nonFinite, err = true, nil
		}
	}
	if err != nil {
		st.LocalThreshold = savedLocal
		return err
	}
	if nonFinite {
		local.Reset()
	}
	// The values leave this rank in the wire's precision; the residual keeps
	// what the rounding took off (step 6).
	roundingOf(call, st.Config, st.Iter, roundContribution).apply(local)
	sc.local = local
	call.Stats.LocalSelected = local.Len()

	// Step 2: space repartition.
	call.Phase(PhaseReduce)
	if err := repartitionIfDue(ctx, call, st, local); err != nil {
		return err
	}

	// Step 3: split and reduce my region.
	r := call.Rank()
	reduced, err := splitAndReduce(ctx, call, st.Boundaries, local, sc.denseRegionSum(st.Boundaries[r], st.Boundaries[r+1]), sc)
	if err != nil {
		return err
	}

	// Step 4 and 5: global selection, balance and allgatherv.
	global, skip, err := globalSelection(ctx, call, st, reduced, k, exact, nonFinite)
	if err != nil {
		return err
	}
	if skip {
		st.LocalThreshold, st.GlobalThreshold = savedLocal, savedGlobal
		return fmt.Errorf("%w: %w", ErrNonFinite, errStepSkipped)
	}
	call.Stats.GlobalSelected = global.Len()
	call.Stats.LocalThreshold, call.Stats.GlobalThreshold = st.LocalThreshold, st.GlobalThreshold

	// Step 6: residual, then the averaged result into the caller's buffer.
	call.Phase(PhaseOutput)
	// The residual keeps acc less the values sent (the rounding errors of
	// 16-bit ones), and an owner's also the rounding errors of its sums; in
	// the same pass grad becomes the result.
	foldOutput(st.Residual, grad, local, global, sc.ownerErr, p)
	st.Iter++
	return nil
}

// okTopkDense is Ok-Topk at density 1: the dense ring allreduce of acc =
// grad + residual, averaged into grad, in float32 whatever Config.Values
// (a ring's partial sums are rounded at every hop). Held entries go into
// the ring as zeros and stay in the residual. A failed call leaves grad,
// the residual and the state as they were: the ring reads acc as it goes
// (never stored) and writes grad only once every message has arrived, and
// the held entries are put back.
func okTopkDense(ctx context.Context, call *Call, st *TensorState, grad []float32) error {
	n, p := len(grad), call.Size()
	bad := sumVec(grad, st.Residual).countNonFinite() // in the select phase, as the sparse path's
	call.Phase(PhaseAgree)
	if err := agreeOnInput(ctx, call, bad, nil); err != nil {
		return err
	}
	// acc is not stored, so a held entry reads as zero with both its terms
	// cleared: grad's, then the residual's, are stashed per range.
	sc := call.okTopkScratch(st)
	held := sc.held[:0]
	for _, h := range call.Hold {
		held = append(held, grad[h.Start:h.End]...)
		held = append(held, st.Residual[h.Start:h.End]...)
		clear(grad[h.Start:h.End])
		clear(st.Residual[h.Start:h.End])
	}
	sc.held = held
	if err := ringAllreduce(ctx, call, grad, st.Residual, grad); err != nil { // it times its own phases
		at := 0
		for _, h := range call.Hold {
			at += copy(grad[h.Start:h.End], held[at:])
			at += copy(st.Residual[h.Start:h.End], held[at:])
		}
		return err
	}
	call.Phase(PhaseOutput)
	scale(grad, p)
	clear(st.Residual)
	at := 0
	for _, h := range call.Hold {
		w := h.End - h.Start
		sumVec(held[at:at+w], held[at+w:at+2*w]).copyTo(st.Residual[h.Start:h.End]) // acc, finite (agreed above)
		at += 2 * w
	}
	call.Stats.LocalSelected, call.Stats.GlobalSelected = n-len(held)/2, n
	st.Iter++
	return nil
}

func selectAll(dst Sparse, x vec) Sparse {
	dst = growSparse(dst, x.len())
	for i := range dst.Idx {
		dst.Idx[i] = uint32(i)
	}
	x.copyTo(dst.Val)
	return dst
}

// repartitionIfDue is step 2 as a tensor's calls run it: every τ calls,
// and whenever the boundaries are not for this number of ranks.
func repartitionIfDue(ctx context.Context, call *Call, st *TensorState, local Sparse) error {
	if st.Iter%st.Config.Tau != 0 && len(st.Boundaries) == call.Size()+1 {
		return nil
	}
	sent, msgs := call.Stats.BytesSent, call.Stats.MessagesSent
	b, err := repartition(ctx, call, local, st.N)
	call.Stats.RepartitionWords += int(call.Stats.BytesSent-sent) / 4
	call.Stats.RepartitionMessages += int(call.Stats.MessagesSent - msgs)
	if err != nil {
		return err
	}
	st.Boundaries = b
	return nil
}

// repartition computes region boundaries from the P-quantile positions of
// every rank's selected indices, averaged over the ranks with integer
// arithmetic (the sum over ranks, exact, divided by P) so that every rank
// gets the same boundaries. Up to okTopkGatheredControlMaxP ranks every
// rank gathers every rank's quantiles and sums them; beyond, the sums are
// one SumAllreduce of P+1 64-bit integers. Same sums, same boundaries.
func repartition(ctx context.Context, call *Call, local Sparse, n int) ([]uint32, error) {
	p := call.Size()
	quantiles := make([]uint64, p+1)
	for j := 0; j <= p; j++ {
		switch {
		case j == p:
			quantiles[j] = uint64(n)
		case local.Len() == 0:
			quantiles[j] = uint64(j) * uint64(n) / uint64(p) // nothing selected: equal split
		case j > 0:
			quantiles[j] = uint64(local.Idx[j*local.Len()/p])
		}
	}
	sum := make([]uint64, p+1)
	if okTopkSumsControl(p) {
		copy(sum, quantiles)
		if err := SumAllreduce(ctx, call, stepRepartition, sum); err != nil {
			return nil, err
		}
		for j, s := range sum {
			// Every rank's quantile is at most its n: a larger sum means
			// another rank's n is larger than this one's.
			if s > uint64(p)*uint64(n) {
				return nil, fmt.Errorf("%w: region boundary %d summed over the ranks is %d, above P·n = %d (different tensor sizes?)", ErrMismatch, j, s, uint64(p)*uint64(n))
			}
		}
	} else {
		payload := make([]byte, 8*(p+1))
		for j, q := range quantiles {
			binary.LittleEndian.PutUint64(payload[8*j:], q)
		}
		blocks, err := okTopkGatherEqual(ctx, call, stepRepartition, payload)
		if err != nil {
			return nil, err
		}
		for r, b := range blocks {
			for j := range sum {
				q := binary.LittleEndian.Uint64(b[8*j:])
				if q > uint64(n) {
					return nil, fmt.Errorf("%w: rank %d's region boundary %d exceeds n=%d (different tensor sizes?)", ErrMismatch, r, q, n)
				}
				sum[j] += q
			}
		}
	}
	bounds := make([]uint32, p+1)
	for j := range bounds {
		bounds[j] = uint32(sum[j] / uint64(p))
	}
	bounds[0], bounds[p] = 0, uint32(n)
	return bounds, nil
}

// okTopkSparseInput runs steps 2–5 on a caller's own selection (no state,
// an exact global top-k): the lower-level call for callers who select
// themselves. The caller's selection takes the place of step 1, so Select
// stays 0 and LocalSelected is the input's size.
func okTopkSparseInput(ctx context.Context, call *Call, n int, in Sparse, k int) (Sparse, error) {
	st := NewTensorState(0, Config{Algorithm: OkTopk, Density: 1, Tau: 1, TauPrime: 1})
	st.N = n
	call.Stats.LocalSelected = in.Len()
	call.Phase(PhaseReduce)
	sent, msgs := call.Stats.BytesSent, call.Stats.MessagesSent
	b, err := repartition(ctx, call, in, n)
	call.Stats.RepartitionWords += int(call.Stats.BytesSent-sent) / 4
	call.Stats.RepartitionMessages += int(call.Stats.MessagesSent - msgs)
	if err != nil {
		return Sparse{}, err
	}
	reduced, err := splitAndReduce(ctx, call, b, in, &mergedRegionSum{}, call.okTopkScratch(st))
	if err != nil {
		return Sparse{}, err
	}
	global, _, err := globalSelection(ctx, call, st, reduced, k, true, false)
	if err != nil {
		return Sparse{}, err
	}
	call.Stats.GlobalSelected = global.Len()
	call.Stats.GlobalThreshold = st.GlobalThreshold
	return global, nil
}

// okTopkCost is Ok-Topk's cost under Auto's model (auto.go): split and
// reduce (P−1 rounds), histograms, one refinement round, balance,
// allgatherv; a repartition every τ calls and a few more refinement rounds
// for the exact cut every τ′. Each allgather is one round up to
// okTopkDirectMaxP ranks, Bruck's ⌈log₂ P⌉ above; beyond
// okTopkGatheredControlMaxP the histograms, refinement rounds and
// boundaries are allreduces (2⌊log₂ P⌋ rounds, +2 when P is not a power of
// two) and the owners' counts an allgather. At density 1: its NaN
// agreement, then a dense ring.
func okTopkCost(s callShape, cfg Config, sparseInput bool) costTerms {
	if s.k == s.n && !sparseInput {
		t := ringCost(s, cfg, false)
		t.rounds += s.L
		return t
	}
	tau, tauPrime := float64(cfg.Tau), float64(cfg.TauPrime)
	g := s.L
	if s.p <= okTopkDirectMaxP {
		g = 1
	}
	payload := mul(mul(okTopkReuseVolume*s.K, pairBytes(s.K/s.N, cfg.Values)), s.f)
	if okTopkSumsControl(s.p) {
		// Allreduces of 81 and 64 counts and of P+1 boundaries, then the
		// counts' allgather of a word per owner.
		a := 2*s.Lp + 2*s.fold
		share, fold := (s.Pp-1)/s.Pp, s.fold
		return costTerms{
			rounds: s.P - 1 + 2*a + 2*g + 1 + a/tau + 4*a/tauPrime,
			bytes: payload + mul(4*(81+64), 2*share+fold) + mul(4, s.P-1) +
				mul(8*(s.P+1), 2*share+fold)/tau,
			passes:  okTopkPasses + 3/s.P + 1.6/tauPrime,
			entries: 3 * s.K,
		}
	}
	return costTerms{
		rounds: s.P - 1 + 3*g + 1 + g/tau + 4*g/tauPrime,
		bytes: payload + mul(4*(81+64), s.P-1) +
			mul(16*(s.P+1), s.P-1)/tau,
		passes:  okTopkPasses + 3/s.P + 1.6/tauPrime,
		entries: 3 * s.K,
	}
}
