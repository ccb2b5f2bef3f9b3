package main

// The communicator behind an oktopk_comm_t: package binding's Worker, which
// runs its calls in issue order, with the handle and settings the C ABI
// knows it by and its last error; each export passes the calling C thread
// to the worker's one-thread-at-a-time rule.

import (
	"io"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport/zmq"
)

type communicator struct {
	*binding.Worker
	handle    int64
	settings  settings
	lastError lastError

	// After a shrink (shrink.go): the ranks of the original communicator
	// still in this one, ascending (nil: every rank, none lost), and the
	// shrinks so far.
	members      []int
	round        int
	originalSize int // the original communicator's size (0: this one's)
	admits       int // oktopk_comm_admit calls on this communicator
}

// world is the original communicator's size.
func (c *communicator) world() int {
	if c.originalSize > 0 {
		return c.originalSize
	}
	return c.Size
}

func newCommunicator(rank, size int, s settings, net *zmq.Transport, store io.Closer) *communicator {
	return &communicator{Worker: binding.NewWorker(rank, size, s.timeout, net, store), settings: s}
}

// operation is one call as the worker runs it.
type operation = binding.Operation

// request is a queued operation and the communicator it runs on (whose
// handle its failure is recorded under).
type request struct {
	*binding.Request
	comm *communicator
}

// start queues an operation from the calling C thread (an export's own
// goroutine runs on it).
func (c *communicator) start(local bool, run operation) (*request, error) {
	r, err := c.Worker.Start(callerThread(), local, run)
	if err != nil {
		return nil, err
	}
	return &request{Request: r, comm: c}, nil
}

// refuse is binding's Refuse from the calling C thread.
func (c *communicator) refuse(err error, wait bool) error {
	return c.Worker.Refuse(callerThread(), err, wait)
}

// do is a blocking operation from the calling C thread.
func (c *communicator) do(local bool, run operation) (core.Stats, error) {
	return c.Worker.Do(callerThread(), local, run)
}
