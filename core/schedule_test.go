package core

import (
	"context"
	"errors"
	"fmt"
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
			in := gaussianInputs(p, n, 11)
			ledger := &flightLedger{delay: flightDelay, inFlight: map[int]map[flightKey]bool{}}
			inner := transport.NewInProc(p)
			ctx, cancel := context.WithTimeout(context.Background(), inProcTimeout)
			defer cancel()
			errs := make([]error, p)
			var wg sync.WaitGroup
			for r := range p {
				wg.Add(1)
				go func() {
					defer wg.Done()
					c := NewCommunicator(&ledgerTransport{Transport: inner[r], ledger: ledger})
					_, errs[r] = c.SparseAllreduce(ctx, 1, append([]float32(nil), in[r]...), baselineConfig(GTopk, 0.05))
					if errs[r] != nil {
						for _, tr := range inner {
							tr.Abort(errs[r])
						}
					}
				}()
			}
			wg.Wait()
			for _, tr := range inner {
				tr.Close()
			}
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			for _, v := range ledger.violations {
				t.Error(v)
			}
		})
	}
}

type flightKey struct {
	to  int
	tag transport.Tag
}

// flightLedger holds, per sending rank, its gTopk data messages not yet
// received.
type flightLedger struct {
	delay      time.Duration
	mu         sync.Mutex
	inFlight   map[int]map[flightKey]bool
	violations []string
}

type ledgerTransport struct {
	transport.Transport
	ledger *flightLedger
}

func tracked(tag transport.Tag, dtype transport.Dtype) bool {
	return tag.Op == transport.OpGTopk && dtype == transport.DtypeSparseF32
}

func (l *ledgerTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	if tracked(tag, dtype) {
		g, me := l.ledger, l.Rank()
		g.mu.Lock()
		for k := range g.inFlight[me] {
			g.violations = append(g.violations, fmt.Sprintf("rank %d sent step %d to rank %d while its step %d to rank %d was in flight", me, tag.Step, peer, k.tag.Step, k.to))
		}
		if g.inFlight[me] == nil {
			g.inFlight[me] = map[flightKey]bool{}
		}
		g.inFlight[me][flightKey{peer, tag}] = true
		g.mu.Unlock()
	}
	return l.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

func (l *ledgerTransport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	m, err := l.Transport.Recv(ctx, peer, tag)
	if err == nil && tracked(tag, m.Dtype) {
		time.Sleep(l.ledger.delay) // the message is still on the wire
		g := l.ledger
		g.mu.Lock()
		delete(g.inFlight[peer], flightKey{l.Rank(), tag})
		g.mu.Unlock()
	}
	return m, err
}
