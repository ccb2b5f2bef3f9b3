package core

// The link model behind Auto: what one message, one byte on the wire and one
// byte of a pass over memory cost on this job, measured once per
// communicator and held bitwise alike by every rank, so that every rank
// predicts the same times and makes the same choice.
//
// The measurement (Communicator.MeasureLink, or the first Auto call) works
// as follows.
//
//  1. Memory: every rank times one error-feedback accumulation over 2^20
//     elements (three arrays of 4 MiB) three times, all ranks at once, so
//     that ranks sharing cores measure the contention their calls will
//     meet; γ is the median time over the bytes touched.
//  2. Latency: with h = ⌊P/2⌋, rank r < 2h pairs with r+h or r−h: ranks
//     half a job apart, which on a job over several hosts usually sit on
//     different hosts, whose links bound the collectives (a neighbour
//     would often share the host). The lower rank of each pair sends
//     probeRounds small pings, each answered before the next; α is the
//     median round trip over two. An odd P leaves the last rank out.
//  3. Bandwidth: the lower rank sends probeBytes, answered by probeBytes;
//     β is that round trip less the small one, over 2·probeBytes.
//  4. Agreement: an allgather (Bruck, ⌈log₂ P⌉ rounds) of every rank's
//     (α, β, γ), then on every rank the median of each over the ranks that
//     measured it. Every rank computes it from the same bits in the same
//     order, so every rank holds the same model to the bit.
//
// The pairs measure at once, so the time does not grow with P beyond the
// allgather's ⌈log₂ P⌉ rounds: about probeRounds small round trips, one of
// 2·probeBytes, and a few milliseconds of memory passes — about 0.1 s at
// 200 Mbit/s, a few milliseconds on loopback.
//
// The messages go under their own operation (transport.OpLinkProbe) and
// their own sequence number, so they never meet a collective's: a rank that
// measures while a peer runs a collective fails with ErrMismatch on
// "algorithm".

