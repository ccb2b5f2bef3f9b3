package core

// Call, one collective call: every message of an algorithm goes through it,
// so its Stats count the bytes on the wire, phase by phase; and goSafe and
// PanicError, which turn a panic in core into ErrInternal.

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"github.com/oktopk/oktopk/transport"
	"golang.org/x/sync/errgroup"
)

// Call is one collective call on a communicator: the transport, the call's
// sequence number (the same on every rank) and the statistics it gathers.
// Every message an algorithm sends goes through Call so that the words
// counted in Stats are the words that crossed the wire.
type Call struct {
	T     transport.Transport
	Op    transport.Op
	Seq   uint64
	Desc  transport.CallDesc // what this rank was asked to do; every rank must agree
	Stats *Stats

	// Values is the type selected values travel in (the tensor's
	// Config.Values; float32 for calls without state), Hold the ranges of
	// the caller's buffer this rank holds back (SparseAllreduceHolding).
	Values ValueType
	Hold   []Span

	mu         sync.Mutex   // Stats is updated by concurrent exchanges of one call
	phase      Phase        // the phase running, whose Stats.Phases entry counts the bytes moved
	phaseStart time.Time    // when it started; zero before the first Phase
	scratch    *callScratch // lent by the communicator for this call; nil: none
}

// callScratch is working memory a Communicator lends to its calls, one at a
// time (a communicator runs one call at a time): however many tensors it
// reduces, it holds one set of Ok-Topk's buffers and of the sparse
// baselines' selection, sized for the largest, instead of one per tensor.
type callScratch struct {
	okTopk    okTopkScratch
	selection Sparse // a baseline's local selection
}

// withScratch lends s to the call.
func withScratch(s *callScratch) CallOption { return func(c *Call) { c.scratch = s } }

// okTopkScratch is the buffers of Ok-Topk's steps for this call: the
// communicator's when it lent them, else the tensor's own.
func (c *Call) okTopkScratch(st *TensorState) *okTopkScratch {
	if c.scratch != nil {
		return &c.scratch.okTopk
	}
	return &st.scratch
}

// selection is the storage of a baseline's local selection for this call:
// the communicator's when it lent one, else the tensor's own.
func (c *Call) selection(st *TensorState) *Sparse {
	if c.scratch != nil {
		return &c.scratch.selection
	}
	return &st.scratch.local
}

// NewCall starts a call and announces it to the transport (see
// transport.Transport.StartCall); stats may be nil.
func NewCall(t transport.Transport, op transport.Op, seq uint64, stats *Stats, opts ...CallOption) *Call {
	if stats == nil {
		stats = &Stats{}
	}
	c := &Call{T: t, Op: op, Seq: seq, Stats: stats}
	for _, o := range opts {
		o(c)
	}
	t.StartCall(op, seq, c.Desc)
	return c
}

// CallOption sets an optional property of a Call.
type CallOption func(*Call)

// WithDesc describes the call (tensor id, n, k, the caller's dtype) so that
// ranks which issued different calls fail with ErrMismatch on every rank.
func WithDesc(d transport.CallDesc) CallOption { return func(c *Call) { c.Desc = d } }

// DescribeCall is the descriptor of a call on tensor (0 if none) of n
// elements selecting k, from a caller whose buffer holds dtype (a
// CallOptions.Dtype: its zero value stands for float32).
func DescribeCall(dtype transport.Dtype, tensor uint64, n, k int) transport.CallDesc {
	if dtype == 0 {
		dtype = transport.DtypeFloat32
	}
	return transport.CallDesc{Tensor: tensor, N: uint64(n), K: uint64(k), Dtype: dtype}
}

func (c *Call) Rank() int { return c.T.Rank() }
func (c *Call) Size() int { return c.T.Size() }

func (c *Call) tag(step uint32) transport.Tag {
	return transport.Tag{Op: c.Op, Seq: c.Seq, Step: step}
}

// Send sends one message of this call to peer. A panic in the transport
// comes back as ErrInternal, as from SendRecv.
func (c *Call) Send(ctx context.Context, peer int, step uint32, dtype transport.Dtype, count uint64, payload []byte) (err error) {
	defer func() {
		if v := recover(); v != nil {
			err = PanicError(v)
		}
	}()
	if err := c.T.Send(ctx, peer, c.tag(step), dtype, count, payload); err != nil {
		return err
	}
	c.countSent(uint64(len(payload)))
	return nil
}

// Recv receives the message of this call's step from peer. A panic in the
// transport comes back as ErrInternal, as from SendRecv.
func (c *Call) Recv(ctx context.Context, peer int, step uint32) (m transport.Message, err error) {
	defer func() {
		if v := recover(); v != nil {
			m, err = transport.Message{}, PanicError(v)
		}
	}()
	m, err = c.T.Recv(ctx, peer, c.tag(step))
	if err != nil {
		return m, err
	}
	c.countReceived(uint64(len(m.Payload)))
	return m, nil
}

