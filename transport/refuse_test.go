package transport

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// twoRanks returns the in-process and the ZeroMQ transports of two ranks.
func twoRanks(t *testing.T) map[string][]Transport {
	zs := startZMQ(t, 2, nil)
	return map[string][]Transport{"inproc": NewInProc(2), "zmq": {zs[0], zs[1]}}
}

// exchange runs call seq as one message each way and returns each rank's
// error.
func exchange(ts []Transport, seq uint64) [2]error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var errs [2]error
	done := make(chan int, 2)
	for r := range ts {
		go func() {
			defer func() { done <- r }()
			ts[r].StartCall(OpAllgather, seq, CallDesc{N: 1})
			tag := Tag{Op: OpAllgather, Seq: seq}
			if errs[r] = ts[r].Send(ctx, 1-r, tag, DtypeBytes, 1, []byte{byte(r)}); errs[r] != nil {
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
			ts[0].StartCall(OpAllgather, 2, CallDesc{N: 1})
			_, err := ts[0].Recv(ctx, 1, Tag{Op: OpAllgather, Seq: 2})
			if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), "rank 1 refused call 2: invalid argument: data is NULL") {
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

// A peer that refuses call after call runs ahead (a refusal waits for
// nobody): past maxPendingRefusals of them this rank fails with a mismatch
// instead of keeping them all.
func TestRefusalsAheadAreBounded(t *testing.T) {
	ts := NewInProc(2)
	ctx := context.Background()
	for seq := uint64(1); seq <= maxPendingRefusals+1; seq++ {
		ts[1].RefuseCall(ctx, seq, "bad")
	}
	err := ts[0].Send(ctx, 1, Tag{Op: OpAllgather, Seq: 1}, DtypeBytes, 0, nil)
	if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), fmt.Sprintf("more than %d refused calls ahead", maxPendingRefusals)) {
		t.Fatalf("after %d refusals ahead: %v, want ErrMismatch naming the bound", maxPendingRefusals+1, err)
	}
}
