package main

// Tests of C ABI error handling: each error value mapped to its result
// code, a panic turned into an internal error, and destroyed handles told
// apart from unknown ones.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/oktopk/oktopk/binding"
	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// Result codes of include/oktopk.h, spelled out: a test file cannot use cgo.
const (
	success, invalidArgumentCode, invalidUsageCode, systemError, remoteError = 0, 1, 2, 3, 4
	timeout, mismatch, aborted, internalError, inProgress, nonFinite         = 5, 6, 7, 8, 9, 10
)

// Each error value maps to its one result code, also when wrapped, and a
// communicator poisoned by an earlier failure reports aborted, whatever the
// failure was.
func TestResultOfMapsEveryErrorValueToItsCode(t *testing.T) {
	wrap := func(err error) error { return fmt.Errorf("oktopk: rank 1 step 3: %w", err) }
	cases := []struct {
		err  error
		want int
	}{
		{nil, success},
		{errInProgress, inProgress},
		{panicked(), internalError},
		{wrap(core.ErrInternal), internalError},
		{wrap(core.ErrInvalidArgument), invalidArgumentCode},
		{wrap(core.ErrInvalidUsage), invalidUsageCode},
		{wrap(core.ErrNonFinite), nonFinite},
		{wrap(transport.ErrTimeout), timeout},
		{context.DeadlineExceeded, timeout},
		{wrap(transport.ErrMismatch), mismatch},
		{wrap(transport.ErrRemote), remoteError},
		{wrap(transport.ErrBadFrame), remoteError},
		{wrap(transport.ErrAborted), aborted},
		{wrap(transport.ErrClosed), aborted},
		{fmt.Errorf("%w: earlier failure: %w", transport.ErrAborted, transport.ErrTimeout), aborted},
		{wrap(transport.ErrAuth), systemError},
		{wrap(transport.ErrRendezvous), systemError},
		{errors.New("listen tcp 10.0.0.1:0: bind: cannot assign requested address"), systemError},
	}
	for _, c := range cases {
		if got := int(resultOf(c.err)); got != c.want {
			t.Errorf("resultOf(%v) = %d, want %d", c.err, got, c.want)
		}
	}
}

// A panic inside an export body becomes an error carrying the panic text.
func TestProtectTurnsAPanicIntoAnInternalError(t *testing.T) {
	err := binding.Protect(func() error {
		var m map[string]int
		m["x"] = 1
		return nil
	})
	var p binding.Panic
	if !errors.As(err, &p) || int(resultOf(err)) != internalError || !strings.Contains(err.Error(), "assignment to entry in nil map") {
		t.Fatalf("got %v", err)
	}
}

// Handles are never reused, so a destroyed handle is told apart from one
// that never existed, and a second remove fails.
func TestTableTellsDestroyedFromUnknownHandles(t *testing.T) {
	tab := newTable[int](1000)
	h := tab.add(7)
	if v, err := tab.get("thing", h); err != nil || v != 7 {
		t.Fatalf("get: %v %v", v, err)
	}
	if _, err := tab.remove("thing", h); err != nil {
		t.Fatal(err)
	}
	_, err := tab.remove("thing", h)
	if !errors.Is(err, core.ErrInvalidUsage) || !strings.Contains(err.Error(), "already destroyed") {
		t.Fatalf("second remove: %v", err)
	}
	_, err = tab.get("thing", 5) // below the base: another table's handle
	if !errors.Is(err, core.ErrInvalidUsage) || !strings.Contains(err.Error(), "not a thing handle") {
		t.Fatalf("other table's: %v", err)
	}
	_, err = tab.get("thing", h+100)
	if !errors.Is(err, core.ErrInvalidUsage) || !strings.Contains(err.Error(), "not a thing handle") {
		t.Fatalf("unknown: %v", err)
	}
	if h2 := tab.add(8); h2 == h {
		t.Fatal("handle reused")
	}
}

// panicked is the error binding.Protect makes of a panic.
func panicked() error { return binding.Protect(func() error { panic("boom") }) }