// SendRecv sends to one peer, then receives from another; a ring or a
// pairwise exchange never waits on itself, since Send only queues (it never
// waits for the peer to receive) and the transport receives in the
// background. Both run on the caller's goroutine: goroutines of their own
// gained nothing and cost a start and a wake-up on every step. A panic in
// the transport comes back as ErrInternal, as from core's goroutines.
func (c *Call) SendRecv(ctx context.Context, to int, step uint32, dtype transport.Dtype, count uint64, payload []byte, from int) (msg transport.Message, err error) {
	defer func() {
		if v := recover(); v != nil {
			msg, err = transport.Message{}, PanicError(v)
		}
	}()
	if err := c.T.Send(ctx, to, c.tag(step), dtype, count, payload); err != nil {
		return transport.Message{}, err
	}
	c.countSent(uint64(len(payload)))
	if msg, err = c.T.Recv(ctx, from, c.tag(step)); err != nil {
		return msg, err
	}
	c.countReceived(uint64(len(msg.Payload)))
	return msg, nil
}

// ErrInternal is a bug in this library caught at run time: a panic in one of
// its goroutines, turned into an error so that it fails the call instead of
// the host process (the C ABI's recover covers only the calling goroutine).
var ErrInternal = errors.New("oktopk: internal error")

// goSafe runs f in a goroutine of g like g.Go, but a panic in f becomes g's
// error (ErrInternal, with the panic value and the goroutine's stack) instead
// of killing the process. Every goroutine core starts goes through it.
func goSafe(g *errgroup.Group, f func() error) {
	g.Go(func() (err error) {
		defer func() {
			if v := recover(); v != nil {
				err = PanicError(v)
			}
		}()
		return f()
	})
}

// panicError is ErrInternal for a recovered panic, with its value and the
// stack of the goroutine that panicked.
// PanicError is ErrInternal carrying a recovered panic and its stack: what
// a call returns (and the C ABI reports as oktopkInternalError) instead of
// crashing the host process.
func PanicError(v any) error {
	return fmt.Errorf("%w: panic: %v\n%s", ErrInternal, v, debug.Stack())
}

func (c *Call) countSent(bytes uint64) {
	c.mu.Lock()
	c.Stats.BytesSent += bytes
	c.Stats.MessagesSent++
	c.Stats.Phases[c.phase].BytesSent += bytes
	c.Stats.Phases[c.phase].MessagesSent++
	c.mu.Unlock()
}

func (c *Call) countReceived(bytes uint64) {
	c.mu.Lock()
	c.Stats.BytesReceived += bytes
	c.Stats.MessagesReceived++
	c.Stats.Phases[c.phase].BytesReceived += bytes
	c.Stats.Phases[c.phase].MessagesReceived++
	c.mu.Unlock()
}

// Phase ends the phase running, adding its time since it started to its
// Stats.Phases entry, and starts p; a phase may run several times in one
// call (its times add up). The phases of a call run back to back from its
// first Phase to EndPhases, so together they cover all of it: their times
// add up to the call's (Stats.Total, less what the communicator does before
// the algorithm starts). Bytes sent and received count towards the phase
// running when the message was queued or arrived, so an algorithm switches
// phases only once the exchanges of the one before have returned.
func (c *Call) Phase(p Phase) {
	now := time.Now()
	c.mu.Lock()
	if !c.phaseStart.IsZero() {
		c.Stats.Phases[c.phase].Time += now.Sub(c.phaseStart)
	}
	c.phase, c.phaseStart = p, now
	c.mu.Unlock()
}

// EndPhases ends the phase running (a no-op when none is); the
// communicator calls it when the algorithm returns, failed or not.
func (c *Call) EndPhases() {
	now := time.Now()
	c.mu.Lock()
	if !c.phaseStart.IsZero() {
		c.Stats.Phases[c.phase].Time += now.Sub(c.phaseStart)
	}
	c.phaseStart = time.Time{}
	c.mu.Unlock()
}

// Phase names a part of a call, timed on its own in Stats.Phases. Every
// algorithm's call is cut into the same phases, so one phase means the same
// work in each (a phase an algorithm does not have stays zero):
type Phase int

const (
	// PhaseSelect forms acc = grad + residual (error feedback's accumulate
	// pass) and selects this rank's entries from it. It is the same work in
	// every algorithm, whether the two are one fused pass (Ok-Topk's reuse
	// calls) or two.
	PhaseSelect Phase = iota
	// PhaseAgree is the agreement on NaN/Inf in any rank's input (a word
	// per round, ⌈log P⌉ rounds) of the baselines and of the sparse-input
	// calls; Ok-Topk's dense-gradient calls carry it in their histograms.
	PhaseAgree
	// PhaseReduce sums the selections: Ok-Topk's split-and-reduce (with
	// its repartition every τ calls), SparCML's and TopkDSA's split and
	// owner sums, SSAR's recursive doubling, gTopk's tree reduce, TopkA's
	// and Gaussiank's sum of the gathered selections, and a dense
	// allreduce's reduce-scatter (Rabenseifner: fold and recursive halving).
	PhaseReduce
	// PhaseGlobalSelect is Ok-Topk's global selection: the histogram
	// exchange and its refinement rounds, the cut, and (where the
	// histograms are summed) the owners' counts.
	PhaseGlobalSelect
	// PhaseBalance is Ok-Topk's move of the kept entries into P equal
	// shares.
	PhaseBalance
	// PhaseAllgather spreads the result: the allgatherv of Ok-Topk's
	// shares, of the reduced regions (split-allgather), of TopkA's and
	// Gaussiank's selections, gTopk's broadcast, and a dense allreduce's
	// allgather (Rabenseifner: recursive doubling and unfold).
	PhaseAllgather
	// PhaseOutput writes the caller's buffer (the averaged result) and the
	// residual; for a dense allreduce the copy of the result into the
	// caller's buffer, the copy kept to restore it on failure, and the
	// averaging.
	PhaseOutput
	// NumPhases is the number of phases.
	NumPhases
)

