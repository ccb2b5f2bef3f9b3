package core

// Tests of failures mid-call: a send or receive failing anywhere leaves
// every rank's gradient and tensor state as they were, and a panic in one of
// core's goroutines comes back as ErrInternal.

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/oktopk/oktopk/internal/testref"
	"github.com/oktopk/oktopk/transport"
)

var errInjected = errors.New("injected transport failure")

// failingTransport fails its failSend-th Send or its failRecv-th Recv
// (counted from 1 once armed; 0 never fails) without touching the wire, as a
// dropped connection would at that point of the call.
type failingTransport struct {
	transport.Transport
	armed              atomic.Bool
	failSend, failRecv int64
	sends, recvs       atomic.Int64
	fired              atomic.Bool
}

func (f *failingTransport) Send(ctx context.Context, peer int, tag transport.Tag, dtype transport.Dtype, count uint64, payload []byte) error {
	if f.armed.Load() && f.sends.Add(1) == f.failSend {
		f.fired.Store(true)
		return fmt.Errorf("send to rank %d (%v): %w", peer, tag, errInjected)
	}
	return f.Transport.Send(ctx, peer, tag, dtype, count, payload)
}

func (f *failingTransport) Recv(ctx context.Context, peer int, tag transport.Tag) (transport.Message, error) {
	if f.armed.Load() && f.recvs.Add(1) == f.failRecv {
		f.fired.Store(true)
		return transport.Message{}, fmt.Errorf("receive from rank %d (%v): %w", peer, tag, errInjected)
	}
	return f.Transport.Recv(ctx, peer, tag)
}

// runWithFailingTransports is runRanks over failingTransports wrapping one
// in-process group: when a rank fails, every transport is aborted so the
// others return promptly.
func runWithFailingTransports(p int, fn func(ctx context.Context, r int, c *Communicator, ft *failingTransport) error) []error {
	ts := transport.NewInProc(p)
	fts := make([]*failingTransport, p)
	for r := range ts {
		fts[r] = &failingTransport{Transport: ts[r]}
	}
	return runRanks(ts, inProcTimeout, func(ctx context.Context, r int) error {
		return fn(ctx, r, NewCommunicator(fts[r]), fts[r])
	})
}

// Nothing lost: for every algorithm, a call that fails at its m-th send or
// receive on one rank leaves every failed rank's gradient and tensor state
// (residual, thresholds, region boundaries, call count) bitwise as they were
// before the call, so a retry or a skip loses no gradient mass. The warm-up
// calls put the failing call on a threshold-reuse iteration (1) and on a
// refresh-and-repartition one (4).
func TestFailedCallLeavesGradientAndStateAsTheyWere(t *testing.T) {
	const n = 2000
	type fault struct {
		send, recv int64
	}
	faults := []fault{{send: 1}, {send: 2}, {send: 3}, {send: 6}, {recv: 1}, {recv: 2}, {recv: 4}, {recv: 9}}
	for _, alg := range Algorithms() {
		for _, p := range []int{3, 4} {
			for _, warmup := range []int{1, 4} {
				for _, f := range faults {
					name := fmt.Sprintf("%v/P=%d/warmup=%d/send=%d/recv=%d", alg, p, warmup, f.send, f.recv)
					t.Run(name, func(t *testing.T) {
						cfg := Config{Algorithm: alg, Density: 0.02, Tau: 4, TauPrime: 2}
						bad := 1
						var fired bool
						errs := runWithFailingTransports(p, func(ctx context.Context, r int, c *Communicator, ft *failingTransport) error {
							for call := 0; call < warmup; call++ {
								if _, err := c.SparseAllreduce(ctx, 5, gaussianInputs(p, n, uint64(call))[r], cfg); err != nil {
									return fmt.Errorf("warm-up call %d: %w", call, err)
								}
							}
							var before stateCopy
							st := c.TensorStateOf(5)
							if st != nil {
								before = copyState(st)
							}
							g := gaussianInputs(p, n, uint64(warmup))[r]
							orig := slices.Clone(g)
							if r == bad {
								ft.failSend, ft.failRecv = f.send, f.recv
								ft.armed.Store(true)
							}
							_, err := c.SparseAllreduce(ctx, 5, g, cfg)
							if r == bad {
								fired = ft.fired.Load()
							}
							if err == nil {
								return nil // this rank finished before the failure reached it
							}
							if i, differs := testref.FirstBitwiseDifference(g, orig); differs {
								return fmt.Errorf("rank %d: failed call (%v) changed gradient[%d] from %v to %v", r, err, i, orig[i], g[i])
							}
							if st != nil {
								if e := sameState(st, before); e != nil {
									return fmt.Errorf("rank %d: failed call (%v) changed the state: %w", r, err, e)
								}
							}
							return fmt.Errorf("rank %d: %w", r, err)
						})
						if !fired {
							if err := errors.Join(errs...); err != nil {
								t.Fatalf("no fault injected (the call has fewer messages), yet: %v", err)
							}
							return
						}
						if !errors.Is(errs[bad], errInjected) {
							t.Fatalf("rank %d: %v, want the injected failure", bad, errs[bad])
						}
						for _, err := range errs {
							if err != nil && !errors.Is(err, errInjected) && !errors.Is(err, transport.ErrAborted) {
								t.Errorf("%v", err) // a changed buffer or state
							}
						}
					})
				}
			}
		}
	}
}

// A panic in one of core's goroutines comes back as ErrInternal from the
// call, with the stack, instead of killing the process.
func TestPanicInCoreGoroutineIsErrInternal(t *testing.T) {
	errs := runWithFailingTransports(2, func(ctx context.Context, r int, c *Communicator, ft *failingTransport) error {
		if r == 0 {
			c.T = panickingTransport{c.T}
		}
		_, err := c.Allreduce(ctx, make([]float32, 10), false, DenseRing)
		return err
	})
	if !errors.Is(errs[0], ErrInternal) {
		t.Fatalf("rank 0: %v, want ErrInternal", errs[0])
	}
	if msg := errs[0].Error(); !strings.Contains(msg, "boom") || !strings.Contains(msg, "goroutine") {
		t.Fatalf("rank 0: %q lacks the panic value or the stack", msg)
	}
}

type panickingTransport struct{ transport.Transport }

func (panickingTransport) Send(context.Context, int, transport.Tag, transport.Dtype, uint64, []byte) error {
	panic("boom")
}
