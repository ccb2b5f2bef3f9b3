package main

// The communicator behind an oktopk_comm_t and its worker goroutine, which
// runs the communicator's calls one at a time in issue order; start, refuse,
// do, abort and destroy are how the exports reach it.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// maxOutstanding bounds the requests queued on one communicator; a caller
// that starts more without waiting gets ErrInvalidUsage instead of a hang,
// and the communicator is aborted (see start).
const maxOutstanding = 4096

// communicator is what a C oktopk_comm_t names: a core.Communicator over a
// ZeroMQ transport, plus one worker goroutine that runs its operations one at
// a time in issue order (the order must agree across ranks, and core's
// sequence numbers follow it).
//
// Issue order is only defined within one thread: calls of two threads would
// be queued in whichever order they came, which differs from rank to rank,
// and a call of one thread would meet another thread's call on a peer. So
// the collectives queued or running at any moment all come from one thread
// (issuer); another thread's collective is refused with ErrInvalidUsage
// until they are done, before it takes a sequence number. One thread may
// queue many (the asynchronous calls); any thread may wait on them.
type communicator struct {
	handle     int64
	rank, size int
	settings   settings

	net   *zmq.Transport
	store io.Closer // rendezvous server this rank runs, or nil

	mu          sync.Mutex // guards comm, closed, issuer, collectives and sending on ops
	comm        *core.Communicator
	closed      bool
	issuer      uintptr // the thread whose collectives are queued or running
	collectives int     // collectives queued or running
	ops         chan *request
	workerEnd   chan struct{}

	// ctx is the parent of every call's context; abort cancels it.
	ctx     context.Context
	cancel  context.CancelCauseFunc
	aborted atomic.Bool
	// broken is set after a panic inside a call: core's state may be
	// half-updated and its locks held, so nothing may run on it again.
	broken  atomic.Bool
	pending atomic.Int64 // queued or running requests

	lastError lastError

	// widener runs calls on the caller's buffers, keeping the float32 copy
	// of a half-precision one; only the worker uses it, so one per
	// communicator is enough.
	widener binding.Widener
}

func newCommunicator(rank, size int, s settings, net *zmq.Transport, store io.Closer) *communicator {
	ctx, cancel := context.WithCancelCause(context.Background())
	c := &communicator{
		rank: rank, size: size, settings: s, net: net, store: store,
		ops: make(chan *request, maxOutstanding), workerEnd: make(chan struct{}),
		ctx: ctx, cancel: cancel,
	}
	go c.worker()
	return c
}

// operation is one call as the worker runs it.
type operation = func(ctx context.Context, cc *core.Communicator) (core.Stats, error)

var errAbortedByCaller = fmt.Errorf("%w: by oktopk_comm_abort", transport.ErrAborted)

// connected makes the core communicator once the transport reaches every peer.
func (c *communicator) connected() {
	c.mu.Lock()
	c.comm = core.NewCommunicator(c.net)
	c.mu.Unlock()
}

// request is one queued operation. local operations (tensor state) touch no
// peer and still run after an abort, so a failed job can be checkpointed.
type request struct {
	comm  *communicator
	local bool
	run   operation
	done  chan struct{}
	err   error
	stats core.Stats
}

func (c *communicator) worker() {
	defer close(c.workerEnd)
	for r := range c.ops {
		r.stats, r.err = c.execute(r)
		if !r.local {
			// Before done: a thread that waited for this request may issue
			// the next call from another thread at once.
			c.mu.Lock()
			c.collectives--
			c.mu.Unlock()
		}
		c.pending.Add(-1)
		close(r.done)
	}
}

func (c *communicator) execute(r *request) (core.Stats, error) {
	c.mu.Lock()
	cc := c.comm
	c.mu.Unlock()
	if cc == nil {
		return core.Stats{}, invalidUsage("communicator is bound but not connected (call oktopk_comm_connect)")
	}
	if c.broken.Load() {
		return core.Stats{}, fmt.Errorf("%w: an earlier call failed with an internal error", transport.ErrAborted)
	}
	if !r.local && c.aborted.Load() {
		return core.Stats{}, errAbortedByCaller
	}
	ctx, cancel := c.callContext()
	defer cancel()
	var st core.Stats
	err := protect(func() error {
		var err error
		st, err = r.run(ctx, cc)
		return err
	})
	if errors.As(err, new(abiPanic)) {
		c.broken.Store(true)
		c.abort(fmt.Errorf("%w: internal error in an earlier call", transport.ErrAborted))
	}
	return st, err
}

