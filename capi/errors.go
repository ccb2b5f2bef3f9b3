package main

// Errors at the ABI boundary: resultOf, the one mapping from an error to a
// result code; call and callOn, which every export body runs through; and
// the last-error slots that oktopk_get_last_error reads.

/*
#include "../include/oktopk.h"
*/
import "C"

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"unsafe"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// resultOf maps an error value to its C result code: core's and transport's
// sentinels, a panic (binding.Panic wraps core.ErrInternal), a context's
// cancellation or deadline, and anything else from the operating system.
// It is the only place in Go where a result code is chosen; every export
// that returns one returns resultOf's. (abi.c answers in C alone for a
// forked child, where no Go may run.) Order matters where one error wraps
// several sentinels: a communicator poisoned by a timeout reports
// ErrAborted wrapping ErrTimeout, and the caller must learn that the
// communicator is unusable.
func resultOf(err error) C.oktopk_result_t {
	switch {
	case err == nil:
		return C.oktopkSuccess
	case errors.Is(err, errInProgress):
		return C.oktopkInProgress
	case errors.Is(err, core.ErrInternal):
		return C.oktopkInternalError
	case errors.Is(err, core.ErrInvalidArgument):
		return C.oktopkInvalidArgument
	case errors.Is(err, core.ErrInvalidUsage):
		return C.oktopkInvalidUsage
	case errors.Is(err, core.ErrNonFinite):
		return C.oktopkNonFinite
	case errors.Is(err, transport.ErrAborted), errors.Is(err, transport.ErrClosed),
		errors.Is(err, context.Canceled):
		return C.oktopkAborted
	case errors.Is(err, transport.ErrTimeout), errors.Is(err, context.DeadlineExceeded):
		return C.oktopkTimeout
	case errors.Is(err, transport.ErrMismatch):
		return C.oktopkMismatch
	case errors.Is(err, transport.ErrRemote), errors.Is(err, transport.ErrBadFrame):
		return C.oktopkRemoteError
	case errors.Is(err, transport.ErrBadPeer):
		return C.oktopkInternalError
	}
	// Everything else comes from the operating system or libzmq: bind,
	// resolve, connect, authentication, rendezvous.
	return C.oktopkSystemError
}

// errInProgress is oktopk_test's "not yet"; it is not recorded as an error.
var errInProgress = errors.New("oktopk: request in progress")

func invalidArgument(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{core.ErrInvalidArgument}, args...)...)
}

func invalidUsage(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{core.ErrInvalidUsage}, args...)...)
}

// lastError keeps the message of the most recent failed call: one slot per
// communicator (in its table entry) and one global slot, which every failure
// also writes, for calls that have no communicator (comm 0).
type lastError struct {
	mu  sync.Mutex
	msg string
}

func (l *lastError) set(msg string) {
	l.mu.Lock()
	l.msg = msg
	l.mu.Unlock()
}

func (l *lastError) get() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.msg
}

var globalLastError lastError

// call runs one export body (abi.c has refused a forked child): turns a panic into
// oktopkInternalError, maps the error to its result code and records its
// message in the global slot and (when comm names a live communicator) the
// communicator's slot.
func call(comm int64, body func() error) C.oktopk_result_t {
	err := binding.Protect(body)
	if err != nil && !errors.Is(err, errInProgress) {
		record(comm, err)
	}
	return resultOf(err)
}

// callOn is call for an export on a communicator: it looks comm up and runs
// body on it. An unknown or destroyed handle fails with ErrInvalidUsage
// before body runs, recorded in the global slot only.
func callOn(comm C.oktopk_comm_t, body func(c *communicator) error) C.oktopk_result_t {
	return call(int64(comm), func() error {
		c, err := lookup(comm)
		if err != nil {
			return err
		}
		return body(c)
	})
}

// lookup returns the live communicator comm names, or ErrInvalidUsage
// saying whether it was destroyed or never existed.
func lookup(comm C.oktopk_comm_t) (*communicator, error) {
	return comms.get("communicator", int64(comm))
}

func record(comm int64, err error) {
	msg := err.Error()
	globalLastError.set(msg)
	if c := comms.peek(comm); c != nil {
		c.lastError.set(msg)
	}
}

// copyMessage writes msg into buf[:len] always NUL-terminated; it reports
// whether msg was cut short.
func copyMessage(msg string, buf *C.char, n C.size_t) bool {
	if uint64(n) > uint64(len(msg))+1 {
		n = C.size_t(len(msg) + 1)
	}
	dst := unsafe.Slice((*byte)(unsafe.Pointer(buf)), int(n))
	m := copy(dst[:len(dst)-1], msg)
	dst[m] = 0
	return m < len(msg)
}
