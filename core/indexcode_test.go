package core

// Tests of the coded indices: every shape of index list comes back exactly
// from the fewest bytes its gaps allow, each malformed frame is refused with
// its own error, and what a frame costs at density 1%; a benchmark of
// encoding and decoding per entry.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	mathbits "math/bits"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/oktopk/oktopk/transport"
)

// codedIndexBytes is what putIndices must write for idx: 4 bytes for the
// count and 4 for the first index, then per block of gapBlock gaps a width byte and the gaps at
// the width of the block's largest.
func codedIndexBytes(idx []uint32) int {
	if len(idx) == 0 {
		return 0
	}
	total := 8
	for start := 1; start < len(idx); start += gapBlock {
		end := min(start+gapBlock, len(idx))
		widest := 0
		for i := start; i < end; i++ {
			widest = max(widest, mathbits.Len32(idx[i]-idx[i-1]-1))
		}
		total += 1 + ((end-start)*widest+7)/8
	}
	return total
}

// uniformIndices draws about density × n distinct indices of [0, n),
// ascending.
func uniformIndices(rng *rand.Rand, n int, density float64) []uint32 {
	var idx []uint32
	for i := 0; i < n; i++ {
		if rng.Float64() < density {
			idx = append(idx, uint32(i))
		}
	}
	return idx
}

func TestCodedIndicesRoundTripExactlyInTheFewestBytes(t *testing.T) {
	rng := rand.New(rand.NewPCG(62, 1))
	run := func(n int) []uint32 { // n consecutive indices from 7
		idx := make([]uint32, n)
		for i := range idx {
			idx[i] = uint32(7 + i)
		}
		return idx
	}
	cases := map[string]struct {
		idx         []uint32
		base, limit uint32
	}{
		"none":                            {nil, 0, 10},
		"one at the base":                 {[]uint32{5}, 5, 6},
		"one at the last index":           {[]uint32{math.MaxUint32 - 1}, 0, math.MaxUint32},
		"the widest gap":                  {[]uint32{0, math.MaxUint32 - 1}, 0, math.MaxUint32},
		"consecutive: gaps of no bits":    {run(300), 7, 307},
		"a block and one gap":             {run(gapBlock + 2), 0, 1000},
		"two full blocks":                 {run(2*gapBlock + 1), 0, 1000},
		"1% of 2^20, region-relative":     {uniformIndices(rng, 1<<20, 0.01), 0, 1 << 20},
		"0.1% of 2^20":                    {uniformIndices(rng, 1<<20, 0.001), 0, 1 << 20},
		"half of 5000":                    {uniformIndices(rng, 5000, 0.5), 0, 5000},
		"a cluster, then a far one":       {append(run(200), 3_000_000), 0, 3_000_001},
		"from a base far into the tensor": {[]uint32{1 << 30, 1<<30 + 1, 1<<30 + 1000}, 1 << 30, 1<<30 + 1001},
	}
	for name, c := range cases {
		vals := make([]float32, len(c.idx))
		for i := range vals {
			vals[i] = float32(rng.NormFloat64())
		}
		in := Sparse{Idx: c.idx, Val: vals}
		b := EncodeSparse(nil, in, c.base)
		if want := 4*len(c.idx) + codedIndexBytes(c.idx); len(b) != want {
			t.Errorf("%s: %d bytes, want %d (4 a value and the coded gaps)", name, len(b), want)
		}
		out, err := DecodeSparse(Sparse{}, b, uint64(in.Len()), c.base, c.limit)
		if err != nil || !sparseBitwiseEqual(out, in) {
			t.Errorf("%s: came back as %d entries (%v)", name, out.Len(), err)
		}
		// Every frame the encoder makes passes the frame header's size
		// check, whatever its values.
		for _, v := range []ValueType{ValuesFloat32, ValuesFloat16, ValuesBFloat16} {
			frame := encodeSparseAs(nil, in, c.base, v)
			if err := transport.CheckPayloadSize(v.sparseDtype(), uint64(in.Len()), uint64(len(frame))); err != nil {
				t.Errorf("%s: a frame of %v values would be dropped: %v", name, v, err)
			}
		}
	}
}

// A frame to break: 300 entries with float32 values in region [1000,
// 60000), their gaps 65 and 95 (less one), so every block is 7 bits wide.
func codedFrameToBreak() (frame []byte, idx []uint32, base, limit uint32) {
	const n = 300
	s := Sparse{Idx: make([]uint32, n), Val: make([]float32, n)}
	for i := range n {
		s.Idx[i], s.Val[i] = uint32(1000+90*i+(i*37)%30), float32(i)
	}
	return EncodeSparse(nil, s, 1000), s.Idx, 1000, 60000
}

