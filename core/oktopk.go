package core

// Ok-Topk sparse allreduce (Li & Hoefler, PPoPP'22, Algorithms 1 and 2).
//
// One call works on acc = grad + residual, on every rank at once:
//
//  1. Local threshold. Select about k entries of acc by |acc| > local
//     threshold. Every τ′ calls the threshold is recomputed exactly (the k-th
//     largest |acc|, and the selection is the exact top-k); in between it is
//     reused and nudged (SelectByThreshold).
//  2. Space repartition, every τ calls. Each rank takes the P-quantile
//     positions of its selected indices; the boundaries are averaged over
//     the ranks, so each of the P regions holds about k/P selected entries
//     of every rank. In between the boundaries are reused.
//  3. Split and reduce. Rank r owns region r. In step i = 1…P−1 rank r sends
//     its selected entries of region (r+i) mod P to that rank and receives
//     region r's entries from rank (r−i) mod P; the rotation spreads the
//     traffic so no rank is every sender's target at once. Up to
//     min(4, P) exchanges are in flight, and the owner adds contributions
//     in the order the schedule delivers them (its own, then ranks r−1,
//     r−2, …) while later ones are still on the wire. Only the owner sums
//     its region, so every rank gets the same bits. Indices travel
//     region-relative as integers. The dense-gradient call sums into an
//     array over its region; the sparse-input call merges the sorted index
//     lists instead, so its cost follows the pairs, not n (same bits).
//  4. Global selection. The owners allgather histograms of their reduced
//     magnitudes — 80 bins an eighth of an octave wide, centred on the last
//     global threshold — and every rank cuts the summed histogram at the bin
//     edge that keeps closest to k entries. When that keeps outside
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
//     This departs from DESIGN §2 step 4, which reuses the last threshold
//     and nudges it from the count: a nudged threshold lags any change of
//     the gradient's scale by many calls (measured: after a 32× drop the
//     global result held 3–10 entries per call for tens of calls). Cutting
//     the current call's histogram costs control words instead, but the
//     global count is near k on every call.
//  5. Balance, then allgatherv. Every owner's count follows from the
//     histograms (no separate count exchange); the kept entries, in index
//     order, are cut into P equal shares and moved to the rank holding that
//     share; the balanced blocks are allgathered. Every rank now has the
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
// takes its sums' rounding errors, so nothing is lost; a pair is then 1.5
// words instead of 2. Entries the caller holds back
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
// 2k(P−1)/P). Control, beside it: the histogram allgather, 81(P−1) words
// (80 counts and the NaN flag), and 64(P−1) per refinement round (at most
// 4 rounds for an eighth-octave bin, 6 for the open-ended end bins; usually
// none or one). Every τ calls the repartition allgathers P+1 boundaries of
// 2 words, 2(P+1)(P−1); every τ′ calls the exact cut takes up to 6
// refinement rounds. Latency: (P−1)α for split-and-reduce, about α for the
// balance (its few messages go out at once); every allgather — the
// histograms, each refinement round, the repartition's boundaries, and step
// 5's balanced shares — is one round up to P = 16, each rank sending its
// block straight to every other (AllgatherDirect: P−1 messages at once),
// and beyond that Bruck's algorithm in ⌈log₂ P⌉ rounds (AllgatherEqual,
// AllgathervBruck; okTopkDirectMaxP). So about (P + 3)α per reuse call with
// one refinement round up to 16 ranks, Pα + 3⌈log₂ P⌉α beyond: within the
// paper's (2P + 2 log P)α either way.

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	mathbits "math/bits"
	"sort"

	"github.com/oktopk/oktopk/transport"
	"golang.org/x/sync/errgroup"
)

func init() {
	registerSparse(OkTopk, okTopkAllreduce)
	registerSparseInput(OkTopk, okTopkSparseInput)
}

