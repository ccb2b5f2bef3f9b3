package core

// Reduced-precision values on the wire, and entries a rank holds back.
//
// Sparse values may travel as float16 or bfloat16 instead of float32
// (Config.Values): a value is then 2 bytes instead of 4, beside its index
// coded as a gap (about 1.2 bytes at density 1%, indexcode.go). What
// follows is about these 16-bit formats, rounded value by value; 8-bit
// and 4-bit values (int8values.go, int4values.go) share a scale per block
// of a frame, so they are rounded where each frame is made, by the same
// rules of ownership.
// Nothing is lost to the rounding, because it happens where error feedback
// can take the difference back:
//
//   - A rank rounds its own selected values once, before they leave it, and
//     its residual keeps acc − rounded for every entry the global result
//     holds (UpdateResidual subtracts the value sent instead of zeroing).
//     Algorithms whose messages carry only these contributions (TopkA,
//     Gaussiank) need nothing more: every rank sums the same rounded values
//     in float32.
//   - Ok-Topk's owners sum the rounded contributions in float32 and send the
//     sums on (balance and allgather), so a sum is rounded a second time,
//     once, by its owner, and every rank — the owner too — uses the rounded
//     sum: the results stay bitwise identical on every rank. That rounding
//     error belongs to no single contributor, so the owner's residual takes
//     it (exact sum − rounded sum, computed exactly in float32). Keeping the
//     sums in float32 on the wire instead would leave half the values of a
//     call at 4 bytes.
//   - Rounding saturates at the largest finite value of the format instead
//     of overflowing to Inf: what does not fit waits in the residual.
//
// So over any number of calls the sum over ranks of the gradients equals
// P × the outputs plus the change of the residuals, up to float32 rounding
// of the additions themselves (TestReducedPrecisionMassIsExact).
//
// Stochastic rounding (Config.Stochastic) rounds up or down with
// probabilities that make the rounding unbiased. Its random bits are a hash
// of (tensor id, call number on the tensor, rank, index, which rounding), so
// a rerun is bitwise reproducible and no state is kept.
//
// SparCML's, TopkDSA's and gTopk's messages carry partial sums that are
// summed again on the way (several roundings no one residual owns), and the
// dense algorithms keep no residual: they refuse reduced-precision values.
// The sparse-input call keeps no residual either and refuses them too. At
// density 1 Ok-Topk is a dense ring allreduce and sends float32.
//
// Held entries (SparseAllreduceHolding): a rank may leave ranges of its
// gradient out of a call — for a parameter the framework found unused at
// this step, whose result it will discard. They are kept out of the
// selection and stay in the residual; other ranks' entries there are
// reduced as usual, so a result the caller does use is complete too.

import (
	"fmt"
	"math"
	"sort"
	"strings"

	"github.com/oktopk/oktopk/transport"
)

// ValueType is the precision sparse values travel in. The values are the C
// ABI's (oktopk_dtype_t's, then OKTOPK_INT8 and OKTOPK_INT4) and must not
// change.
type ValueType int

const (
	ValuesFloat32 ValueType = iota
	ValuesFloat16
	ValuesBFloat16
	ValuesInt8 // 8 bits with a scale per block of values (int8values.go)
	ValuesInt4 // 4 bits with a scale per block of values (int4values.go)
	numValueTypes
)

var valueTypeNames = [...]string{"float32", "float16", "bfloat16", "int8", "int4"}

func (v ValueType) String() string {
	if v.Valid() {
		return valueTypeNames[v]
	}
	return fmt.Sprintf("value type(%d)", int(v))
}

func (v ValueType) Valid() bool { return v >= 0 && v < numValueTypes }

// ParseValueType accepts the names of String, case-insensitively.
func ParseValueType(name string) (ValueType, error) {
	for i, n := range valueTypeNames {
		if strings.EqualFold(name, n) {
			return ValueType(i), nil
		}
	}
	return 0, fmt.Errorf("%w: unknown value type %q (one of %s)", ErrInvalidArgument, name, strings.Join(valueTypeNames[:], ", "))
}

// sparseDtype is the frame dtype of (index, value) pairs of this type.
func (v ValueType) sparseDtype() transport.Dtype {
	switch v {
	case ValuesFloat16:
		return transport.DtypeSparseF16
	case ValuesBFloat16:
		return transport.DtypeSparseBF16
	case ValuesInt8:
		return transport.DtypeSparseI8
	case ValuesInt4:
		return transport.DtypeSparseI4
	}
	return transport.DtypeSparseF32
}

// width is the whole bytes one value takes on the wire at most (scales
// aside: valueBytes; a 4-bit value takes half of its byte).
func (v ValueType) width() int {
	switch v {
	case ValuesFloat32:
		return 4
	case ValuesInt8, ValuesInt4:
		return 1
	}
	return 2
}

