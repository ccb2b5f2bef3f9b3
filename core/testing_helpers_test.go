package core

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/transport"
)

// inProcTimeout bounds every in-process run, so a deadlock fails the test
// with the ranks' errors instead of hanging it (generous for -race on a
// loaded machine).
const inProcTimeout = 60 * time.Second

// runInProcErrors runs fn once per rank, each in its own goroutine with its
// own Communicator over one in-process transport group, and returns every
// rank's error. When a rank fails, every rank's transport is aborted so the
// others return promptly instead of waiting for the timeout.
func runInProcErrors(t testing.TB, p int, timeout time.Duration, fn func(ctx context.Context, rank int, c *Communicator) error) []error {
	t.Helper()
	ts := transport.NewInProc(p)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	errs := make([]error, p)
	var wg sync.WaitGroup
	var once sync.Once
	for r := 0; r < p; r++ {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			defer func() {
				if v := recover(); v != nil {
					errs[r] = fmt.Errorf("rank %d panicked: %v", r, v)
				}
				if errs[r] != nil {
					once.Do(func() {
						for _, tr := range ts {
							tr.Abort(fmt.Errorf("rank %d failed: %w", r, errs[r]))
						}
					})
				}
			}()
			errs[r] = fn(ctx, r, NewCommunicator(ts[r]))
		}(r)
	}
	wg.Wait()
	for _, tr := range ts {
		tr.Close()
	}
	return errs
}

// runInProc is runInProcErrors for runs that must succeed on every rank.
func runInProc(t testing.TB, p int, fn func(ctx context.Context, rank int, c *Communicator) error) {
	t.Helper()
	if err := errors.Join(runInProcErrors(t, p, inProcTimeout, fn)...); err != nil {
		t.Fatalf("P=%d: %v", p, err)
	}
}