// Step numbers of the phases of one call; each phase uses steps from its
// base up, so phases never share a tag.
const (
	stepRepartition uint32 = 0 << 20
	stepSplit       uint32 = 1 << 20
	stepCounts      uint32 = 2 << 20
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
	ownerErr  Sparse         // step 4: rounding errors of this owner's sums, for its residual
	sends     []byte         // step 5: the kept entries other ranks' shares take, encoded
	parts     []Sparse       // step 5: the parts of this rank's share received, per owner
	balanced  Sparse         // step 5: this rank's share
	share     []byte         // step 5: this rank's share, encoded for the allgather
	blocks    []Sparse       // step 5: the shares gathered, decoded, per rank
	global    Sparse         // step 5: the global result

	histogramWords int // words this rank sent in the last call's histogram exchanges
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
	if st.Iter%st.Config.Tau == 0 || len(st.Boundaries) != p+1 {
		b, err := repartition(ctx, call, local, n)
		if err != nil {
			return err
		}
		st.Boundaries = b
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

// repartition computes region boundaries from the P-quantile positions of
// every rank's selected indices, averaged over the ranks with integer
// arithmetic so that every rank gets the same boundaries.
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
	payload := make([]byte, 8*(p+1))
	for j, q := range quantiles {
		binary.LittleEndian.PutUint64(payload[8*j:], q)
	}
	blocks, err := okTopkGatherEqual(ctx, call, stepRepartition, payload)
	if err != nil {
		return nil, err
	}
	sum := make([]uint64, p+1)
	for r, b := range blocks {
		for j := range sum {
			q := binary.LittleEndian.Uint64(b[8*j:])
			if q > uint64(n) {
				return nil, fmt.Errorf("%w: rank %d's region boundary %d exceeds n=%d (different tensor sizes?)", ErrMismatch, r, q, n)
			}
			sum[j] += q
		}
	}
	bounds := make([]uint32, p+1)
	for j := range bounds {
		bounds[j] = uint32(sum[j] / uint64(p))
	}
	bounds[0], bounds[p] = 0, uint32(n)
	return bounds, nil
}

// regionOf returns the slice of s (ascending) inside [lo, hi).
func regionOf(s Sparse, lo, hi uint32) Sparse {
	a := sort.Search(len(s.Idx), func(i int) bool { return s.Idx[i] >= lo })
	b := a + sort.Search(len(s.Idx)-a, func(i int) bool { return s.Idx[a+i] >= hi })
	return Sparse{Idx: s.Idx[a:b], Val: s.Val[a:b]}
}

// regionSum adds the contributions to one region, in the order they are
// added: for every index, ((0 + first) + second) + … over the contributions
// holding it, so the bits depend on that order alone and not on how the sum
// is kept. Each contribution must be ascending and inside the region.
type regionSum interface {
	add(c Sparse)
	// result is every index any contribution held (a sum that cancels to 0
	// included), ascending, in storage of its own.
	result() Sparse
}

// denseRegionSum keeps the sum in a dense array over the region's width,
// the call's scratch: for the dense-gradient call, which makes passes over
// n elements anyway and keeps its scratch between calls.
type denseRegionSum struct {
	lo      uint32
	sum     []float32
	touched []uint64 // which entries some contribution held, a bit per entry
	count   int      // entries touched
	out     *Sparse  // the result's storage, kept for the next call
}

// denseRegionSum returns sc's dense sum over [lo, hi), emptied.
func (sc *okTopkScratch) denseRegionSum(lo, hi uint32) *denseRegionSum {
	width := int(hi - lo)
	// The region is summed densely, but only the entries some rank sent
	// are ever read or written: an entry's first contribution is added to
	// 0 (as if the sum had been cleared) and marks it in touched, a bit per
	// entry. Only the bits are cleared per call, n/(32P) words.
	// A repartition moves the boundaries, so the buffers are made with a
	// quarter's slack: not anew after every repartition that widens the
	// region a little. (Pages never written cost no memory.)
	if cap(sc.regionSum) < width {
		sc.regionSum = make([]float32, width+width/4)
	}
	words := (width + 63) / 64
	if cap(sc.touched) < words {
		sc.touched = make([]uint64, words+words/4)
	}
	sc.dense = denseRegionSum{lo: lo, sum: sc.regionSum[:width], touched: sc.touched[:words], out: &sc.reduced}
	clear(sc.dense.touched)
	return &sc.dense
}

func (d *denseRegionSum) add(c Sparse) {
	for j, ix := range c.Idx {
		e := ix - d.lo
		w, bit := e/64, uint64(1)<<(e%64)
		if d.touched[w]&bit == 0 {
			d.touched[w] |= bit
			d.sum[e] = 0 + c.Val[j] // the bits of adding to a cleared sum (−0 becomes +0)
			d.count++
		} else {
			d.sum[e] += c.Val[j]
		}
	}
}

func (d *denseRegionSum) result() Sparse {
	reduced := growSparse(*d.out, d.count)
	j := 0
	for w, bits := range d.touched {
		for ; bits != 0; bits &= bits - 1 {
			e := w*64 + mathbits.TrailingZeros64(bits)
			reduced.Idx[j], reduced.Val[j] = d.lo+uint32(e), d.sum[e]
			j++
		}
	}
	*d.out = reduced
	return reduced
}

// mergedRegionSum keeps the sum as a sparse vector and merges each
// contribution's sorted indices into it: memory and time follow the pairs
// (at most P merges over them), whatever the region's width. It is the
// sparse-input call's, whose n may be 2^32−1 with a handful of pairs.
type mergedRegionSum struct {
	sum, spare Sparse // spare is the previous sum's storage, reused by the next merge
}

func (m *mergedRegionSum) add(c Sparse) {
	a := m.sum
	out := m.spare
	out.Reset()
	if need := a.Len() + c.Len(); cap(out.Idx) < need {
		// Room for the sums still to come, so the two buffers settle
		// after a few contributions instead of growing on each one.
		out.Idx, out.Val = make([]uint32, 0, 2*need), make([]float32, 0, 2*need)
	}
	var zero float32 // 0 + v, as the dense sum forms it: −0 becomes +0
	i, j := 0, 0
	for i < a.Len() && j < c.Len() {
		switch ai, cj := a.Idx[i], c.Idx[j]; {
		case ai < cj:
			out.Append(ai, a.Val[i])
			i++
		case cj < ai:
			out.Append(cj, zero+c.Val[j])
			j++
		default:
			out.Append(ai, a.Val[i]+c.Val[j])
			i++
			j++
		}
	}
	out.Idx = append(out.Idx, a.Idx[i:]...)
	out.Val = append(out.Val, a.Val[i:]...)
	for ; j < c.Len(); j++ {
		out.Append(c.Idx[j], zero+c.Val[j])
	}
	m.sum, m.spare = out, a
}

func (m *mergedRegionSum) result() Sparse { return m.sum }

// splitAndReduce is step 3: it returns the reduced entries of this rank's
// region (every index any rank contributed, ascending), summed into sum; the
// messages are encoded and decoded in sc's storage.
func splitAndReduce(ctx context.Context, call *Call, bounds []uint32, local Sparse, sum regionSum, sc *okTopkScratch) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	lo, hi := bounds[r], bounds[r+1]

	// Each region's entries of the selection, encoded for its owner into
	// its own part of one buffer (the parts never overlap, so the
	// exchanges in flight encode at once).
	at := make([]int, p+1) // region j is local[at[j]:at[j+1]]
	for j := 1; j < p; j++ {
		at[j] = at[j-1] + sort.Search(local.Len()-at[j-1], func(i int) bool { return local.Idx[at[j-1]+i] >= bounds[j] })
	}
	at[p] = local.Len()
	if cap(sc.encoded) < 8*local.Len() {
		sc.encoded = make([]byte, 8*local.Len())
	}
	for len(sc.decoded) < p {
		sc.decoded = append(sc.decoded, Sparse{})
	}
	region := func(j int) Sparse { return Sparse{Idx: local.Idx[at[j]:at[j+1]], Val: local.Val[at[j]:at[j+1]]} }

	contributions := make([]Sparse, p)
	arrived := make([]chan struct{}, p)
	for i := range arrived {
		arrived[i] = make(chan struct{})
	}
	contributions[r] = region(r)
	close(arrived[r])

	g, gctx := errgroup.WithContext(ctx)
	slots := make(chan struct{}, min(maxExchangesInFlight, p))
	goSafe(g, func() error {
		for i := 1; i < p; i++ {
			to, from := (r+i)%p, (r-i+p)%p
			select {
			case slots <- struct{}{}:
			case <-gctx.Done():
				return transport.ContextError(gctx, "split and reduce")
			}
			goSafe(g, func() error {
				defer func() { <-slots }()
				out := region(to)
				payload := encodeSparseAs(sc.encoded[8*at[to]:8*at[to+1]:8*at[to+1]], out, bounds[to], call.Values)
				m, err := call.SendRecv(gctx, to, stepSplit, call.Values.sparseDtype(), uint64(out.Len()), payload, from)
				if err != nil {
					return err
				}
				if m.Dtype != call.Values.sparseDtype() {
					return fmt.Errorf("%w: rank %d sent %s in split-and-reduce, this rank %s (another value type configured?)", ErrMismatch, from, m.Dtype, call.Values.sparseDtype())
				}
				in, err := decodeSparseAs(sc.decoded[from], m.Payload, m.Count, lo, hi, call.Values)
				sc.decoded[from] = in // kept for the next call, grown or not
				if err != nil {
					return fmt.Errorf("from rank %d: %w", from, err)
				}
				contributions[from] = in
				close(arrived[from])
				return nil
			})
		}
		return nil
	})
	// Reduce while later contributions are still arriving, in the order
	// the schedule delivers them: my own, then ranks r−1, r−2, … (mod P).
	// Only the owner sums its region, so the order is fixed per region and
	// every rank ends with the same bits.
	goSafe(g, func() error {
		for i := 0; i < p; i++ {
			src := (r - i + p) % p
			select {
			case <-arrived[src]:
			case <-gctx.Done():
				return nil // the failing exchange reports the error
			}
			sum.add(contributions[src])
		}
		return nil
	})
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	return sum.result(), nil
}

