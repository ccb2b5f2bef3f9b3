package core

// Tests of the algorithms' schedules: phase times and bytes add up to the
// call's, gTopk's broadcast sends one message at a time, and every
// baseline's critical path has the rounds its cost formula counts.

import (
	"context"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// Every algorithm's phases cover its call: on every rank and every call the
// phases' times add up to no more than Stats.Total (no time counted twice),
// and the median over the calls of what they leave out is within 1% of the
// median call plus 100 µs (the communicator's own few microseconds before
// the algorithm starts; a median, so that the scheduler descheduling a rank
// in that window on a busy machine does not fail the test). The phases'
// bytes add up exactly to the call's. Under -race or -short n shrinks to
// 2^16, so that the race detector gets through in seconds.
func TestPhasesAddUpToTotal(t *testing.T) {
	const p, calls = 4, 5
	n := 1 << 20
	if testing.Short() || raceEnabled {
		n = 1 << 16
	}
	in := gaussianInputs(p, n, 7)
	for _, alg := range Algorithms() {
		t.Run(alg.String(), func(t *testing.T) {
			cfg := Config{Algorithm: alg, Density: 0.01, Tau: 4, TauPrime: 2} // Ok-Topk: exact, reuse and repartition calls
			stats := make([][]Stats, p)
			runInProc(t, p, func(ctx context.Context, r int, c *Communicator) error {
				grad := make([]float32, n)
				for range calls {
					copy(grad, in[r])
					st, err := c.SparseAllreduce(ctx, 1, grad, cfg)
					if err != nil {
						return err
					}
					stats[r] = append(stats[r], st)
				}
				return nil
			})
			for r, calls := range stats {
				var gaps, totals []time.Duration
				for c, st := range calls {
					var sum time.Duration
					var sent, received uint64
					for _, ph := range st.Phases {
						sum += ph.Time
						sent += ph.BytesSent
						received += ph.BytesReceived
					}
					if sum > st.Total {
						t.Errorf("rank %d call %d: phases add up to %v, more than the call's %v: %+v", r, c, sum, st.Total, st.Phases)
					}
					if sent != st.BytesSent || received != st.BytesReceived {
						t.Errorf("rank %d call %d: phases sent %d and received %d bytes, the call %d and %d", r, c, sent, received, st.BytesSent, st.BytesReceived)
					}
					gaps = append(gaps, st.Total-sum)
					totals = append(totals, st.Total)
				}
				gap, total := medianDuration(gaps), medianDuration(totals)
				if tol := total/100 + 100*time.Microsecond; gap > tol {
					t.Errorf("rank %d: the phases leave out %v of a call of %v (medians over %d calls), more than %v", r, gap, total, len(calls), tol)
				}
			}
		})
	}
}

func medianDuration(v []time.Duration) time.Duration {
	s := slices.Clone(v)
	slices.Sort(s)
	return s[len(s)/2]
}

// runWrapped runs one SparseAllreduce of in[r] with cfg on every rank r, in
// process, each rank's transport wrapped by wrap.
func runWrapped(t *testing.T, in [][]float32, cfg Config, wrap func(transport.Transport) transport.Transport) {
	t.Helper()
	p := len(in)
	inner := transport.NewInProc(p)
	errs := runRanks(inner, inProcTimeout, func(ctx context.Context, r int) error {
		c := NewCommunicator(wrap(inner[r]))
		_, err := c.SparseAllreduce(ctx, 1, append([]float32(nil), in[r]...), cfg)
		return err
	})
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
}

// dataMessage reports whether a message of op with dtype is one of the
// algorithm's payload messages: not the NaN/Inf agreement's words, not
// gTopk's acknowledgements (both DtypeBytes).
func dataMessage(op transport.Op, tag transport.Tag, dtype transport.Dtype) bool {
	return tag.Op == op && (dtype == transport.DtypeSparseF32 || dtype == transport.DtypeFloat32)
}

type flightKey struct {
	from, to int
	tag      transport.Tag
}

// gTopk's broadcast is a binomial tree in which a rank sends one message at
// a time: it sends to its next child only once the child before has
// received. A transport in between records every gTopk data message from
// the moment it is sent until its receiver's Recv returns, which it delays
// by flightDelay, and fails the test when a rank sends while one of its own
// messages is still in flight. Before the broadcast waited for an
// acknowledgement, every parent queued all its messages at once (they then
// shared its link, so the child with the largest subtree waited for all of
// them), which this catches.
func TestGTopkBroadcastSendsOneMessageAtATime(t *testing.T) {
	const n, flightDelay = 4096, 20 * time.Millisecond
	for _, p := range []int{4, 5, 8} {
		t.Run(fmt.Sprint("P=", p), func(t *testing.T) {
			g := &flightLedger{delay: flightDelay, inFlight: map[int]map[flightKey]bool{}}
			runWrapped(t, gaussianInputs(p, n, 11), baselineConfig(GTopk, 0.05), func(tr transport.Transport) transport.Transport {
				return &flightTransport{Transport: tr, ledger: g}
			})
			for _, v := range g.violations {
				t.Error(v)
			}
		})
	}
}

// flightLedger holds, per sending rank, its gTopk data messages not yet
// received.
type flightLedger struct {
	delay      time.Duration
	mu         sync.Mutex
	inFlight   map[int]map[flightKey]bool
	violations []string
}

type flightTransport struct {
	transport.Transport
	ledger *flightLedger
}

func (l *flightTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	if dataMessage(transport.OpGTopk, tag, dtype) {
		g, me := l.ledger, l.Rank()
		g.mu.Lock()
		for k := range g.inFlight[me] {
			g.violations = append(g.violations, fmt.Sprintf("rank %d sent step %d to rank %d while its step %d to rank %d was in flight", me, tag.Step, peer, k.tag.Step, k.to))
		}
		if g.inFlight[me] == nil {
			g.inFlight[me] = map[flightKey]bool{}
		}
		g.inFlight[me][flightKey{me, peer, tag}] = true
		g.mu.Unlock()
	}
	return l.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

func (l *flightTransport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	m, err := l.Transport.Recv(ctx, peer, tag)
	if err == nil && dataMessage(transport.OpGTopk, tag, m.Dtype) {
		time.Sleep(l.ledger.delay) // the message is still on the wire
		g := l.ledger
		g.mu.Lock()
		delete(g.inFlight[peer], flightKey{peer, l.Rank(), tag})
		g.mu.Unlock()
	}
	return m, err
}

// Every baseline's payload messages form chains of the length its cost
// formula's latency term counts: a message's depth is one more than the
// deepest payload message its sender had received before sending it, and
// the call's rounds are the deepest message's (the NaN/Inf agreement's
// ⌈log P⌉ words and gTopk's acknowledgements are not counted). The
// formulas: dense ring 2(P−1); Rabenseifner 2 log P; TopkA and Gaussiank
// log P (their papers' allgather); TopkDSA and SparCML's split-allgather
// P−1 for the split plus log P for the allgather (the table's ≈ P + log P);
// SSAR_Recursive_double log P; gTopk 2 log P. With a ring allgather TopkA,
// Gaussiank and the split-allgathers took P−1 rounds for it.
func TestBaselinesCriticalPathRounds(t *testing.T) {
	const n = 4096
	for _, p := range []int{4, 8} {
		logP := bits.Len(uint(p - 1))
		want := map[Algorithm]int{
			DenseRing: 2 * (p - 1), DenseRabenseifner: 2 * logP,
			TopkA: logP, Gaussiank: logP,
			TopkDSA: p - 1 + logP, SSARSplitAllgather: p - 1 + logP, DSARSplitAllgather: p - 1 + logP,
			SSARRecursiveDouble: logP, GTopk: 2 * logP,
		}
		in := gaussianInputs(p, n, 13)
		for _, alg := range Algorithms() {
			if alg == OkTopk {
				continue // not a baseline: its refinement rounds vary from call to call
			}
			t.Run(fmt.Sprintf("%v/P=%d", alg, p), func(t *testing.T) {
				d := &depthLedger{op: alg.Op(), clock: make([]int, p), stamps: map[flightKey]int{}}
				runWrapped(t, in, baselineConfig(alg, 0.01), func(tr transport.Transport) transport.Transport {
					return &depthTransport{Transport: tr, ledger: d}
				})
				if d.deepest != want[alg] {
					t.Errorf("%d rounds of payload messages in a row, the formula's %d", d.deepest, want[alg])
				}
			})
		}
	}
}

// depthLedger is a logical clock over one call's payload messages: clock[r]
// is the depth of the deepest message rank r has received.
type depthLedger struct {
	op      transport.Op
	mu      sync.Mutex
	clock   []int
	stamps  map[flightKey]int
	deepest int
}

type depthTransport struct {
	transport.Transport
	ledger *depthLedger
}

func (l *depthTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	if d := l.ledger; dataMessage(d.op, tag, dtype) {
		me := l.Rank()
		d.mu.Lock()
		depth := d.clock[me] + 1
		d.stamps[flightKey{me, peer, tag}] = depth
		d.deepest = max(d.deepest, depth)
		d.mu.Unlock()
	}
	return l.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

func (l *depthTransport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	m, err := l.Transport.Recv(ctx, peer, tag)
	if d := l.ledger; err == nil && dataMessage(d.op, tag, m.Dtype) {
		me := l.Rank()
		d.mu.Lock()
		d.clock[me] = max(d.clock[me], d.stamps[flightKey{peer, me, tag}])
		d.mu.Unlock()
	}
	return m, err
}
