package zmq

// Tests of refused calls on both transports: a refusal fails the peer's
// call of that number, and ranks that refuse the same calls stay in step.

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// twoRanks returns the in-process and the ZeroMQ transports of two ranks.
func twoRanks(t *testing.T) map[string][]transport.Transport {
	zs := startZMQ(t, 2, nil)
	return map[string][]transport.Transport{"inproc": transport.NewInProc(2), "zmq": {zs[0], zs[1]}}
}

// exchange runs call seq as one message each way and returns each rank's
// error.
func exchange(ts []transport.Transport, seq uint64) [2]error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var errs [2]error
	done := make(chan int, 2)
	for r := range ts {
		go func() {
			defer func() { done <- r }()
			ts[r].StartCall(transport.OpAllgather, seq, transport.CallDesc{N: 1})
			tag := transport.Tag{Op: transport.OpAllgather, Seq: seq}
			if errs[r] = ts[r].Send(ctx, 1-r, tag, transport.DtypeBytes, 1, []byte{byte(r)}); errs[r] != nil {
				return
			}
			_, errs[r] = ts[r].Recv(ctx, 1-r, tag)
		}()
	}
	<-done
	<-done
	return errs
}

// A refusal of call 2 that arrives before the peer starts call 2 fails that
// call when it starts, naming the refusing rank, the call and the reason.
// (A refusal that arrives while the call waits is core's tests' case.)
func TestRefusalFailsThePeersCallOfThatNumber(t *testing.T) {
	for kind, ts := range twoRanks(t) {
		t.Run(kind, func(t *testing.T) {
			if errs := exchange(ts, 1); errs[0] != nil || errs[1] != nil {
				t.Fatalf("call 1: %v", errs)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			ts[1].RefuseCall(ctx, 2, "oktopk: invalid argument: data is NULL")
			time.Sleep(50 * time.Millisecond) // over TCP, the refusal arrives first
			ts[0].StartCall(transport.OpAllgather, 2, transport.CallDesc{N: 1})
			_, err := ts[0].Recv(ctx, 1, transport.Tag{Op: transport.OpAllgather, Seq: 2})
			if !errors.Is(err, transport.ErrMismatch) || !strings.Contains(err.Error(), "rank 1 refused call 2: invalid argument: data is NULL") {
				t.Fatalf("call 2 on the peer: %v, want ErrMismatch naming rank 1, call 2 and the reason", err)
			}
		})
	}
}

// Ranks that refuse the same calls, at different paces, ignore each other's
// refusals: their next call exchanges data.
func TestRefusalsOfACallRefusedHereAreIgnored(t *testing.T) {
	for kind, ts := range twoRanks(t) {
		t.Run(kind, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			for seq := uint64(1); seq <= 3; seq++ {
				ts[0].RefuseCall(ctx, seq, "bad")
			}
			time.Sleep(50 * time.Millisecond) // rank 1 sees the refusals ahead of it
			for seq := uint64(1); seq <= 3; seq++ {
				ts[1].RefuseCall(ctx, seq, "bad")
			}
			if errs := exchange(ts, 4); errs[0] != nil || errs[1] != nil {
				t.Fatalf("call 4 after calls 1-3 refused on both ranks: %v", errs)
			}
		})
	}
}
