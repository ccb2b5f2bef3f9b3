package transport

// Tests of the endpoint exchange: every rank's endpoint in rank order, and
// the two start-up mistakes it names at once instead of timing out.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"
)

func TestExchangeEndpointsGivesEveryRanksEndpointInOrder(t *testing.T) {
	store := NewMemStore()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	got := make([][]string, 3)
	errs := make([]error, 3)
	for r := 2; r >= 0; r-- {
		wg.Add(1)
		go func(r int) {
			defer wg.Done()
			got[r], errs[r] = ExchangeEndpoints(ctx, store, 0, r, 3, fmt.Sprintf("tcp://h%d:1", r))
		}(r)
	}
	wg.Wait()
	for r := range got {
		if errs[r] != nil || strings.Join(got[r], " ") != "tcp://h0:1 tcp://h1:1 tcp://h2:1" {
			t.Fatalf("rank %d: %v %v", r, got[r], errs[r])
		}
	}
}

// A second process with a rank already taken is refused at once, saying
// so; the first keeps its rank.
func TestExchangeEndpointsRefusesARankAlreadyTaken(t *testing.T) {
	store := NewMemStore()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	first := make(chan error, 1)
	go func() {
		_, err := ExchangeEndpoints(ctx, store, 0, 1, 2, "tcp://a:1")
		first <- err
	}()
	if err := store.Wait(ctx, "oktopk/g0/ep/1"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := ExchangeEndpoints(ctx, store, 0, 1, 2, "tcp://b:1")
	if !errors.Is(err, ErrRendezvous) || !strings.Contains(err.Error(), "rank 1 of 2 is already taken") || time.Since(start) > time.Second {
		t.Fatalf("second rank 1 after %v: %v", time.Since(start), err)
	}
	if _, err := ExchangeEndpoints(ctx, store, 0, 0, 2, "tcp://c:1"); err != nil {
		t.Fatal(err)
	}
	if err := <-first; err != nil {
		t.Fatalf("the first rank 1: %v", err)
	}
}

// A rank started with another rank count than rank 0's fails at once
// naming both counts, whether its count is larger (it would wait for a
// rank that does not exist) or smaller.
func TestExchangeEndpointsRefusesAnotherRankCount(t *testing.T) {
	for _, size := range []int{2, 4} {
		store := NewMemStore()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		go ExchangeEndpoints(ctx, store, 0, 0, 3, "tcp://a:1") // rank 0 waits for ranks that never come, until cancel
		start := time.Now()
		_, err := ExchangeEndpoints(ctx, store, 0, 1, size, "tcp://b:1")
		want := fmt.Sprintf("rank 0 joined a job of 3 ranks, this rank (1) was started with %d", size)
		if !errors.Is(err, ErrMismatch) || !strings.Contains(err.Error(), want) || time.Since(start) > time.Second {
			t.Errorf("size %d after %v: %v", size, time.Since(start), err)
		}
		cancel()
	}
}