func TestCodedIndicesRefuseEachMalformedFrameByName(t *testing.T) {
	frame, idx, base, limit := codedFrameToBreak()
	count := len(idx)
	section := frame[:len(frame)-4*count] // the coded indices
	const firstWidth = 8                  // the first block's width byte, after the count and the first index
	lastGaps := (count-2)%gapBlock + 1
	if width := frame[firstWidth]; width != 7 || len(section) != codedIndexBytes(idx) || lastGaps*7%8 == 0 {
		t.Fatalf("the frame to break is not the one described: width %d, %d bytes of indices, no padding after the last gap", width, len(section))
	}
	edit := func(f func(b []byte)) []byte {
		b := append([]byte(nil), frame...)
		f(b)
		return b
	}
	frameOf := func(payload []byte, count uint64, limit uint32) func() error {
		return func() error {
			dst := Sparse{Idx: make([]uint32, 0, 4), Val: make([]float32, 0, 4)}
			got, err := DecodeSparse(dst, payload, count, base, limit)
			if err != nil && (got.Len() != 0 || len(got.Val) != 0) {
				return fmt.Errorf("refused (%w), but handed back %d entries", err, got.Len())
			}
			return err
		}
	}
	indicesOf := func(b []byte) func() error {
		return func() error {
			_, _, err := readIndices(nil, b, count, base, limit)
			return err
		}
	}
	cases := []struct {
		name   string
		decode func() error
		want   error
	}{
		{"no count", indicesOf(section[:3]), ErrSparseTruncated},
		{"no first index", indicesOf(section[:7]), ErrSparseTruncated},
		{"no width byte", indicesOf(section[:firstWidth]), ErrSparseTruncated},
		{"a block cut short", indicesOf(section[:firstWidth+10]), ErrSparseTruncated},
		{"the last block cut short", indicesOf(section[:len(section)-1]), ErrSparseTruncated},
		{"values cut short", frameOf(frame[:len(frame)-1], uint64(count), limit), ErrSparseTruncated},
		{"a frame too short for the count's values", frameOf(section, uint64(count), limit), ErrSparseTruncated},
		{"a count larger than the frame's", frameOf(frame, uint64(count+1), limit), ErrSparseCountMismatch},
		{"a count smaller than the frame's", frameOf(frame, uint64(count-1), limit), ErrSparseCountMismatch},
		{"a byte past the values", frameOf(append(append([]byte(nil), frame...), 0), uint64(count), limit), ErrSparseCountMismatch},
		{"bytes for no entries", frameOf(frame, 0, limit), ErrSparseCountMismatch},
		{"a first index past the region", frameOf(edit(func(b []byte) {
			binary.LittleEndian.PutUint32(b[4:], limit-base)
		}), uint64(count), limit), ErrSparseIndexPastEnd},
		{"a gap past the region", frameOf(frame, uint64(count), base+20000), ErrSparseIndexPastEnd},
		{"gaps past 2^32", frameOf(edit(func(b []byte) {
			binary.LittleEndian.PutUint32(b[4:], math.MaxUint32-2000)
		}), uint64(count), math.MaxUint32), ErrSparseIndexPastEnd},
		{"a width of 33 bits", frameOf(edit(func(b []byte) { b[firstWidth] = 33 }), uint64(count), limit), ErrSparseGapWidth},
		{"a width of 255 bits", frameOf(edit(func(b []byte) { b[firstWidth] = 255 }), uint64(count), limit), ErrSparseGapWidth},
		{"a block one bit wider than its gaps", frameOf(widenFirstBlock(frame, firstWidth), uint64(count), limit), ErrSparseNotCanonical},
		{"padding bits set", frameOf(edit(func(b []byte) { b[len(section)-1] |= 0x80 }), uint64(count), limit), ErrSparseNotCanonical},
	}
	for _, c := range cases {
		if err := c.decode(); !errors.Is(err, c.want) || !errors.Is(err, transport.ErrBadFrame) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	if err := frameOf(frame, uint64(count), limit)(); err != nil {
		t.Fatalf("the unbroken frame: %v", err)
	}
}

// widenFirstBlock re-packs the gaps of frame's first block (its width byte
// at offset at) one bit wider: every gap still decodes to the same index,
// but the frame is no longer the encoder's.
func widenFirstBlock(frame []byte, at int) []byte {
	width := uint(frame[at])
	gaps := make([]uint64, gapBlock)
	var acc uint64
	held, pos := uint(0), at+1
	for i := range gaps {
		for ; held < width; held += 8 {
			acc |= uint64(frame[pos]) << held
			pos++
		}
		gaps[i], acc, held = acc&(1<<width-1), acc>>width, held-width
	}
	wide := []byte{byte(width + 1)}
	acc, held = 0, 0
	for _, g := range gaps {
		acc |= g << held
		for held += width + 1; held >= 8; held -= 8 {
			wide, acc = append(wide, byte(acc)), acc>>8
		}
	}
	if held > 0 {
		wide = append(wide, byte(acc))
	}
	return slices.Concat(frame[:at], wide, frame[pos:])
}

// At density 1% the gaps average 99: uniformly spread indices take about
// 9.3 bits each (a block's largest gap is about 4.1 times the mean) instead
// of 32, so a pair with a float32 value is at most 5.25 bytes instead of 8.
func TestCodedIndicesSizeAtOnePercent(t *testing.T) {
	rng := rand.New(rand.NewPCG(62, 3))
	const n = 1 << 22 / 4 // a region of Ok-Topk's at n = 2^22, P = 4
	idx := uniformIndices(rng, n, 0.01)
	bits := 8 * float64(codedIndexBytes(idx)) / float64(len(idx))
	t.Logf("%d indices at density 1%%: %.2f bits an index, %.3f bytes a float32 pair (8 before), %.3f a 16-bit one (6)",
		len(idx), bits, 4+bits/8, 2+bits/8)
	if bits > 10 {
		t.Errorf("%.2f bits an index at density 1%%, want at most 10", bits)
	}
}

// BenchmarkSparseCodec: encoding and decoding a region's entries at the
// densities of the benchmarks (n = 2^22, P = 4: a region of 2^20), in ns
// an entry and bytes an entry, with float32 values and with 8-bit and
// 4-bit ones (their encoding includes the rounding, quantize, as a call
// makes it).
func BenchmarkSparseCodec(b *testing.B) {
	for _, v := range []ValueType{ValuesFloat32, ValuesInt8, ValuesInt4} {
		for _, density := range []float64{0.01, 0.001} {
			rng := rand.New(rand.NewPCG(62, 4))
			const n = 1 << 20
			idx := uniformIndices(rng, n, density)
			s := Sparse{Idx: idx, Val: make([]float32, len(idx))}
			for i := range s.Val {
				s.Val[i] = float32(rng.NormFloat64())
			}
			exact := append([]float32(nil), s.Val...)
			v.quantize(s, nil)
			frame := encodeSparseAs(nil, s, 0, v)
			entryBytes := float64(len(frame)) / float64(len(idx))
			b.Run(fmt.Sprintf("encode/%v/density=%g", v, density), func(b *testing.B) {
				buf := make([]byte, 0, sparseSlotsBytes(v, len(idx), 1))
				b.SetBytes(int64(len(frame)))
				for b.Loop() {
					if v.scaled() {
						copy(s.Val, exact)
						v.quantize(s, nil)
					}
					buf = encodeSparseAs(buf, s, 0, v)
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(idx)), "ns/entry")
				b.ReportMetric(entryBytes, "B/entry")
			})
			b.Run(fmt.Sprintf("decode/%v/density=%g", v, density), func(b *testing.B) {
				dst := Sparse{}
				b.SetBytes(int64(len(frame)))
				for b.Loop() {
					var err error
					if dst, err = decodeSparseAs(dst, frame, uint64(len(idx)), 0, n, v); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(idx)), "ns/entry")
				b.ReportMetric(entryBytes, "B/entry")
			})
		}
	}
}

