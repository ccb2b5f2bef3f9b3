package binding

// Worker: a communicator's worker goroutine, which runs its calls one at a
// time in issue order, one thread's collectives at a time; its abort and
// its destroy within a bound; and Protect, which turns a panic inside a
// call into an error.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
	"github.com/oktopk/oktopk/transport/zmq"
)

// maxOutstanding bounds the requests queued on one communicator; a caller
// that starts more without waiting gets ErrInvalidUsage instead of a hang,
// and the communicator is aborted (see Start).
const maxOutstanding = 4096

// Worker is a core.Communicator over a ZeroMQ transport, plus one goroutine
// that runs its operations one at a time in issue order (the order must
// agree across ranks, and core's sequence numbers follow it): what a C
// oktopk_comm_t names.
//
// Issue order is only defined within one thread: calls of two threads would
// be queued in whichever order they came, which differs from rank to rank,
// and a call of one thread would meet another thread's call on a peer. So
// the collectives queued or running at any moment all come from one thread
// (issuer); another thread's collective is refused with ErrInvalidUsage
// until they are done, before it takes a sequence number. One thread may
// queue many (the asynchronous calls); any thread may wait on them.
type Worker struct {
	Rank, Size int
	timeout    time.Duration // per call; 0: none

	Net   *zmq.Transport
	store io.Closer // rendezvous server this rank runs, or nil

	mu          sync.Mutex // guards comm, closed, issuer, collectives and sending on ops
	comm        *core.Communicator
	closed      bool
	issuer      uintptr // the thread whose collectives are queued or running
	collectives int     // collectives queued or running
	ops         chan *Request
	workerEnd   chan struct{}

	// ctx is the parent of every call's context; abort cancels it.
	ctx     context.Context
	cancel  context.CancelCauseFunc
	aborted atomic.Bool
	// broken is set after a panic inside a call: core's state may be
	// half-updated and its locks held, so nothing may run on it again.
	broken  atomic.Bool
	pending atomic.Int64 // queued or running requests

	// Widener runs calls on the caller's buffers, keeping the float32 copy
	// of a half-precision one; only operations (run by the worker) use it,
	// so one per communicator is enough.
	Widener Widener
}

// TakeStore hands over the rendezvous server this rank runs (nil if
// none): a communicator made from this one (a shrink) keeps it running.
func (c *Worker) TakeStore() io.Closer {
	c.mu.Lock()
	defer c.mu.Unlock()
	s := c.store
	c.store = nil
	return s
}

// NewWorker starts the worker of rank of size over net (bound, not yet
// connected); timeout bounds each call (0: none); store, if not nil, is the
// rendezvous server this rank runs, closed by Destroy.
func NewWorker(rank, size int, timeout time.Duration, net *zmq.Transport, store io.Closer) *Worker {
	ctx, cancel := context.WithCancelCause(context.Background())
	c := &Worker{
		Rank: rank, Size: size, timeout: timeout, Net: net, store: store,
		ops: make(chan *Request, maxOutstanding), workerEnd: make(chan struct{}),
		ctx: ctx, cancel: cancel,
	}
	go c.worker()
	return c
}

// Operation is one call as the worker runs it.
type Operation = func(ctx context.Context, cc *core.Communicator) (core.Stats, error)

// ErrAbortedByCaller is what every call fails with after the caller's own
// Abort (oktopk_comm_abort).
var ErrAbortedByCaller = fmt.Errorf("%w: by oktopk_comm_abort", transport.ErrAborted)

// Connected makes the core communicator once the transport reaches every peer.
func (c *Worker) Connected() {
	c.mu.Lock()
	c.comm = core.NewCommunicator(c.Net)
	c.mu.Unlock()
}

// IsConnected reports whether Connected has run.
func (c *Worker) IsConnected() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.comm != nil
}

// Request is one queued operation. Local operations (tensor state) touch no
// peer and still run after an abort, so a failed job can be checkpointed.
// Once Done is closed, Err and Stats hold its outcome.
type Request struct {
	local bool
	run   Operation
	done  chan struct{}
	Err   error
	Stats core.Stats
}

// Done is closed when the operation has run.
func (r *Request) Done() <-chan struct{} { return r.done }