// globalSelection is steps 4 and 5. It returns the global sparse sum
// (identical on every rank), or skip when some rank saw a non-finite value.
func globalSelection(ctx context.Context, call *Call, st *TensorState, reduced Sparse, k int, exact, nonFinite bool) (Sparse, bool, error) {
	// Every owner announces a magnitude histogram of its reduced entries
	// (and whether it saw NaN/Inf); every rank sums them identically.
	call.Phase(PhaseGlobalSelect)
	words := &st.scratch.histogramWords
	*words = 0
	sc := call.okTopkScratch(st)
	base := histogramBase(st.GlobalThreshold)
	hists, anyNonFinite, err := exchangeHistograms(ctx, call, reduced, base, nonFinite, words)
	if err != nil {
		return Sparse{}, false, err
	}
	if anyNonFinite {
		return Sparse{}, true, nil
	}

	// Cut the summed histograms where closest to k entries stay, refining
	// the boundary bin when that is far from k (a reuse call), or until
	// exactly the k largest stay (an exact call: the exact global top-k,
	// ties to the lower index, for a few histogram rounds instead of
	// gathering every owner's candidates). Every rank computes the same
	// cut, and every owner's count, from the same histograms.
	cut, err := chooseGlobalCut(ctx, call, reduced, hists, base, k, exact, words)
	if err != nil {
		return Sparse{}, false, err
	}
	sc.kept = cut.keep(sc.kept, reduced, call.Rank())
	// Each owner rounds its sums once to the wire's precision; every rank,
	// this one too, uses the rounded sums, and this owner's residual takes
	// the rounding errors (values.go).
	sc.ownerErr.Reset()
	if call.Values != ValuesFloat32 {
		sc.ownerErr = roundingOf(call, st.Config, st.Iter, roundOwnerSum).applyKeepingErrors(sc.kept, sc.ownerErr)
	}
	call.Phase(PhaseBalance)
	balanced, err := balance(ctx, call, sc.kept, cut.counts, sc)
	if err != nil {
		return Sparse{}, false, err
	}
	call.Phase(PhaseAllgather)
	global, err := gatherSparse(ctx, call, stepAllgather, balanced, uint32(st.N), sc)
	if err != nil {
		return Sparse{}, false, err
	}
	st.GlobalThreshold = reusableThreshold(cut.threshold(), global)
	return global, false, nil
}

