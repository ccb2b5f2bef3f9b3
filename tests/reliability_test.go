package tests

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// relComms connects p ranks in process: over memory ("inproc") or over real
// ZeroMQ TCP sockets on loopback ("zmq"), with the given diagnostics.
func relComms(t *testing.T, kind string, p int, diag transport.Diagnostics) []*core.Communicator {
	t.Helper()
	if kind == "zmq" {
		return zmqCommsWith(t, p, func(_ int, o *transport.ZMQOptions) { o.Diagnostics = diag })
	}
	comms := make([]*core.Communicator, p)
	for r, tr := range transport.NewInProcDiagnostics(p, diag) {
		comms[r] = core.NewCommunicator(tr)
	}
	t.Cleanup(func() {
		for _, c := range comms {
			c.T.Close()
		}
	})
	return comms
}

// eachRank runs f on every rank concurrently and returns every rank's error
// and how long it took. Unlike runRanks it does not abort the others when
// one fails: the library itself must release them.
func eachRank(p int, f func(r int) error) ([]error, []time.Duration) {
	errs := make([]error, p)
	took := make([]time.Duration, p)
	var wg sync.WaitGroup
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			errs[r] = f(r)
			took[r] = time.Since(start)
		}()
	}
	wg.Wait()
	return errs, took
}

// mismatchCase makes rank 2's call differ from ranks 0 and 1 in one field.
type mismatchCase struct {
	field  string
	values [2]string // what ranks 0–1 and rank 2 have, as the error prints them
	alter  func(ctx context.Context, id *uint64, n *int, cfg *core.Config) context.Context
}

var mismatchCases = []mismatchCase{
	{"algorithm", [2]string{"oktopk", "topka"}, func(ctx context.Context, _ *uint64, _ *int, cfg *core.Config) context.Context {
		cfg.Algorithm = core.TopkA
		return ctx
	}},
	{"tensor", [2]string{"7", "8"}, func(ctx context.Context, id *uint64, _ *int, _ *core.Config) context.Context {
		*id = 8
		return ctx
	}},
	{"n", [2]string{"1000", "1001"}, func(ctx context.Context, _ *uint64, n *int, _ *core.Config) context.Context {
		*n = 1001
		return ctx
	}},
	{"dtype", [2]string{"float32", "float16"}, func(ctx context.Context, _ *uint64, _ *int, _ *core.Config) context.Context {
		return core.WithCallerDtype(ctx, transport.DtypeFloat16)
	}},
	{"k", [2]string{"10", "20"}, func(ctx context.Context, _ *uint64, _ *int, cfg *core.Config) context.Context {
		cfg.Density = 0.02
		return ctx
	}},
}

// Ranks that issue different calls under one sequence number — another
// algorithm, tensor, size, dtype or density — all fail with ErrMismatch (the
// field and both values named), well within the timeout, never with a
// timeout and never with data; and every later call fails at once with
// ErrAborted. Rank 2 differs; ranks 0 and 1 agree with each other, so at
// least one of them learns of the mismatch only from a peer's abort.
func TestMismatchedCallsFailWithMismatchOnEveryRank(t *testing.T) {
	const p, timeout = 3, 10 * time.Second
	for _, kind := range []string{"inproc", "zmq"} {
		for _, alg := range []core.Algorithm{core.OkTopk, core.GTopk, core.TopkDSA} {
			for _, mc := range mismatchCases {
				if mc.field == "algorithm" && alg == core.TopkA {
					continue
				}
				values := mc.values
				if mc.field == "algorithm" {
					values[0] = alg.String()
				}
				t.Run(fmt.Sprintf("%s/%v/%s", kind, alg, mc.field), func(t *testing.T) {
					comms := relComms(t, kind, p, transport.Diagnostics{StallWarn: -1})
					errs, took := eachRank(p, func(r int) error {
						ctx, cancel := context.WithTimeout(context.Background(), timeout)
						defer cancel()
						cfg := core.DefaultConfig()
						cfg.Algorithm = alg
						id, n := uint64(7), 1000
						// One agreed call first (on another tensor: a tensor
						// that changes size on one rank is a local
						// ErrInvalidArgument): the mismatch is mid-job.
						if _, err := comms[r].SparseAllreduce(ctx, 6, make([]float32, n), cfg); err != nil {
							return fmt.Errorf("agreed call: %w", err)
						}
						if r == 2 {
							ctx = mc.alter(ctx, &id, &n, &cfg)
						}
						g := make([]float32, n)
						for i := range g {
							g[i] = float32(i%13) - 6
						}
						if _, err := comms[r].SparseAllreduce(ctx, id, g, cfg); err == nil {
							return errors.New("mismatched call returned data")
						} else if !errors.Is(err, transport.ErrMismatch) {
							return fmt.Errorf("want ErrMismatch, got %w", err)
						} else if !strings.Contains(err.Error(), mc.field+": rank") ||
							!strings.Contains(err.Error(), values[0]) || !strings.Contains(err.Error(), values[1]) {
							return fmt.Errorf("mismatch does not name %s and both values %v: %w", mc.field, values, err)
						} else if r == 0 {
							t.Logf("rank 0: %v", err)
						}
						// The communicator is poisoned: the next call fails fast.
						start := time.Now()
						_, err := comms[r].SparseAllreduce(ctx, 7, make([]float32, 1000), core.DefaultConfig())
						if !errors.Is(err, transport.ErrAborted) || time.Since(start) > 100*time.Millisecond {
							return fmt.Errorf("call after a mismatch: want ErrAborted at once, got %v after %v", err, time.Since(start))
						}
						return nil
					})
					for r := range errs {
						if errs[r] != nil {
							t.Errorf("rank %d: %v", r, errs[r])
						}
						if took[r] > timeout/2 {
							t.Errorf("rank %d took %v: it waited for the timeout instead of learning of the mismatch", r, took[r])
						}
					}
				})
			}
		}
	}
}