// valueBytes is the bytes of count values of this type on the wire.
func (v ValueType) valueBytes(count int) int {
	switch v {
	case ValuesInt8:
		return int8ValueBytes(count)
	case ValuesInt4:
		return int4ValueBytes(count)
	}
	return v.width() * count
}

// bytesPerValue is the bytes a value takes on the wire in a long frame,
// its share of its block's scale included: what the cost model prices
// (predict.go's pairBytes).
func (v ValueType) bytesPerValue() float64 {
	switch v {
	case ValuesInt8:
		return 1 + 4.0/int8Block
	case ValuesInt4:
		return 0.5 + 4.0/int8Block
	}
	return float64(v.width())
}

// scaled says whether values of this type share a scale per block of a
// frame (8-bit and 4-bit values), and so are rounded as each frame is made
// (int8values.go), not value by value.
func (v ValueType) scaled() bool { return v == ValuesInt8 || v == ValuesInt4 }

// quantize rounds s's values in place in the blocks of a frame of values
// of this type (8-bit or 4-bit; other types are left as they are) and,
// unless errs is nil, appends what the rounding took off to errs.
func (v ValueType) quantize(s Sparse, errs *Sparse) {
	switch v {
	case ValuesInt8:
		quantizeInt8(s, errs)
	case ValuesInt4:
		quantizeInt4(s, errs)
	}
}

// half says whether values of this type are a 16-bit format, rounded value
// by value (Nearest, Stochastic); 8-bit and 4-bit values are rounded by
// the block, as their frame is made (int8values.go).
func (v ValueType) half() bool { return v == ValuesFloat16 || v == ValuesBFloat16 }

// takesReducedValues says whether a can send 16-bit values: the algorithms
// whose every rounding has an owner (see the top of this file). Auto can, as
// it then chooses among those that can (and the dense ones, which send
// float32 and keep no residual).
func (a Algorithm) takesReducedValues() bool { return a.row().halfValues }

// TakesReducedValues is takesReducedValues for the C ABI
// (oktopk_algorithm_takes_reduced_values) and the plugins, which ask the
// library rather than keep a list of their own.
func (a Algorithm) TakesReducedValues() bool { return a.takesReducedValues() }

func (a Algorithm) whyNoReducedValues() string {
	if a.Dense() {
		return fmt.Sprintf("%v keeps no residual to take the rounding error back", a)
	}
	return fmt.Sprintf("%v sends partial sums that are summed again on the way, whose rounding errors belong to no one rank's residual", a)
}

// half is one 16-bit format: its conversions and its +Inf bits.
type half struct {
	narrow func(float32) uint16 // round to nearest, ties to even
	widen  func(uint16) float32 // exact
	inf    uint16
}

var halves = [numValueTypes]half{
	ValuesFloat16:  {float32ToFloat16, float16ToFloat32, 0x7c00},
	ValuesBFloat16: {float32ToBFloat16, bfloat16ToFloat32, 0x7f80},
}

func bfloat16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Nearest rounds a finite x to the nearest value of v (ties to even),
// saturating at ±the largest finite value; the result is a float32 that
// converts to v exactly. Float32, 8-bit and 4-bit values (rounded by the
// block, int8values.go) come back as they are.
func (v ValueType) Nearest(x float32) float32 {
	if !v.half() {
		return x
	}
	f := halves[v]
	h := f.narrow(x)
	if h&0x7fff == f.inf {
		h-- // overflow: the largest finite value of that sign
	}
	return f.widen(h)
}

// Stochastic rounds a finite x to one of the two values of v around it,
// the one farther from zero with probability (|x| − |lo|)/(|hi| − |lo|) for
// a uniform u, so that the rounding is unbiased; it saturates like Nearest,
// and leaves float32, 8-bit and 4-bit values as they are.
func (v ValueType) Stochastic(x float32, u uint32) float32 {
	if !v.half() {
		return x
	}
	f := halves[v]
	h := f.narrow(x)
	lo := f.widen(h)
	if abs32(lo) > abs32(x) { // rounded away from zero (or overflowed): step back
		h--
		lo = f.widen(h)
	}
	if lo == x || (h+1)&0x7fff == f.inf {
		return lo
	}
	hi := f.widen(h + 1) // one step farther from zero, same sign
	// x − lo is exact (Sterbenz, or lo = 0) and hi − lo a power of two.
	if float64(u) < float64(x-lo)/float64(hi-lo)*(1<<32) {
		return hi
	}
	return lo
}

// valueRounding rounds the values one rank sends in one call.
type valueRounding struct {
	values     ValueType
	stochastic bool
	seed       uint64
}

