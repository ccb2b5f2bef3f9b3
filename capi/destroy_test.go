package main

// Tests that Destroy returns within its bound while an aborted call is
// still computing, over two ranks of one job connected in this process.

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// destroySlack is what a loaded machine (tests share two cores) may add to
// binding.DestroyBound.
const destroySlack = 250 * time.Millisecond

// twoCommunicators connects two ranks of one job inside this process, each
// wrapped as the C ABI wraps it.
func twoCommunicators(t *testing.T) [2]*communicator {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	token := transport.NewToken()
	var nets [2]*zmq.Transport
	for r := range nets {
		z, err := zmq.Listen(zmq.Options{Rank: r, Size: 2, Token: token})
		if err != nil {
			t.Fatal(err)
		}
		nets[r] = z
	}
	eps := []string{nets[0].Endpoint(), nets[1].Endpoint()}
	var cs [2]*communicator
	var wg sync.WaitGroup
	errs := make([]error, 2)
	for r := range nets {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = nets[r].Connect(ctx, eps)
		}()
		cs[r] = newCommunicator(r, 2, settings{timeout: time.Minute}, nets[r], nil)
	}
	wg.Wait()
	for r, err := range errs {
		if err != nil {
			t.Fatalf("rank %d: %v", r, err)
		}
		cs[r].Connected()
	}
	return cs
}

// Destroy keeps oktopk.h's promise (within a second) even when a call it
// aborts does not return: one that is busy with its own computation gets
// destroyCallGrace, then the sockets close under it, and the call ends with
// an error of its own later.
func TestDestroyReturnsWithinItsBoundWhileACallIsStillComputing(t *testing.T) {
	cs := twoCommunicators(t)
	defer cs[1].Destroy()
	running, release := make(chan struct{}), make(chan struct{})
	r, err := cs[0].start(false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
		close(running)
		<-release // a computation that does not look at ctx
		return core.Stats{}, ctx.Err()
	})
	if err != nil {
		t.Fatal(err)
	}
	<-running
	start := time.Now()
	if err := cs[0].Destroy(); err != nil {
		t.Fatalf("destroy: %v", err)
	}
	took := time.Since(start)
	if took > binding.DestroyBound+destroySlack {
		t.Fatalf("destroy with a call still computing took %v, bound %v", took, binding.DestroyBound)
	}
	t.Logf("destroy with a call still computing took %v (bound %v)", took, binding.DestroyBound)
	select {
	case <-r.Done():
		t.Fatal("the computing call returned before it was released")
	default:
	}
	close(release)
	<-r.Done()
	if !errors.Is(r.Err, context.Canceled) {
		t.Fatalf("the call ended with %v, want its context cancelled", r.Err)
	}
}
