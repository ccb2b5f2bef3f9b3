package tests

// Tests of what follows a timeout or a late rank: every later call fails
// fast with ErrAborted, and the stall warning names the late rank and the
// call's sequence number.

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
	"github.com/oktopk/oktopk/transport/zmq"
)

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
					// Fails at once rather than waiting: this call has no
					// deadline, and rank 2 never calls, so anything but the
					// abort would wait for ever. The bound is far over a loaded
					// 2-core machine's scheduling delays under the race
					// detector (78 ms seen against an earlier 50 ms bound).
					if d := time.Since(start); d > time.Second {
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
				comms = zmqCommsWith(t, p, func(r int, o *zmq.Options) {
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