// reusableThreshold is th, or, when th is 0 (nothing was left out, as when
// every rank selected the same entries), one step below the smallest
// nonzero magnitude kept: a zero threshold would centre the next call's
// histogram on nothing. It stays 0 only for a result without a nonzero
// entry; then the next call's histogram starts at 0 and is refined.
func reusableThreshold(th float32, global Sparse) float32 {
	if th > 0 {
		return th
	}
	smallest := float32(math.Inf(1))
	for _, v := range global.Val {
		if a := abs32(v); a > 0 && a < smallest {
			smallest = a
		}
	}
	if math.IsInf(float64(smallest), 1) {
		return 0
	}
	return math.Nextafter32(smallest, 0)
}

// Magnitudes are compared as keys: the bits of |v|, which order like |v|
// for every non-NaN float (non-finite values never reach step 4).
const keyLimit = 1 << 31 // above every key

func magnitudeKey(v float32) uint64 { return uint64(math.Float32bits(v) &^ signBit) }

// The global threshold's histogram: bins an eighth of an octave wide (the
// float's exponent and top three mantissa bits), from 3 octaves below the
// previous threshold to 7 above, so one call follows even a fast change of
// scale. Bin 0 also holds everything smaller, the last bin everything
// larger.
const (
	histogramBins  = 80
	histogramShift = 20 // float32 bits >> 20: exponent and 3 mantissa bits
	histogramBelow = 24 // bins below the previous threshold
)

