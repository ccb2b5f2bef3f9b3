package main

// The selection exports, which need no communicator: exact top-k and
// threshold selection over a caller's float32 array.

/*
#include "const_types.h"
*/
import "C"

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/oktopk/oktopk/core"
)

//export go_oktopk_topk
func go_oktopk_topk(x *C.oktopk_const_float, n C.size_t, k C.size_t, indices *C.uint32_t, values *C.float) C.oktopk_result_t {
	return call(0, func() error {
		switch {
		case uint64(n) > core.MaxElements:
			return invalidArgument("n = %d exceeds %d", uint64(n), uint64(core.MaxElements))
		case k > n:
			return invalidArgument("k = %d > n = %d", uint64(k), uint64(n))
		case n > 0 && x == nil:
			return invalidArgument("x is NULL")
		case k > 0 && (indices == nil || values == nil):
			return invalidArgument("indices or values is NULL")
		}
		s, err := core.TopK(unsafe.Slice((*float32)(unsafe.Pointer(x)), int(n)), int(k))
		if err != nil {
			return err
		}
		copy(unsafe.Slice((*uint32)(unsafe.Pointer(indices)), int(k)), s.Idx)
		copy(unsafe.Slice((*float32)(unsafe.Pointer(values)), int(k)), s.Val)
		return nil
	})
}

//export go_oktopk_threshold_select
func go_oktopk_threshold_select(x *C.oktopk_const_float, n C.size_t, threshold C.float, indices *C.uint32_t, values *C.float, capacity C.size_t, count *C.size_t) C.oktopk_result_t {
	return call(0, func() error {
		switch {
		case uint64(n) > core.MaxElements:
			return invalidArgument("n = %d exceeds %d", uint64(n), uint64(core.MaxElements))
		case n > 0 && x == nil:
			return invalidArgument("x is NULL")
		case capacity > 0 && (indices == nil || values == nil):
			return invalidArgument("indices or values is NULL")
		case count == nil:
			return invalidArgument("count is NULL")
		case math.IsNaN(float64(threshold)):
			return invalidArgument("threshold is NaN")
		}
		capN := int(min(uint64(capacity), uint64(n)))
		// The destination slices are the caller's buffers with their
		// capacity: append writes in place up to capacity and moves to Go
		// memory after, so nothing is ever written past the caller's end.
		dst := core.Sparse{
			Idx: unsafe.Slice((*uint32)(unsafe.Pointer(indices)), capN)[:0],
			Val: unsafe.Slice((*float32)(unsafe.Pointer(values)), capN)[:0],
		}
		s, nonFinite := core.SelectAboveChecked(dst, unsafe.Slice((*float32)(unsafe.Pointer(x)), int(n)), float32(threshold))
		if nonFinite > 0 {
			*count = 0
			return fmt.Errorf("%w: %d NaN or infinite entries in x", core.ErrNonFinite, nonFinite)
		}
		*count = C.size_t(s.Len())
		if uint64(s.Len()) > uint64(capacity) {
			return invalidArgument("%d entries pass the threshold, capacity is %d", s.Len(), uint64(capacity))
		}
		return nil
	})
}
