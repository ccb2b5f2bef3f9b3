package core

// Parallel selection: when a vector is cut into chunks (parallelCutoff,
// selectionChunks) and how the chunks run on their own goroutines
// (forEachChunk).

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
// goroutines, so below 2·parallelCutoff = 2^20 it runs on the caller's.
//
// Measured on an idle 2-core machine with the block-scan selection
// (go test -run '^$' -bench 'SelectionCutoff' -benchtime 3000x ./core; k =
// 1%; mean µs per call, one chunk against two):
//
//	n       threshold    exact top-k
//	2^17     39 /  47    155 / 192
//	2^18     73 /  87    192 / 231
//	2^19    143 / 150    296 / 311
//	2^20    268 / 243    494 / 453
//
// The fastest single calls favour two chunks from 2^16 (13 against 16 µs),
// but the mean is what a training step pays, and it carries the cost of
// waking a second goroutine on an idle core (several µs, often tens). Two
// chunks win on the mean from 2^20.
const parallelCutoff = 1 << 19

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