func histogramKey(v float32) int { return int(math.Float32bits(abs32(v)) >> histogramShift) }

func histogramBase(threshold float32) int { return max(histogramKey(threshold)-histogramBelow, 0) }

func histogramBin(v float32, base int) int {
	return min(max(histogramKey(v)-base, 0), histogramBins-1)
}

// binLow is the smallest key in bin b (b = histogramBins: keyLimit, as the
// last bin holds everything larger).
func binLow(base, b int) uint64 {
	switch {
	case b == 0:
		return 0
	case b >= histogramBins:
		return keyLimit
	}
	return min(uint64(base+b)<<histogramShift, keyLimit)
}

// A reuse call's cut should keep close to k entries. The coarse histogram
// alone is accepted when its best cut keeps within this window (eighth-
// octave bins usually land there); otherwise the boundary bin is refined.
// The upper end keeps the volume of step 5 within the paper's bound.
const (
	globalAcceptLow  = 3.0 / 4.0
	globalAcceptHigh = 5.0 / 4.0
	refineBins       = 64 // sub-bins per refinement round
)

// globalCut is a reuse call's global selection, the same on every rank:
// every reduced entry with key ≥ edge and, when quota is set, the first
// quota[o] entries (in index order) of owner o with key edge−1 — ties split
// toward the lower index, as TopK splits them.
type globalCut struct {
	edge   uint64
	quota  []int
	counts []int // entries each owner keeps
}

// keep returns the entries of reduced the cut keeps on owner, in dst's
// storage (reset first).
func (c globalCut) keep(dst, reduced Sparse, owner int) Sparse {
	kept := dst
	kept.Reset()
	ties := 0
	if c.quota != nil {
		ties = c.quota[owner]
	}
	for j, v := range reduced.Val {
		key := magnitudeKey(v)
		if key >= c.edge {
			kept.Append(reduced.Idx[j], v)
		} else if ties > 0 && key+1 == c.edge {
			kept.Append(reduced.Idx[j], v)
			ties--
		}
	}
	return kept
}

// threshold is the t with |v| > t exactly for keys ≥ edge (0 when every
// entry is kept).
func (c globalCut) threshold() float32 {
	if c.edge == 0 {
		return 0
	}
	return math.Float32frombits(uint32(min(c.edge, keyLimit) - 1))
}