func (c *Worker) worker() {
	defer close(c.workerEnd)
	for r := range c.ops {
		r.Stats, r.Err = c.execute(r)
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

func (c *Worker) execute(r *Request) (core.Stats, error) {
	c.mu.Lock()
	cc := c.comm
	c.mu.Unlock()
	if cc == nil {
		return core.Stats{}, fmt.Errorf("%w: communicator is bound but not connected (call oktopk_comm_connect)", core.ErrInvalidUsage)
	}
	if c.broken.Load() {
		return core.Stats{}, fmt.Errorf("%w: an earlier call failed with an internal error", transport.ErrAborted)
	}
	if !r.local && c.aborted.Load() {
		return core.Stats{}, ErrAbortedByCaller
	}
	ctx, cancel := c.CallContext()
	defer cancel()
	var st core.Stats
	err := Protect(func() error {
		var err error
		st, err = r.run(ctx, cc)
		return err
	})
	if errors.As(err, new(Panic)) {
		c.broken.Store(true)
		c.Abort(fmt.Errorf("%w: internal error in an earlier call", transport.ErrAborted))
	}
	return st, err
}

// CallContext bounds one call by the configured timeout (0: no bound).
func (c *Worker) CallContext() (context.Context, context.CancelFunc) {
	if c.timeout > 0 {
		return context.WithTimeout(c.ctx, c.timeout)
	}
	return context.WithCancel(c.ctx)
}

// Start queues an operation and returns its request. thread is the
// calling thread (the C ABI's caller's): a collective (not local) is
// refused while another thread's collectives are queued or running.
func (c *Worker) Start(thread uintptr, local bool, run Operation) (*Request, error) {
	r := &Request{local: local, run: run, done: make(chan struct{})}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: communicator is being destroyed", core.ErrInvalidUsage)
	}
	if !local && c.collectives > 0 && c.issuer != thread {
		c.mu.Unlock()
		return nil, fmt.Errorf("%w: another thread's call is queued or running on this communicator; "+
			"collective calls on one communicator must come from one thread at a time, "+
			"since their order must be the same on every rank (this call was not made)", core.ErrInvalidUsage)
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
	err := fmt.Errorf("%w: more than %d requests outstanding on one communicator (wait on some first); "+
		"the communicator is aborted", core.ErrInvalidUsage, maxOutstanding)
	c.Abort(fmt.Errorf("%w: a call beyond %d requests outstanding could not be made", transport.ErrAborted, maxOutstanding))
	return nil, err
}

// Refuse is a collective this rank refuses before queueing it (a bad
// pointer, size, dtype or algorithm): the refusal still goes through the
// worker in issue order, takes the call's sequence number and tells the
// peers, so that a peer that made the call fails it (mismatch) instead of
// pairing it with this rank's next call. A blocking call waits until the
// peers are told; an asynchronous start does not. It returns err.
func (c *Worker) Refuse(thread uintptr, err error, wait bool) error {
	r, serr := c.Start(thread, false, func(ctx context.Context, cc *core.Communicator) (core.Stats, error) {
		return core.Stats{}, cc.Refuse(ctx, err)
	})
	if serr == nil && wait {
		<-r.done
	}
	return err
}

// Do is a blocking operation: Start, then wait.
func (c *Worker) Do(thread uintptr, local bool, run Operation) (core.Stats, error) {
	r, err := c.Start(thread, local, run)
	if err != nil {
		return core.Stats{}, err
	}
	<-r.done
	return r.Stats, r.Err
}

// Abort fails the running call and every later one. Callable from any
// thread while another is blocked inside a call on the same communicator.
func (c *Worker) Abort(cause error) {
	c.aborted.Store(true)
	c.cancel(cause)
	c.mu.Lock()
	cc := c.comm
	c.mu.Unlock()
	if cc != nil {
		cc.Abort(cause)
	} else if c.Net != nil {
		c.Net.Abort(cause)
	}
}

// destroyCallGrace is how long Destroy lets a call it aborted take to
// return before it closes the sockets under it. Every wait of a call on a
// peer ends at once on the abort; only a call in the middle of its own
// computation (a selection over a large tensor) takes longer, and it fails
// at its next step once the sockets are closed.
const destroyCallGrace = 500 * time.Millisecond

// DestroyBound is what oktopk.h promises for oktopk_comm_destroy ("within
// one second"): the grace, then closing the sockets.
const DestroyBound = destroyCallGrace + zmq.CloseBound

// Destroy stops the worker and releases the sockets within destroyBound.
// Operations still queued or running are aborted rather than waited for, so
// destroy returns promptly even when a peer is dead; an idle communicator is
// closed without an abort so that peers finishing their last call still get
// every message. A call still running when destroy returns ends on its own
// with an error (its request must still be waited on, as always).
func (c *Worker) Destroy() error {
	c.mu.Lock()
	c.closed = true
	close(c.ops)
	c.mu.Unlock()
	if c.pending.Load() > 0 {
		c.Abort(fmt.Errorf("%w: communicator destroyed with requests outstanding", transport.ErrAborted))
	}
	grace := time.NewTimer(destroyCallGrace)
	select {
	case <-c.workerEnd:
	case <-grace.C:
	}
	grace.Stop()
	c.cancel(fmt.Errorf("%w: communicator destroyed", transport.ErrClosed))
	var err error
	if c.Net != nil {
		err = c.Net.Close()
	}
	if c.store != nil {
		if e := c.store.Close(); err == nil {
			err = e
		}
	}
	return err
}

// Panic is a panic recovered around a call (core.PanicError), told apart
// from the internal errors core returns by itself: it leaves the
// communicator in an unknown state, so the worker marks it broken.
type Panic struct{ error }

func (p Panic) Unwrap() error { return p.error }

// Protect runs body, turning a panic into a Panic error.
func Protect(body func() error) (err error) {
	defer func() {
		if p := recover(); p != nil {
			err = Panic{core.PanicError(p)}
		}
	}()
	return body()
}