// After a timeout (a rank that never makes the call) every later call on the
// ranks that waited fails at once with ErrAborted. Over TCP the rank that
// times out first aborts, and the other may learn of it from that abort
// (ErrRemote, whose text carries the timeout) before its own deadline.
func TestAfterTimeoutEveryLaterCallFailsFastWithAborted(t *testing.T) {
	for _, kind := range []string{"inproc", "zmq"} {
		t.Run(kind, func(t *testing.T) {
			comms := relComms(t, kind, 3, transport.Diagnostics{StallWarn: -1})
			errs, _ := eachRank(2, func(r int) error { // rank 2 never calls
				ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
				_, err := comms[r].Allreduce(ctx, make([]float32, 100), false, core.DenseRing)
				cancel()
				if !errors.Is(err, transport.ErrTimeout) && !errors.Is(err, transport.ErrRemote) {
					return fmt.Errorf("want ErrTimeout, got %v", err)
				}
				if !strings.Contains(err.Error(), "timeout") || !strings.Contains(err.Error(), "seq=1") || !strings.Contains(err.Error(), "peer") {
					return fmt.Errorf("timeout does not name the peer and seq: %v", err)
				}
				for i := 0; i < 3; i++ {
					start := time.Now()
					_, err := comms[r].Allreduce(context.Background(), make([]float32, 100), false, core.DenseRing)
					if !errors.Is(err, transport.ErrAborted) {
						return fmt.Errorf("later call %d: want ErrAborted, got %v", i, err)
					}
					if d := time.Since(start); d > 50*time.Millisecond {
						return fmt.Errorf("later call %d took %v", i, d)
					}
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
}

// lineLog collects log lines for a test.
type lineLog struct {
	mu    sync.Mutex
	lines []string
}

func (l *lineLog) log(line string) {
	l.mu.Lock()
	l.lines = append(l.lines, line)
	l.mu.Unlock()
}

func (l *lineLog) all() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]string(nil), l.lines...)
}

// Stall diagnostics: 3 ranks, rank 2 starts its second call late. After the
// warning time, ranks 0 and 1 each log one line naming rank 2, the operation
// and its sequence number, and rank 2's last started call (learnt from its
// heartbeats over TCP); the call then completes normally.
func TestStallWarningNamesTheLateRankAndSeq(t *testing.T) {
	for _, kind := range []string{"inproc", "zmq"} {
		t.Run(kind, func(t *testing.T) {
			logs := []*lineLog{{}, {}, {}}
			const p = 3
			comms := make([]*core.Communicator, p)
			// One diagnostics per rank, so each rank's lines are its own.
			if kind == "inproc" {
				diag := transport.Diagnostics{StallWarn: 700 * time.Millisecond, Log: func(line string) {
					for r := 0; r < p; r++ {
						if strings.Contains(line, fmt.Sprintf("rank %d waiting", r)) {
							logs[r].log(line)
						}
					}
				}}
				comms = relComms(t, kind, p, diag)
			} else {
				comms = zmqCommsWith(t, p, func(r int, o *transport.ZMQOptions) {
					o.Diagnostics = transport.Diagnostics{StallWarn: 700 * time.Millisecond, Log: logs[r].log}
				})
			}
			errs, _ := eachRank(p, func(r int) error {
				ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
				defer cancel()
				for call := 1; call <= 2; call++ {
					if r == 2 && call == 2 {
						time.Sleep(1500 * time.Millisecond)
					}
					x := make([]float32, 1000)
					for i := range x {
						x[i] = float32(r + i%5)
					}
					if _, err := comms[r].Allreduce(ctx, x, false, core.DenseRing); err != nil {
						return err
					}
					for i, v := range x {
						if want := float32(3 + 3*(i%5)); v != want {
							return fmt.Errorf("call %d: x[%d] = %v, want %v", call, i, v, want)
						}
					}
				}
				return nil
			})
			if err := errors.Join(errs...); err != nil {
				t.Fatal(err)
			}
			for r := 0; r < 2; r++ {
				lines := logs[r].all()
				want := fmt.Sprintf("oktopk: rank %d waiting", r)
				tail := "in allreduce_ring seq=2: ranks [2] have not started it (last started seq=1)"
				if len(lines) != 1 || !strings.HasPrefix(lines[0], want) || !strings.HasSuffix(lines[0], tail) {
					t.Errorf("rank %d logged %q, want one line %q … %q", r, lines, want, tail)
				} else {
					t.Logf("rank %d: %s", r, lines[0])
				}
			}
			if lines := logs[2].all(); len(lines) != 0 {
				t.Errorf("the late rank itself logged %q", lines)
			}
		})
	}
}