// chooseGlobalCut finds the reuse call's cut. The coarse histograms give
// the edge keeping closest to k entries; when that is outside the accepted
// window (many entries piled in the one bin the k-th largest falls in), the
// ranks narrow that bin with further rounds of refineBins sub-bins each,
// down to a single key if need be, whose ties are then split by owner
// order. So a reuse call keeps within the window or exactly k entries,
// unless fewer than k were reduced at all (then it keeps them all).
func chooseGlobalCut(ctx context.Context, call *Call, reduced Sparse, hists [][histogramBins]uint32, base, k int, exact bool, histogramWords *int) (globalCut, error) {
	p := len(hists)
	acceptable := func(total, k int) bool { return total == k || !exact && acceptableCount(total, k) }
	coarse := func(o, b int) int { return int(hists[o][b]) }
	above := make([]int, p) // per owner, entries above the bin being refined
	totals := cumulativeTotals(coarse, p, histogramBins, 0)
	best := closestTo(totals, k)
	if acceptable(totals[best], k) || totals[0] < k {
		return globalCut{edge: binLow(base, best), counts: ownerCounts(above, coarse, best, histogramBins)}, nil
	}
	// The k-th largest lies in the highest bin from which on at least k
	// entries are reduced; narrow it.
	b := boundary(totals, k)
	above = ownerCounts(above, coarse, b+1, histogramBins)
	lo, hi := binLow(base, b), binLow(base, b+1)
	for round := uint32(0); ; round++ {
		sub, err := exchangeRefinement(ctx, call, stepRefine+round*AllgatherSteps(p), reduced, lo, hi, histogramWords)
		if err != nil {
			return globalCut{}, err
		}
		fine := func(o, s int) int { return int(sub[o][s]) }
		aboveTotal := 0
		for _, a := range above {
			aboveTotal += a
		}
		totals := cumulativeTotals(fine, p, refineBins, aboveTotal)
		best := closestTo(totals, k)
		if acceptable(totals[best], k) {
			return globalCut{edge: subLow(lo, hi, best), counts: ownerCounts(above, fine, best, refineBins)}, nil
		}
		s := boundary(totals, k)
		above = ownerCounts(above, fine, s+1, refineBins)
		lo, hi = subLow(lo, hi, s), subLow(lo, hi, s+1)
		if hi-lo == 1 {
			// One key left: keep everything above it and split its
			// ties by owner order, so exactly k are kept.
			ties := make([]int, p)
			for o := range ties {
				ties[o] = fine(o, s)
			}
			return splitTies(lo, above, ties, k), nil
		}
	}
}

// ownerCounts is above plus, per owner, its entries in bins from..nbins−1.
func ownerCounts(above []int, bins func(o, b int) int, from, nbins int) []int {
	c := append([]int(nil), above...)
	for o := range c {
		for b := from; b < nbins; b++ {
			c[o] += bins(o, b)
		}
	}
	return c
}

// splitTies keeps every entry with a key above key and, of the ties[o] at
// key on each owner, the first k − Σabove in owner order, which is index
// order.
func splitTies(key uint64, above, ties []int, k int) globalCut {
	need := k
	for _, a := range above {
		need -= a
	}
	cut := globalCut{edge: key + 1, quota: make([]int, len(above)), counts: append([]int(nil), above...)}
	for o, t := range ties {
		q := min(t, max(need, 0))
		cut.quota[o], cut.counts[o] = q, cut.counts[o]+q
		need -= q
	}
	return cut
}

// subLow is the smallest key of sub-bin s of [lo, hi) split refineBins ways:
// a key maps to sub-bin (key−lo)·refineBins/(hi−lo).
func subLow(lo, hi uint64, s int) uint64 {
	w := hi - lo
	return lo + (uint64(s)*w+refineBins-1)/refineBins
}

func subBin(key, lo, hi uint64) int { return int((key - lo) * refineBins / (hi - lo)) }

// cumulativeTotals[c] is how many entries (summed over owners) lie in bins
// ≥ c, plus above; the last element (c = nbins) is above alone.
func cumulativeTotals(bins func(o, b int) int, p, nbins, above int) []int {
	totals := make([]int, nbins+1)
	totals[nbins] = above
	for b := nbins - 1; b >= 0; b-- {
		totals[b] = totals[b+1]
		for o := 0; o < p; o++ {
			totals[b] += bins(o, b)
		}
	}
	return totals
}

// closestTo is the cut whose total is closest to k, ties toward keeping more.
func closestTo(totals []int, k int) int {
	best := 0
	for c := range totals {
		if abs(totals[c]-k) < abs(totals[best]-k) {
			best = c
		}
	}
	return best
}