import (
	"context"
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// LinkModel is the α-β model of one communicator's links, plus the cost of
// memory passes, in seconds.
type LinkModel struct {
	Alpha float64 // seconds per message: latency and per-message overhead
	Beta  float64 // seconds per byte sent by one rank
	Gamma float64 // seconds per byte read or written by a pass over memory
}

// Valid reports whether every figure is finite and not negative.
func (m LinkModel) Valid() bool {
	for _, v := range []float64{m.Alpha, m.Beta, m.Gamma} {
		if !(v >= 0 && v <= math.MaxFloat64) {
			return false
		}
	}
	return true
}

func (m LinkModel) String() string {
	rate := "unbounded"
	if m.Beta > 0 {
		rate = fmt.Sprintf("%.3g Gbit/s", 8e-9/m.Beta)
	}
	return fmt.Sprintf("α = %.1f µs, β = %.3g ns/B (%s), γ = %.3g ns/B", m.Alpha*1e6, m.Beta*1e9, rate, m.Gamma*1e9)
}

const (
	probeRounds      = 8 // small round trips for α
	probePassRepeats = 3
)

// Sizes of the measurement; variables only so that tests under the race
// detector, which slows the timed loop tenfold, can shrink them.
var (
	probeBytes   = 1 << 20 // each way, for β
	probePassLen = 1 << 20 // elements of the timed accumulation, for γ
)

// Steps of the measurement's messages (one call, its own sequence number).
const (
	stepProbePing  uint32 = 0    // + 2i: ping i; + 2i + 1: its answer
	stepProbeLarge uint32 = 1000 // and + 1 for the answer
	stepProbeAgree uint32 = 2000
)

// MeasureLink measures the link model, agrees on it with every rank and
// keeps it for Auto's choices. It is a collective call: every rank makes it
// at the same point of the call order. A failure poisons the communicator as
// a failed collective does.
func (c *Communicator) MeasureLink(ctx context.Context) (LinkModel, error) {
	seq, err := c.begin()
	if err != nil {
		return LinkModel{}, err
	}
	m, err := c.measureLink(ctx, seq)
	return m, c.end(err)
}

// Link returns the link model Auto uses, and whether there is one yet (the
// first Auto call measures it when none was measured or set).
func (c *Communicator) Link() (LinkModel, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.link == nil {
		return LinkModel{}, false
	}
	return *c.link, true
}

// SetLinkModel installs m instead of a measurement, for a job that knows its
// network (or a test). It takes no sequence number and tells no peer: every
// rank must set the same figures at the same point of the call order, or
// their Auto calls may choose differently (which fails those calls with
// ErrMismatch, never silently).
func (c *Communicator) SetLinkModel(m LinkModel) error {
	if !m.Valid() {
		return fmt.Errorf("%w: link model %+v: every figure must be finite and >= 0", ErrInvalidArgument, m)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.link = &m
	return nil
}

// ensureLink measures the link model under call seq when there is none yet,
// and returns the sequence number the caller's collective then takes. Every
// rank has a model, or has none, at the same point of the call order, so
// every rank measures in the same call.
func (c *Communicator) ensureLink(ctx context.Context, seq uint64) (uint64, error) {
	if c.link != nil {
		return seq, nil
	}
	if _, err := c.measureLink(ctx, seq); err != nil {
		return seq, err
	}
	c.seq++
	return c.seq, nil
}

// measureLink runs the measurement as call seq (taken by begin) and keeps
// the agreed model.
func (c *Communicator) measureLink(ctx context.Context, seq uint64) (LinkModel, error) {
	start := time.Now()
	call := NewCall(c.T, transport.OpLinkProbe, seq, nil)
	p, r := call.Size(), call.Rank()
	mine := [3]float64{math.NaN(), math.NaN(), measurePass()}
	if h := p / 2; r < 2*h {
		partner, lead := r+h, true
		if r >= h {
			partner, lead = r-h, false
		}
		alpha, beta, err := pingPong(ctx, call, partner, lead)
		if err != nil {
			return LinkModel{}, fmt.Errorf("oktopk: link measurement with rank %d: %w", partner, err)
		}
		if lead {
			mine[0], mine[1] = alpha, beta
		}
	}
	own := make([]byte, 0, 24)
	for _, v := range mine {
		own = binary.LittleEndian.AppendUint64(own, math.Float64bits(v))
	}
	blocks, err := AllgatherEqual(ctx, call, stepProbeAgree, own)
	if err != nil {
		return LinkModel{}, fmt.Errorf("oktopk: link measurement, agreement: %w", err)
	}
	var figures [3][]float64
	for _, b := range blocks {
		for j := range figures {
			if v := math.Float64frombits(binary.LittleEndian.Uint64(b[8*j:])); v >= 0 && v <= math.MaxFloat64 {
				figures[j] = append(figures[j], v)
			}
		}
	}
	m := LinkModel{Alpha: median(figures[0]), Beta: median(figures[1]), Gamma: median(figures[2])}
	c.link = &m
	if debugAuto() {
		logAuto("rank %d: link measured in %.1f ms over %d ranks: %v", r, ms(time.Since(start)), p, m)
	}
	return m, nil
}

// pingPong measures α and β with partner; only the lead's figures are kept
// (the other rank answers).
func pingPong(ctx context.Context, call *Call, partner int, lead bool) (alpha, beta float64, err error) {
	small := make([]byte, 8)
	exchange := func(step uint32, payload []byte) (time.Duration, error) {
		t0 := time.Now()
		if lead {
			if err := call.Send(ctx, partner, step, transport.DtypeBytes, uint64(len(payload)), payload); err != nil {
				return 0, err
			}
			m, err := call.Recv(ctx, partner, step+1)
			if err != nil {
				return 0, err
			}
			if len(m.Payload) != len(payload) {
				return 0, fmt.Errorf("%w: link probe answer of %d bytes, sent %d", ErrMismatch, len(m.Payload), len(payload))
			}
			return time.Since(t0), nil
		}
		m, err := call.Recv(ctx, partner, step)
		if err != nil {
			return 0, err
		}
		if len(m.Payload) != len(payload) {
			return 0, fmt.Errorf("%w: link probe of %d bytes, want %d", ErrMismatch, len(m.Payload), len(payload))
		}
		return 0, call.Send(ctx, partner, step+1, transport.DtypeBytes, uint64(len(payload)), payload)
	}
	rtts := make([]float64, 0, probeRounds)
	for i := uint32(0); i < probeRounds; i++ {
		d, err := exchange(stepProbePing+2*i, small)
		if err != nil {
			return 0, 0, err
		}
		rtts = append(rtts, d.Seconds())
	}
	large, err := exchange(stepProbeLarge, make([]byte, probeBytes))
	if err != nil || !lead {
		return 0, 0, err
	}
	rtt := median(rtts)
	transfer := large.Seconds() - rtt
	if transfer <= 0 {
		// Latency noise larger than the transfer (a very fast link): the
		// whole round trip bounds it from above.
		transfer = large.Seconds()
	}
	return rtt / 2, transfer / float64(2*probeBytes), nil
}

// measurePass times Accumulate, the pass every error-feedback call makes,
// and returns seconds per byte touched (two arrays read, one written).
func measurePass() float64 {
	grad := make([]float32, probePassLen)
	residual := make([]float32, probePassLen)
	acc := make([]float32, probePassLen)
	for i := range grad {
		grad[i] = float32(i & 1023)
	}
	Accumulate(acc, grad, residual) // faults the pages in, untimed
	times := make([]float64, probePassRepeats)
	for i := range times {
		t0 := time.Now()
		Accumulate(acc, grad, residual)
		times[i] = time.Since(t0).Seconds()
	}
	return median(times) / float64(3*4*probePassLen)
}

// median of v (0 for none); for an even count the mean of the middle two.
// The same values give the same bits on every rank.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }
