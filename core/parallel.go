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
// goroutines, so below 2·parallelCutoff it runs on the caller's goroutine.
//
// Measured with BenchmarkSelectionCutoff (threshold selection and exact
// top-k at k = 1%, 1 vs 2 chunks, n = 2^14 … 2^20) on the 2-core AMD EPYC
// (Zen 5) development VM, shared with a CI run at the time: 2 chunks were
// slower at n = 2^15 (goroutine start and join, about 2–5 µs, against
// ~4 µs of work), about even at n = 2^16 and faster from n = 2^17 (threshold
// selection 1.3×, top-k 1.5× at 2^18). Chunks of 2^16 elements put the
// switch at n = 2^17.
const parallelCutoff = 1 << 16

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
