package main

// Tests of the cross-rank timing summary: a call timed from the first
// rank's start to the last rank's end, exact gathers of every bit, and a
// call's timing round-tripping through words.

import (
	"context"
	"errors"
	"math"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// A call lasts from the first rank's start to the last rank's end, not as
// long as rank 0 saw it; its phases are those of the rank that finished
// last, and a phase's wire time is the most bytes any rank sent or received
// in it ÷ the rate.
func TestSummarizeTimesACallUntilEveryRankHasFinished(t *testing.T) {
	const ms = uint64(time.Millisecond)
	ranks := []callTiming{
		{start: 1000 * ms, end: 1010 * ms},      // rank 0: the root, back early
		{start: 1001 * ms, end: 1050 * ms},      // the last to finish
		{start: 1000*ms + ms/2, end: 1030 * ms}, // the last to start is rank 1
	}
	ranks[1].phase[core.PhaseReduce] = 20 * ms
	ranks[1].phase[core.PhaseAllgather] = 29 * ms
	ranks[0].phase[core.PhaseAllgather] = 2 * ms
	ranks[0].sent[core.PhaseAllgather] = 2_500_000 // 2.5 MB sent by one rank...
	ranks[2].recvd[core.PhaseAllgather] = 1_000_000
	ranks[2].sent[core.PhaseReduce] = 250_000 // ...and 250 kB
	s := summarize(ranks, 200e6)
	near := func(got, want float64) bool { return math.Abs(got-want) < 1e-9 }
	if !near(s.ms, 50) || !near(s.rank0Ms, 10) || !near(s.skewMs, 1) {
		t.Errorf("call %v ms, rank 0 %v ms, skew %v ms; want 50, 10, 1", s.ms, s.rank0Ms, s.skewMs)
	}
	if !near(s.phaseMs[core.PhaseReduce], 20) || !near(s.phaseMs[core.PhaseAllgather], 29) {
		t.Errorf("phases %v; want the last rank's: reduce 20, allgather 29", s.phaseMs)
	}
	// 2.5 MB at 200 Mbit/s is 100 ms, 250 kB is 10 ms.
	if !near(s.wireMs[core.PhaseAllgather], 100) || !near(s.wireMs[core.PhaseReduce], 10) || s.wireMs[core.PhaseSelect] != 0 {
		t.Errorf("wire times %v; want allgather 100, reduce 10, select 0", s.wireMs)
	}
	if w := summarize(ranks, 0).wireMs[core.PhaseReduce]; !math.IsNaN(w) {
		t.Errorf("wire time %v with no rate; want NaN", w)
	}
}

// gatherExact hands every rank every rank's values bit for bit, wall-clock
// nanoseconds included, which float32 slots alone (gather) would round to
// about 2^37 ns.
func TestGatherExactKeepsEveryBit(t *testing.T) {
	const p = 3
	ts := transport.NewInProc(p)
	defer func() {
		for _, tr := range ts {
			tr.Close()
		}
	}()
	want := func(r int) []uint64 {
		return []uint64{uint64(time.Date(2026, 11, 24, 2, 0, 0, 123_456_789, time.UTC).UnixNano()) + uint64(r), 0, math.MaxUint64 - uint64(r), 65535}
	}
	got := make([][][]uint64, p)
	errs := make([]error, p)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for r := range p {
		wg.Add(1)
		go func() {
			defer wg.Done()
			got[r], errs[r] = gatherExact(ctx, core.NewCommunicator(ts[r]), want(r))
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for r := range p {
		for q := range p {
			if !slices.Equal(got[r][q], want(q)) {
				t.Errorf("rank %d has %v from rank %d, want %v", r, got[r][q], q, want(q))
			}
		}
	}
}

// A call's timing survives its trip through words() and timingOf().
func TestCallTimingRoundTrips(t *testing.T) {
	var c callTiming
	c.start, c.end = 1, 2
	for p := range core.NumPhases {
		c.phase[p], c.sent[p], c.recvd[p] = uint64(10+p), uint64(20+p), uint64(30+p)
	}
	w := c.words()
	if len(w) != timingWords || timingOf(w) != c {
		t.Errorf("%d words, back %+v; want %d, %+v", len(w), timingOf(w), timingWords, c)
	}
}