// callContext bounds one call by the configured timeout (0: no bound).
func (c *communicator) callContext() (context.Context, context.CancelFunc) {
	if c.settings.timeout > 0 {
		return context.WithTimeout(c.ctx, c.settings.timeout)
	}
	return context.WithCancel(c.ctx)
}

// start queues an operation and returns its request. It must run on the
// calling C thread (an export's own goroutine): a collective (not local) is
// refused while another thread's collectives are queued or running.
func (c *communicator) start(local bool, run operation) (*request, error) {
	r := &request{comm: c, local: local, run: run, done: make(chan struct{})}
	thread := callerThread()
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, invalidUsage("communicator is being destroyed")
	}
	if !local && c.collectives > 0 && c.issuer != thread {
		c.mu.Unlock()
		return nil, invalidUsage("another thread's call is queued or running on this communicator; " +
			"collective calls on one communicator must come from one thread at a time, " +
			"since their order must be the same on every rank (this call was not made)")
	}
	// pending (queued or running) only falls meanwhile, so below the bound
	// the queue, as long as the bound, has room.
	if c.pending.Load() < maxOutstanding {
		select {
		case c.ops <- r:
			c.pending.Add(1)
			if !local {
				c.issuer = thread
				c.collectives++
			}
			c.mu.Unlock()
			return r, nil
		default:
		}
	}
	c.mu.Unlock()
	// This rank cannot make the call, and its peers will: aborting makes
	// them fail too, where a refusal that took no sequence number would
	// pair this rank's next call with their call.
	err := invalidUsage("more than %d requests outstanding on one communicator (wait on some first); "+
		"the communicator is aborted", maxOutstanding)
	c.abort(fmt.Errorf("%w: a call beyond %d requests outstanding could not be made", transport.ErrAborted, maxOutstanding))
	return nil, err
}

// refuse is a collective this rank refuses before queueing it (a bad
// pointer, size, dtype or algorithm): the refusal still goes through the
// worker in issue order, takes the call's sequence number and tells the
// peers, so that a peer that made the call fails it (mismatch) instead of
// pairing it with this rank's next call. A blocking call waits until the
// peers are told; an asynchronous start does not. It returns err.
func (c *communicator) refuse(err error, wait bool) error {
	r, serr := c.start(false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
		return core.Stats{}, cc.Refuse(ctx, err)
	})
	if serr == nil && wait {
		<-r.done
	}
	return err
}

// do is a blocking operation: start, then wait.
func (c *communicator) do(local bool, run operation) (core.Stats, error) {
	r, err := c.start(local, run)
	if err != nil {
		return core.Stats{}, err
	}
	<-r.done
	return r.stats, r.err
}

// abort fails the running call and every later one. Callable from any
// thread while another is blocked inside a call on the same communicator.
func (c *communicator) abort(cause error) {
	c.aborted.Store(true)
	c.cancel(cause)
	c.mu.Lock()
	cc := c.comm
	c.mu.Unlock()
	if cc != nil {
		cc.Abort(cause)
	} else if c.net != nil {
		c.net.Abort(cause)
	}
}

// destroyCallGrace is how long destroy lets a call it aborted take to
// return before it closes the sockets under it. Every wait of a call on a
// peer ends at once on the abort; only a call in the middle of its own
// computation (a selection over a large tensor) takes longer, and it fails
// at its next step once the sockets are closed.
const destroyCallGrace = 500 * time.Millisecond

// destroyBound is what oktopk.h promises for oktopk_comm_destroy ("within
// one second"): the grace, then closing the sockets.
const destroyBound = destroyCallGrace + zmq.CloseBound

// destroy stops the worker and releases the sockets within destroyBound.
// Operations still queued or running are aborted rather than waited for, so
// destroy returns promptly even when a peer is dead; an idle communicator is
// closed without an abort so that peers finishing their last call still get
// every message. A call still running when destroy returns ends on its own
// with an error (its request must still be waited on, as always).
func (c *communicator) destroy() error {
	c.mu.Lock()
	c.closed = true
	close(c.ops)
	c.mu.Unlock()
	if c.pending.Load() > 0 {
		c.abort(fmt.Errorf("%w: communicator destroyed with requests outstanding", transport.ErrAborted))
	}
	grace := time.NewTimer(destroyCallGrace)
	select {
	case <-c.workerEnd:
	case <-grace.C:
	}
	grace.Stop()
	c.cancel(fmt.Errorf("%w: communicator destroyed", transport.ErrClosed))
	var err error
	if c.net != nil {
		err = c.net.Close()
	}
	if c.store != nil {
		if e := c.store.Close(); err == nil {
			err = e
		}
	}
	return err
}