// Which rounding of a call: a rank's own contribution, or an owner's sum.
const (
	roundContribution = 1
	roundOwnerSum     = 2
)

// roundingOf is the rounding of call (its tensor's config, its rank, the
// tensor's call count) for the given use.
func roundingOf(call *Call, cfg Config, iter int, use uint64) valueRounding {
	seed := splitmix64(splitmix64(splitmix64(call.Desc.Tensor)^uint64(iter)) ^ uint64(call.Rank())<<8 ^ use)
	return valueRounding{values: cfg.Values, stochastic: cfg.Stochastic, seed: seed}
}

// round rounds the value x of entry ix.
func (r valueRounding) round(ix uint32, x float32) float32 {
	if r.stochastic {
		return r.values.Stochastic(x, uint32(splitmix64(r.seed+uint64(ix)*0x9e3779b97f4a7c15)>>32))
	}
	return r.values.Nearest(x)
}

// apply rounds s's values in place (16-bit values only: 8-bit and 4-bit
// ones are rounded as their frames are made, int8values.go).
func (r valueRounding) apply(s Sparse) {
	if !r.values.half() {
		return
	}
	for j, x := range s.Val {
		s.Val[j] = r.round(s.Idx[j], x)
	}
}

// splitmix64 is SplitMix64's output function: a bijective 64-bit mix.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// Span is a range [Start, End) of a tensor's entries.
type Span struct{ Start, End int }

// checkHold reports held spans that are empty, out of order, overlapping
// or not inside n entries, as ErrInvalidArgument.
func checkHold(hold []Span, n int) error {
	prev := 0
	for i, h := range hold {
		if h.Start < prev || h.End <= h.Start || h.End > n {
			return fmt.Errorf("%w: held range %d [%d, %d) is empty, overlaps the one before, or is not inside the %d entries", ErrInvalidArgument, i, h.Start, h.End, n)
		}
		prev = h.End
	}
	return nil
}

// selectHolding runs sel with the held entries of acc read as zero, puts
// them back, and drops any held entry from the selection (an exact top-k
// takes zeros when fewer than k entries are nonzero): a held entry is never
// sent, so the residual keeps all of acc there. acc is not stored (vec.go),
// so its terms are cleared there: grad's entries, then the residual's, go
// to stash (scratch storage, returned for reuse) and come back bit for bit.
// NaN or ±Inf in a held entry is ErrNonFinite, as anywhere else in acc:
// every rank skips the step rather than keep it in the residual.
func selectHolding(acc vec, hold []Span, stash []float32, sel func() (Sparse, error)) (Sparse, []float32, error) {
	if len(hold) == 0 {
		s, err := sel()
		return s, stash, err
	}
	stash = stash[:0]
	bad := 0
	for _, h := range hold {
		held := vec{x: acc.x[h.Start:h.End]}
		if acc.r != nil {
			held.r = acc.r[h.Start:h.End]
		}
		bad += held.countNonFinite()
		stash = append(stash, held.x...)
		clear(held.x)
		if held.r != nil {
			stash = append(stash, held.r...)
			clear(held.r)
		}
	}
	s, err := sel()
	at := 0
	for _, h := range hold {
		at += copy(acc.x[h.Start:h.End], stash[at:])
		if acc.r != nil {
			at += copy(acc.r[h.Start:h.End], stash[at:])
		}
	}
	if err != nil {
		return s, stash, err
	}
	s = dropHeld(s, hold)
	if bad > 0 {
		return s, stash, fmt.Errorf("%w: %d held entries", ErrNonFinite, bad)
	}
	return s, stash, nil
}

// dropHeld filters s (ascending) in place to the entries outside hold.
func dropHeld(s Sparse, hold []Span) Sparse {
	j := 0
	for i, ix := range s.Idx {
		h := sort.Search(len(hold), func(h int) bool { return hold[h].End > int(ix) })
		if h < len(hold) && hold[h].Start <= int(ix) {
			continue
		}
		s.Idx[j], s.Val[j] = ix, s.Val[i]
		j++
	}
	s.Idx, s.Val = s.Idx[:j], s.Val[:j]
	return s
}

// applyKeepingErrors rounds s's values in place like apply and returns errs
// (reset, its storage reused) holding exact − rounded for every value the
// rounding changed: the difference of two neighbouring floats, exact in
// float32.
func (r valueRounding) applyKeepingErrors(s Sparse, errs Sparse) Sparse {
	errs.Reset()
	if !r.values.half() {
		return errs
	}
	for j, x := range s.Val {
		s.Val[j] = r.round(s.Idx[j], x)
		if d := x - s.Val[j]; d != 0 {
			errs.Append(s.Idx[j], d)
		}
	}
	return errs
}