// The cost model's bits per coded index (codedIndexBits) are what frames of
// indices spread at random take, within 2% (the model leaves out the
// frame's own 8 bytes and each block's padding to a byte, which a frame of
// 2^20 positions makes small), from density 0.1% to 99%.
func TestCodedIndexBitsAreWhatFramesTake(t *testing.T) {
	rng := rand.New(rand.NewPCG(62, 9))
	for _, d := range []float64{0.001, 0.01, 0.1, 0.5, 0.9, 0.99} {
		idx := uniformIndices(rng, 1<<20, d)
		measured := float64(8*(codedIndexBytes(idx)-8)) / float64(len(idx)-1)
		if model := codedIndexBits(d); math.Abs(model-measured) > 0.02*measured+0.1 {
			t.Errorf("density %g: the model prices %.3f bits an index, frames take %.3f", d, model, measured)
		}
	}
}

// SparCML's switch prices pairs as the model does: at 32-bit pairs it was
// dense from half a region set; coded, pairs stay smaller than the region's
// values up to about 97%. TopkDSA's keeps the reference's margin (pairs
// above two thirds of the dense bytes), about 60% coded.
func TestDenseSwitchesPriceCodedPairs(t *testing.T) {
	const length = 100000
	for _, c := range []struct {
		nnz         int
		sparcml, ds bool
	}{{1000, false, false}, {50000, false, false}, {58000, false, false}, {63000, false, true}, {90000, false, true}, {99000, true, true}, {length, true, true}} {
		if got := denseIsNoLarger(c.nnz, length); got != c.sparcml {
			t.Errorf("SparCML, %d of %d set: dense %v", c.nnz, length, got)
		}
		if got := reducedRegionGoesDense(c.nnz, length); got != c.ds {
			t.Errorf("TopkDSA, %d of %d set: dense %v", c.nnz, length, got)
		}
	}
	if !denseIsNoLarger(0, 0) || reducedRegionGoesDense(0, 0) {
		t.Error("an empty region: SparCML's switch sends it dense, TopkDSA's as pairs, as before")
	}
}