// boundary is the highest bin from which on at least k entries lie (the bin
// holding the k-th largest); totals[0] ≥ k.
func boundary(totals []int, k int) int {
	b := 0
	for b+1 < len(totals)-1 && totals[b+1] >= k {
		b++
	}
	return b
}

func acceptableCount(total, k int) bool {
	return float64(total) >= globalAcceptLow*float64(k) && float64(total) <= globalAcceptHigh*float64(k)
}

func abs(x int) int {
	if x < 0 {
		return -x
	}
	return x
}

// exchangeHistograms allgathers every owner's histogram and non-finite flag.
func exchangeHistograms(ctx context.Context, call *Call, reduced Sparse, base int, nonFinite bool, words *int) ([][histogramBins]uint32, bool, error) {
	var mine [histogramBins]uint32
	for _, v := range reduced.Val {
		mine[histogramBin(v, base)]++
	}
	payload := make([]byte, 4*(histogramBins+1))
	for b, c := range mine {
		binary.LittleEndian.PutUint32(payload[4*b:], c)
	}
	if nonFinite {
		payload[4*histogramBins] = 1
	}
	sent := call.Stats.BytesSent
	blocks, err := okTopkGatherEqual(ctx, call, stepCounts, payload)
	*words += int(call.Stats.BytesSent-sent) / 4
	if err != nil {
		return nil, false, err
	}
	hists := make([][histogramBins]uint32, len(blocks))
	anyNonFinite := false
	for r, b := range blocks {
		for i := range hists[r] {
			hists[r][i] = binary.LittleEndian.Uint32(b[4*i:])
		}
		anyNonFinite = anyNonFinite || b[4*histogramBins] != 0
	}
	return hists, anyNonFinite, nil
}

// exchangeRefinement allgathers every owner's histogram of its reduced
// entries with keys in [lo, hi), refineBins sub-bins.
func exchangeRefinement(ctx context.Context, call *Call, step uint32, reduced Sparse, lo, hi uint64, words *int) ([][refineBins]uint32, error) {
	var mine [refineBins]uint32
	for _, v := range reduced.Val {
		if key := magnitudeKey(v); key >= lo && key < hi {
			mine[subBin(key, lo, hi)]++
		}
	}
	payload := make([]byte, 4*refineBins)
	for b, c := range mine {
		binary.LittleEndian.PutUint32(payload[4*b:], c)
	}
	sent := call.Stats.BytesSent
	blocks, err := okTopkGatherEqual(ctx, call, step, payload)
	*words += int(call.Stats.BytesSent-sent) / 4
	if err != nil {
		return nil, err
	}
	hists := make([][refineBins]uint32, len(blocks))
	for r, b := range blocks {
		for i := range hists[r] {
			hists[r][i] = binary.LittleEndian.Uint32(b[4*i:])
		}
	}
	return hists, nil
}

