// Package binding is what a language binding of the library needs over
// package core, written once for the C ABI (capi) and the test programs
// that drive core as the C ABI does: a caller's buffer in any element type
// the library takes, widened to float32 for a call and narrowed back only
// when the call succeeds, with the element type in the call's options so
// that ranks passing different types fail with a mismatch.
package binding

import (
	"context"
	"fmt"

	"github.com/oktopk/oktopk/core"
	"github.com/oktopk/oktopk/transport"
)

// Buffer is a caller's buffer: F32 when Dtype is transport.DtypeFloat32,
// Half (the raw 16-bit values) when it is DtypeFloat16 or DtypeBFloat16.
type Buffer struct {
	Dtype transport.Dtype
	F32   []float32
	Half  []uint16
}

// Float32 is a float32 buffer.
func Float32(x []float32) Buffer { return Buffer{Dtype: transport.DtypeFloat32, F32: x} }

// Len is the buffer's element count.
func (b Buffer) Len() int {
	if b.Dtype == transport.DtypeFloat32 {
		return len(b.F32)
	}
	return len(b.Half)
}

// Check refuses an element type the library does not reduce.
func (b Buffer) Check() error {
	switch b.Dtype {
	case transport.DtypeFloat32, transport.DtypeFloat16, transport.DtypeBFloat16:
		return nil
	}
	return fmt.Errorf("%w: element type %v (float32, float16 or bfloat16)", core.ErrInvalidArgument, b.Dtype)
}

// Widener runs calls on Buffers. It keeps the float32 copy of a
// half-precision buffer, reused call after call; one caller at a time (the
// C ABI has one per communicator, used by its worker only).
type Widener struct {
	scratch []float32
}

// Run runs f on b as float32: in place for float32; for half precision on
// a widened copy, narrowed back (round to nearest, ties to even) only when
// f succeeds, so that a failed call leaves the caller's buffer as it was.
func (w *Widener) Run(b Buffer, f func([]float32) (core.Stats, error)) (core.Stats, error) {
	if err := b.Check(); err != nil {
		return core.Stats{}, err
	}
	if b.Dtype == transport.DtypeFloat32 {
		return f(b.F32)
	}
	n := len(b.Half)
	if cap(w.scratch) < n {
		w.scratch = make([]float32, n)
	}
	wide := w.scratch[:n]
	if b.Dtype == transport.DtypeFloat16 {
		core.Float16ToFloat32(wide, b.Half)
	} else {
		core.BFloat16ToFloat32(wide, b.Half)
	}
	st, err := f(wide)
	if err != nil {
		return st, err
	}
	if b.Dtype == transport.DtypeFloat16 {
		core.Float32ToFloat16(b.Half, wide)
	} else {
		core.Float32ToBFloat16(b.Half, wide)
	}
	return st, nil
}

// Allreduce is core's dense allreduce of b.
func (w *Widener) Allreduce(ctx context.Context, cc *core.Communicator, b Buffer, average bool, alg core.Algorithm) (core.Stats, error) {
	return w.Run(b, func(x []float32) (core.Stats, error) {
		return cc.AllreduceWith(ctx, x, average, alg, core.CallOptions{Dtype: b.Dtype})
	})
}

// SparseAllreduce is core's sparse allreduce of b on tensor id, with this
// call's settings and options (their Dtype is b's).
func (w *Widener) SparseAllreduce(ctx context.Context, cc *core.Communicator, id uint64, b Buffer, cfg core.Config, opts core.CallOptions) (core.Stats, error) {
	opts.Dtype = b.Dtype
	return w.Run(b, func(x []float32) (core.Stats, error) {
		return cc.SparseAllreduceWith(ctx, id, x, cfg, opts)
	})
}
