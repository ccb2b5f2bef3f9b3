package core

import (
	"runtime"
	"sync"
)

// Selection on large vectors runs on every core: the vector is cut into
// contiguous chunks, one goroutine per chunk. Each chunk first counts what it
// will contribute, a prefix sum over the chunks gives every chunk its offset
// in the output, and the chunks then fill their parts in parallel — so the
// output is in index order and bitwise identical to the one-goroutine path,
// whatever the number of chunks.

// parallelCutoff is the chunk size below which a chunk is not worth a
// goroutine: a vector of n elements runs on min(GOMAXPROCS, n/parallelCutoff)
// goroutines, so below 2·parallelCutoff = 2^18 it runs on the caller's.
//
// Measured with BenchmarkSelectionCutoff (k = 1%, one chunk against two,
// n = 2^13 … 2^20, fastest of 1200–5000 runs each) on the 2-core AMD EPYC
// (Zen 5) development VM while other jobs kept its load average at 10–25:
//
//   - The fixed cost of a second chunk (goroutine start and join, per-chunk
//     histogram clearing, the rank walk over two histograms) is about 1–2 µs
//     for threshold selection and 10–12 µs for exact top-k; one chunk takes
//     43 µs and 119–148 µs at n = 2^17, 86–88 µs and 186–201 µs at 2^18.
//   - What the second core saves could not be pinned down: it was seldom
//     free. Two chunks won in some runs (threshold selection 11.8 against
//     15.0 µs at n = 2^15, 274–291 against 367 µs at 2^20) and tied or lost
//     by the fixed cost in the rest.
//
// So the cutoff bounds the loss when no core is free: from n = 2^18 a second
// chunk costs at most ~2% (threshold) and ~6% (top-k) of the one-chunk time,
// and saves up to half of it when a core is idle. Re-measure on a quiet
// machine: the crossover there is likely lower.
const parallelCutoff = 1 << 17

// selectionChunks is how many chunks a selection over n elements uses.
func selectionChunks(n int) int {
	return max(1, min(runtime.GOMAXPROCS(0), n/parallelCutoff))
}

// forEachChunk runs fn(c, lo, hi) for the chunks c = 0…chunks−1 of [0, n)
// (the equal split of chunkStart), each on its own goroutine except the
// last, which runs on the caller's; it returns when all have returned. A
// panic in a chunk's goroutine is raised again on the caller's goroutine,
// where the caller's recover (goSafe, the C ABI's) turns it into an error
// instead of losing the process.
func forEachChunk(n, chunks int, fn func(c, lo, hi int)) {
	if chunks <= 1 {
		fn(0, 0, n)
		return
	}
	var wg sync.WaitGroup
	panics := make([]any, chunks-1)
	for c := 0; c < chunks-1; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { panics[c] = recover() }()
			fn(c, chunkStart(n, chunks, c), chunkStart(n, chunks, c+1))
		}()
	}
	fn(chunks-1, chunkStart(n, chunks, chunks-1), n)
	wg.Wait()
	for _, v := range panics {
		if v != nil {
			panic(v)
		}
	}
}