var phaseNames = [NumPhases]string{"select", "agree", "reduce", "global_select", "balance", "allgather", "output"}

// String is the phase's name as the benchmark's CSV columns use it.
func (p Phase) String() string {
	if p >= 0 && p < NumPhases {
		return phaseNames[p]
	}
	return fmt.Sprintf("phase(%d)", int(p))
}

// PhaseStats is one phase's share of a call on one rank: its wall time and
// the payload bytes and messages this rank queued and received while it ran.
type PhaseStats struct {
	Time             time.Duration
	BytesSent        uint64
	BytesReceived    uint64
	MessagesSent     uint64
	MessagesReceived uint64
}

// Stats is one rank's view of one call.
type Stats struct {
	BytesSent        uint64
	BytesReceived    uint64
	MessagesSent     uint64
	MessagesReceived uint64
	K                int     // target count, ceil(density·n)
	LocalSelected    int     // entries this rank contributed
	GlobalSelected   int     // entries in the global result
	LocalThreshold   float32 // selection was |x| > LocalThreshold (exact top-k: the largest magnitude left out)
	GlobalThreshold  float32
	Phases           [NumPhases]PhaseStats // the call cut into its phases (Phase)
	Total            time.Duration

	// Ok-Topk: the entries of the global result this rank kept as the
	// owner of its region (step 4), before step 5 balanced them into equal
	// shares. Over the ranks these show how even the regions were, which
	// is what the balance step corrects.
	Kept int

	// Which algorithm ran (Auto's choice, for a call with Auto), and the
	// time the communicator's cost model predicted for it (0 while the
	// communicator has no link model: see Communicator.MeasureLink).
	Algorithm Algorithm
	Predicted time.Duration

	// ξ of the call (xi.go), when the call was asked to measure it
	// (CallOptions.MeasureXi) and ran a sparse algorithm (or Auto chose
	// one, or chose dense, whose ξ is 0 up to rounding): XiMeasured says
	// so, Xi is the ratio and XiGradNorm its denominator ‖Σ_r grad_r‖, so
	// that several tensors' ξ combine into one (the root of the sum of the
	// squared numerators over the root of the sum of the squared
	// denominators).
	XiMeasured bool
	Xi         float64
	XiGradNorm float64

	// The traffic of ξ's measurement (its dense allreduce of 2n values
	// before the call), when the call measured ξ: kept apart from
	// BytesSent and BytesReceived, which count the algorithm's own
	// traffic, as the paper's bounds do.
	XiBytesSent     uint64
	XiBytesReceived uint64

	// Ok-Topk: the words and messages of BytesSent and MessagesSent that
	// went to the repartition's boundaries (step 2, every τ calls),
	// counted in PhaseReduce with step 3's payload but control, not
	// payload, as the paper's bounds count it.
	RepartitionWords    int
	RepartitionMessages int

	// Ok-Topk: the words of BytesSent that went to the global cut's
	// histogram exchanges and, where the histograms are summed by
	// allreduce, the owners' counts (counts, not values; all of the
	// global-select phase), which its cost tests keep apart from the
	// payload the paper's bounds count.
	histogramWords int
}

// Time is the time phase p took in the call.
func (s *Stats) Time(p Phase) time.Duration { return s.Phases[p].Time }

// WordsSent is BytesSent in the cost model's 4-byte words (an index and a
// value one word each; indices coded as gaps, indexcode.go, take less).
func (s *Stats) WordsSent() uint64 { return s.BytesSent / 4 }

// WordsReceived is BytesReceived in the same 4-byte words.
func (s *Stats) WordsReceived() uint64 { return s.BytesReceived / 4 }

// Add accumulates o into s (for totals over several calls).
func (s *Stats) Add(o Stats) {
	s.BytesSent += o.BytesSent
	s.BytesReceived += o.BytesReceived
	s.MessagesSent += o.MessagesSent
	s.MessagesReceived += o.MessagesReceived
	for p := range s.Phases {
		s.Phases[p].Time += o.Phases[p].Time
		s.Phases[p].BytesSent += o.Phases[p].BytesSent
		s.Phases[p].BytesReceived += o.Phases[p].BytesReceived
		s.Phases[p].MessagesSent += o.Phases[p].MessagesSent
		s.Phases[p].MessagesReceived += o.Phases[p].MessagesReceived
	}
	s.Total += o.Total
	s.Predicted += o.Predicted
}
