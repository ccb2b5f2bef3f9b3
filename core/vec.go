package core

// What a selection reads. Error feedback works on acc = grad + residual, and
// storing acc would cost a second n-element buffer beside the residual for
// every tensor. Nothing needs it stored: each pass over acc forms it a tile
// at a time (tileLen sums written to a 16 KiB buffer that stays in the L1
// cache) and reads the tile from there, as Ok-Topk's fused accumulate-and-
// select pass always did. A pass then reads grad and residual instead of
// acc, but the pass that wrote acc is gone, and the last pass forms acc a
// last time as the new residual while it clears the gradient (residual.go's
// foldOutput), which were two passes: a call makes fewer passes over
// memory than before. It moves as many bytes on Ok-Topk's reuse calls (the
// hot path: 6n words) and fewer on its sampled exact refreshes (6n instead
// of 7n); a selection that reads acc two or three times (the exact top-k's
// histogram fallback) reads both arrays as often.
//
// The sums are bitwise the same on every pass: float32 addition is exact to
// the IEEE rules, with no fused or reordered operation, so the residual
// keeps exactly the values the selection saw.

// vec is a vector x, or, with r set, the element-wise sum x + r.
type vec struct {
	x, r []float32
}

// plainVec is x itself; passes over it read x's memory directly.
func plainVec(x []float32) vec { return vec{x: x} }

// sumVec is grad + residual (residual holds at least len(grad) elements).
func sumVec(grad, residual []float32) vec { return vec{x: grad, r: residual[:len(grad)]} }

func (v vec) len() int { return len(v.x) }

// at is entry i.
func (v vec) at(i int) float32 {
	if v.r == nil {
		return v.x[i]
	}
	return v.x[i] + v.r[i]
}

// tileLen is how many sums one tile holds: 4096 floats, 16 KiB, the block
// scan's tile (topk_scan.go), so a tile's second look finds it in the L1 cache.
const tileLen = tileBlocks * scanBlock

type tile [tileLen]float32

// each calls fn on v[lo:hi] as consecutive spans, span[0] being entry base:
// for a plain vector one span, x's own memory; for a sum, tiles of at most
// tileLen sums formed in buf (nil is fine for a plain vector). A span is
// valid only during its call.
func (v vec) each(lo, hi int, buf *tile, fn func(span []float32, base int)) {
	if v.r == nil {
		fn(v.x[lo:hi], lo)
		return
	}
	for ; lo < hi; lo += tileLen {
		end := min(hi, lo+tileLen)
		fn(addTile(buf, v.x[lo:end], v.r[lo:end]), lo)
	}
}

// tiles is each with tiles of at most tileLen entries for a plain vector
// too (its own memory, no copy): for a pass that must look up between tiles.
func (v vec) tiles(lo, hi int, buf *tile, fn func(span []float32, base int)) {
	for ; lo < hi; lo += tileLen {
		end := min(hi, lo+tileLen)
		if v.r == nil {
			fn(v.x[lo:end], lo)
		} else {
			fn(addTile(buf, v.x[lo:end], v.r[lo:end]), lo)
		}
	}
}

// addTile writes g + r (len(g) ≤ tileLen) into buf and returns it.
func addTile(buf *tile, g, r []float32) []float32 {
	a := buf[:len(g)]
	r = r[:len(a)]
	i := 0
	for ; i+4 <= len(a); i += 4 {
		a4, g4, r4 := a[i:i+4:i+4], g[i:i+4:i+4], r[i:i+4:i+4]
		a4[0], a4[1], a4[2], a4[3] = g4[0]+r4[0], g4[1]+r4[1], g4[2]+r4[2], g4[3]+r4[3]
	}
	for ; i < len(a); i++ {
		a[i] = g[i] + r[i]
	}
	return a
}

// copyTo writes v into dst (len(dst) = v.len()).
func (v vec) copyTo(dst []float32) {
	if v.r == nil {
		copy(dst, v.x)
		return
	}
	g, r := v.x[:len(dst)], v.r[:len(dst)]
	for i := range dst {
		dst[i] = g[i] + r[i]
	}
}

// firstNaN returns the index of the first NaN in v, or -1.
func (v vec) firstNaN() int {
	if v.r == nil {
		return firstNaN(v.x)
	}
	g, r := v.x, v.r[:len(v.x)]
	for i := range g {
		if s := g[i] + r[i]; s != s {
			return i
		}
	}
	return -1
}

// countNonFinite is how many entries of v are NaN or ±Inf.
func (v vec) countNonFinite() int {
	if v.r == nil {
		return countNonFinite(v.x)
	}
	g, r := v.x, v.r[:len(v.x)]
	bad := 0
	for i := range g {
		if s := g[i] + r[i]; s-s != 0 { // NaN for NaN and ±Inf, 0 otherwise
			bad++
		}
	}
	return bad
}

// tilesFor returns one tile buffer per chunk for passes over v, from the
// scratch's own (grown as needed, kept for the next call); nil entries for
// a plain vector, which needs none.
func (sc *selectionScratch) tilesFor(v vec, chunks int) []*tile {
	for len(sc.tiles) < chunks {
		sc.tiles = append(sc.tiles, nil)
	}
	tiles := sc.tiles[:chunks]
	if v.r != nil {
		for c := range tiles {
			if tiles[c] == nil {
				tiles[c] = new(tile)
			}
		}
	}
	return tiles
}