// balance is step 5's first half: the kept entries of all owners, taken in
// index order, are cut into P equal shares; rank j receives share j. Each
// owner sends the parts of its entries that fall in other ranks' shares.
// The result is in sc's storage.
func balance(ctx context.Context, call *Call, kept Sparse, counts []int, sc *okTopkScratch) (Sparse, error) {
	p, r := call.Size(), call.Rank()
	total := 0
	starts := make([]int, p+1) // global position of each owner's first entry
	for o, c := range counts {
		starts[o] = total
		total += c
	}
	starts[p] = total
	share := func(j int) int { return j * total / p }
	overlap := func(aLo, aHi, bLo, bHi int) (int, int) { return max(aLo, bLo), min(aHi, bHi) }

	g, gctx := errgroup.WithContext(ctx)
	// Send my entries that belong to other ranks' shares, each part encoded
	// into its own place in one buffer (the parts never overlap).
	if cap(sc.sends) < 8*kept.Len() {
		sc.sends = make([]byte, 8*kept.Len())
	}
	for j := 0; j < p; j++ {
		lo, hi := overlap(starts[r], starts[r+1], share(j), share(j+1))
		if j == r || lo >= hi {
			continue
		}
		a, b := lo-starts[r], hi-starts[r]
		part := Sparse{Idx: kept.Idx[a:b], Val: kept.Val[a:b]}
		payload := encodeSparseAs(sc.sends[8*a:8*b:8*b], part, 0, call.Values)
		goSafe(g, func() error {
			return call.Send(gctx, j, stepBalance, call.Values.sparseDtype(), uint64(part.Len()), payload)
		})
	}
	// Receive the parts of my share that other owners hold, in owner order.
	for len(sc.parts) < p {
		sc.parts = append(sc.parts, Sparse{})
	}
	parts := make([]Sparse, p)
	for o := 0; o < p; o++ {
		lo, hi := overlap(starts[o], starts[o+1], share(r), share(r+1))
		if lo >= hi {
			continue
		}
		if o == r {
			parts[o] = Sparse{Idx: kept.Idx[lo-starts[r] : hi-starts[r]], Val: kept.Val[lo-starts[r] : hi-starts[r]]}
			continue
		}
		goSafe(g, func() error {
			m, err := call.Recv(gctx, o, stepBalance)
			if err != nil {
				return err
			}
			if m.Count != uint64(hi-lo) || m.Dtype != call.Values.sparseDtype() {
				return fmt.Errorf("%w: rank %d moved %d entries of %s, want %d of %s", ErrMismatch, o, m.Count, m.Dtype, hi-lo, call.Values.sparseDtype())
			}
			s, err := decodeSparseAs(sc.parts[o], m.Payload, m.Count, 0, ^uint32(0), call.Values)
			sc.parts[o], parts[o] = s, s
			return err
		})
	}
	if err := g.Wait(); err != nil {
		return Sparse{}, err
	}
	sc.balanced = concatSparse(sc.balanced, parts)
	return sc.balanced, nil
}

// concatSparse returns the parts one after the other in dst's storage
// (reset first, grown when too small).
func concatSparse(dst Sparse, parts []Sparse) Sparse {
	total := 0
	for _, s := range parts {
		total += s.Len()
	}
	dst = reserveSparse(Sparse{Idx: dst.Idx[:0], Val: dst.Val[:0]}, total)
	dst.Reset()
	for _, s := range parts {
		dst.Idx = append(dst.Idx, s.Idx...)
		dst.Val = append(dst.Val, s.Val...)
	}
	return dst
}

// gatherSparse allgathers every rank's sparse block (Bruck's algorithm: the
// balanced shares are of about one size) and concatenates them in rank
// order; blocks must be disjoint and ascending across ranks, which
// DecodeSparse and the order check enforce.
func gatherSparse(ctx context.Context, call *Call, step uint32, mine Sparse, n uint32, sc *okTopkScratch) (Sparse, error) {
	dtype := call.Values.sparseDtype()
	sc.share = encodeSparseAs(sc.share, mine, 0, call.Values)
	blocks, err := okTopkGather(ctx, call, step, Block{Dtype: dtype, Count: uint64(mine.Len()), Payload: sc.share})
	if err != nil {
		return Sparse{}, err
	}
	for len(sc.blocks) < len(blocks) {
		sc.blocks = append(sc.blocks, Sparse{})
	}
	parts := make([]Sparse, len(blocks))
	var last int64 = -1 // the largest index so far
	for r, b := range blocks {
		if b.Dtype != dtype {
			return Sparse{}, fmt.Errorf("%w: rank %d sent %s in the allgather, this rank %s", ErrMismatch, r, b.Dtype, dtype)
		}
		s, err := decodeSparseAs(sc.blocks[r], b.Payload, b.Count, 0, n, call.Values)
		sc.blocks[r] = s
		if err != nil {
			return Sparse{}, fmt.Errorf("from rank %d: %w", r, err)
		}
		if s.Len() > 0 {
			if int64(s.Idx[0]) <= last {
				return Sparse{}, fmt.Errorf("%w: rank %d's block overlaps the one before", transport.ErrBadFrame, r)
			}
			last = int64(s.Idx[s.Len()-1])
		}
		parts[r] = s
	}
	sc.global = concatSparse(sc.global, parts)
	return sc.global, nil
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
	b, err := repartition(ctx, call, in, n)
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
