package core

// The radix select's working parts: the 16-bit digit histograms of the keys
// (per chunk, summed only over the digits a walk passes), the walk that finds
// the digit holding a given rank, and the per-call scratch memory kept on a
// short free list between calls. topk.go puts them together.

import (
	"math"
	"sync"
	"unsafe"
)

// histogram counts 16-bit digits of keys.
type histogram [1 << 16]uint32

// chunkHistograms are the histograms of the chunks of one vector; their sum
// is the vector's histogram. It is never formed: the walk for a rank adds
// the chunks' counts only over the digits it passes, usually a small part
// of the 2^16.
type chunkHistograms []*histogram

// count is the vector's count of digit d.
func (hs chunkHistograms) count(d uint32) int {
	c := 0
	for _, h := range hs {
		c += int(h[d])
	}
	return c
}

// selectionScratch is the per-call working memory of a selection.
type selectionScratch struct {
	high, low    []*histogram // one per chunk
	candidateLow *histogram   // the low digits of the candidates in bucket b
	candidateSet []*histogram // chunkHistograms{candidateLow}
	parts        []Sparse     // per-chunk selections of SelectAbove
	counts       []int
	ties         []int
	sample       []float32 // SampledThreshold's and topKBySample's sample
	positions    Sparse    // topKBySample's top k among the copied values
	moments      []float64 // meanStd's per-block sums
	tiles        []*tile   // per chunk, for passes over a sum (vec.go)
}

// scratches holds the selectionScratch not in use. A free list rather than
// a sync.Pool: a pool is emptied by every garbage collection and keeps one
// object per P, so steady-state calls would still grow new histograms and
// buffers now and then; this list keeps up to maxFreeScratches (usually one
// per tensor being reduced concurrently), and leaves any beyond that, from
// a burst of concurrent selections, to the garbage collector, so a burst
// does not hold its memory for the life of the process.
const maxFreeScratches = 8

var scratches struct {
	sync.Mutex
	free []*selectionScratch
}

func getScratch() *selectionScratch {
	scratches.Lock()
	defer scratches.Unlock()
	if n := len(scratches.free); n > 0 {
		sc := scratches.free[n-1]
		scratches.free = scratches.free[:n-1]
		return sc
	}
	h := new(histogram)
	return &selectionScratch{candidateLow: h, candidateSet: []*histogram{h}}
}

func putScratch(sc *selectionScratch) {
	scratches.Lock()
	if len(scratches.free) < maxFreeScratches {
		scratches.free = append(scratches.free, sc)
	}
	scratches.Unlock()
}

// histograms returns chunks histograms from *hs, growing it.
func histograms(hs *[]*histogram, chunks int) []*histogram {
	for len(*hs) < chunks {
		*hs = append(*hs, new(histogram))
	}
	return (*hs)[:chunks]
}

func (sc *selectionScratch) countsFor(chunks int) []int { return ints(&sc.counts, chunks) }
func (sc *selectionScratch) tiesFor(chunks int) []int   { return ints(&sc.ties, chunks) }

func ints(s *[]int, n int) []int {
	if cap(*s) < n {
		*s = make([]int, n)
	}
	*s = (*s)[:n]
	return *s
}

func key(v float32) uint32 { return math.Float32bits(v) &^ signBit }

// floatBits views x's memory as the bit patterns of its floats: the hot
// loops read keys with one integer load instead of a float load and a move.
func floatBits(x []float32) []uint32 {
	return unsafe.Slice((*uint32)(unsafe.Pointer(unsafe.SliceData(x))), len(x))
}

// highHistograms counts the top 16 bits of the keys of each chunk.
func (sc *selectionScratch) highHistograms(v vec, chunks int) chunkHistograms {
	perChunk := histograms(&sc.high, chunks)
	tiles := sc.tilesFor(v, chunks)
	forEachChunk(v.len(), chunks, func(c, lo, hi int) {
		h := perChunk[c]
		clear(h[:])
		v.each(lo, hi, tiles[c], func(x []float32, _ int) { countHigh(h, x) })
	})
	return perChunk
}

func countHigh(h *histogram, x []float32) {
	bits := floatBits(x)
	i := 0
	for ; i+4 <= len(bits); i += 4 {
		b := bits[i : i+4 : i+4]
		h[(b[0]&^signBit)>>16]++
		h[(b[1]&^signBit)>>16]++
		h[(b[2]&^signBit)>>16]++
		h[(b[3]&^signBit)>>16]++
	}
	for _, u := range bits[i:] {
		h[(u&^signBit)>>16]++
	}
}

// lowHistograms counts, per chunk, the low 16 bits of the keys in bucket b.
func (sc *selectionScratch) lowHistograms(v vec, chunks int, b uint32) chunkHistograms {
	perChunk := histograms(&sc.low, chunks)
	tiles := sc.tilesFor(v, chunks)
	forEachChunk(v.len(), chunks, func(c, lo, hi int) {
		h := perChunk[c]
		clear(h[:])
		v.each(lo, hi, tiles[c], func(x []float32, _ int) {
			for _, u := range floatBits(x) {
				if u&^signBit>>16 == b {
					h[u&0xffff]++
				}
			}
		})
	})
	return perChunk
}

// digitOfRank walks the digits down from top and returns the digit that
// holds the r-th largest entry, counting the above entries already known to
// be larger, and the count of entries larger than that digit. Eight digits
// are summed at a time while the rank is out of reach: most of a histogram
// of a small or clustered input is empty.
func (hs chunkHistograms) digitOfRank(top uint32, r, above int) (digit uint32, larger int) {
	d := int(top)
	for ; d >= 8; d -= 8 {
		s := 0
		for _, h := range hs {
			g := h[d-7 : d+1 : d+1]
			s += int(g[0]) + int(g[1]) + int(g[2]) + int(g[3]) + int(g[4]) + int(g[5]) + int(g[6]) + int(g[7])
		}
		if above+s >= r {
			break
		}
		above += s
	}
	for ; d > 0; d-- {
		c := hs.count(uint32(d))
		if above+c >= r {
			break
		}
		above += c
	}
	return uint32(d), above
}

// nonFiniteInBuckets is how many keys lie at or above +Inf's bucket (NaN
// and ±Inf, and nothing else).
func (hs chunkHistograms) nonFiniteInBuckets() int {
	c := 0
	for d := uint32(infKey >> 16); d < 1<<16; d++ {
		c += hs.count(d)
	}
	return c
}

// firstNaN returns the index of the first NaN in x, or -1.
func firstNaN(x []float32) int {
	for i, v := range x {
		if v != v {
			return i
		}
	}
	return -1
}
